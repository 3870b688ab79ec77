"""The loss contract: every objective is a small module with one explicit tensor signature.

All per-token tensors are token-aligned `[B, T]`: position t holds log pi(input_ids[t] |
input_ids[:t]); position 0 and every prompt/tool/pad token have mask 0. The trainer calls
every loss the same way and never branches on the algorithm's name.

Also home of what that contract needs: `check_shapes`, `aggregate` (token-mean / seq-mean /
seq-sum reduction of a masked `[B, T]` tensor, with `masked_mean`) and `aggregate_count` (what
`aggregate` divides by, which a learner uses to weight its micro-batches).
"""
from __future__ import annotations

import dataclasses

import torch

from rayllm_rl.objectives.options import Aggregated, Proximal

AGGREGATIONS = ("token-mean", "seq-mean", "seq-sum")
PROX_LOGP_METHODS = ("recompute", "loglinear")

LossTerms = tuple[torch.Tensor, dict[str, float]]
"""What a policy loss's `terms` returns: the per-token loss `[B, T]` (0 off-mask) and its metrics."""


def aggregate(
    per_token: torch.Tensor, mask: torch.Tensor, mode: str = "token-mean", *, max_tokens: int | None = None
) -> torch.Tensor:
    """Reduce a per-token `[B, T]` tensor over masked tokens to a scalar.

    token-mean: sum of masked values / number of masked tokens in the batch.
    seq-mean: mean over sequences of each sequence's masked mean.
    seq-sum: mean over sequences of each sequence's masked sum.
    constant (Dr.GRPO, needs `max_tokens`): sum of masked values / (B * max_tokens), B counting
    every row, empty ones included; the normaliser does not depend on the sequence lengths.
    "constant" is not in `AGGREGATIONS` (the modes every loss accepts): only losses that own a
    `max_tokens` use it. `aggregate_count` gives each mode's divisor (a learner weights its
    micro-batches by it).
    Sequences with no masked token are excluded from the mean over sequences in both seq modes
    (they have no tokens to learn from); an all-empty batch gives 0 (still attached to the graph).
    Values at unmasked positions are never read (inf/NaN there cannot leak into the result).
    """
    if mode == "constant":
        if max_tokens is None or max_tokens <= 0:
            raise ValueError(f"aggregation 'constant' needs max_tokens > 0, got {max_tokens}")
        vals = torch.where(mask != 0, per_token, torch.zeros_like(per_token))
        return vals.sum() / (per_token.shape[0] * float(max_tokens))
    if mode not in AGGREGATIONS:
        raise ValueError(f"unknown aggregation {mode!r}; valid: {list(AGGREGATIONS)}")
    m = mask != 0
    vals = torch.where(m, per_token, torch.zeros_like(per_token))
    if mode == "token-mean":
        return vals.sum() / m.sum().clamp_min(1)
    seq_sum = vals.sum(dim=-1)  # [B]
    counts = m.sum(dim=-1)  # [B]
    nonempty = counts > 0
    per_seq = seq_sum / counts.clamp_min(1) if mode == "seq-mean" else seq_sum
    return torch.where(nonempty, per_seq, torch.zeros_like(per_seq)).sum() / nonempty.sum().clamp_min(1)


def aggregate_count(mask: torch.Tensor, mode: str = "token-mean") -> float:
    """How many units `aggregate(., mask, mode)` averages over, for a mask `[B, T]`.

    token-mean: masked tokens; seq-mean and seq-sum: rows with at least one masked token (empty
    rows are left out of the mean over sequences); constant: every row, empty ones included (the
    `max_tokens` factor is the same for every batch). `aggregate` divides a sum over the batch by
    this count (clamped at 1, and an empty count means a zero sum), so micro-batches `k` of one
    batch satisfy `sum_k count_k / count * aggregate(x_k, mask_k) = aggregate(x, mask)` exactly.
    """
    m = mask != 0
    if mode == "token-mean":
        return float(m.sum())
    if mode in ("seq-mean", "seq-sum"):
        return float(m.any(dim=-1).sum())
    if mode == "constant":
        return float(mask.shape[0])
    raise ValueError(f"unknown aggregation {mode!r}; valid: {list(AGGREGATIONS) + ['constant']}")


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of `values` `[B, T]` over tokens where mask != 0; 0 when the mask is empty."""
    return aggregate(values, mask, "token-mean")


def check_shapes(logp: torch.Tensor, **others: torch.Tensor | None) -> None:
    """Raise ValueError unless `logp` is `[B, T]` and every non-None tensor in `others` matches it.

    `advantages` may also be `[B]` (broadcast over tokens).
    """
    if logp.dim() != 2:
        raise ValueError(f"logp must be [B, T], got shape {tuple(logp.shape)}")
    for name, t in others.items():
        if t is None:
            continue
        ok = t.shape == logp.shape or (name == "advantages" and tuple(t.shape) == tuple(logp.shape[:1]))
        if not ok:
            want = f"{tuple(logp.shape)}" + (f" or {tuple(logp.shape[:1])}" if name == "advantages" else "")
            raise ValueError(
                f"shape mismatch: {name} has shape {tuple(t.shape)}, expected {want} (logp shape)"
            )


@dataclasses.dataclass
class LossOutput:
    """A scalar loss to backpropagate and detached float metrics to log."""

    loss: torch.Tensor
    metrics: dict[str, float] = dataclasses.field(default_factory=dict)


class Loss(torch.nn.Module):
    """Base class: `forward(logp, behav_logp, prox_logp, advantages, mask, ref_logp=None)`.

    Shapes: logp, behav_logp, prox_logp, mask, ref_logp `[B, T]`; advantages `[B, T]` or `[B]`
    (broadcast over tokens). `prox_logp` is None unless the algorithm needs the learner's
    pre-update logprobs (decoupled PPO, truncated IS: `needs_prox_logp`); `ref_logp` is None
    unless KL to a reference policy is on.

    A policy loss implements `terms(logp, behav_logp, prox_logp, advantages, mask, ref_logp)`,
    returning its unaggregated per-token loss `[B, T]` (0 off-mask) and its metrics; the
    `forward` here checks the shapes, `reduce`s that with `aggregation` and adds the `loss`
    metric. A loss that is not per-token (SFT's minor_sft) overrides `forward` instead.
    """

    options_class: type | None = None
    """The dataclass of this loss's options (objectives/options.py), which the constructor reads: an instance, or
    keyword overrides that build one. None for a loss built from plain arguments (the `TruncatedIS` wrapper)."""
    needs_prox_logp: bool = False
    """The learner must pass `prox_logp` (it recomputes it, or approximates it: `prox_logp_method`)."""
    needs_ref_logp: bool = False
    """The learner must pass `ref_logp` (reference-model logprobs)."""
    prox_logp_method: str = Proximal.prox_logp_method
    """How the learner gets `prox_logp` when `needs_prox_logp`: 'recompute' (a forward pass with the
    pre-update weights) or 'loglinear' (`loglinear_prox_logp` from the token versions, no extra pass)."""
    aggregation: str = Aggregated.aggregation
    """How `reduce` turns per-token losses into a scalar (`aggregate`)."""
    scores_sampled_tokens: bool = True
    """Its tokens were drawn by the rollout's sampler, so the learner replays the sampling mask when it
    scores them (`rayllm_rl.sampling_mask`); False for demonstrations (SFT): the full softmax."""

    def reduce(self, per_token: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Aggregate a per-token loss `[B, T]` with this loss's aggregation."""
        return aggregate(per_token, mask, self.aggregation)

    def normalizer(self, mask: torch.Tensor) -> float:
        """How many units this loss averages over for a mask `[B, T]` (`aggregate_count`).

        A learner that splits a batch into micro-batches weights micro-batch k's loss by
        `normalizer(mask_k) / normalizer(mask)`: the weighted sum of the micro-batch losses is
        then the full-batch loss, whatever the split and however many rows are empty.
        """
        return aggregate_count(mask, self.aggregation)

    def forward(
        self,
        logp: torch.Tensor,
        behav_logp: torch.Tensor,
        prox_logp: torch.Tensor | None,
        advantages: torch.Tensor,
        mask: torch.Tensor,
        ref_logp: torch.Tensor | None = None,
    ) -> LossOutput:
        """The aggregated loss and its metrics (`loss` first, then those of `terms`)."""
        check_shapes(
            logp, behav_logp=behav_logp, prox_logp=prox_logp, advantages=advantages, mask=mask, ref_logp=ref_logp
        )
        per_token, metrics = self.terms(logp, behav_logp, prox_logp, advantages, mask, ref_logp)
        loss = self.reduce(per_token, mask)
        return LossOutput(loss=loss, metrics={"loss": float(loss.detach()), **metrics})
