"""CISPO (MiniMax-M1, 2025): clip the detached importance weight, never drop a token's gradient."""
from __future__ import annotations

from typing import Any

import torch

from rayllm_rl.objectives.base import AGGREGATIONS, Loss, LossTerms
from rayllm_rl.objectives.grpo import prepare, ratio_metrics
from rayllm_rl.objectives.options import CISPOOptions, resolve


class CISPOLoss(Loss):
    """Clipped IS-weight Policy Optimization (MiniMax et al. 2025, "MiniMax-M1: Scaling
    Test-Time Compute Efficiently with Lightning Attention", arXiv:2506.13585, Eq. 4-5).

    Per token `-sg(clip(r, 1-eps_low, 1+eps_high)) * A * logp`, `r = exp(logp - old)`,
    `old = prox_logp if given else behav_logp`, sg = stop-gradient; aggregated "token-mean"
    (the paper normalises by the total number of tokens of the group, sum_i |o_i|).
    Gradient per token: `-clip(r) * A / n` -- tokens whose ratio is clipped STILL contribute
    (unlike PPO-clip, which zeroes them); the clip only bounds the weight.

    Defaults (`CISPOOptions`): `clip_eps_low=None` = no lower bound (MiniMax-M1: "we did not impose a
    lower bound on the IS weight by setting eps_low to a large value" and tuned only eps_high);
    `clip_eps_high` is borrowed from DAPO's clip-higher value (`CLIP_HIGHER`, 0.28; the paper does
    not fix one number for eps_high; tune it), i.e. an upper cap of 1.28 on the weight. TRL
    (`loss_type="cispo"`, whose `epsilon_high` is the cap itself) and ScaleRL cap it at 5.0:
    `clip_eps_high=4.0` reproduces that.
    Metrics: clip_fraction_low/high count masked tokens whose weight is clipped on that side,
    whatever the sign of A (CISPO clips the weight, not the objective).
    """

    options_class = CISPOOptions

    def __init__(self, options: CISPOOptions | None = None, /, **overrides: Any) -> None:
        super().__init__()
        self.options = o = resolve(self.options_class, options, overrides, type(self).__name__)
        if o.clip_eps_low is not None and not 0.0 <= o.clip_eps_low <= 1.0:
            raise ValueError(f"clip_eps_low must be None or in [0, 1], got {o.clip_eps_low}")
        if o.clip_eps_high < 0:
            raise ValueError(f"clip_eps_high must be >= 0, got {o.clip_eps_high}")
        if o.aggregation not in AGGREGATIONS:
            raise ValueError(f"unknown aggregation {o.aggregation!r}; valid: {list(AGGREGATIONS)}")
        self.clip_eps_low = None if o.clip_eps_low is None else float(o.clip_eps_low)
        self.clip_eps_high = float(o.clip_eps_high)
        self.aggregation = o.aggregation

    def extra_repr(self) -> str:
        return f"clip_eps_low={self.clip_eps_low}, clip_eps_high={self.clip_eps_high}, aggregation={self.aggregation!r}"

    def per_token(
        self, logp: torch.Tensor, old: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """Unaggregated `-sg(clip(r)) * A * logp` `[B, T]` (0 off-mask) and the ratio metrics."""
        m, safe_logp, safe_old, adv = prepare(logp, old, advantages, mask)
        log_ratio = safe_logp - safe_old
        r = torch.exp(log_ratio).detach()
        lo = None if self.clip_eps_low is None else 1.0 - self.clip_eps_low
        hi = 1.0 + self.clip_eps_high
        weight = torch.clamp(r, min=lo, max=hi)
        per_token = -weight * adv * safe_logp
        low = (r < lo) if lo is not None else torch.zeros_like(m)
        return per_token, ratio_metrics(m, safe_logp, log_ratio, low, r > hi)

    def terms(self, logp: torch.Tensor, behav_logp: torch.Tensor, prox_logp: torch.Tensor | None,
              advantages: torch.Tensor, mask: torch.Tensor, ref_logp: torch.Tensor | None) -> LossTerms:
        """`per_token` against `old = prox_logp if given else behav_logp`; `ref_logp` is not used."""
        return self.per_token(logp, prox_logp if prox_logp is not None else behav_logp, advantages, mask)
