"""Tinker's training primitives on a `Learner`: `forward_backward` accumulates gradients (it never steps), and
`optim_step` applies them with Adam's parameters given for that step. `Learner.train_step` is both at once with
the job's fixed optimizer settings; a user's own loop (`rayllm_rl.tinker`) calls these two instead.

The batch is Tinker's data padded into a TensorDict `[N, T]` (`rayllm_rl.tinker.data.to_batch`):
`input_ids` (the datum's `model_input`), `attention_mask` (1 on its positions), `target_tokens` (the token each
position is scored on: any token, not only the next input), and `inputs`, a TensorDict of the loss's float
`[N, T]` inputs (`weights`, `logprobs`, `advantages`, ...; an optional `mask` restricts the trained positions).

Under FSDP every rank gets the full batch and runs its slice of rows, as `train_step` does; the logprobs of every
row come back on every rank.
"""
from __future__ import annotations

import math
from typing import Any, Mapping

import torch
from tensordict import TensorDict

from rayllm_rl.learner.distributed import all_gather_objects, to_local_scalar
from rayllm_rl.learner.learner import reshard
from rayllm_rl.learner.logprobs import micro_batches, token_logprobs
from rayllm_rl.sampling_mask import SamplingMask

ADAM_KEYS = ("learning_rate", "beta1", "beta2", "eps", "weight_decay", "grad_clip_norm")
"""Tinker's `AdamParams` fields, which `optim_step` takes each step."""


def trained_mask(td: TensorDict) -> torch.Tensor:
    """`[N, T]`: the datum's positions, times its `mask` input when it has one."""
    mask = td["attention_mask"].to(torch.float32)
    return mask * td["inputs"]["mask"] if "mask" in td["inputs"].keys() else mask


def _score(learner, mb: TensorDict, mask: SamplingMask) -> torch.Tensor:
    """Logprobs `[B, T]` of `mb`'s target tokens under the learner's weights (0 on padding)."""
    dev = learner.device
    with learner.precision.autocast(dev):
        return token_logprobs(learner.model, mb["input_ids"].to(dev), mb["attention_mask"].to(dev),
                              learner.temperature, chunk_size=learner.cfg.logprob_chunk_size, mask=mask,
                              targets=mb["target_tokens"].to(dev))


def forward_backward(learner, td: TensorDict, loss, *, backward: bool = True,
                     sampling_mask: SamplingMask = SamplingMask()) -> tuple[torch.Tensor, dict[str, float]]:
    """Score `td`'s target tokens, evaluate `loss` (`objectives.token_sum`: `loss(logp, inputs, mask)`) and, with
    `backward`, ADD its gradient to the parameters' (Tinker: gradients accumulate until `optim_step`). Returns the
    logprobs `[N, T]` (float32, CPU, 0 on padding) and the loss's metrics over the whole batch (`:sum` metrics
    summed over micro-batches, the others weighted by the loss's `normalizer`). `sampling_mask`: the top-k / top-p
    the data's tokens were sampled under, replayed when a loss scores sampled tokens. A backward that fails part
    way clears every accumulated gradient (the client then refuses the next `optim_step`: `TrainingClient`)."""
    n, width = td.batch_size[0], td["input_ids"].shape[1]
    if n == 0:
        raise ValueError("forward_backward got no datum")
    total = float(loss.normalizer(trained_mask(td))) or 1.0
    world, rank = learner.world_size, learner.rank
    bounds = [(r * n // world, (r + 1) * n // world) for r in range(world)]
    lo, hi = bounds[rank]
    budget, rows = learner.cfg.max_tokens_per_micro_batch, learner.cfg.micro_batch_size
    mbs = micro_batches(td[lo:hi], budget, rows) if hi > lo else []
    passes = max(len(micro_batches(td[a:b], budget, rows)) if b > a else 0 for a, b in bounds)
    scoring = sampling_mask if getattr(loss, "scores_sampled_tokens", True) else SamplingMask()
    logp_rows = torch.zeros(hi - lo, width, dtype=torch.float32)
    metrics: dict[str, float] = {}
    lora_eval = learner.lora is not None and not backward  # no adapter dropout in a forward-only score
    training = learner.model.training
    if lora_eval:
        learner.model.eval()
    try:
        with torch.enable_grad() if backward else torch.no_grad():
            for idx, mb in mbs:
                logp = _score(learner, mb, scoring)
                trained = trained_mask(mb).to(logp.device)
                out = loss(logp, {k: v.to(logp.device) for k, v in mb["inputs"].items()}, trained)
                weight = float(loss.normalizer(trained)) / total
                if backward:
                    (out.loss * weight).backward()
                for k, v in out.metrics.items():
                    metrics[k] = metrics.get(k, 0.0) + (v if k.endswith(":sum") else v * weight)
                logp_rows[idx, :logp.shape[1]] = logp.detach().float().cpu()
            if backward and world > 1:  # zero-weight passes join the other ranks' all-gathers / reduce-scatters
                dummy = micro_batches(td[:1], budget)[0][1]
                for _ in range(passes - len(mbs)):
                    _score(learner, dummy, scoring).sum().mul(0.0).backward()
    except Exception:
        if backward:  # a part of this call's gradient may be in: drop every accumulated one, never step on a part
            learner.optimizer.zero_grad(set_to_none=True)
        raise
    finally:
        learner.model.train(training)
    if not backward:
        reshard(learner.model)
    if world == 1:
        return logp_rows, metrics
    logp_all, summed = torch.zeros(n, width, dtype=torch.float32), {}
    for (a, _), (part, part_metrics) in zip(bounds, all_gather_objects((logp_rows, metrics))):
        logp_all[a:a + part.shape[0]] = part
        for k, v in part_metrics.items():
            summed[k] = summed.get(k, 0.0) + v
    return logp_all, summed


def optim_step(learner, adam: Mapping[str, Any]) -> dict[str, float]:
    """Apply the accumulated gradients with AdamW at `adam`'s settings (Tinker's `AdamParams` fields, `ADAM_KEYS`:
    the learning rate, betas, eps, decoupled weight decay, and a global gradient-norm clip, 0 = none), then clear
    them. A non-finite gradient norm (on any rank) skips the step, weights and optimizer state untouched."""
    if missing := [k for k in ADAM_KEYS if k not in adam]:
        raise ValueError(f"optim_step needs Adam's {list(ADAM_KEYS)}; missing {missing}")
    lr, clip = float(adam["learning_rate"]), float(adam["grad_clip_norm"])
    if not (lr >= 0 and 0 <= adam["beta1"] < 1 and 0 <= adam["beta2"] < 1 and adam["eps"] >= 0 and clip >= 0):
        raise ValueError(f"optim_step: Adam parameters out of range: {dict(adam)} (learning_rate, eps, "
                         "grad_clip_norm >= 0; betas in [0, 1))")
    for g in learner.optimizer.param_groups:
        g.update(lr=lr, betas=(float(adam["beta1"]), float(adam["beta2"])), eps=float(adam["eps"]),
                 weight_decay=float(adam["weight_decay"]))
    grad_norm = to_local_scalar(torch.nn.utils.clip_grad_norm_(learner.model.parameters(),
                                                               clip if clip > 0 else math.inf))
    if not math.isfinite(grad_norm):
        learner.optimizer.zero_grad(set_to_none=True)
        return {"skipped_nonfinite_steps": 1.0}
    learner.optimizer.step()
    learner.optimizer.zero_grad(set_to_none=True)
    learner.optim_steps += 1
    return {"grad_norm": grad_norm, "lr": lr, "skipped_nonfinite_steps": 0.0}
