"""GRPO / PPO-clip policy loss with decoupled clip bounds and an optional KL-to-reference term.

Also home of the small helpers every objective shares: `aggregate` (token-mean / seq-mean /
seq-sum reduction of a masked `[B, T]` tensor), `masked_mean`, `kl_estimate` (Schulman's k1/k2/k3)
and `check_shapes`.
"""
from __future__ import annotations

import torch

from rayllm_rl.objectives.base import Loss, LossOutput

AGGREGATIONS = ("token-mean", "seq-mean", "seq-sum")
KL_ESTIMATORS = ("k1", "k2", "k3")


def aggregate(per_token: torch.Tensor, mask: torch.Tensor, mode: str = "token-mean") -> torch.Tensor:
    """Reduce a per-token `[B, T]` tensor over masked tokens to a scalar.

    token-mean: sum of masked values / number of masked tokens in the batch.
    seq-mean: mean over sequences of each sequence's masked mean.
    seq-sum: mean over sequences of each sequence's masked sum.
    Sequences with no masked token are excluded from the mean over sequences in both seq modes
    (they have no tokens to learn from); an all-empty batch gives 0 (still attached to the graph).
    Values at unmasked positions are never read (inf/NaN there cannot leak into the result).
    """
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


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of `values` `[B, T]` over tokens where mask != 0; 0 when the mask is empty."""
    return aggregate(values, mask, "token-mean")


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


class GRPOLoss(Loss):
    """PPO-clip surrogate with separate low/high clip bounds (DAPO clip-higher) and optional KL.

    Per token: `-min(r*A, clip(r, 1-eps_low, 1+eps_high)*A) + kl_coef * KL_t` with
    `r = exp(logp - old)`, `old = prox_logp if given else behav_logp`; then `aggregate`d.
    `old`, `advantages` and `ref_logp` are treated as constants (detached).
    """

    def __init__(
        self,
        *,
        clip_eps_low: float = 0.2,
        clip_eps_high: float = 0.2,
        kl_coef: float = 0.0,
        kl_estimator: str = "k3",
        aggregation: str = "token-mean",
    ) -> None:
        super().__init__()
        if not 0.0 <= clip_eps_low < 1.0 or clip_eps_high < 0.0:
            raise ValueError(
                f"need 0 <= clip_eps_low < 1 and clip_eps_high >= 0, got {clip_eps_low}, {clip_eps_high}"
            )
        if kl_coef < 0:
            raise ValueError(f"kl_coef must be >= 0, got {kl_coef}")
        if kl_estimator not in KL_ESTIMATORS:
            raise ValueError(f"unknown kl_estimator {kl_estimator!r}; valid: {list(KL_ESTIMATORS)}")
        if aggregation not in AGGREGATIONS:
            raise ValueError(f"unknown aggregation {aggregation!r}; valid: {list(AGGREGATIONS)}")
        self.clip_eps_low = float(clip_eps_low)
        self.clip_eps_high = float(clip_eps_high)
        self.kl_coef = float(kl_coef)
        self.kl_estimator = kl_estimator
        self.aggregation = aggregation
        self.needs_ref_logp = self.kl_coef > 0

    def extra_repr(self) -> str:
        return (
            f"clip_eps_low={self.clip_eps_low}, clip_eps_high={self.clip_eps_high}, "
            f"kl_coef={self.kl_coef}, kl_estimator={self.kl_estimator!r}, aggregation={self.aggregation!r}"
        )

    def forward(
        self,
        logp: torch.Tensor,
        behav_logp: torch.Tensor,
        prox_logp: torch.Tensor | None,
        advantages: torch.Tensor,
        mask: torch.Tensor,
        ref_logp: torch.Tensor | None = None,
    ) -> LossOutput:
        """Return the aggregated loss and masked metrics; all inputs `[B, T]` (advantages may be `[B]`)."""
        check_shapes(
            logp, behav_logp=behav_logp, prox_logp=prox_logp, advantages=advantages, mask=mask, ref_logp=ref_logp
        )
        if self.kl_coef > 0 and ref_logp is None:
            raise ValueError("GRPOLoss with kl_coef > 0 needs ref_logp, got None")
        m = mask != 0
        old = (prox_logp if prox_logp is not None else behav_logp).detach()
        adv = advantages.detach().to(logp.dtype)
        if adv.dim() == 1:
            adv = adv.unsqueeze(-1)
        zeros = torch.zeros_like(logp)
        # Zero every input off-mask so garbage there (inf, NaN, huge ratios) cannot reach the
        # loss or its gradient: torch.where alone does not stop NaN gradients from the other branch.
        adv = torch.where(m, adv.expand_as(logp), zeros)
        safe_logp = torch.where(m, logp, zeros)
        log_ratio = safe_logp - torch.where(m, old, zeros)
        ratio = torch.exp(log_ratio)
        clipped = torch.clamp(ratio, 1.0 - self.clip_eps_low, 1.0 + self.clip_eps_high)
        per_token = torch.maximum(-ratio * adv, -clipped * adv)

        kl = None
        if self.kl_coef > 0:
            kl = kl_estimate(safe_logp, torch.where(m, ref_logp.detach(), zeros), self.kl_estimator)
            per_token = per_token + self.kl_coef * kl
        loss = aggregate(per_token, m, self.aggregation)

        with torch.no_grad():
            n = m.sum().clamp_min(1)
            r = ratio.detach()
            low = m & (adv < 0) & (r < 1.0 - self.clip_eps_low)
            high = m & (adv > 0) & (r > 1.0 + self.clip_eps_high)
            r_m = torch.where(m, r, torch.zeros_like(r))
            sum_r, sum_r2 = r_m.sum(), (r_m * r_m).sum()
            ess = sum_r * sum_r / (m.sum() * sum_r2) if m.any() else torch.zeros(())
            metrics = {
                "loss": float(loss.detach()),
                "clip_fraction_low": float(low.sum() / n),
                "clip_fraction_high": float(high.sum() / n),
                "clip_fraction": float((low.sum() + high.sum()) / n),
                # k3 estimate of KL(old || new): exp(old - logp) - 1 - (old - logp).
                "approx_kl": float(masked_mean(torch.expm1(-log_ratio.detach()) + log_ratio.detach(), m)),
                "ess": float(ess),
                # Mean negative logprob of the sampled tokens (a proxy: true entropy needs logits).
                "entropy_proxy": float(masked_mean(-safe_logp.detach(), m)),
            }
            if kl is not None:
                metrics["kl_ref"] = float(masked_mean(kl.detach(), m))
        return LossOutput(loss=loss, metrics=metrics)
