"""tests/learning_bounds.py: each bound passes a series that learned and fails one that did not (synthetic
numbers, seeded: a flat series with the noise of a real run, weights that did not move, a constant classifier)."""
from __future__ import annotations

import random

import pytest

from learning_bounds import (assert_advantages_every_step, assert_beats_majority, assert_falls, assert_greedy_gain,
                             assert_moves_together, assert_rises, assert_separated, greedy_gain_counts, sign_test_p)


def per_step_rewards(start: float, end: float, steps: int = 80, noise: float = 0.06, seed: int = 0) -> list[float]:
    """A per-step mean reward going linearly from `start` to `end`, with a batch mean's sampling noise
    (64 binary rewards at p ~ 0.3 have a standard deviation of ~0.06)."""
    rng = random.Random(seed)
    return [start + (end - start) * t / (steps - 1) + rng.gauss(0, noise) for t in range(steps)]


def test_assert_rises_passes_a_learning_run_and_fails_flat_ones():
    rl = per_step_rewards(0.24, 0.54)  # the shape of test_ray_pipeline's learning run
    assert assert_rises(rl[:15], rl[-15:]) > 3
    for seed in range(20):  # flat runs with the same noise: none passes (each would with probability ~0.2%)
        flat = per_step_rewards(0.3, 0.3, seed=seed)
        with pytest.raises(AssertionError, match=r"reward: .* needs > 3 SE"):
            assert_rises(flat[:15], flat[-15:])
    with pytest.raises(AssertionError):  # no noise and no change: nothing rose
        assert_rises([0.0] * 15, [0.0] * 15)
    with pytest.raises(AssertionError):  # it fell
        assert_rises(rl[-15:], rl[:15])


def test_assert_rises_scales_with_the_runs_noise():
    """The same rise of 0.1 is learning in a quiet run and noise in a loud one: the bound moves with the spread."""
    quiet, loud = per_step_rewards(0.3, 0.4, noise=0.02), per_step_rewards(0.3, 0.4, noise=0.3)
    assert_rises(quiet[:15], quiet[-15:])
    with pytest.raises(AssertionError, match="needs > 3 SE"):
        assert_rises(loud[:15], loud[-15:])


def test_assert_separated_compares_two_samples():
    rng = random.Random(1)
    up = [0.5 + rng.gauss(0, 0.2) for _ in range(30)]
    down = [-0.5 + rng.gauss(0, 0.2) for _ in range(30)]
    same = [rng.gauss(0, 0.2) for _ in range(30)]
    assert assert_separated(down, up, what="logprob change") > 3
    with pytest.raises(AssertionError, match="logprob change"):
        assert_separated(same, [x + rng.gauss(0, 0.2) for x in same], what="logprob change")


def test_sign_test_p_values():
    assert sign_test_p(5, 0) == 1 / 32 and sign_test_p(0, 0) == 1.0
    assert sign_test_p(7, 1) == pytest.approx(9 / 256)
    assert sign_test_p(3, 3) > 0.5


def test_assert_greedy_gain_per_item():
    before = [0] * 15 + [1] * 5
    learned = [1] * 6 + [0] * 9 + [1] * 5  # 6 items up, none down: p = 1/64
    assert assert_greedy_gain(before, learned) == pytest.approx(1 / 64)
    with pytest.raises(AssertionError, match=r"0 items up and 0 down .* p = 1"):
        assert_greedy_gain(before, before)  # weights that did not move: the same greedy answers
    churned = [1] * 8 + [0] * 7 + [0] * 4 + [1]  # 8 up, 4 down: net +4 items, as likely as not by chance flips
    with pytest.raises(AssertionError, match="8 items up and 4 down"):
        assert_greedy_gain(before, churned)


def test_assert_greedy_gain_from_means_takes_the_worst_case():
    up, down, _ = greedy_gain_counts(0.4, 1.0, 30)  # every item right after: none went down
    assert (up, down) == (18, 0)
    assert assert_greedy_gain(0.4, 1.0, 30) < 1e-5
    up, down, _ = greedy_gain_counts(0.4, 0.6, 30)  # +6 items; up to 12 of the 12 right before may have fallen
    assert (up, down) == (18, 12)
    with pytest.raises(AssertionError, match="18 items up and 12 down"):
        assert_greedy_gain(0.4, 0.6, 30)
    with pytest.raises(AssertionError, match="0 items up and 0 down"):
        assert_greedy_gain(0.5, 0.5, 30)
    with pytest.raises(ValueError, match="not the mean of 30 binary"):
        greedy_gain_counts(0.41, 0.6, 30)


def test_assert_falls():
    assert assert_falls(4.0, 1.0, 0.5, what="nll") == 0.25
    with pytest.raises(AssertionError, match=r"nll: 4 -> 3 = 0.75 x the first; needs < 0.5 x"):
        assert_falls(4.0, 3.0, 0.5, what="nll")
    with pytest.raises(AssertionError):
        assert_falls(4.0, 4.0, 1.0)  # flat: not below the first value


def test_assert_beats_majority():
    rng = random.Random(2)
    labels = [1.0 if rng.random() < 0.27 else 0.0 for _ in range(1000)]  # a quarter positive
    majority = 1 - sum(labels) / len(labels)
    assert assert_beats_majority(0.99, labels) > 0.9
    with pytest.raises(AssertionError, match="majority-class rate"):
        assert_beats_majority(majority, labels)  # a constant classifier: always "wrong"
    with pytest.raises(AssertionError):
        assert_beats_majority(majority + 0.01, labels)  # within the noise of 1000 examples


def test_assert_moves_together():
    rng = random.Random(3)
    rule = per_step_rewards(0.2, 0.45, seed=4)
    tracking = [r + rng.gauss(0, 0.02) + 0.03 for r in rule]  # follows the rule sample by sample, with an offset
    assert assert_moves_together(tracking, rule, what="rm vs rule") > 0.5
    hacked = per_step_rewards(0.2, 0.6, seed=5)  # rises too, but on its own noise: level correlation, no tracking
    with pytest.raises(AssertionError, match="rm vs rule"):
        assert_moves_together(hacked, rule, what="rm vs rule")
    with pytest.raises(AssertionError):
        assert_moves_together([0.5] * 80, rule)  # a constant score follows nothing


def test_assert_separated_with_the_noise_of_untouched_values():
    """Two values against six: their own variances say little; the spread of the untouched rows is the noise."""
    rng = random.Random(6)
    untouched = [rng.gauss(0, 0.5) for _ in range(56)]
    assert assert_separated([-3.3, -0.5], [2.2, 2.7, 2.3, 1.9, 2.6, 2.3], noise=untouched) > 3
    with pytest.raises(AssertionError, match="from the spread of 56 untouched values"):
        assert_separated(untouched[:2], untouched[2:8], noise=untouched)  # rows that moved for no reason


def test_assert_advantages_every_step():
    assert assert_advantages_every_step([{"step": s, "advantage_abs_mean": 0.5} for s in range(1, 81)]) == 0.5
    records = [{"step": s, "advantage_abs_mean": 0.0 if s in (7, 9) else 0.4} for s in range(1, 81)]
    with pytest.raises(AssertionError, match=r"steps where every group agreed: \[7, 9\]"):
        assert_advantages_every_step(records)


def test_assert_beats_majority_with_a_share_of_the_errors_to_avoid():
    labels = [1.0] * 38 + [0.0] * 1162  # the format-noise set's shape: a constant is right 96.8% of the time
    assert assert_beats_majority(0.9942, labels, avoid=0.75) > 0.8
    with pytest.raises(AssertionError, match=r"avoiding 75% of its errors\); avoids 68%"):
        assert_beats_majority(0.99, labels, avoid=0.75)  # significant, but short of the target
