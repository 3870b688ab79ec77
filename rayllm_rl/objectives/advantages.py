"""Outcome-reward advantages: group-relative (GRPO / RLOO), batch-global and masked per-token
normalisation.

A trajectory is a whole episode (a multi-turn conversation is one row with one reward), so the
group advantage of the episode reward is also what TorchRL's MCAdvantage computes for it, once
the std conventions agree: MCAdvantage divides by the unbiased (G - 1) std clamped at 1e-6,
`std_estimator="unbiased"` by that std + eps."""
from __future__ import annotations

import dataclasses
from typing import Literal

import torch

ADVANTAGE_MODES = ("group", "global", "none")
STD_ESTIMATORS = ("population", "unbiased")


def _check_std_estimator(std_estimator: str) -> None:
    if std_estimator not in STD_ESTIMATORS:
        raise ValueError(f"unknown std_estimator {std_estimator!r}; valid: {list(STD_ESTIMATORS)}")


def _check_rewards(rewards: torch.Tensor) -> torch.Tensor:
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be [N], got shape {tuple(rewards.shape)}")
    return rewards if rewards.is_floating_point() else rewards.float()


def group_advantages(
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    *,
    mean: bool = True,
    std: bool = True,
    eps: float = 1e-6,
    leave_one_out: bool = False,
    std_estimator: str = "population",
) -> torch.Tensor:
    """Group-relative advantages `[N]` from rewards `[N]` and integer group ids `[N]` (any values, any order).

    mean: subtract the group mean; with `leave_one_out` (RLOO) subtract the mean of the *other*
    members instead. A singleton group has no peers, so under leave-one-out its baseline is its own
    reward (advantage 0), matching the plain-mean case and avoiding `r / eps` blow-ups when `std`.
    std: divide by (std of the group's rewards + eps). `std_estimator="population"` divides the
    sum of squared deviations by G (the group size), "unbiased" by G - 1 (Bessel's correction, as
    TRL, verl and TorchRL's MCAdvantage do): unbiased = population * sqrt(G / (G - 1)), 1.069 at
    G = 8. Singletons have std 0 under both.
    Vectorised with `torch.unique(return_inverse=True)` + `index_add`, no loop over groups.
    """
    rewards = _check_rewards(rewards)
    if group_ids.shape != rewards.shape:
        raise ValueError(
            f"shape mismatch: group_ids has shape {tuple(group_ids.shape)}, rewards has {tuple(rewards.shape)}"
        )
    if group_ids.is_floating_point() or group_ids.is_complex():
        raise ValueError(f"group_ids must be an integer tensor, got dtype {group_ids.dtype}")
    _, inv = torch.unique(group_ids, return_inverse=True)
    num_groups = int(inv.max()) + 1 if inv.numel() else 0
    work = rewards.double()
    counts = torch.zeros(num_groups, dtype=work.dtype, device=work.device).index_add_(0, inv, torch.ones_like(work))
    sums = torch.zeros_like(counts).index_add_(0, inv, work)
    group_mean = (sums / counts)[inv]  # counts >= 1 for every group that exists
    n = counts[inv]

    adv = work
    if mean:
        if leave_one_out:
            loo = (sums[inv] - work) / (n - 1).clamp_min(1)
            baseline = torch.where(n > 1, loo, work)
        else:
            baseline = group_mean
        adv = work - baseline
    if std:
        _check_std_estimator(std_estimator)
        sq = torch.zeros_like(counts).index_add_(0, inv, (work - group_mean) ** 2)
        dof = counts if std_estimator == "population" else (counts - 1).clamp_min(1)
        group_std = (sq / dof).sqrt()[inv]
        adv = adv / (group_std + eps)
    return adv.to(rewards.dtype)


def global_advantages(
    rewards: torch.Tensor, *, mean: bool = True, std: bool = True, eps: float = 1e-6,
    std_estimator: str = "population",
) -> torch.Tensor:
    """Batch-level advantages `[N]`: subtract the batch mean and/or divide by (std + eps), the std
    over N ("population") or N - 1 ("unbiased"; a single reward has std 0)."""
    rewards = _check_rewards(rewards)
    adv = rewards
    if mean:
        adv = adv - rewards.mean()
    if std:
        _check_std_estimator(std_estimator)
        unbiased = std_estimator == "unbiased" and rewards.numel() > 1
        adv = adv / (rewards.std(unbiased=unbiased) + eps)
    return adv


def masked_normalize(values: torch.Tensor, mask: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    """Whiten per-token `values` `[B, T]` with mean/population-std over masked tokens (AReaL-style).

    Statistics are computed in float64; unlike AReaL, off-mask positions are returned as 0 rather
    than `-mean / std`, so they never look like real advantages. An empty mask gives all zeros.
    """
    if values.shape != mask.shape:
        raise ValueError(
            f"shape mismatch: values has shape {tuple(values.shape)}, mask has {tuple(mask.shape)}"
        )
    m = mask != 0
    x = torch.where(m, values.double(), torch.zeros((), dtype=torch.float64, device=values.device))
    n = m.sum().clamp_min(1)
    mu = x.sum() / n
    var = (torch.where(m, x - mu, torch.zeros_like(x)) ** 2).sum() / n
    out = torch.where(m, (x - mu) / (var.sqrt() + eps), torch.zeros_like(x))
    return out.to(values.dtype if values.is_floating_point() else torch.float32)


@dataclasses.dataclass
class AdvantageConfig:
    """How rollout rewards `[N]` become advantages `[N]`."""

    mode: Literal["group", "global", "none"] = "group"
    """'group': relative to the prompt's group (GRPO/RLOO); 'global': relative to the batch; 'none': raw rewards."""
    mean: bool = True
    """Subtract a baseline (the group or batch mean)."""
    std: bool = True
    """Divide by the group or batch reward std (+ eps); Dr. GRPO turns this off."""
    std_estimator: Literal["population", "unbiased"] = "population"
    """Which std `std` divides by: 'population' (squared deviations / G, G the group or batch size)
    or 'unbiased' (/ (G - 1), Bessel's correction, as TRL, verl and TorchRL's MCAdvantage; larger by
    sqrt(G / (G - 1)), 1.069 at G = 8)."""
    leave_one_out: bool = False
    """Group mode only: baseline is the mean of the *other* group members (RLOO)."""
    eps: float = 1e-6
    """Added to the std before dividing, so constant-reward groups give 0 instead of NaN."""

    def __post_init__(self) -> None:
        if self.mode not in ADVANTAGE_MODES:
            raise ValueError(f"unknown advantage mode {self.mode!r}; valid: {list(ADVANTAGE_MODES)}")
        if self.leave_one_out and self.mode != "group":
            raise ValueError(f"leave_one_out needs mode='group', got mode={self.mode!r}")
        if self.std_estimator not in STD_ESTIMATORS:
            raise ValueError(f"algo.advantage.std_estimator={self.std_estimator!r}: valid values are "
                             f"{list(STD_ESTIMATORS)}")


def compute_advantages(
    rewards: torch.Tensor, group_ids: torch.Tensor | None, cfg: AdvantageConfig
) -> torch.Tensor:
    """Advantages `[N]` for rewards `[N]` (and group ids `[N]`, required in 'group' mode) per `cfg`."""
    if cfg.mode == "group":
        if group_ids is None:
            raise ValueError("advantage mode 'group' needs group_ids, got None")
        return group_advantages(
            rewards, group_ids, mean=cfg.mean, std=cfg.std, eps=cfg.eps, leave_one_out=cfg.leave_one_out,
            std_estimator=cfg.std_estimator,
        )
    if cfg.mode == "global":
        return global_advantages(rewards, mean=cfg.mean, std=cfg.std, eps=cfg.eps, std_estimator=cfg.std_estimator)
    return _check_rewards(rewards).clone()

