"""What a failed episode does (`rollout.on_failure`): the one place that decides, one class per policy.

A *sample* is one trajectory, one row of a group's `[n, T]` episode. It fails when its workflow, environment,
tool or sandbox raises, when it runs past its timeout, when its server is lost, or when its reward raises, hangs
or is not a number (data/failures.py names the causes and how a workflow marks a row). A failed sample is never
a silent reward 0: a 0 inside a group moves the group's mean and std, and so every other sample's advantage.

    resample    run the prompt's missing samples again (up to `resample_budget` re-runs), then as `drop`
    drop        train on the finished samples: the group's mean/std are over them, if at least `min_finished`
                finished (else as `drop_group`)
    drop_group  nothing of the group is trained on
    zero        the behaviour before failures were counted: a sample whose reward failed stays in the group with
                the 0 its reward scored; a sample with no tokens (its workflow raised) loses the group

`run_group` runs one prompt under the policy: each attempt is bounded by `attempt_timeout_s` (cause `timeout`
for the samples it held), an attempt that raises fails all its samples (an episode that breaks the trajectory
contract raises out of it: a bug, not a failure to retry), and the result is a `GroupResult`: the
episode to store (`[n', T]`, without the `failed` key) or None, the failed samples by cause, the samples run
again. Plain asyncio; the collector (collector.py) calls it through `run_and_store` in both backends.
"""
from __future__ import annotations

import abc
import asyncio
import collections
import dataclasses
import logging
from typing import ClassVar, Mapping

import torch
from tensordict import TensorDict

from rayllm_rl.data.failures import (ATTEMPT_KEY, SAMPLES_KEY, cause_of, count_causes, failed_mask,
                                     without_failed_key)
from rayllm_rl.data.trajectory import check_episode, concat_padded

log = logging.getLogger(__name__)

ON_FAILURE = ("resample", "drop", "drop_group", "zero")
"""The values of `rollout.on_failure`; the first is the default."""


@dataclasses.dataclass
class Attempts:
    """What the attempts at one prompt gave so far: finished rows, failed rows that carry tokens, how many samples
    failed with nothing to train on (`lost`), by cause (`causes`), the size of the group (`expected`)."""

    expected: int
    finished: list = dataclasses.field(default_factory=list)
    failed_with_tokens: list = dataclasses.field(default_factory=list)
    lost: int = 0
    causes: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    resampled: int = 0
    error: str | None = None

    @property
    def n_finished(self) -> int:
        return sum(int(td.batch_size[0]) for td in self.finished)

    @property
    def any_failed(self) -> bool:
        return bool(self.causes)

    def add(self, td: TensorDict, want: int) -> None:
        """Take an attempt's episode: at most `want` finished rows (a re-run of a workflow that ignores
        `num_samples` gives a whole group), its failed rows counted by cause."""
        bad = failed_mask(td)
        self.causes.update(count_causes(td))
        ok = td[~bad]
        if ok.batch_size[0] > want:
            ok = ok[:want]
        if ok.batch_size[0]:
            self.finished.append(without_failed_key(ok))
        failed = td[bad]
        with_tokens = failed["loss_mask"].any(-1) if failed.batch_size[0] else torch.zeros(0, dtype=torch.bool)
        if bool(with_tokens.any()):
            self.failed_with_tokens.append(failed[with_tokens])
        self.lost += int((~with_tokens).sum())

    def fail_all(self, n: int, exc: BaseException) -> None:
        """An attempt at `n` samples ended with `exc`: all of them failed, with its cause."""
        cause = cause_of(exc)
        self.causes[cause] += n
        self.lost += n
        self.error = f"{type(exc).__name__}: {exc}"

    def rows(self, parts: list) -> TensorDict | None:
        return concat_padded(parts) if parts else None


class Policy(abc.ABC):
    """One value of `rollout.on_failure`: how many re-runs a group gets (`budget`) and what is stored (`settle`)."""

    name: ClassVar[str] = ""
    retries: ClassVar[bool] = False

    def __init__(self, min_finished: int, resample_budget: int):
        self.min_finished = min_finished
        self.resample_budget = resample_budget

    @property
    def budget(self) -> int:
        return self.resample_budget if self.retries else 0

    @abc.abstractmethod
    def settle(self, a: Attempts) -> TensorDict | None:
        """The episode to store after the last attempt, or None: the group is dropped."""


class Drop(Policy):
    """Train on the finished samples if at least min(min_finished, group size) finished; else drop the group."""

    name = "drop"

    def settle(self, a: Attempts) -> TensorDict | None:
        return a.rows(a.finished) if a.n_finished >= min(self.min_finished, a.expected) else None


class Resample(Drop):
    """Run the missing samples again, `resample_budget` times at most; then as `drop`."""

    name = "resample"
    retries = True


class DropGroup(Policy):
    """Any failed sample drops its whole group."""

    name = "drop_group"

    def settle(self, a: Attempts) -> TensorDict | None:
        return None if a.any_failed else a.rows(a.finished)


class Zero(Policy):
    """A failed sample with tokens stays with the reward its reward path gave it (a failed reward function
    counts 0, in a weighted sum too); one without tokens (its workflow raised) loses the group."""

    name = "zero"

    def settle(self, a: Attempts) -> TensorDict | None:
        if a.lost:
            return None
        return a.rows(a.finished + [without_failed_key(td) for td in a.failed_with_tokens])


POLICIES: Mapping[str, type[Policy]] = {p.name: p for p in (Resample, Drop, DropGroup, Zero)}
"""`rollout.on_failure` -> its policy, in the order of `ON_FAILURE` (tests/test_failed_episodes.py checks both)."""


@dataclasses.dataclass(frozen=True)
class FailurePolicy:
    """The job's `rollout.on_failure` and its numbers, resolved by the plan (`JobPlan.failure_policy`); picklable,
    it rides to the env workers."""

    on_failure: str = "resample"
    group_size: int = 1
    """Samples a prompt's group holds (`rollout.group_size`), unless its workflow has a `group_size` of its own:
    how many samples failed when an attempt fails as a whole."""
    min_finished: int = 2
    resample_budget: int = 2
    attempt_timeout_s: float = 600.0
    """One attempt at a prompt (its whole group, or its missing samples); past it they fail with cause timeout."""

    def __post_init__(self) -> None:
        if self.on_failure not in POLICIES:
            raise ValueError(f"rollout.on_failure={self.on_failure!r}: allowed values are {list(ON_FAILURE)}")

    def policy(self) -> Policy:
        return POLICIES[self.on_failure](self.min_finished, self.resample_budget)

    @property
    def deadline_s(self) -> float:
        """The longest one prompt may take: every attempt at its bound."""
        return (self.policy().budget + 1) * self.attempt_timeout_s


@dataclasses.dataclass
class GroupResult:
    """What running one prompt under the policy gave."""

    episode: TensorDict | None
    """The episode to store `[n', T]` (no `failed` key), or None: dropped (see `dropped`) or rejected."""
    rejected: bool = False
    """The workflow returned None (AReaL's "reject this episode"): not a failure."""
    causes: dict[str, int] = dataclasses.field(default_factory=dict)
    """Failed samples by cause (every attempt's)."""
    resampled: int = 0
    """Samples run again."""
    dropped: bool = False
    """The group was dropped because of failed samples."""
    error: str | None = None
    """The last exception an attempt ended with."""


async def run_group(workflow, engine, row: dict, rules: FailurePolicy) -> GroupResult:
    """Run the prompt `row` with `workflow` on `engine` under `rules` (see the module's docstring)."""
    policy = rules.policy()
    own = getattr(workflow, "group_size", None)
    a = Attempts(expected=own if isinstance(own, int) and own >= 1 else rules.group_size)
    attempt, want = 0, a.expected
    while True:
        run_row = row if attempt == 0 else {**row, SAMPLES_KEY: want, ATTEMPT_KEY: attempt}
        try:
            out = await asyncio.wait_for(workflow.arun_episode(engine, run_row), rules.attempt_timeout_s)
        except Exception as exc:  # noqa: BLE001 - a failed attempt is counted, the collector goes on
            if isinstance(exc, TimeoutError) and not str(exc):  # asyncio's own says nothing
                exc = TimeoutError(f"no episode within {rules.attempt_timeout_s:g}s (rollout.episode_timeout_s)")
            a.fail_all(want, exc)
            log.warning("episode of group %s failed (%s): %s", row.get("group_id"), cause_of(exc), a.error)
        else:
            # an episode breaking the contract is the workflow's bug, not a failed sample: it raises (ValueError
            # naming the problem), the collector counts its group as failed and never runs it again
            td = check_episode(out, row.get("group_id"), type(workflow).__name__)
            if td is None:
                if attempt == 0:
                    return GroupResult(None, rejected=True)
                td = TensorDict({}, batch_size=[0])  # a re-run the workflow rejected gives nothing
            if attempt == 0:  # the group is what the workflow returned, failed rows included
                a.expected = want = int(td.batch_size[0])
            if td.batch_size[0]:
                a.add(td, want)
        want = a.expected - a.n_finished
        if want <= 0 or attempt >= policy.budget:
            break
        attempt += 1
        a.resampled += want
    episode = policy.settle(a)
    return GroupResult(episode, causes=dict(a.causes), resampled=a.resampled,
                       dropped=episode is None and a.any_failed, error=a.error)
