"""Supervised fine-tuning losses (plain NLL and TorchRL's MinorSFT) behind the common `Loss` contract."""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from rayllm_rl.objectives.base import (
    AGGREGATIONS, Loss, LossOutput, aggregate, aggregate_count, check_shapes, masked_mean,
)
from rayllm_rl.objectives.grpo import kl_estimate
from rayllm_rl.objectives.options import SFTOptions, resolve

SFT_FUNCTIONS = ("sft", "minor_sft")


class SFTLoss(Loss):
    """SFT on masked target tokens; `behav_logp`, `prox_logp` and `advantages` are ignored.

    Options: `SFTOptions`. sft: `aggregate(-logp, mask, aggregation)` (default token-mean; TorchRL's SFTLoss default,
    the mean over sequences of each sequence's mean NLL, is `aggregation="seq-mean"`).
    minor_sft (TorchRL's MinorSFT, DPO-inspired, gentler than SFT): per sequence i with |y_i|
    masked tokens,
        x_i = beta * (sum_t logp_t - sum_t ref_t) / |y_i|     (normalize_by_seq_length=True, TorchRL's default)
        x_i = beta * (sum_t logp_t - sum_t ref_t)             (normalize_by_seq_length=False)
    and the loss is `-logsigmoid(x_i)` averaged over the sequences that have at least one masked
    token (`aggregation` does not apply to it).
    With `kl_to_ref_coeff > 0` (loss_function "sft" only), `coeff * aggregate(k3(logp, ref_logp),
    mask, aggregation)` is added. minor_sft regularises toward the reference by construction, so it
    rejects `kl_to_ref_coeff > 0` (TorchRL sets it to 0 with a warning); it reports `kl_ref`
    (masked mean k3, no gradient) as TorchRL logs `kl_to_ref`.
    """

    scores_sampled_tokens = False
    """Demonstrations: scored under the full softmax, whatever the rollout's top-p."""

    options_class = SFTOptions

    def __init__(self, options: SFTOptions | None = None, /, **overrides: Any) -> None:
        super().__init__()
        self.options = o = resolve(self.options_class, options, overrides, type(self).__name__)
        if o.loss_function not in SFT_FUNCTIONS:
            raise ValueError(f"unknown loss_function {o.loss_function!r}; valid: {list(SFT_FUNCTIONS)}")
        if o.aggregation not in AGGREGATIONS:
            raise ValueError(f"unknown aggregation {o.aggregation!r}; valid: {list(AGGREGATIONS)}")
        if o.kl_to_ref_coeff < 0:
            raise ValueError(f"kl_to_ref_coeff must be >= 0, got {o.kl_to_ref_coeff}")
        if o.loss_function == "minor_sft" and o.kl_to_ref_coeff > 0:
            raise ValueError("kl_to_ref_coeff applies to loss_function='sft' only: minor_sft already regularises "
                             "toward the reference (TorchRL turns the coefficient off for it), "
                             f"got {o.kl_to_ref_coeff}")
        self.loss_function = o.loss_function
        self.beta = float(o.beta)
        self.kl_to_ref_coeff = float(o.kl_to_ref_coeff)
        self.aggregation = o.aggregation
        self.normalize_by_seq_length = bool(o.normalize_by_seq_length)
        self.needs_ref_logp = o.loss_function == "minor_sft" or self.kl_to_ref_coeff > 0

    def extra_repr(self) -> str:
        return (
            f"loss_function={self.loss_function!r}, beta={self.beta}, kl_to_ref_coeff={self.kl_to_ref_coeff}, "
            f"aggregation={self.aggregation!r}, normalize_by_seq_length={self.normalize_by_seq_length}"
        )

    def normalizer(self, mask: torch.Tensor) -> float:
        """minor_sft averages over the non-empty sequences; sft over its `aggregation`'s units."""
        return aggregate_count(mask, "seq-mean" if self.loss_function == "minor_sft" else self.aggregation)

    def minor_sft(self, safe_logp: torch.Tensor, safe_ref: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
        """Mean over non-empty rows of `-logsigmoid(x_i)` (see the class docstring); inputs `[B, T]`, 0 off-mask."""
        counts = m.sum(-1)  # [B]
        margin = safe_logp.sum(-1) - safe_ref.sum(-1)  # [B]
        if self.normalize_by_seq_length:
            margin = margin / counts.clamp_min(1)
        nonempty = counts > 0
        per_seq = torch.where(nonempty, -F.logsigmoid(self.beta * margin), torch.zeros_like(margin))
        return per_seq.sum() / nonempty.sum().clamp_min(1)

    def forward(
        self,
        logp: torch.Tensor,
        behav_logp: torch.Tensor | None,
        prox_logp: torch.Tensor | None,
        advantages: torch.Tensor | None,
        mask: torch.Tensor,
        ref_logp: torch.Tensor | None = None,
    ) -> LossOutput:
        """Return the SFT loss and metrics (`nll`, `loss`, `kl_ref` when a reference is used); tensors `[B, T]`."""
        check_shapes(logp, mask=mask, ref_logp=ref_logp)
        if self.needs_ref_logp and ref_logp is None:
            why = "loss_function='minor_sft'" if self.loss_function == "minor_sft" else "kl_to_ref_coeff > 0"
            raise ValueError(f"SFTLoss with {why} needs ref_logp, got None")
        m = mask != 0
        zeros = torch.zeros_like(logp)
        safe_logp = torch.where(m, logp, zeros)  # off-mask garbage never reaches loss or gradient
        safe_ref = torch.where(m, ref_logp.detach().to(logp.dtype), zeros) if ref_logp is not None else None

        if self.loss_function == "sft":
            loss = aggregate(-safe_logp, m, self.aggregation)
        else:
            loss = self.minor_sft(safe_logp, safe_ref, m)

        kl = None
        if self.needs_ref_logp:
            kl = kl_estimate(safe_logp, safe_ref, "k3")
            if self.kl_to_ref_coeff > 0:
                loss = loss + self.kl_to_ref_coeff * aggregate(kl, m, self.aggregation)

        metrics = {"loss": float(loss.detach()), "nll": float(masked_mean(-safe_logp.detach(), m))}
        if kl is not None:
            metrics["kl_ref"] = float(masked_mean(kl.detach(), m))
        return LossOutput(loss=loss, metrics=metrics)
