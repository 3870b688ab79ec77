"""TopKRewardSelector (TorchRL's above-median rule and plain top-k) and DAPO's uniform-group filter,
against hand-computed values."""
from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict

from rayllm_rl.data.selectors import TopKRewardSelector, drop_uniform_groups, top_k_mask


def _t(xs, dtype=torch.float32):
    return torch.tensor(xs, dtype=dtype)


def _l(xs):
    return torch.tensor(xs, dtype=torch.long)


# ---------------------------------------------------------------- TopKRewardSelector
# Interleaved groups of 4. Group 0 = rows 0,2,4,6 with rewards 1,3,3,2: sorted 1,2,3,3, lower
# median 2 -> eligible above it: rows 2, 4 (the 3s). Group 1 = rows 1,3,5,7 with rewards 1,2,1,1:
# sorted 1,1,1,2, median 1 -> eligible: row 3 only.
TK_GID = [0, 1, 0, 1, 0, 1, 0, 1]
TK_R = [1.0, 1.0, 3.0, 2.0, 3.0, 1.0, 2.0, 1.0]


def _td(rewards, gids):
    n = len(rewards)
    ids = torch.arange(n).unsqueeze(-1).repeat(1, 3)  # row index in every token slot
    return TensorDict(
        {"input_ids": ids, "loss_mask": torch.ones(n, 3, dtype=torch.bool), "rewards": _t(rewards),
         "group_id": _l(gids)},
        batch_size=[n],
    )


def _kept(mask):
    return mask.nonzero().flatten().tolist()


def test_top_k_keeps_only_rewards_above_the_group_median_by_default():
    out = TopKRewardSelector(k=2)(_td(TK_R, TK_GID))
    assert out["input_ids"][:, 0].tolist() == [2, 3, 4]  # group 1 has one reward above its median
    assert out["rewards"].tolist() == [3.0, 2.0, 3.0]
    assert out["group_id"].tolist() == [0, 1, 0]
    assert out["input_ids"].shape == (3, 3)


def test_top_k_drops_uniform_groups_and_the_median_itself():
    # [0, 0, 0, 1] with k=2: median 0, only the 1 is above it (plain top-k would also keep row 0).
    assert _kept(top_k_mask(_t([0.0, 0.0, 0.0, 1.0]), _l([5] * 4), 2)) == [3]
    assert _kept(top_k_mask(_t([0.0, 0.0, 0.0, 1.0]), _l([5] * 4), 2, above_median=False)) == [0, 3]
    # a uniform group keeps nothing, whatever k; the other group (odd size 3: median 3) keeps the 5
    rewards, gids = _t([2.0, 5.0, 2.0, 1.0, 2.0, 3.0]), _l([8, 4, 8, 4, 8, 4])
    assert _kept(top_k_mask(rewards, gids, 3)) == [1]
    # [0, 1, 1, 1]: the lower median is 1, nothing is above it
    assert _kept(top_k_mask(_t([0.0, 1.0, 1.0, 1.0]), _l([0] * 4), 2)) == []
    # even size 4, rewards 4, 1, 3, 2: lower median 2 -> 4 and 3 eligible; k=1 keeps the 4
    assert _kept(top_k_mask(_t([4.0, 1.0, 3.0, 2.0]), _l([1] * 4), 1)) == [0]
    assert _kept(top_k_mask(_t([4.0, 1.0, 3.0, 2.0]), _l([1] * 4), 4)) == [0, 2]
    td = _td([1.0, 1.0, 1.0], [0, 0, 0])
    assert TopKRewardSelector(k=2)(td).batch_size[0] == 0


def test_group_median_is_torch_median_per_group():
    from rayllm_rl.data.selectors import group_median

    g = torch.Generator().manual_seed(0)
    rewards = torch.randint(0, 4, (40,), generator=g).float()
    gids = torch.randint(0, 6, (40,), generator=g)
    got = group_median(rewards, gids)
    for gid in gids.unique().tolist():
        rows = gids == gid
        assert (got[rows] == rewards[rows].median()).all(), gid


def test_plain_top_k_keeps_best_two_per_group_with_stable_ties():
    out = TopKRewardSelector(k=2, above_median=False)(_td(TK_R, TK_GID))
    assert out["input_ids"][:, 0].tolist() == [1, 2, 3, 4]  # group 1: row 3 (2) and row 1 (first tied 1)
    assert out["rewards"].tolist() == [1.0, 3.0, 2.0, 3.0]


def test_top_k_one_and_k_larger_than_group():
    # k=1: group 0 best is the first 3 (row 2); group 1 best is row 3.
    assert _kept(top_k_mask(_t(TK_R), _l(TK_GID), 1)) == [2, 3]
    assert _kept(top_k_mask(_t(TK_R), _l(TK_GID), 5)) == [2, 3, 4]  # every row above its median
    assert top_k_mask(_t(TK_R), _l(TK_GID), 5, above_median=False).all()


def test_top_k_errors():
    with pytest.raises(ValueError, match="k must be"):
        TopKRewardSelector(k=0)
    td = _td(TK_R, TK_GID)
    del td["group_id"]
    with pytest.raises(KeyError, match="group_id"):
        TopKRewardSelector(k=2)(td)


# ---------------------------------------------------------------- drop_uniform_groups
def test_drop_uniform_groups():
    # group 3: all 1 (dropped); group 8: 0,1,0 (kept); group 5: 0,0 (dropped); group 9: 1,0.5 (kept).
    gids = [3, 8, 3, 5, 8, 9, 3, 5, 8, 9]
    rew = [1.0, 0.0, 1.0, 0.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.5]
    kept, n = drop_uniform_groups(_td(rew, gids))
    assert n == 2
    assert kept["input_ids"][:, 0].tolist() == [1, 4, 5, 8, 9]
    assert kept["group_id"].tolist() == [8, 8, 9, 8, 9]


def test_drop_uniform_groups_all_mixed_and_all_uniform():
    kept, n = drop_uniform_groups(_td([0.0, 1.0, 1.0, 0.0], [0, 0, 1, 1]))
    assert n == 0 and kept.batch_size[0] == 4
    kept, n = drop_uniform_groups(_td([0.0, 0.0, 1.0], [0, 0, 1]))  # a singleton group is uniform
    assert n == 2 and kept.batch_size[0] == 0


def test_drop_uniform_groups_missing_key():
    td = _td([0.0, 1.0], [0, 0])
    del td["rewards"]
    with pytest.raises(KeyError, match="rewards"):
        drop_uniform_groups(td)
