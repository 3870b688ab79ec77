"""GRPO / PPO-clip policy loss with decoupled clip bounds and an optional KL-to-reference term.

Also home of the helpers the policy losses share: `kl_estimate` (Schulman's k1/k2/k3), `prepare`
(masked, NaN-safe inputs) and `ratio_metrics`.
"""
from __future__ import annotations

from typing import Any

import torch

from rayllm_rl.objectives.base import AGGREGATIONS, Loss, LossTerms, masked_mean
from rayllm_rl.objectives.options import GRPOOptions, PPOClip, read_as, resolve

RATIO_LEVELS = ("token", "sequence")
KL_ESTIMATORS = ("k1", "k2", "k3")


def kl_estimate(logp: torch.Tensor, ref_logp: torch.Tensor, estimator: str = "k3") -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from sampled-token logprobs, `[B, T]` -> `[B, T]`.

    With lr = ref_logp - logp: k1 = -lr, k2 = lr^2 / 2, k3 = exp(lr) - 1 - lr (Schulman 2020).
    """
    lr = ref_logp - logp
    if estimator == "k1":
        return -lr
    if estimator == "k2":
        return 0.5 * lr * lr
    if estimator == "k3":
        return torch.expm1(lr) - lr
    raise ValueError(f"unknown kl_estimator {estimator!r}; valid: {list(KL_ESTIMATORS)}")


def prepare(
    logp: torch.Tensor, old: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Masked, NaN-safe inputs shared by the policy losses: `(m, safe_logp, safe_old, adv)`.

    Every input is zeroed off-mask so garbage there (inf, NaN, huge ratios) cannot reach a loss
    or its gradient (torch.where alone does not stop NaN gradients from the other branch).
    `old` and `advantages` are detached; `advantages` `[B]` is broadcast to `[B, T]`.
    """
    m = mask != 0
    zeros = torch.zeros_like(logp)
    adv = advantages.detach().to(logp.dtype)
    if adv.dim() == 1:
        adv = adv.unsqueeze(-1)
    adv = torch.where(m, adv.expand_as(logp), zeros)
    safe_logp = torch.where(m, logp, zeros)
    safe_old = torch.where(m, old.detach().to(logp.dtype), zeros)
    return m, safe_logp, safe_old, adv


def ratio_metrics(
    m: torch.Tensor,
    safe_logp: torch.Tensor,
    log_ratio: torch.Tensor,
    low: torch.Tensor,
    high: torch.Tensor,
) -> dict[str, float]:
    """The metrics every policy loss reports, from the masked per-token log-ratio `[B, T]`.

    clip_fraction_low/high/clip_fraction: fraction of masked tokens in the boolean `low`/`high`;
    approx_kl: k3 estimate of KL(old || new) from tokens sampled by old: with the ratio
    `r = exp(logp - old)`, `r - 1 - log r` (Schulman 2020: k3 of KL(q || p) on samples of q is
    `p/q - 1 - log(p/q)`), unbiased and >= 0 per token;
    ess: `(sum r)^2 / (n sum r^2)`; entropy_proxy: mean `-logp` of the sampled tokens (true
    entropy needs logits).
    """
    with torch.no_grad():
        n = m.sum().clamp_min(1)
        lr = log_ratio.detach()
        r = torch.where(m, torch.exp(lr), torch.zeros_like(lr))
        sum_r, sum_r2 = r.sum(), (r * r).sum()
        ess = sum_r * sum_r / (m.sum() * sum_r2) if m.any() else torch.zeros(())
        low, high = low & m, high & m
        return {
            "clip_fraction_low": float(low.sum() / n),
            "clip_fraction_high": float(high.sum() / n),
            "clip_fraction": float((low.sum() + high.sum()) / n),
            "approx_kl": float(masked_mean(torch.expm1(lr) - lr, m)),
            "ess": float(ess),
            "entropy_proxy": float(masked_mean(-safe_logp.detach(), m)),
        }


class GRPOLoss(Loss):
    """PPO-clip surrogate with separate low/high clip bounds (DAPO clip-higher) and optional KL.

    Per token: `-min(r*A, clip(r, 1-eps_low, 1+eps_high)*A) + kl_coef * KL(pi||ref)_t
    + kl_behav_coef * KL(pi||behav)_t` with `r = exp(logp - old)`, `old = prox_logp if given
    else behav_logp`; then `aggregate`d. `old`, `advantages`, `behav_logp` and `ref_logp` are
    treated as constants (detached).

    `ratio_level="sequence"` is GSPO (Zheng et al. 2025, "Group Sequence Policy Optimization",
    arXiv:2507.18071): every token of sequence i uses the length-normalised sequence ratio
    `s_i = exp(mean_{t in i, masked} (logp_t - old_t))` (the gradient flows through the mean, so
    d s_i / d logp_t = s_i / |y_i|), clipped to `[1-eps_low, 1+eps_high]` exactly like the token
    ratio. GSPO clips far tighter than token-level PPO (the paper uses eps_low=3e-4,
    eps_high=4e-4) because s_i is a geometric mean close to 1. GSPO averages per sequence, so
    with `aggregation=None` sequence level defaults to "seq-mean" (token level to "token-mean");
    an explicit aggregation is honoured. With per-sequence advantages, seq-mean gives exactly the
    GSPO objective `mean_i min(s_i A_i, clip(s_i) A_i)`.

    `clip_ratio_c` (None = off; verl's dual-clip, 3.0 there when on, must be > 1): for A < 0 the
    per-token loss is also capped at `clip_ratio_c * |A|`, i.e. `min(max(-r*A, -clip(r)*A),
    -clip_ratio_c * A)`; a token with A < 0 and r > clip_ratio_c then has no gradient, so one very
    unlikely-under-old token with a negative advantage cannot dominate the update. Tokens with
    A >= 0 are unchanged. Metric `clip_fraction_dual`: fraction of masked tokens capped that way.

    `per_token(logp, old, advantages, mask)` returns the unaggregated policy-gradient term (zero
    off-mask) and the ratio metrics, so wrappers (`TruncatedIS`) can reweight it before `reduce`.
    """

    options_class = GRPOOptions

    def __init__(self, options: PPOClip | None = None, /, **overrides: Any) -> None:
        """`options`: a `self.options_class` (GRPOOptions here; DAPOOptions, DrGRPOOptions in the subclasses), or
        keyword overrides that build one. Read as GRPOOptions: a field the class lacks (DAPO's KL penalty) takes
        GRPOOptions' default."""
        super().__init__()
        self.options = resolve(self.options_class, options, overrides, type(self).__name__)
        o = read_as(GRPOOptions, self.options)
        if not 0.0 <= o.clip_eps_low < 1.0 or o.clip_eps_high < 0.0:
            raise ValueError(
                f"need 0 <= clip_eps_low < 1 and clip_eps_high >= 0, got {o.clip_eps_low}, {o.clip_eps_high}"
            )
        if o.kl_coef < 0:
            raise ValueError(f"kl_coef must be >= 0, got {o.kl_coef}")
        if o.clip_ratio_c is not None and not o.clip_ratio_c > 1.0:
            raise ValueError(f"clip_ratio_c (dual-clip) must be None (off) or > 1, got {o.clip_ratio_c}")
        if o.kl_behav_coef < 0:
            raise ValueError(f"kl_behav_coef must be >= 0, got {o.kl_behav_coef}")
        if o.kl_estimator not in KL_ESTIMATORS:
            raise ValueError(f"unknown kl_estimator {o.kl_estimator!r}; valid: {list(KL_ESTIMATORS)}")
        if o.ratio_level not in RATIO_LEVELS:
            raise ValueError(f"unknown ratio_level {o.ratio_level!r}; valid: {list(RATIO_LEVELS)}")
        aggregation = o.aggregation
        if aggregation is None:
            aggregation = "seq-mean" if o.ratio_level == "sequence" else "token-mean"
        if aggregation not in AGGREGATIONS:
            raise ValueError(f"unknown aggregation {aggregation!r}; valid: {list(AGGREGATIONS)}")
        self.clip_eps_low = float(o.clip_eps_low)
        self.clip_eps_high = float(o.clip_eps_high)
        self.kl_coef = float(o.kl_coef)
        self.kl_behav_coef = float(o.kl_behav_coef)
        self.kl_estimator = o.kl_estimator
        self.aggregation = aggregation
        self.ratio_level = o.ratio_level
        self.clip_ratio_c = None if o.clip_ratio_c is None else float(o.clip_ratio_c)
        self.needs_ref_logp = self.kl_coef > 0

    def extra_repr(self) -> str:
        return (
            f"clip_eps_low={self.clip_eps_low}, clip_eps_high={self.clip_eps_high}, "
            f"kl_coef={self.kl_coef}, kl_behav_coef={self.kl_behav_coef}, kl_estimator={self.kl_estimator!r}, "
            f"aggregation={self.aggregation!r}, ratio_level={self.ratio_level!r}, clip_ratio_c={self.clip_ratio_c}"
        )

    def per_token(
        self, logp: torch.Tensor, old: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """Unaggregated clipped surrogate `[B, T]` (0 off-mask; dual-clipped with `clip_ratio_c`) and its metrics."""
        m, safe_logp, safe_old, adv = prepare(logp, old, advantages, mask)
        log_ratio = safe_logp - safe_old
        if self.ratio_level == "sequence":
            counts = m.sum(dim=-1, keepdim=True).clamp_min(1)
            seq_log_ratio = log_ratio.sum(dim=-1, keepdim=True) / counts  # [B, 1]
            log_ratio = torch.where(m, seq_log_ratio.expand_as(log_ratio), torch.zeros_like(log_ratio))
        ratio = torch.exp(log_ratio)
        clipped = torch.clamp(ratio, 1.0 - self.clip_eps_low, 1.0 + self.clip_eps_high)
        per_token = torch.maximum(-ratio * adv, -clipped * adv)
        dual_capped = None
        if self.clip_ratio_c is not None:
            cap = -self.clip_ratio_c * adv  # [B, T], = clip_ratio_c * |A| where A < 0
            dual_capped = (adv < 0) & (per_token.detach() > cap) & m
            per_token = torch.where(adv < 0, torch.minimum(per_token, cap), per_token)
        r = ratio.detach()
        metrics = ratio_metrics(
            m, safe_logp, log_ratio, (adv < 0) & (r < 1.0 - self.clip_eps_low),
            (adv > 0) & (r > 1.0 + self.clip_eps_high)
        )
        if dual_capped is not None:
            metrics["clip_fraction_dual"] = float(dual_capped.sum() / m.sum().clamp_min(1))
        return per_token, metrics

    def penalty(
        self, logp: torch.Tensor, behav_logp: torch.Tensor, ref_logp: torch.Tensor | None, mask: torch.Tensor
    ) -> tuple[torch.Tensor | None, dict[str, float]]:
        """KL penalties per token `[B, T]` (0 off-mask; None when both are off) and their metrics.

        `kl_coef * KL(pi || pi_ref)` from `ref_logp` plus `kl_behav_coef * KL(pi || pi_behav)`
        from the inference policy's own logprobs (a direct pull toward the sampler, for the
        engine/trainer mismatch and stale rollouts), both with `kl_estimator`. Metrics
        `kl_ref` / `kl_behav` are the masked means of the unscaled estimates.
        """
        m = mask != 0
        zeros = torch.zeros_like(logp)
        safe_logp = torch.where(m, logp, zeros)
        total, metrics = None, {}
        for name, coef, other in (("kl_ref", self.kl_coef, ref_logp), ("kl_behav", self.kl_behav_coef, behav_logp)):
            if coef <= 0:
                continue
            if other is None:
                raise ValueError(f"{type(self).__name__} with kl_coef > 0 needs ref_logp (reference logprobs), "
                                 "got None")
            kl = kl_estimate(safe_logp, torch.where(m, other.detach().to(logp.dtype), zeros), self.kl_estimator)
            metrics[name] = float(masked_mean(kl.detach(), m))
            total = coef * kl if total is None else total + coef * kl
        return total, metrics

    def terms(self, logp: torch.Tensor, behav_logp: torch.Tensor, prox_logp: torch.Tensor | None,
              advantages: torch.Tensor, mask: torch.Tensor, ref_logp: torch.Tensor | None) -> LossTerms:
        """Per-token clipped surrogate vs `old` plus the KL penalties `[B, T]`, and their metrics."""
        kl, kl_stats = self.penalty(logp, behav_logp, ref_logp, mask)
        old = prox_logp if prox_logp is not None else behav_logp
        per_token, ratio_stats = self.per_token(logp, old, advantages, mask)
        if kl is not None:
            per_token = per_token + kl
        return per_token, {**ratio_stats, **kl_stats}
