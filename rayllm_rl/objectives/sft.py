"""Supervised fine-tuning losses (plain NLL and TorchRL's MinorSFT) behind the common `Loss` contract."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from rayllm_rl.objectives.base import AGGREGATIONS, Loss, LossOutput, aggregate, check_shapes, masked_mean
from rayllm_rl.objectives.grpo import kl_estimate

SFT_FUNCTIONS = ("sft", "minor_sft")


class SFTLoss(Loss):
    """SFT on masked target tokens; `behav_logp`, `prox_logp` and `advantages` are ignored.

    sft: `aggregate(-logp, mask, aggregation)`.
    minor_sft (TorchRL's MinorSFT, DPO-inspired, gentler than SFT): per sequence
    `-logsigmoid(beta * (sum_t logp - sum_t ref_logp))` over masked tokens, averaged over sequences
    that have at least one masked token (`aggregation` does not apply to this term).
    With `kl_to_ref_coeff > 0`, `coeff * aggregate(k3(logp, ref_logp), mask, aggregation)` is added.
    """

    def __init__(
        self,
        *,
        loss_function: str = "sft",
        beta: float = 0.1,
        kl_to_ref_coeff: float = 0.0,
        aggregation: str = "token-mean",
    ) -> None:
        super().__init__()
        if loss_function not in SFT_FUNCTIONS:
            raise ValueError(f"unknown loss_function {loss_function!r}; valid: {list(SFT_FUNCTIONS)}")
        if aggregation not in AGGREGATIONS:
            raise ValueError(f"unknown aggregation {aggregation!r}; valid: {list(AGGREGATIONS)}")
        if kl_to_ref_coeff < 0:
            raise ValueError(f"kl_to_ref_coeff must be >= 0, got {kl_to_ref_coeff}")
        self.loss_function = loss_function
        self.beta = float(beta)
        self.kl_to_ref_coeff = float(kl_to_ref_coeff)
        self.aggregation = aggregation
        self.needs_ref_logp = loss_function == "minor_sft" or self.kl_to_ref_coeff > 0

    def extra_repr(self) -> str:
        return (
            f"loss_function={self.loss_function!r}, beta={self.beta}, "
            f"kl_to_ref_coeff={self.kl_to_ref_coeff}, aggregation={self.aggregation!r}"
        )

    def forward(
        self,
        logp: torch.Tensor,
        behav_logp: torch.Tensor | None,
        prox_logp: torch.Tensor | None,
        advantages: torch.Tensor | None,
        mask: torch.Tensor,
        ref_logp: torch.Tensor | None = None,
    ) -> LossOutput:
        """Return the SFT loss and metrics (`nll`, `loss`, `kl_ref` when on); tensors `[B, T]`."""
        check_shapes(logp, mask=mask, ref_logp=ref_logp)
        if self.needs_ref_logp and ref_logp is None:
            why = "loss_function='minor_sft'" if self.loss_function == "minor_sft" else "kl_to_ref_coeff > 0"
            raise ValueError(f"SFTLoss with {why} needs ref_logp, got None")
        m = mask != 0
        zeros = torch.zeros_like(logp)
        safe_logp = torch.where(m, logp, zeros)  # off-mask garbage never reaches loss or gradient
        safe_ref = torch.where(m, ref_logp.detach(), zeros) if ref_logp is not None else None

        if self.loss_function == "sft":
            loss = aggregate(-safe_logp, m, self.aggregation)
        else:
            margin = self.beta * (safe_logp.sum(-1) - safe_ref.sum(-1))  # [B]
            nonempty = m.any(-1)
            per_seq = torch.where(nonempty, -F.logsigmoid(margin), torch.zeros_like(margin))
            loss = per_seq.sum() / nonempty.sum().clamp_min(1)

        kl = None
        if self.kl_to_ref_coeff > 0:
            kl = kl_estimate(safe_logp, safe_ref, "k3")
            loss = loss + self.kl_to_ref_coeff * aggregate(kl, m, self.aggregation)

        metrics = {"loss": float(loss.detach()), "nll": float(masked_mean(-safe_logp.detach(), m))}
        if kl is not None:
            metrics["kl_ref"] = float(masked_mean(kl.detach(), m))
        return LossOutput(loss=loss, metrics=metrics)
