"""Outcome-reward advantages: group-relative (GRPO / RLOO), batch-global, masked per-token
normalisation, and Monte-Carlo episode returns for multi-step trajectories (TorchRL's MCAdvantage)."""
from __future__ import annotations

import dataclasses

import torch

ADVANTAGE_MODES = ("group", "global", "none")
MC_REDUCTIONS = ("sum", "max", "mean", "last")


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
) -> torch.Tensor:
    """Group-relative advantages `[N]` from rewards `[N]` and integer group ids `[N]` (any values, any order).

    mean: subtract the group mean; with `leave_one_out` (RLOO) subtract the mean of the *other*
    members instead. A singleton group has no peers, so under leave-one-out its baseline is its own
    reward (advantage 0), matching the plain-mean case and avoiding `r / eps` blow-ups when `std`.
    std: divide by (population std of the group's rewards + eps); singletons have std 0.
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
        sq = torch.zeros_like(counts).index_add_(0, inv, (work - group_mean) ** 2)
        group_std = (sq / counts).sqrt()[inv]
        adv = adv / (group_std + eps)
    return adv.to(rewards.dtype)


def global_advantages(
    rewards: torch.Tensor, *, mean: bool = True, std: bool = True, eps: float = 1e-6
) -> torch.Tensor:
    """Batch-level advantages `[N]`: subtract the batch mean and/or divide by (population std + eps)."""
    rewards = _check_rewards(rewards)
    adv = rewards
    if mean:
        adv = adv - rewards.mean()
    if std:
        adv = adv / (rewards.std(unbiased=False) + eps)
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

    mode: str = "group"
    """'group': relative to the prompt's group (GRPO/RLOO); 'global': relative to the batch; 'none': raw rewards."""
    mean: bool = True
    """Subtract a baseline (the group or batch mean)."""
    std: bool = True
    """Divide by the group or batch reward std (+ eps); Dr. GRPO turns this off."""
    leave_one_out: bool = False
    """Group mode only: baseline is the mean of the *other* group members (RLOO)."""
    eps: float = 1e-6
    """Added to the std before dividing, so constant-reward groups give 0 instead of NaN."""
    mc_reduction: str = "sum"
    """Multi-step episodes only (compute_mc_advantages): episode return = sum, max, mean or last of its step rewards."""

    def __post_init__(self) -> None:
        if self.mode not in ADVANTAGE_MODES:
            raise ValueError(f"unknown advantage mode {self.mode!r}; valid: {list(ADVANTAGE_MODES)}")
        if self.mc_reduction not in MC_REDUCTIONS:
            raise ValueError(f"unknown mc_reduction {self.mc_reduction!r}; valid: {list(MC_REDUCTIONS)}")
        if self.leave_one_out and self.mode != "group":
            raise ValueError(f"leave_one_out needs mode='group', got mode={self.mode!r}")


def compute_advantages(
    rewards: torch.Tensor, group_ids: torch.Tensor | None, cfg: AdvantageConfig
) -> torch.Tensor:
    """Advantages `[N]` for rewards `[N]` (and group ids `[N]`, required in 'group' mode) per `cfg`."""
    if cfg.mode == "group":
        if group_ids is None:
            raise ValueError("advantage mode 'group' needs group_ids, got None")
        return group_advantages(
            rewards, group_ids, mean=cfg.mean, std=cfg.std, eps=cfg.eps, leave_one_out=cfg.leave_one_out
        )
    if cfg.mode == "global":
        return global_advantages(rewards, mean=cfg.mean, std=cfg.std, eps=cfg.eps)
    return _check_rewards(rewards).clone()


# ---------------------------------------------------------------- Monte-Carlo (multi-step) advantages


def _int_ids(name: str, ids: torch.Tensor, like: torch.Tensor) -> None:
    if ids.shape != like.shape:
        raise ValueError(f"shape mismatch: {name} has shape {tuple(ids.shape)}, rewards has {tuple(like.shape)}")
    if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
        raise ValueError(f"{name} must be an integer tensor, got dtype {ids.dtype}")


def episode_returns(
    rewards: torch.Tensor,
    episode_ids: torch.Tensor,
    step_index: torch.Tensor,
    *,
    reduction: str = "sum",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Reduce per-step rewards `[N]` to one return per episode.

    Returns `(returns [E], inverse [N], episode_keys [E])`: `returns[inverse]` broadcasts back to
    steps, `episode_keys` are the distinct episode ids in sorted order. `reduction` is 'sum', 'max',
    'mean' or 'last' (the reward of the step with the largest `step_index`). Steps may come in any
    order, but an (episode, step) pair must not repeat. Computed in float64.
    """
    rewards = _check_rewards(rewards)
    _int_ids("episode_ids", episode_ids, rewards)
    _int_ids("step_index", step_index, rewards)
    if reduction not in MC_REDUCTIONS:
        raise ValueError(f"unknown reduction {reduction!r}; valid: {list(MC_REDUCTIONS)}")
    keys, inv = torch.unique(episode_ids, return_inverse=True)
    num = keys.numel()
    pairs = torch.stack([inv, step_index.to(inv.dtype)], dim=1)
    if pairs.shape[0] and torch.unique(pairs, dim=0).shape[0] != pairs.shape[0]:
        raise ValueError("duplicate (episode_id, step) pair: each step of an episode must appear once")
    work = rewards.double()
    zeros = torch.zeros(num, dtype=work.dtype, device=work.device)
    if reduction in ("sum", "mean"):
        out = zeros.index_add(0, inv, work)
        if reduction == "mean":
            out = out / zeros.index_add(0, inv, torch.ones_like(work))
    elif reduction == "max":
        out = zeros.scatter_reduce(0, inv, work, reduce="amax", include_self=False)
    else:  # last
        steps = step_index.to(torch.long)
        last_step = torch.zeros(num, dtype=torch.long, device=work.device).scatter_reduce(
            0, inv, steps, reduce="amax", include_self=False
        )
        is_last = steps == last_step[inv]
        out = zeros.index_add(0, inv, torch.where(is_last, work, torch.zeros_like(work)))
    return out, inv, keys


def mc_advantages(
    rewards: torch.Tensor,
    episode_ids: torch.Tensor,
    step_index: torch.Tensor,
    *,
    reduction: str = "sum",
    group_ids: torch.Tensor | None = None,
    normalize: str = "group",
    mean: bool = True,
    std: bool = True,
    eps: float = 1e-6,
) -> torch.Tensor:
    """Monte-Carlo advantages `[N]` for multi-step trajectories (TorchRL's MCAdvantage).

    Each row is one step (one LLM turn) of an episode. The episode's return is the `reduction`
    ('sum' | 'max' | 'mean' | 'last') of its steps' rewards; returns are then normalised across
    episodes -- 'group': episodes sharing a `group_ids` value (the same prompt), as in
    `group_advantages`; 'global': over all episodes; 'none': raw returns -- and every step of an
    episode receives its episode's advantage. Each episode counts once in the statistics, however
    many steps it has. All steps of an episode must carry the same group id.
    """
    if normalize not in ADVANTAGE_MODES:
        raise ValueError(f"unknown normalize {normalize!r}; valid: {list(ADVANTAGE_MODES)}")
    returns, inv, _ = episode_returns(rewards, episode_ids, step_index, reduction=reduction)
    out_dtype = _check_rewards(rewards).dtype
    if normalize == "group":
        if group_ids is None:
            raise ValueError("mc_advantages with normalize='group' needs group_ids, got None")
        _int_ids("group_ids", group_ids, rewards)
        g = group_ids.to(torch.long)
        n = returns.numel()
        g_lo = torch.zeros(n, dtype=torch.long, device=g.device).scatter_reduce(0, inv, g, "amin", include_self=False)
        g_hi = torch.zeros(n, dtype=torch.long, device=g.device).scatter_reduce(0, inv, g, "amax", include_self=False)
        if bool((g_lo != g_hi).any()):
            raise ValueError("mc_advantages: the steps of one episode carry different group_ids")
        adv = group_advantages(returns, g_lo, mean=mean, std=std, eps=eps)
    elif normalize == "global":
        adv = global_advantages(returns, mean=mean, std=std, eps=eps)
    else:
        adv = returns
    return adv[inv].to(out_dtype)


@dataclasses.dataclass
class MCAdvantage:
    """Callable writing `advantage_key` `[N]` into a step-level TensorDict via `mc_advantages`.

    Reads `rewards_key`, `episode_key`, `step_key` (and `group_key` when normalize='group');
    returns the same TensorDict, modified in place.
    """

    reduction: str = "sum"
    """Episode return: sum, max, mean or last of the step rewards."""
    normalize: str = "group"
    """'group' (across episodes of a prompt), 'global' (across all episodes) or 'none'."""
    mean: bool = True
    """Subtract the group/batch mean of episode returns."""
    std: bool = True
    """Divide by the group/batch std of episode returns (+ eps)."""
    eps: float = 1e-6
    """Added to the std before dividing."""
    rewards_key: str = "rewards"
    """Per-step reward key `[N]`."""
    episode_key: str = "episode_id"
    """Per-step episode id key `[N]`."""
    step_key: str = "step"
    """Per-step step-index key `[N]`."""
    group_key: str = "group_id"
    """Per-step group (prompt) id key `[N]`."""
    advantage_key: str = "advantages"
    """Output key `[N]`."""

    def __post_init__(self) -> None:
        if self.reduction not in MC_REDUCTIONS:
            raise ValueError(f"unknown reduction {self.reduction!r}; valid: {list(MC_REDUCTIONS)}")
        if self.normalize not in ADVANTAGE_MODES:
            raise ValueError(f"unknown normalize {self.normalize!r}; valid: {list(ADVANTAGE_MODES)}")

    def __call__(self, td):
        needed = [self.rewards_key, self.episode_key, self.step_key]
        if self.normalize == "group":
            needed.append(self.group_key)
        keys = set(td.keys())
        missing = [k for k in needed if k not in keys]
        if missing:
            raise KeyError(f"MCAdvantage: TensorDict is missing keys {missing}; has {sorted(keys)}")
        td[self.advantage_key] = mc_advantages(
            td[self.rewards_key],
            td[self.episode_key],
            td[self.step_key],
            reduction=self.reduction,
            group_ids=td[self.group_key] if self.normalize == "group" else None,
            normalize=self.normalize,
            mean=self.mean,
            std=self.std,
            eps=self.eps,
        )
        return td


def compute_mc_advantages(
    rewards: torch.Tensor,
    episode_ids: torch.Tensor,
    step_index: torch.Tensor,
    group_ids: torch.Tensor | None,
    cfg: AdvantageConfig,
) -> torch.Tensor:
    """`mc_advantages` driven by an `AdvantageConfig` (mode -> normalize, mc_reduction, mean, std, eps).

    leave_one_out is not supported for episode returns and raises.
    """
    if cfg.leave_one_out:
        raise ValueError("compute_mc_advantages does not support leave_one_out")
    return mc_advantages(
        rewards, episode_ids, step_index, reduction=cfg.mc_reduction, group_ids=group_ids,
        normalize=cfg.mode, mean=cfg.mean, std=cfg.std, eps=cfg.eps,
    )
