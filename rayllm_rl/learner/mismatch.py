"""How far the rollout engine's logprobs are from the learner's on the tokens a step trains.

The learner scores every batch anyway; these figures reuse that forward (no extra pass). They are
taken on a step's first minibatch, before the step's update, so with `optim.num_minibatches=1` they
cover the whole batch and, at version lag 0, measure the engine/learner mismatch alone (kernels,
precision, sampling); at lag k they add k updates of policy change. `r = exp(logp_learner -
logp_rollout)` is the importance ratio the decoupled and TIS losses correct with.
"""
from __future__ import annotations

import torch

RATIO_BAND = (0.5, 2.0)
"""A token whose ratio leaves this band counts in `mismatch_frac_outside` (TIS/MIS caps sit near it)."""
QUANTILES = (0.5, 0.9, 0.99)
"""Quantiles of the ratio reported as `mismatch_ratio_p50`, `_p90`, `_p99`."""
MAX_LAG_KEYS = 4
"""Lags 0..MAX_LAG_KEYS-1 get figures of their own; larger lags are pooled under `lag{MAX_LAG_KEYS}+`."""


def mismatch_figures(learner_logp: torch.Tensor, rollout_logp: torch.Tensor,
                     lag: torch.Tensor | None = None) -> dict[str, float]:
    """Figures over `K` trained tokens: `learner_logp`, `rollout_logp` `[K]` (the sampled tokens'
    logprobs), `lag` `[K]` (policy versions between the token's sampler and the learner; None = unknown).

    `mismatch_abs_logp_diff`: mean |Δ logprob|; `mismatch_k3`: mean of `r - 1 - log r`, Schulman's k3
    estimate of KL(rollout || learner) on the rollout's samples; `mismatch_ratio_{min,max,p50,p90,p99}`;
    `mismatch_frac_outside`: share of tokens with r outside `RATIO_BAND`; per lag the mean |Δ|, k3 and
    token count (`..._lag0`, `..._lag1`, ...). Computed in float64 from the given values."""
    if learner_logp.shape != rollout_logp.shape or learner_logp.dim() != 1:
        raise ValueError(f"mismatch_figures needs two [K] tensors, got {tuple(learner_logp.shape)} and "
                         f"{tuple(rollout_logp.shape)}")
    k = learner_logp.numel()
    if k == 0:
        return {"mismatch_tokens": 0.0}
    d = learner_logp.detach().double().cpu() - rollout_logp.detach().double().cpu()
    r = d.exp()
    k3 = r - 1.0 - d
    q = torch.quantile(r, torch.tensor(QUANTILES, dtype=torch.float64))
    out = {"mismatch_tokens": float(k), "mismatch_abs_logp_diff": float(d.abs().mean()),
           "mismatch_k3": float(k3.mean()),
           "mismatch_ratio_min": float(r.min()), "mismatch_ratio_max": float(r.max()),
           **{f"mismatch_ratio_p{round(p * 100)}": float(v) for p, v in zip(QUANTILES, q)},
           "mismatch_frac_outside": float(((r < RATIO_BAND[0]) | (r > RATIO_BAND[1])).double().mean())}
    if lag is not None:
        lag = lag.detach().cpu().long().clamp(min=0, max=MAX_LAG_KEYS)
        for v in lag.unique().tolist():
            sel = lag == v
            name = f"lag{v}" if v < MAX_LAG_KEYS else f"lag{MAX_LAG_KEYS}+"
            out[f"mismatch_tokens_{name}"] = float(sel.sum())
            out[f"mismatch_abs_logp_diff_{name}"] = float(d[sel].abs().mean())
            out[f"mismatch_k3_{name}"] = float(k3[sel].mean())
    return out


class MismatchMeter:
    """Collects the trained tokens' logprobs over the micro-batches of one optimizer step (`add`), then
    gives the figures over all of them (`figures`, after gathering the ranks' tokens under FSDP)."""

    def __init__(self) -> None:
        self.parts: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]] = []

    def add(self, logp: torch.Tensor, mb) -> None:
        """`logp` `[n, T]`: the learner's logprobs of micro-batch `mb` (its `logprobs`, `loss_mask`,
        `versions` `[n, T]` and `prox_version` `[n]`: the version it is trained from, when known). Tokens
        of version < 0 (SFT demonstrations, prompts) were sampled by no engine and are left out."""
        mask = mb["loss_mask"].bool().to(logp.device)  # may be the batch's own tensor: never edit it in place
        if "versions" in mb.keys():  # only tokens an engine sampled have a rollout logprob (SFT demos: version -1)
            mask = mask & (mb["versions"].to(logp.device) >= 0)
        lag = None
        if "prox_version" in mb.keys() and "versions" in mb.keys():
            lag = (mb["prox_version"].reshape(-1, 1).to(logp.device) - mb["versions"].to(logp.device))[mask]
        self.parts.append((logp.detach()[mask].float().cpu(), mb["logprobs"].to(logp.device)[mask].float().cpu(),
                           None if lag is None else lag.cpu()))

    def tokens(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        if not self.parts:  # e.g. an FSDP rank whose shard of the minibatch is empty
            return torch.zeros(0), torch.zeros(0), torch.zeros(0, dtype=torch.long)
        learner, rollout, lags = zip(*self.parts)
        return torch.cat(learner), torch.cat(rollout), None if any(x is None for x in lags) else torch.cat(lags)

    def figures(self, gather=None) -> dict[str, float]:
        """`gather(obj) -> [obj of every rank]` (FSDP ranks each hold a shard of the minibatch), or None."""
        parts = [self.tokens()] if gather is None else gather(self.tokens())
        learner = torch.cat([p[0] for p in parts])
        rollout = torch.cat([p[1] for p in parts])
        lag = None if any(p[2] is None for p in parts) else torch.cat([p[2] for p in parts])
        return mismatch_figures(learner, rollout, lag)


def mismatch_summary(records) -> dict[str, float | None]:
    """The run's mismatch from its RL step records: token-weighted mean |Δ logprob| and k3, the largest
    ratio, and the share of tokens outside `RATIO_BAND` (None where no step measured a sampled token)."""
    steps = [r for r in records if r.get("phase") == "rl" and r.get("mismatch_tokens")]
    tokens = sum(r["mismatch_tokens"] for r in steps)
    if not tokens:
        return {"tokens": 0, "abs_logp_diff": None, "k3": None, "ratio_max": None, "frac_outside": None}
    mean = lambda k: sum(r[k] * r["mismatch_tokens"] for r in steps) / tokens  # noqa: E731
    return {"tokens": int(tokens), "abs_logp_diff": mean("mismatch_abs_logp_diff"), "k3": mean("mismatch_k3"),
            "ratio_max": max(r["mismatch_ratio_max"] for r in steps), "frac_outside": mean("mismatch_frac_outside")}
