"""Group-level filters on a trajectory TensorDict (batch dim first, `group_id [N]`, `rewards [N]`).

TopKRewardSelector (TorchRL's `torchrl.data.llm.TopKRewardSelector`): keep, of each prompt group,
at most k completions whose reward is above the group's median (a uniform group keeps none); the
job applies it with `rollout.keep_top_k` (the `top_k_selection` stage of `algorithm.batch_prep`,
before advantages). drop_uniform_groups: DAPO's
dynamic sampling filter, dropping groups whose rewards are all equal (their group-normalised
advantages are all 0: no signal). Both keep the surviving rows in their original order.
"""
from __future__ import annotations

import dataclasses

import torch
from tensordict import TensorDictBase


def _check_keys(td: TensorDictBase, *keys: str, who: str) -> None:
    have = set(td.keys())
    missing = [k for k in keys if k not in have]
    if missing:
        raise KeyError(f"{who}: TensorDict is missing keys {missing}; has {sorted(have)}")
    if td.batch_dims != 1:
        raise ValueError(f"{who}: need one batch dim, got batch_size {tuple(td.batch_size)}")
    n = td.batch_size[0]
    for k in keys:
        if tuple(td[k].shape) != (n,):
            raise ValueError(f"{who}: key {k!r} must have shape ({n},), got {tuple(td[k].shape)}")


def group_median(rewards: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """Each row's group median `[N]` (float64), the lower one for an even group size as
    `torch.median` gives: element (G - 1) // 2 of the group's rewards sorted ascending."""
    n = rewards.shape[0]
    if n == 0:
        return torch.zeros(0, dtype=torch.float64, device=rewards.device)
    _, inv = torch.unique(group_ids, return_inverse=True)
    r = rewards.double()
    by_reward = torch.sort(r, stable=True).indices
    order = by_reward[torch.sort(inv[by_reward], stable=True).indices]  # grouped, ascending inside a group
    sizes = torch.bincount(inv)  # [num_groups]; groups are numbered in sorted-id order, as `order` is
    starts = torch.cumsum(sizes, 0) - sizes
    return r[order[starts + (sizes - 1) // 2]][inv]


def top_k_mask(rewards: torch.Tensor, group_ids: torch.Tensor, k: int, *, above_median: bool = True) -> torch.Tensor:
    """Bool mask `[N]` selecting, in each group, up to k rows with the highest reward.

    above_median=True (TorchRL's TopKRewardSelector): only rows whose reward is strictly above
    their group's (lower) median are eligible, so a group whose rewards are all equal keeps no
    row, and rewards [0, 0, 0, 1] with k=2 keep only the 1. above_median=False: plain top-k by
    rank (groups with <= k rows are kept whole).
    Ties are broken by position (earlier row wins). Vectorised: one stable sort by reward
    (descending) then a stable sort by group, and a rank within each group; eligible rows always
    rank before ineligible ones of their group, so ranking all rows ranks the eligible ones.
    """
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    n = rewards.shape[0]
    if n == 0:
        return torch.zeros(0, dtype=torch.bool, device=rewards.device)
    _, inv = torch.unique(group_ids, return_inverse=True)
    # Stable sort by reward descending keeps position order among ties; a stable sort by group
    # afterwards keeps that order inside each group.
    by_reward = torch.sort(rewards.double(), descending=True, stable=True).indices
    by_group = torch.sort(inv[by_reward], stable=True).indices
    order = by_reward[by_group]  # rows grouped, best first within a group
    g_sorted = inv[order]
    pos = torch.arange(n, device=rewards.device)
    starts = torch.ones(n, dtype=torch.bool, device=rewards.device)
    starts[1:] = g_sorted[1:] != g_sorted[:-1]
    first = torch.cummax(torch.where(starts, pos, torch.zeros_like(pos)), dim=0).values
    rank = pos - first
    mask = torch.zeros(n, dtype=torch.bool, device=rewards.device)
    mask[order] = rank < k
    if above_median:
        mask &= rewards.double() > group_median(rewards, group_ids)
    return mask


@dataclasses.dataclass
class TopKRewardSelector:
    """Keep, per group, up to `k` trajectories with the highest reward (ties: earlier row first).

    By default as TorchRL's `TopKRewardSelector`: only rewards strictly above the group's median
    (`torch.median`, the lower middle value for an even group) are eligible, so uniform groups
    are dropped whole and a group keeps between 0 and k rows. `above_median=False` ranks every
    row (exactly k rows per group of >= k). `__call__(td)` returns a new TensorDict with the kept
    rows in their original order (TorchRL returns them best first).
    """

    k: int
    """How many trajectories to keep per group, at most."""
    rewards_key: str = "rewards"
    """Per-sequence reward key `[N]`."""
    group_key: str = "group_id"
    """Per-sequence group (prompt) id key `[N]`."""
    above_median: bool = True
    """Only rewards strictly above the group's median are eligible (TorchRL); False: plain top-k."""

    def __post_init__(self) -> None:
        if isinstance(self.k, bool) or not isinstance(self.k, int) or self.k < 1:
            raise ValueError(f"TopKRewardSelector: k must be an int >= 1, got {self.k!r}")

    def mask(self, td: TensorDictBase) -> torch.Tensor:
        """The bool keep-mask `[N]`."""
        _check_keys(td, self.rewards_key, self.group_key, who="TopKRewardSelector")
        return top_k_mask(td[self.rewards_key], td[self.group_key], self.k, above_median=self.above_median)

    def __call__(self, td: TensorDictBase) -> TensorDictBase:
        return td[self.mask(td)]


def uniform_group_mask(rewards: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """Bool mask `[N]`: True for rows whose group's rewards are all equal (exact comparison)."""
    if rewards.shape[0] == 0:
        return torch.zeros(0, dtype=torch.bool, device=rewards.device)
    _, inv = torch.unique(group_ids, return_inverse=True)
    g = int(inv.max()) + 1
    r = rewards.double()
    lo = torch.zeros(g, dtype=r.dtype, device=r.device).scatter_reduce(0, inv, r, "amin", include_self=False)
    hi = torch.zeros(g, dtype=r.dtype, device=r.device).scatter_reduce(0, inv, r, "amax", include_self=False)
    return (lo == hi)[inv]


def drop_uniform_groups(
    td: TensorDictBase, *, rewards_key: str = "rewards", group_key: str = "group_id"
) -> tuple[TensorDictBase, int]:
    """DAPO dynamic sampling: drop every group whose rewards are all equal.

    Returns `(kept_td, n_dropped_groups)`; kept rows stay in their original order. A singleton
    group is uniform and is dropped.
    """
    _check_keys(td, rewards_key, group_key, who="drop_uniform_groups")
    uniform = uniform_group_mask(td[rewards_key], td[group_key])
    n_dropped = int(torch.unique(td[group_key][uniform]).numel())
    return td[~uniform], n_dropped
