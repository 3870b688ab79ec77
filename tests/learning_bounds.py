"""Bounds derived from the run itself, for the tests that check that a training run learned.

A fixed threshold on a learning curve ("the reward rose by 0.1", "the first step's KL is above 4") holds on the
machine it was measured on. Another CPU's kernels round the same float sums in another order (AVX2 and AVX-512
vector widths, bf16 matmuls with or without AMX), a run then samples other tokens from its first step on, and the
number the threshold was fitted to reads 3.97 where it read 5.4. These helpers compare a run with itself instead:

- `assert_rises(first, last)`: a windowed mean rose by `K` standard errors of the difference, the standard error
  from the two windows' own step-to-step spread (Welch), so the noise of the run that is judged sets the bar;
- `assert_separated(lower, upper)`: the same test on any two samples (e.g. the logprob change of the rows with a
  positive advantage against those with a negative one, the noise then from the rows with none);
- `assert_greedy_gain(before, after, n)`: a greedy (deterministic) score over `n` items rose by more items than
  chance flips explain: an exact sign test at `ALPHA`, per item when the items' scores are known, and for the
  worst case the two means allow when only the means are;
- `assert_falls(first, last, ratio)`: a positive quantity fell below `ratio` times its first value (the caller
  states why that ratio);
- `assert_beats_majority(accuracy, labels)`: a classifier's accuracy on a labelled set is `K` binomial standard
  errors above what always answering the set's majority label scores (and, optionally, avoids a stated share of
  that constant's errors);
- `assert_moves_together(x, y)`: two per-step series move together step to step (the correlation of their
  changes is `K` standard errors above 0), e.g. a reward model's batch mean and the rule's on the same rollouts;
- `assert_advantages_every_step(records)`: GRPO had something to learn from on every step (some group's rewards
  differed), in place of a bound on how much, which the trajectory sets.

Each one fails a run that does not learn: a flat series (windows from one distribution), weights that did not
move (no greedy answer changed), a constant classifier, two series that move independently. `tests/
test_learning_bounds.py` shows each passing a learning series and failing a flat or noisy one.

Each prints one line, `learning_bounds: <what>: <measured> vs <bound> ...` (pytest shows it with `-s`, and with a
failing test's output), and raises AssertionError with the same line when the bound is not met.
"""
from __future__ import annotations

import math
import statistics
from collections.abc import Sequence

K = 3.0
"""Standard errors a difference must exceed. A run that does not learn, whose two windows come from one
distribution, passes with the one-sided tail probability at 3: 0.13% for a normal difference, 0.3% for Student's
t with the ~28 degrees of freedom of two 15-step windows. The learning runs of this suite clear it by 7-15 standard
errors (docs/testing.md), so a learning run fails it with a negligible probability."""

ALPHA = 0.05
"""Largest one-sided p-value a greedy gain may have (`assert_greedy_gain`). A greedy evaluation has no sampling
noise to measure: its noise is which items flip, so the test is over the items. At 0.05 a gain needs at least 5
items up and none down, 7 up and 1 down, 9 up and 2 down; a run that moves its weights without improving them
(each changed item a fair coin) passes one time in 20 at most. The greedy checks are the second witness of a
learning run: the first, on the sampled training reward, is `assert_rises` at `K`."""


def _report(ok: bool, line: str) -> None:
    line = f"learning_bounds: {line}"
    print(line)
    if not ok:
        raise AssertionError(line)


def _floats(xs: Sequence[float], what: str, least: int) -> list[float]:
    out = [float(x) for x in xs]
    if len(out) < least or not all(math.isfinite(x) for x in out):
        raise ValueError(f"{what}: needs at least {least} finite values, got {out!r:.200}")
    return out


def welch_se(a: Sequence[float], b: Sequence[float]) -> float:
    """Standard error of mean(b) - mean(a) from each sample's own variance (Welch: no equal variances assumed)."""
    a, b = _floats(a, "welch_se", 2), _floats(b, "welch_se", 2)
    return math.sqrt(statistics.variance(a) / len(a) + statistics.variance(b) / len(b))


def assert_separated(lower: Sequence[float], upper: Sequence[float], k: float = K, what: str = "value",
                     noise: Sequence[float] | None = None) -> float:
    """mean(upper) - mean(lower) > k * SE: the two samples' means differ by more than their noise explains.
    Returns the difference in standard errors.

    SE is Welch's (`welch_se`, each sample's own variance), or, given `noise` (values of the same kind that neither
    treatment touched, e.g. the rows a GRPO step gave no advantage), sd(noise) * sqrt(1/len(lower) + 1/len(upper)):
    what two groups of values that moved for no reason differ by. Use `noise` when a sample is too small to
    estimate its own variance (2 values). With no spread at all (SE 0) it requires mean(upper) > mean(lower);
    equal samples always fail."""
    least = 1 if noise is not None else 2
    lower, upper = _floats(lower, what, least), _floats(upper, what, least)
    lo, hi = statistics.fmean(lower), statistics.fmean(upper)
    if noise is None:
        se, how = welch_se(lower, upper), "Welch, from the samples' own spread"
    else:
        noise = _floats(noise, f"{what} (noise)", 2)
        se = statistics.stdev(noise) * math.sqrt(1 / len(lower) + 1 / len(upper))
        how = f"from the spread of {len(noise)} untouched values, sd {statistics.stdev(noise):.4g}"
    ratio = (hi - lo) / se if se > 0 else (math.inf if hi > lo else -math.inf)
    _report(hi - lo > k * se and hi > lo,
            f"{what}: {lo:.4g} (n={len(lower)}) -> {hi:.4g} (n={len(upper)}), difference {hi - lo:+.4g} = "
            f"{ratio:.2f} SE; needs > {k:g} SE = {k * se:.4g} (SE {se:.4g}, {how})")
    return ratio


def assert_rises(first: Sequence[float], last: Sequence[float], k: float = K, what: str = "reward") -> float:
    """The mean of the last window of a per-step series exceeds the first window's by `k` standard errors of the
    difference (`assert_separated`). Each window's step-to-step spread is the run's own noise (the last window's
    includes the trend within it, which only makes the test stricter). A non-learning run, both windows from one
    distribution, passes with probability ~0.1-0.3% at k=3 (`K`). Returns the difference in standard errors."""
    return assert_separated(first, last, k, what)


def sign_test_p(up: int, down: int) -> float:
    """One-sided exact sign test: P(at least `up` of `up + down` fair coin flips come up), the probability that
    chance alone moves this many items up when `up + down` items changed."""
    n = up + down
    return sum(math.comb(n, i) for i in range(up, n + 1)) / 2 ** n if n else 1.0


def greedy_gain_counts(before, after, n: int | None = None) -> tuple[int, int, str]:
    """(items up, items down, how they were counted) for a greedy score before and after training.

    Per item (`before`, `after` sequences of the items' scores): the items whose score rose and fell. From the
    means alone (`before`, `after` floats, `n` binary items: each scores 0 or 1): the split the means allow that
    is least significant, i.e. the most items down: an item can fall only if it scored 1 before and scores 0
    after, so down <= min(before * n, (1 - after) * n), and up = down + the net gain in items."""
    if n is None:
        b, a = _floats(before, "greedy before", 1), _floats(after, "greedy after", 1)
        if len(a) != len(b):
            raise ValueError(f"greedy scores of {len(b)} items before and {len(a)} after")
        return sum(y > x for x, y in zip(b, a)), sum(y < x for x, y in zip(b, a)), f"per item, n={len(b)}"
    counts = []
    for mean in (before, after):
        c = float(mean) * n
        if not 0 <= round(c) <= n or abs(c - round(c)) > 1e-6 * n:
            raise ValueError(f"{mean!r} is not the mean of {n} binary (0/1) item scores")
        counts.append(round(c))
    b, a = counts
    down = min(b, n - a) if a > b else 0
    return max(a - b, 0) + down, down, f"worst case of the means, n={n}"


def assert_greedy_gain(before, after, n: int | None = None, alpha: float = ALPHA, what: str = "greedy score") -> float:
    """A greedy score rose by more items than chance: the exact sign test (`sign_test_p`) of the items that went up
    against those that went down (`greedy_gain_counts`) has p < `alpha`. A greedy evaluation is deterministic given
    the weights, so the noise is not a spread of repeated measurements but which items flip: under "training
    changed answers without improving them" each changed item is a fair coin. Weights that did not move change
    no item and fail (p = 1). Returns p."""
    up, down, how = greedy_gain_counts(before, after, n)
    p = sign_test_p(up, down)
    shown = (f"{statistics.fmean(before):.4g} -> {statistics.fmean(after):.4g}" if n is None
             else f"{float(before):.4g} -> {float(after):.4g}")
    _report(p < alpha and up > down,
            f"{what}: {shown}, {up} items up and {down} down ({how}); sign test p = {p:.3g}, needs < {alpha:g}")
    return p


def assert_falls(first: float, last: float, ratio: float, what: str = "loss") -> float:
    """A positive quantity fell below `ratio` times its first value: a bound computed from the run's first step
    (the caller states why the ratio). Returns last / first."""
    first, last = float(first), float(last)
    if not (math.isfinite(first) and first > 0 and math.isfinite(last)):
        raise ValueError(f"{what}: assert_falls needs a finite positive first value and a finite last, got "
                         f"{first}, {last}")
    _report(last < ratio * first, f"{what}: {first:.4g} -> {last:.4g} = {last / first:.3g} x the first; needs < "
                                  f"{ratio:g} x = {ratio * first:.4g}")
    return last / first


def assert_beats_majority(accuracy: float, labels: Sequence[float], k: float = K, what: str = "accuracy",
                          avoid: float = 0.0) -> float:
    """A classifier's accuracy on a labelled set is `k` binomial standard errors above the set's majority-class
    rate m (what always answering its commoner label scores): accuracy > m + k * sqrt(m (1 - m) / n); and, with
    `avoid`, it avoids at least that share of the majority classifier's errors: 1 - (1 - accuracy) / (1 - m) >=
    avoid (a quality target relative to the set, which the caller states). A constant classifier scores at most m
    and fails; so does one whose edge over m is within the noise of n examples. Returns the share avoided."""
    labels = [round(float(y)) for y in labels]
    if not labels or set(labels) - {0, 1}:
        raise ValueError(f"{what}: labels must be 0 or 1")
    n = len(labels)
    m = max(sum(labels), n - sum(labels)) / n
    noise = m + k * math.sqrt(m * (1 - m) / n)
    target = m + avoid * (1 - m)
    avoided = 1 - (1 - accuracy) / (1 - m) if m < 1 else 0.0
    _report(accuracy > noise and avoided >= avoid,
            f"{what}: {accuracy:.4f} on {n} examples, majority-class rate {m:.4f}; needs > {noise:.4f} (+{k:g} "
            f"binomial SE)" + (f" and >= {target:.4f} (avoiding {avoid:.0%} of its errors)" if avoid else "")
            + f"; avoids {avoided:.0%} of the majority classifier's errors")
    return avoided


def assert_moves_together(x: Sequence[float], y: Sequence[float], k: float = K, what: str = "series") -> float:
    """Two per-step series move together step to step: the Pearson correlation r of their changes (x[t+1] - x[t]
    against y[t+1] - y[t]) is significantly positive, atanh(r) * sqrt(m - 3) > k over m changes (Fisher's z).
    Changes, not levels: two series that merely both trend over a run correlate in level by accident, while two
    batch means computed on the same rollouts share each batch's sampling noise only if one follows the other
    sample by sample. Returns r."""
    x, y = _floats(x, what, 5), _floats(y, what, 5)
    if len(x) != len(y):
        raise ValueError(f"{what}: {len(x)} and {len(y)} steps")
    dx = [b - a for a, b in zip(x, x[1:])]
    dy = [b - a for a, b in zip(y, y[1:])]
    m = len(dx)
    try:
        r = statistics.correlation(dx, dy)
    except statistics.StatisticsError:  # a constant series: no change to follow
        r = 0.0
    z = math.atanh(max(min(r, 1 - 1e-12), -1 + 1e-12)) * math.sqrt(m - 3)
    _report(z > k, f"{what}: correlation of the step-to-step changes r = {r:.3f} over {m} changes, Fisher z = "
                   f"{z:.2f} SE; needs > {k:g} (r > {math.tanh(k / math.sqrt(m - 3)):.3f})")
    return r


def assert_advantages_every_step(records: Sequence[dict], what: str = "advantage_abs_mean") -> float:
    """Every step of a GRPO run trained on a non-zero advantage: some group's completions scored differently (a
    group whose rewards all agree has advantage 0 everywhere and gives no gradient). A structural fact, not a
    size: how large the mean |advantage| is depends on how many groups disagree, which the trajectory sets (the
    rise of the reward, `assert_rises`, is what says the run learned). Returns the mean over the steps."""
    values = _floats([r[what] for r in records], what, 1)
    zero = [r.get("step", i + 1) for i, (r, v) in enumerate(zip(records, values)) if not v > 0]
    _report(not zero, f"{what}: mean {statistics.fmean(values):.4g}, min {min(values):.4g} over {len(values)} steps; "
                      f"needs > 0 on every step (steps where every group agreed: {zero[:10]})")
    return statistics.fmean(values)
