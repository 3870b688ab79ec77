"""On-policy distillation's objective (issue W): per-token advantages from the teacher's reverse KL, through the
job's PPO-clip loss, against values derived by hand for a two-row batch in float64."""
from __future__ import annotations

import pytest
import torch

from rayllm_rl.objectives import GRPOLoss
from rayllm_rl.objectives.distill import distill_advantages, teacher_kl

# Two rows of 4 positions; row 0 has 3 completion tokens (positions 1-3), row 1 has 2 (positions 2-3).
MASK = torch.tensor([[0, 1, 1, 1], [0, 0, 1, 1]], dtype=torch.float64)
TOKENS = torch.tensor([[0, 2, 1, 0], [1, 0, 2, 2]])
TEACHER = torch.tensor([[0.0, -0.5, -2.0, -0.1], [0.0, 0.0, -1.2, -0.7]], dtype=torch.float64)
TASK = torch.tensor([0.5, -0.5], dtype=torch.float64)  # the rows' group advantages (a task reward)
COEF, TASK_COEF = 1.0, 0.5


def _student():
    """Logits `[2, 4, 3]` (a vocabulary of 3) and their log-softmax at `TOKENS` `[2, 4]`."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 4, 3, generator=g, dtype=torch.float64, requires_grad=True)
    logp = torch.log_softmax(logits, -1).gather(-1, TOKENS[..., None])[..., 0]
    return logits, logp


def test_advantages_loss_and_gradient_equal_a_direct_computation_float64():
    logits, logp = _student()
    # behaviour logprobs: the sampler's, a little off the learner's (ratio r = exp(logp - behav) inside the clip),
    # except row 0's last token, whose ratio 1.5 is above 1 + 0.2 with a positive advantage: clipped, no gradient
    shift = torch.tensor([[0.0, 0.05, -0.03, 0.405465108], [0.0, 0.0, 0.02, -0.01]], dtype=torch.float64)
    behav = (logp - shift).detach()

    kl = teacher_kl(behav, TEACHER, MASK)
    adv = distill_advantages(kl, MASK, COEF, TASK, TASK_COEF)
    # by hand: A_t = TASK_COEF * A_row - COEF * (behav_t - teacher_t) on completion tokens, 0 elsewhere
    want = torch.zeros(2, 4, dtype=torch.float64)
    for i, t in [(0, 1), (0, 2), (0, 3), (1, 2), (1, 3)]:
        want[i, t] = TASK_COEF * float(TASK[i]) - COEF * (float(behav[i, t]) - float(TEACHER[i, t]))
    assert torch.equal(adv, want)
    assert torch.equal(kl[MASK == 0], torch.zeros(3, dtype=torch.float64))

    out = GRPOLoss(clip_eps_low=0.2, clip_eps_high=0.2)(logp, behav, None, adv, MASK)
    out.loss.backward()

    # by hand: token-mean over the 5 completion tokens of -min(r A, clip(r) A), r = exp(logp - behav) (~exp(shift));
    # the loss adds the same 5 products in another order: a few ulps of values below 3, hence 1e-14
    r = torch.exp(logp.detach() - behav)
    clipped = (adv > 0) & (r > 1.2) | (adv < 0) & (r < 0.8)
    assert clipped.sum() == 1 and bool(clipped[0, 3]) and float(adv[0, 3]) > 0
    per_token = torch.where(clipped, -r.clamp(0.8, 1.2) * adv, -r * adv) * MASK
    assert abs(float(out.loss.detach()) - float(per_token.sum()) / 5) <= 1e-14
    # d loss / d logp_t = -r_t A_t / 5 on unclipped completion tokens; d logp_t / d logits = onehot - softmax
    # (autograd's log-softmax backward uses exp(log_softmax), equal to softmax within an ulp of values below 1)
    dlogp = torch.where(clipped, torch.zeros_like(r), -r * adv / 5) * MASK
    onehot = torch.nn.functional.one_hot(TOKENS, 3).to(torch.float64)
    want_grad = dlogp[..., None] * (onehot - torch.softmax(logits.detach(), -1))
    assert torch.allclose(logits.grad, want_grad, rtol=0, atol=1e-14)
    assert torch.count_nonzero(logits.grad[0, 3]) == 0 and torch.count_nonzero(logits.grad[:, 0]) == 0


def test_distillation_alone_pushes_the_student_toward_the_teachers_token_choices():
    """No task reward: a token the teacher likes more than the student gets a positive advantage, one it likes
    less a negative one, and a step along the gradient lowers the reverse KL of the sampled tokens."""
    logits, logp = _student()
    behav = logp.detach()
    adv = distill_advantages(teacher_kl(behav, TEACHER, MASK), MASK, coef=1.0)
    assert torch.equal(torch.sign(adv) * MASK, torch.sign(TEACHER - behav) * MASK)
    GRPOLoss()(logp, behav, None, adv, MASK).loss.backward()
    with torch.no_grad():
        stepped = logits - 0.5 * logits.grad
        after = torch.log_softmax(stepped, -1).gather(-1, TOKENS[..., None])[..., 0]
    before_kl = float((teacher_kl(behav, TEACHER, MASK) ** 2).sum())
    after_kl = float((teacher_kl(after, TEACHER, MASK) ** 2).sum())
    assert after_kl < before_kl


def test_bad_shapes_and_weights_are_refused_naming_them():
    with pytest.raises(ValueError, match=r"teacher logprobs \(2, 3\)"):
        teacher_kl(torch.zeros(2, 4), torch.zeros(2, 3), torch.ones(2, 4))
    with pytest.raises(ValueError, match=r"task advantages have shape \(3,\)"):
        distill_advantages(torch.zeros(2, 4), torch.ones(2, 4), 1.0, torch.zeros(3))
    with pytest.raises(ValueError, match="must be >= 0"):
        distill_advantages(torch.zeros(2, 4), torch.ones(2, 4), -1.0)


def test_the_distillation_curve_is_read_against_the_rl_runs_time(tmp_path):
    """benchmarks/distill_vs_rl.py: RL seconds count from the end of the step-0 evaluation; the first distillation
    evaluation at >= 90% of the teacher's (the RL run's last) score, and its share of the RL run's time."""
    import importlib.util
    import json
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "benchmarks" / "distill_vs_rl.py"
    spec = importlib.util.spec_from_file_location("distill_vs_rl", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)

    def metrics(name, evals):
        path = tmp_path / name
        rows = [{"phase": "eval" if s == 0 else "rl", "step": s, "time_s": t, "eval_reward": r} for s, t, r in evals]
        rows.insert(1, {"phase": "rl", "step": 1, "time_s": evals[0][1] + 5.0, "reward": 0.1})  # a step record
        path.write_text("\n".join(map(json.dumps, rows)) + "\n")
        return path

    rl = metrics("rl.jsonl", [(0, 100.0, 0.2), (10, 400.0, 0.4), (20, 700.0, 0.5), (20, 700.0, 0.5)])
    distill = metrics("d.jsonl", [(0, 50.0, 0.2), (5, 150.0, 0.44), (10, 250.0, 0.46), (12, 290.0, 0.45)])
    out = module.main(["--rl", str(rl), "--distill", str(distill)])
    assert out["rl_curve"] == [(0.0, 0, 0.2), (300.0, 10, 0.4), (600.0, 20, 0.5)]  # the repeated final eval once
    assert out["teacher_score"] == 0.5 and out["rl_seconds"] == 600.0 and out["target"] == 0.45
    assert out["reached"] == {"rl_seconds": 200.0, "step": 10, "score": 0.46, "time_share": round(200 / 600, 4)}
    assert out["distill_final"] == 0.45 and out["distill_time_share"] == round(240 / 600, 4)
    assert module.main(["--rl", str(rl), "--distill", str(distill), "--share", "0.95"])["reached"] is None
