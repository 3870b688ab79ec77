"""The loss contract: every objective is a small module with one explicit tensor signature.

All per-token tensors are token-aligned `[B, T]`: position t holds log pi(input_ids[t] |
input_ids[:t]); position 0 and every prompt/tool/pad token have mask 0. The trainer calls
every loss the same way and never branches on the algorithm's name.
"""
from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass
class LossOutput:
    """A scalar loss to backpropagate and detached float metrics to log."""

    loss: torch.Tensor
    metrics: dict[str, float] = dataclasses.field(default_factory=dict)


class Loss(torch.nn.Module):
    """Base class: `forward(logp, behav_logp, prox_logp, advantages, mask, ref_logp=None)`.

    Shapes: logp, behav_logp, prox_logp, mask, ref_logp `[B, T]`; advantages `[B, T]` or `[B]`
    (broadcast over tokens). `prox_logp` is None unless the algorithm needs the learner's
    recomputed pre-update logprobs (decoupled PPO); `ref_logp` is None unless KL to a
    reference policy is on.
    """

    needs_prox_logp: bool = False
    needs_ref_logp: bool = False

    def forward(  # pragma: no cover - signature only
        self,
        logp: torch.Tensor,
        behav_logp: torch.Tensor,
        prox_logp: torch.Tensor | None,
        advantages: torch.Tensor,
        mask: torch.Tensor,
        ref_logp: torch.Tensor | None = None,
    ) -> LossOutput:
        raise TypeError(f"{type(self).__name__} must implement forward")
