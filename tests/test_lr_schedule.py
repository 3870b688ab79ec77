"""The learning-rate schedule (learner/optim.py): warm-up, then constant, linear or cosine decay to a floor;
the job ends the decay at its last optimizer step; the learner applies it step by step."""
from __future__ import annotations

import math

import pytest
import torch

from rayllm_rl.config import load_config
from rayllm_rl.job.config import GRPOJobConfig
from rayllm_rl.learner.learner import Learner
from rayllm_rl.learner.optim import OptimConfig, lr_scale

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_the_scale_at_each_step_equals_the_written_out_schedule():
    # warm-up 4: steps k = 1..4 ramp 1/4 .. 1; decay over k = 4..12 (8 steps of progress), floor 0.1
    cos = OptimConfig(warmup_steps=4, lr_schedule="cosine", decay_steps=12, min_lr_ratio=0.1)
    lin = OptimConfig(warmup_steps=4, lr_schedule="linear", decay_steps=12, min_lr_ratio=0.1)
    const = OptimConfig(warmup_steps=4)
    for step in range(16):
        k = step + 1
        if k < 4:
            want_cos = want_lin = k / 4
        else:
            p = min(1.0, (k - 4) / 8)
            want_cos = 0.1 + 0.9 * (1 + math.cos(math.pi * p)) / 2
            want_lin = 1 - 0.9 * p
        assert lr_scale(cos, step) == pytest.approx(want_cos, abs=1e-15), step
        assert lr_scale(lin, step) == pytest.approx(want_lin, abs=1e-15), step
        assert lr_scale(const, step) == (k / 4 if k < 4 else 1.0)
    # landmarks: the peak right after the warm-up, half-way down at mid-decay, the floor from step 12 on
    assert (lr_scale(cos, 3) == 1.0 and lr_scale(cos, 7) == pytest.approx(0.55)
            and lr_scale(cos, 11) == pytest.approx(0.1))
    assert lr_scale(cos, 40) == pytest.approx(0.1) and lr_scale(lin, 40) == pytest.approx(0.1)
    # no warm-up: the first step already decays a little; to zero by default
    assert lr_scale(OptimConfig(lr_schedule="linear", decay_steps=10), 0) == pytest.approx(0.9)
    assert lr_scale(OptimConfig(lr_schedule="linear", decay_steps=10), 9) == 0.0


def test_bad_schedule_settings_fail_naming_the_key():
    with pytest.raises(ValueError, match="optim.lr_schedule='step'"):
        OptimConfig(lr_schedule="step")
    with pytest.raises(ValueError, match="optim.min_lr_ratio=1.5"):
        OptimConfig(min_lr_ratio=1.5)
    with pytest.raises(ValueError, match="optim.decay_steps=5.*optim.warmup_steps=5"):
        OptimConfig(lr_schedule="cosine", warmup_steps=5, decay_steps=5)
    with pytest.raises(ValueError, match="needs optim.decay_steps"):
        lr_scale(OptimConfig(lr_schedule="cosine"), 0)
    with pytest.raises(ValueError, match="lr_schedule"):
        load_config(GRPOJobConfig, ["optim.lr_schedule=exponential"])


def test_a_job_ends_the_decay_at_its_last_optimizer_step_and_the_dry_run_says_so(capsys):
    from rayllm_rl.job.describe import plan_decisions
    from rayllm_rl.job.plan import make_plan
    from rayllm_rl.job.plan_text import dry_run

    cfg = load_config(GRPOJobConfig, ["trainer.steps=30", "optim.num_minibatches=2", "optim.epochs=3",
                                      "optim.lr_schedule=cosine", "optim.min_lr_ratio=0.1"]).validate(environment=False)
    assert cfg.optim.decay_steps == 30 * 2 * 3
    assert load_config(GRPOJobConfig, ["optim.lr_schedule=linear", "optim.decay_steps=50"]).validate(
        environment=False).optim.decay_steps == 50  # a value given stays
    assert load_config(GRPOJobConfig, []).validate(environment=False).optim.decay_steps is None  # constant
    plan = make_plan(cfg)
    shown = plan_decisions(plan)["schedule"]["optim_lr_schedule"]
    assert shown == "warm-up 10 steps, then cosine to 0.1 x lr at optimizer step 180"
    dry_run(plan, as_json=False)
    assert f"optim.lr=5e-05 ({shown})" in capsys.readouterr().out


def test_the_learner_steps_at_the_scheduled_rate(tiny_model_path, tokenizer):
    """AdamW's lr at each of 5 optimizer steps (2 per batch) is lr x the schedule, the step's own `lr` metric too."""
    from rayllm_rl.data.sft import make_sft_batch
    from rayllm_rl.objectives import SFTLoss

    optim = OptimConfig(lr=1e-3, warmup_steps=2, lr_schedule="cosine", decay_steps=5, min_lr_ratio=0.2,
                        num_minibatches=1, epochs=1)
    learner = Learner(tiny_model_path, optim)
    chats = [[{"role": "user", "content": f"{i}?"}, {"role": "assistant", "content": f"{i}"}] for i in range(4)]
    batch = make_sft_batch(tokenizer, chats)
    seen = []
    for _ in range(6):
        before = {k: v.clone() for k, v in learner.named_tensors().items()}
        seen.append(learner.train_step(batch, SFTLoss())["lr"])
        assert any(not torch.equal(before[k], v) for k, v in learner.named_tensors().items())
    want = [1e-3 * s for s in (0.5, 1.0, 0.2 + 0.8 * (1 + math.cos(math.pi / 3)) / 2,
                                0.2 + 0.8 * (1 + math.cos(2 * math.pi / 3)) / 2, 0.2, 0.2)]
    assert seen == pytest.approx(want, rel=1e-12)
    assert learner.optimizer.param_groups[0]["lr"] == pytest.approx(2e-4)
