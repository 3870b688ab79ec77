"""MC (multi-step) advantages, TopKRewardSelector and DAPO's uniform-group filter, against hand-computed values."""
from __future__ import annotations

import math

import pytest
import torch
from tensordict import TensorDict

from rayllm_rl.data.selectors import TopKRewardSelector, drop_uniform_groups, top_k_mask
from rayllm_rl.objectives.advantages import (
    AdvantageConfig,
    MCAdvantage,
    compute_advantages,
    compute_mc_advantages,
    episode_returns,
    mc_advantages,
)

EPS = 1e-6


def _t(xs, dtype=torch.float32):
    return torch.tensor(xs, dtype=dtype)


def _l(xs):
    return torch.tensor(xs, dtype=torch.long)


# ---------------------------------------------------------------- reductions (normalize='none')
# Episode 5: steps 0,1,2 with rewards 1, 3, 2 -> sum 6, max 3, mean 2, last (step 2) 2.
# Episode 7: steps 0,1   with rewards -1, 0.5 -> sum -0.5, max 0.5, mean -0.25, last (step 1) 0.5.
# Rows are shuffled so that neither episode nor step order can be assumed.
RED_EP = [5, 7, 5, 7, 5]
RED_STEP = [1, 1, 0, 0, 2]
RED_R = [3.0, 0.5, 1.0, -1.0, 2.0]


@pytest.mark.parametrize(
    "reduction, ep5, ep7",
    [("sum", 6.0, -0.5), ("max", 3.0, 0.5), ("mean", 2.0, -0.25), ("last", 2.0, 0.5)],
)
def test_mc_reductions_broadcast_raw_returns_to_every_step(reduction, ep5, ep7):
    adv = mc_advantages(_t(RED_R), _l(RED_EP), _l(RED_STEP), reduction=reduction, normalize="none")
    expected = [ep5 if e == 5 else ep7 for e in RED_EP]
    assert adv.dtype == torch.float32
    assert adv.tolist() == pytest.approx(expected, abs=1e-6)


def test_episode_returns_keys_and_inverse():
    ret, inv, keys = episode_returns(_t(RED_R), _l(RED_EP), _l(RED_STEP), reduction="sum")
    assert keys.tolist() == [5, 7]
    assert ret.tolist() == pytest.approx([6.0, -0.5])
    assert inv.tolist() == [0, 1, 0, 1, 0]


# ---------------------------------------------------------------- group / global normalisation
# Group 0: ep 10 (steps [1, 2] -> sum 3), ep 11 (steps [0, 1, 0] -> sum 1), ep 12 (one step [2] -> 2).
#   Episode returns 3, 1, 2: mean 2, population std sqrt(2/3) -> +sqrt(3/2), -sqrt(3/2), 0.
#   (Per-step statistics would weight ep 11 three times and give different numbers.)
# Group 1: ep 20 (one step [4] -> 4), ep 21 (steps [1, 1] -> 2). Returns 4, 2: mean 3, std 1 -> +1, -1.
ROWS = [  # (episode, step, reward, group)
    (11, 2, 0.0, 0),
    (20, 0, 4.0, 1),
    (10, 0, 1.0, 0),
    (11, 0, 0.0, 0),
    (21, 1, 1.0, 1),
    (12, 0, 2.0, 0),
    (10, 1, 2.0, 0),
    (21, 0, 1.0, 1),
    (11, 1, 1.0, 0),
]
EP = _l([r[0] for r in ROWS])
STEP = _l([r[1] for r in ROWS])
REW = _t([r[2] for r in ROWS])
GID = _l([r[3] for r in ROWS])
S32 = math.sqrt(1.5) / (1.0 + EPS * math.sqrt(1.5))  # 1 / (sqrt(2/3) + eps)
GROUP_ADV = {10: S32, 11: -S32, 12: 0.0, 20: 1.0 / (1.0 + EPS), 21: -1.0 / (1.0 + EPS)}


def test_mc_group_normalisation_per_episode_then_broadcast():
    adv = mc_advantages(REW, EP, STEP, reduction="sum", group_ids=GID, normalize="group")
    assert adv.tolist() == pytest.approx([GROUP_ADV[int(e)] for e in EP], rel=1e-6, abs=1e-6)


def test_mc_group_mean_only_is_dr_grpo_style():
    # Returns 3, 1, 2 (mean 2) and 4, 2 (mean 3), no std division.
    want = {10: 1.0, 11: -1.0, 12: 0.0, 20: 1.0, 21: -1.0}
    adv = mc_advantages(REW, EP, STEP, group_ids=GID, normalize="group", std=False)
    assert adv.tolist() == pytest.approx([want[int(e)] for e in EP], abs=1e-6)


def test_mc_group_max_reduction():
    # max: ep10 2, ep11 1, ep12 2 -> mean 5/3, var ((1/3)^2*2 + (2/3)^2)/3 = 2/9, std sqrt(2)/3.
    #      ep20 4, ep21 1 -> mean 2.5, std 1.5.
    s = math.sqrt(2) / 3
    want = {10: (1 / 3) / (s + EPS), 11: (-2 / 3) / (s + EPS), 12: (1 / 3) / (s + EPS),
            20: 1.5 / (1.5 + EPS), 21: -1.5 / (1.5 + EPS)}
    adv = mc_advantages(REW, EP, STEP, reduction="max", group_ids=GID, normalize="group")
    assert adv.tolist() == pytest.approx([want[int(e)] for e in EP], rel=1e-6, abs=1e-6)


def test_mc_global_normalisation_over_episodes():
    # Episode returns 3, 1, 2, 4, 2: mean 2.4, population var 5.2 / 5 = 1.04.
    ret = {10: 3.0, 11: 1.0, 12: 2.0, 20: 4.0, 21: 2.0}
    sd = math.sqrt(1.04)
    adv = mc_advantages(REW, EP, STEP, reduction="sum", normalize="global")
    assert adv.tolist() == pytest.approx([(ret[int(e)] - 2.4) / (sd + EPS) for e in EP], rel=1e-6, abs=1e-6)


def test_single_step_episodes_match_group_advantages():
    r = _t([1.0, 0.0, 1.0, 1.0, 0.0, 0.0])
    g = _l([0, 0, 0, 1, 1, 1])
    adv = mc_advantages(r, torch.arange(6), torch.zeros(6, dtype=torch.long), group_ids=g)
    ref = compute_advantages(r, g, AdvantageConfig())
    assert torch.allclose(adv, ref)


def test_mc_errors():
    with pytest.raises(ValueError, match="needs group_ids"):
        mc_advantages(REW, EP, STEP, normalize="group")
    with pytest.raises(ValueError, match="unknown reduction"):
        mc_advantages(REW, EP, STEP, reduction="min", group_ids=GID)
    with pytest.raises(ValueError, match="unknown normalize"):
        mc_advantages(REW, EP, STEP, normalize="batch")
    with pytest.raises(ValueError, match="duplicate"):
        mc_advantages(_t([1.0, 2.0]), _l([0, 0]), _l([0, 0]), normalize="none")
    with pytest.raises(ValueError, match="different group_ids"):
        mc_advantages(_t([1.0, 2.0]), _l([0, 0]), _l([0, 1]), group_ids=_l([0, 1]))
    with pytest.raises(ValueError, match="integer"):
        mc_advantages(REW, EP.float(), STEP, normalize="none")


def test_mc_advantage_callable_writes_key():
    td = TensorDict({"rewards": REW, "episode_id": EP, "step": STEP, "group_id": GID}, batch_size=[len(ROWS)])
    out = MCAdvantage()(td)
    assert out is td
    assert td["advantages"].tolist() == pytest.approx([GROUP_ADV[int(e)] for e in EP], rel=1e-6, abs=1e-6)
    with pytest.raises(KeyError, match="step"):
        MCAdvantage()(TensorDict({"rewards": REW, "episode_id": EP, "group_id": GID}, batch_size=[len(ROWS)]))
    with pytest.raises(ValueError, match="unknown reduction"):
        MCAdvantage(reduction="median")


def test_compute_mc_advantages_from_config_and_config_defaults():
    assert AdvantageConfig().mc_reduction == "sum"
    with pytest.raises(ValueError, match="mc_reduction"):
        AdvantageConfig(mc_reduction="median")
    adv = compute_mc_advantages(REW, EP, STEP, GID, AdvantageConfig(mode="group"))
    assert adv.tolist() == pytest.approx([GROUP_ADV[int(e)] for e in EP], rel=1e-6, abs=1e-6)
    with pytest.raises(ValueError, match="leave_one_out"):
        compute_mc_advantages(REW, EP, STEP, GID, AdvantageConfig(leave_one_out=True))


# ---------------------------------------------------------------- TopKRewardSelector
# Interleaved groups of 4. Group 0 = rows 0,2,4,6 with rewards 1,3,3,2 -> k=2 keeps rows 2,4.
# Group 1 = rows 1,3,5,7 with rewards 1,2,1,1 -> keeps row 3 (2) and row 1 (first of the tied 1s).
TK_GID = [0, 1, 0, 1, 0, 1, 0, 1]
TK_R = [1.0, 1.0, 3.0, 2.0, 3.0, 1.0, 2.0, 1.0]


def _td(rewards, gids):
    n = len(rewards)
    ids = torch.arange(n).unsqueeze(-1).repeat(1, 3)  # row index in every token slot
    return TensorDict(
        {"input_ids": ids, "loss_mask": torch.ones(n, 3, dtype=torch.bool), "rewards": _t(rewards), "group_id": _l(gids)},
        batch_size=[n],
    )


def test_top_k_keeps_best_two_per_group_with_stable_ties():
    out = TopKRewardSelector(k=2)(_td(TK_R, TK_GID))
    assert out["input_ids"][:, 0].tolist() == [1, 2, 3, 4]
    assert out["rewards"].tolist() == [1.0, 3.0, 2.0, 3.0]
    assert out["group_id"].tolist() == [1, 0, 1, 0]
    assert out["input_ids"].shape == (4, 3)


def test_top_k_one_and_k_larger_than_group():
    # k=1: group 0 best is the first 3 (row 2); group 1 best is row 3.
    assert top_k_mask(_t(TK_R), _l(TK_GID), 1).nonzero().flatten().tolist() == [2, 3]
    assert top_k_mask(_t(TK_R), _l(TK_GID), 5).all()


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
