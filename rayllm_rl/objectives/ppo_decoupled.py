"""AReaL's decoupled PPO loss (Fu et al. 2025) and the log-linear proximal-logprob approximation."""
from __future__ import annotations

from typing import Any

import torch

from rayllm_rl.objectives.importance import GRPOTISLoss
from rayllm_rl.objectives.options import DecoupledPPOOptions

TIS_MODE_OF = {"cap": "truncate", "mask": "mask"}  # behav_weight_mode -> TruncatedIS mode
BEHAV_WEIGHT_MODES = tuple(TIS_MODE_OF)


class DecoupledPPOLoss(GRPOTISLoss):
    """Decoupled PPO objective of AReaL (Fu et al. 2025, "AReaL: A Large-Scale Asynchronous
    Reinforcement Learning System for Language Reasoning", arXiv:2505.24298, Eq. 5).

    Two policies are decoupled: the proximal policy pi_prox (the learner's weights before this
    update: `needs_prox_logp = True`, recomputed by the learner or, with
    `prox_logp_method="loglinear"`, approximated by `loglinear_prox_logp`) anchors the trust
    region, and the behaviour policy pi_behav (the possibly stale rollout policy) is corrected
    by importance weighting. Per token:
        r = exp(logp - prox)                       (gradient flows through logp)
        pg = -min(r*A, clip(r, 1-eps_low, 1+eps_high)*A)
        w = exp(prox - behav)                      (detached, ALWAYS applied)
        "cap":  w <- min(w, behav_weight_cap)
        "mask": w <- 0 where w > behav_weight_cap  (AReaL's `behav_imp_weight_cap` does this)
        loss_t = w * pg   (+ the KL penalties of `GRPOLoss.penalty` when on), aggregated with `aggregation`.
    That is `GRPOTISLoss` at token level with cap = behav_weight_cap and "cap" read as its
    "truncate" mode, so the computation is `TruncatedIS.terms`; only the names differ.
    In "mask" mode masked tokens still count in the token-mean denominator (as in AReaL, where
    they are zeroed by the weight, not removed from the loss mask). The default mode (DecoupledPPOOptions) is "cap";
    AReaL's `behav_imp_weight_cap` masks, so `behav_weight_mode="mask"` reproduces AReaL.
    `clip_ratio_c` is GRPOLoss's dual-clip (off by default; AReaL's `c_clip`).
    Extra metrics: `behav_weight_mean` (mean of the applied weight over masked tokens) and
    `behav_weight_capped_fraction` (fraction of masked tokens with raw w > cap).
    `prox_logp=None` raises ValueError.
    """

    weight_metrics = ("behav_weight_mean", "behav_weight_capped_fraction")
    options_class = DecoupledPPOOptions

    def __init__(self, options: DecoupledPPOOptions | None = None, /, **overrides: Any) -> None:
        super().__init__(options, **overrides)
        self.behav_weight_cap = float(self.options.behav_weight_cap)
        self.behav_weight_mode = self.options.behav_weight_mode

    def weighting(self, options: Any) -> tuple[str, str, float]:
        """Token level, with `behav_weight_mode` "cap" read as TruncatedIS's "truncate", at `behav_weight_cap`
        (checked here, so that an error names these fields, not TruncatedIS's)."""
        if options.behav_weight_mode not in BEHAV_WEIGHT_MODES:
            raise ValueError(f"unknown behav_weight_mode {options.behav_weight_mode!r}; "
                             f"valid: {list(BEHAV_WEIGHT_MODES)}")
        if not options.behav_weight_cap > 0:
            raise ValueError(f"behav_weight_cap must be > 0, got {options.behav_weight_cap}")
        return "token", TIS_MODE_OF[options.behav_weight_mode], options.behav_weight_cap

    def extra_repr(self) -> str:
        return (
            f"behav_weight_cap={self.behav_weight_cap}, behav_weight_mode={self.behav_weight_mode!r}, "
            f"prox_logp_method={self.prox_logp_method!r}"
        )


def loglinear_prox_logp(
    behav_logp: torch.Tensor,
    versions: torch.Tensor,
    current_version: int | torch.Tensor,
    logp_current: torch.Tensor,
) -> torch.Tensor:
    """Approximate log pi_prox without a recompute forward pass (detached, `[B, T]`).

    Log-linear interpolation between policy versions, after AReaL's recompute-free proximal
    logprob approximation ("loglinear"): policy log-probabilities are assumed to move linearly in
    the version number between the behaviour policy that sampled token t (version `v_t =
    versions[b, t]`, logprob `behav_logp`) and the policy at `current_version` (logprob
    `logp_current`, e.g. the training forward's logp). The proximal policy is the one right
    before the update, version `v_prox = current_version - 1`, so

        alpha_t = (v_prox - v_t) / (current_version - v_t)      (in [0, 1) for v_t < current_version)
        log pi_prox_t ~= behav_logp_t + alpha_t * (logp_current_t - behav_logp_t)

    A token sampled by v_prox itself gets alpha=0 (exactly its behaviour logprob); a very stale
    token gets alpha -> 1 (close to the current logprob). Tokens with `v_t >= v_prox` get
    alpha = 0. Negative versions (e.g. an "unknown" marker on prompt tokens) are not special-cased:
    they read as very stale, so keep such tokens off the loss mask.
    Limits: exact only if log-probs really move linearly in the version index; it ignores the
    curvature of the optimisation path, is only as good as the version bookkeeping, and on the
    first minibatch (`logp_current` = prox) it differs from the true prox only by how stale
    tokens are interpolated. Use the learner's recompute when affordable.

    `current_version` is an int or a per-row `[B]` tensor. The learner uses this with
    `algo.prox_logp_method=loglinear`: `logp_current` is its training forward's logp and
    `current_version` the batch's `prox_version` + 1 (the version this update produces).
    """
    if behav_logp.shape != logp_current.shape or versions.shape != behav_logp.shape:
        raise ValueError(
            f"shape mismatch: behav_logp {tuple(behav_logp.shape)}, versions {tuple(versions.shape)}, "
            f"logp_current {tuple(logp_current.shape)}"
        )
    with torch.no_grad():
        b = behav_logp.detach().to(torch.float64)
        c = logp_current.detach().to(torch.float64)
        v = versions.to(torch.float64)
        cur = torch.as_tensor(current_version, dtype=torch.float64, device=v.device)
        if cur.dim() == 1:
            cur = cur.unsqueeze(-1)  # [B] -> [B, 1], one version per row
        stale = v < cur - 1.0
        alpha = torch.where(stale, (cur - 1.0 - v) / (cur - v).clamp_min(1.0), torch.zeros_like(v))
        out = b + alpha * (c - b)
        return out.to(logp_current.dtype)
