"""DAPO (Yu et al. 2025) and Dr.GRPO (Liu et al. 2025): PPO-clip variants of `GRPOLoss`.

Both reuse GRPOLoss's per-token clipped surrogate and differ only in their options (objectives/options.py:
DAPOOptions, DrGRPOOptions) and aggregation.
DAPO's soft overlong punishment is a reward-shaping helper, `overlong_reward_shaping`.
"""
from __future__ import annotations

from typing import Any

import torch

from rayllm_rl.objectives.base import aggregate
from rayllm_rl.objectives.grpo import GRPOLoss
from rayllm_rl.objectives.options import DR_GRPO_MAX_TOKENS, DAPOOptions, DrGRPOOptions


class DAPOLoss(GRPOLoss):
    """DAPO policy loss (Yu et al. 2025, "DAPO: An Open-Source LLM Reinforcement Learning System
    at Scale", arXiv:2503.14476).

    Per token `-min(r*A, clip(r, 1-eps_low, 1+eps_high)*A)`, `r = exp(logp - old)`, with the
    paper's decoupled "clip-higher" bounds eps_low=0.2, eps_high=0.28, the token-level policy
    gradient loss (aggregation "token-mean": sum over every masked token of the batch / their
    count) and no KL penalty (DAPO removes it: `DAPOOptions` has no KL field, so GRPOLoss reads
    the KLPenalty defaults, off). Dynamic sampling (dropping groups whose rewards
    are all equal) lives in the rollout/advantage side, overlong shaping in
    `overlong_reward_shaping`. `clip_ratio_c` is GRPOLoss's dual-clip (off by default).
    """

    options_class = DAPOOptions


def overlong_reward_shaping(
    lengths: torch.Tensor, max_len: int, cache_len: int, penalty: float = 1.0
) -> torch.Tensor:
    """DAPO's soft overlong punishment (Yu et al. 2025, Eq. 13), added to the task reward.

    With `L = lengths` (response tokens) and `L_max = max_len`, `L_cache = cache_len`:
        0                                   if L <= L_max - L_cache
        -(L - (L_max - L_cache)) / L_cache * penalty   if L_max - L_cache < L <= L_max
        -penalty                            if L > L_max
    Returns a float tensor shaped like `lengths` `[N]`.
    """
    if cache_len <= 0 or cache_len > max_len:
        raise ValueError(f"need 0 < cache_len <= max_len, got cache_len={cache_len}, max_len={max_len}")
    lengths = torch.as_tensor(lengths)
    lf = lengths.to(torch.float64) if not lengths.is_floating_point() else lengths
    start = float(max_len - cache_len)
    window = -(lf - start) / float(cache_len) * penalty
    out = torch.where(lf <= start, torch.zeros_like(lf), window)
    out = torch.where(lf > max_len, torch.full_like(lf, -float(penalty)), out)
    return out


class DrGRPOLoss(GRPOLoss):
    """Dr.GRPO policy loss (Liu et al. 2025, "Understanding R1-Zero-Like Training: A Critical
    Perspective", arXiv:2503.20783).

    Per token the PPO-clip surrogate `-min(r*A, clip(r, 1-eps_low, 1+eps_high)*A)`; the loss is
    the sum over every masked token of the batch divided by the CONSTANT `B * max_tokens` (B =
    rows, empty ones included; `max_tokens` = the generation budget, e.g. max new tokens). Unlike
    token-mean or per-sequence means, this normaliser does not depend on response lengths, which
    removes GRPO's length bias (short wrong answers penalised more per token, long wrong answers
    less). The paper's other half, advantages without std normalisation (`A = R - mean(R)`), is
    configured on the advantage side (`AdvantageConfig(std=False)`), not here.

    `aggregation = "constant"` (see `aggregate`). Learner weighting: `normalizer` counts every
    row (`aggregate_count`), so the learner weights micro-batch k by `B_k / B`; the micro-batch
    loss is `sum_k / (B_k * max_tokens)`, so `sum_k weight_k * loss_k = sum_all / (B * max_tokens)`,
    which is exactly the full-batch loss. `clip_ratio_c` is GRPOLoss's dual-clip (off by default).
    """

    options_class = DrGRPOOptions

    def __init__(self, options: DrGRPOOptions | None = None, /, **overrides: Any) -> None:
        """`max_tokens=None` (the options' default, which a job fills with the generation budget) is
        `DR_GRPO_MAX_TOKENS`."""
        super().__init__(options, **overrides)
        max_tokens = self.options.max_tokens
        if max_tokens is None:
            max_tokens = DR_GRPO_MAX_TOKENS
        if int(max_tokens) <= 0:
            raise ValueError(f"max_tokens must be > 0, got {max_tokens}")
        self.max_tokens = int(max_tokens)
        self.aggregation = "constant"

    def extra_repr(self) -> str:
        return f"max_tokens={self.max_tokens}, " + super().extra_repr()

    def reduce(self, per_token: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return aggregate(per_token, mask, "constant", max_tokens=self.max_tokens)
