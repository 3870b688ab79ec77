"""Truncated importance sampling for the inference/training mismatch, as a `Loss` wrapper."""
from __future__ import annotations

from typing import Any

import torch

from rayllm_rl.objectives.base import PROX_LOGP_METHODS, Loss, LossTerms, masked_mean
from rayllm_rl.objectives.grpo import GRPOLoss
from rayllm_rl.objectives.options import GRPOOptions, GRPOTISOptions, read_as, resolve

TIS_LEVELS = ("token", "sequence")
TIS_MODES = ("truncate", "mask")


class TruncatedIS(Loss):
    """Correct a base loss for the rollout-engine vs trainer mismatch with truncated IS.

    The inference engine (vLLM/SGLang kernels, bf16, ...) samples from pi_behav, which differs
    from the trainer's own recompute pi_prox of the same weights even when fully on-policy.
    Following Yao et al. 2025 ("Your Efficient RL Framework Secretly Brings You Off-Policy RL
    Training", fengyao.notion.site, TIS) and its sequence-level / masking variants (Liu et al.
    2025, "When Speed Kills Stability", MIS), the base loss is computed with
    `old = prox_logp` (`needs_prox_logp = True`: the learner recomputes it) and every token's
    base loss is multiplied by a detached weight:
        level "token":    w_t = exp(prox_t - behav_t)
        level "sequence": w_t = exp(sum_{s in seq, masked} (prox_s - behav_s)) for each token t
        mode "truncate":  w <- min(w, cap)          (TIS)
        mode "mask":      w <- 0 where w > cap       (MIS-style rejection; the tokens / whole
                                                      sequence still count in the normaliser)
    loss = base.reduce(w * base.per_token(logp, prox, A, mask) [+ base.penalty(...)]); the KL
    terms, if the base has them, are not reweighted. The base must expose `per_token(logp, old,
    advantages, mask) -> (per_token_loss, metrics)` and `reduce(per_token, mask)` (GRPOLoss and
    its subclasses, CISPOLoss). Extra metrics (names in `weight_metrics`): `tis_weight_mean`
    (mean applied weight over masked tokens), `tis_capped_fraction` (fraction of masked tokens
    whose raw weight > cap). `aggregation`, `reduce` and `normalizer` are the base's (so the
    learner weights micro-batches as for the base). `prox_logp_method` tells the learner how to
    get prox_logp: "recompute" (a forward pass with the pre-update weights) or "loglinear"
    (`loglinear_prox_logp`, no extra pass). The defaults of `level`, `mode`, `cap` and
    `prox_logp_method` are GRPOTISOptions' (`tis_level`, `tis_mode`, `tis_cap`, `prox_logp_method`).
    """

    needs_prox_logp = True
    weight_metrics = ("tis_weight_mean", "tis_capped_fraction")
    """Metric names of the mean applied weight and of the fraction of masked tokens over the cap."""

    def __init__(self, base_loss: Loss, level: str = GRPOTISOptions.tis_level, mode: str = GRPOTISOptions.tis_mode,
                 cap: float = GRPOTISOptions.tis_cap, prox_logp_method: str = GRPOTISOptions.prox_logp_method) -> None:
        super().__init__()
        if not (hasattr(base_loss, "per_token") and hasattr(base_loss, "reduce")):
            raise ValueError(f"{type(base_loss).__name__} does not expose per_token/reduce; TruncatedIS cannot wrap it")
        if prox_logp_method not in PROX_LOGP_METHODS:
            raise ValueError(f"unknown prox_logp_method {prox_logp_method!r}; valid: {list(PROX_LOGP_METHODS)}")
        if level not in TIS_LEVELS:
            raise ValueError(f"unknown level {level!r}; valid: {list(TIS_LEVELS)}")
        if mode not in TIS_MODES:
            raise ValueError(f"unknown mode {mode!r}; valid: {list(TIS_MODES)}")
        if not cap > 0:
            raise ValueError(f"cap must be > 0, got {cap}")
        self.base = base_loss
        self.prox_logp_method = prox_logp_method
        self.level = level
        self.mode = mode
        self.cap = float(cap)
        self.needs_ref_logp = bool(getattr(base_loss, "needs_ref_logp", False))

    @property
    def aggregation(self) -> str:
        return getattr(self.base, "aggregation", Loss.aggregation)

    def reduce(self, per_token: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.base.reduce(per_token, mask)

    def normalizer(self, mask: torch.Tensor) -> float:
        return self.base.normalizer(mask)

    def extra_repr(self) -> str:
        return f"level={self.level!r}, mode={self.mode!r}, cap={self.cap}, prox_logp_method={self.prox_logp_method!r}"

    def weights(
        self, prox_logp: torch.Tensor, behav_logp: torch.Tensor, mask: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Detached `(w, over_cap)` `[B, T]`: the truncated/masked IS weight (0 off-mask)."""
        return self.importance_weights(prox_logp, behav_logp, mask, level=self.level, mode=self.mode, cap=self.cap)

    @staticmethod
    def importance_weights(
        prox_logp: torch.Tensor,
        behav_logp: torch.Tensor,
        mask: torch.Tensor,
        *,
        level: str,
        mode: str,
        cap: float,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Detached `(w, over_cap)` `[B, T]` in `prox_logp`'s dtype, 0 off-mask: the raw weight
        exp(prox - behav) (token level, or its masked per-sequence product at sequence level),
        `min(w, cap)` in mode "truncate" or 0 where w > cap in mode "mask"; `over_cap` marks the
        masked tokens whose raw weight exceeds `cap`. The one implementation of a capped/masked
        importance weight (`DecoupledPPOLoss` uses it for its behaviour weight)."""
        if level not in TIS_LEVELS:
            raise ValueError(f"unknown level {level!r}; valid: {list(TIS_LEVELS)}")
        if mode not in TIS_MODES:
            raise ValueError(f"unknown mode {mode!r}; valid: {list(TIS_MODES)}")
        m = mask != 0
        zeros = torch.zeros_like(prox_logp)
        with torch.no_grad():
            lw = torch.where(m, prox_logp.detach() - behav_logp.detach().to(prox_logp.dtype), zeros)
            if level == "sequence":
                lw = lw.sum(dim=-1, keepdim=True).expand_as(lw)
            raw = torch.exp(lw)
            over = m & (raw > cap)
            w = torch.clamp(raw, max=cap) if mode == "truncate" else torch.where(over, zeros, raw)
            return torch.where(m, w, zeros), over

    def terms(self, logp: torch.Tensor, behav_logp: torch.Tensor, prox_logp: torch.Tensor | None,
              advantages: torch.Tensor, mask: torch.Tensor, ref_logp: torch.Tensor | None) -> LossTerms:
        """`w * base.per_token(logp, prox_logp, A, mask)` plus the base's KL penalty, and the metrics."""
        if prox_logp is None:
            raise ValueError(
                f"{type(self).__name__} needs prox_logp (the learner recomputes it when needs_prox_logp is True, "
                "or approximates it with loglinear_prox_logp when prox_logp_method='loglinear')"
            )
        penalty_fn = getattr(self.base, "penalty", None)
        kl, kl_stats = penalty_fn(logp, behav_logp, ref_logp, mask) if penalty_fn is not None else (None, {})
        pg, stats = self.base.per_token(logp, prox_logp, advantages, mask)
        w, over = self.weights(prox_logp.to(logp.dtype), behav_logp, mask)
        per_token = w * pg
        if kl is not None:
            per_token = per_token + kl
        m = mask != 0
        mean_key, capped_key = self.weight_metrics
        metrics = {**stats, **kl_stats, mean_key: float(masked_mean(w, m)),
                   capped_key: float(over.sum() / m.sum().clamp_min(1))}
        return per_token, metrics


class GRPOTISLoss(TruncatedIS):
    """`TruncatedIS(GRPOLoss(...), level, mode, cap, prox_logp_method)` from one options object, `GRPOTISOptions`
    (registered as "grpo_tis"): `tis_level`, `tis_mode`, `tis_cap` are TruncatedIS's level, mode and cap, the
    other fields, read as `GRPOOptions`, `GRPOLoss`'s. A subclass reads its own options class and says how they
    weigh (`weighting`)."""

    options_class = GRPOTISOptions

    def __init__(self, options: GRPOTISOptions | None = None, /, **overrides: Any) -> None:
        options = resolve(self.options_class, options, overrides, type(self).__name__)
        level, mode, cap = self.weighting(options)
        super().__init__(GRPOLoss(read_as(GRPOOptions, options)), level=level, mode=mode, cap=cap,
                         prox_logp_method=options.prox_logp_method)
        self.options = options

    def weighting(self, options: Any) -> tuple[str, str, float]:
        """TruncatedIS's `(level, mode, cap)` from this loss's options: here their tis_* fields."""
        return options.tis_level, options.tis_mode, options.tis_cap
