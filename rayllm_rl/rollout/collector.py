"""LLMCollector: keeps episodes running under the staleness bound; its runners fill the buffer.

Plain asyncio, no Ray. The single-process backend drives it directly; `RayLLMCollector`
(orchestration/ray/actors.py) is its actor shell. An *episode* is what one
`workflow.arun_episode(engine, row)` returns -- the trajectories of one prompt (a GRPO group)
-- and it is the replay buffer's unit. The collector only admits episodes and counts them:
the runner it is given (`run_and_store`, or an env worker running it) stores each episode in
the buffer itself, so the episode's tensors never pass through the collector. A sample (one
trajectory) that fails is counted by cause (`failed_episodes/<cause>`), and `rollout.on_failure`
(rollout/failures.py) decides what its group does; a group dropped for it counts in `dropped_groups`.
"""
from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import time
from typing import Any, Awaitable, Callable

from tensordict import TensorDict

from rayllm_rl.data.failures import cause_of
from rayllm_rl.rollout.failures import FailurePolicy, run_group
from rayllm_rl.rollout.staleness import StalenessController

log = logging.getLogger(__name__)


@dataclasses.dataclass
class EpisodeOutcome:
    """What became of one episode that its runner delivered straight to the buffer."""

    accepted: bool
    """Stored in the buffer (False: rejected by the episode filter, e.g. DAPO's uniform groups, or dropped)."""
    generated_tokens: int = 0
    failures: dict[str, int] = dataclasses.field(default_factory=dict)
    """Failed samples by cause (data/failures.py `CAUSES`)."""
    resampled: int = 0
    """Samples run again (`rollout.on_failure=resample`)."""
    dropped: bool = False
    """The group was dropped because of failed samples (nothing stored)."""
    error: str | None = None
    """The last exception an attempt at the group ended with."""


async def run_and_store(workflow, engine, row: dict, put: Callable[[TensorDict], Awaitable[Any]],
                        episode_filter: Callable[[TensorDict], bool] | None = None,
                        failures: FailurePolicy | None = None) -> EpisodeOutcome:
    """Run one prompt's episode under `failures` (`run_group`: each attempt checked by `check_episode`, so a
    custom workflow's mistakes fail it naming the workflow and the keys; failed samples counted by cause and
    handled by the policy; None = the default policy), and `put` what the policy keeps unless rejected: the
    workflow returned None (AReaL's way to drop an episode), the policy dropped the group, or the filter
    refuses it."""
    got = await run_group(workflow, engine, row, failures or FailurePolicy())
    outcome = EpisodeOutcome(accepted=False, failures=got.causes, resampled=got.resampled, dropped=got.dropped,
                             error=got.error)
    td = got.episode
    if td is None or (episode_filter is not None and not episode_filter(td)):
        return outcome
    await put(td)
    return dataclasses.replace(outcome, accepted=True, generated_tokens=int(td["loss_mask"].sum()))


@dataclasses.dataclass(frozen=True)
class CollectorSpec:
    """The job's collector, the same in both backends (`JobPlan.collector_spec`)."""

    prompts_per_step: int
    max_staleness: int
    seed: int = 0
    """Of the prompt order (`PromptLoader`)."""
    group_size: int = 1
    """Samples per prompt: an episode that fails outside its runner (its env worker lost, its call timed out)
    counts this many failed samples."""

    def build(self, dataset, run_episode: Callable[[dict], Awaitable["EpisodeOutcome"]]) -> "LLMCollector":
        """A collector over `dataset`'s rows, running each episode with `run_episode` (it stores it)."""
        from rayllm_rl.data.loader import PromptLoader

        return LLMCollector(PromptLoader(dataset, seed=self.seed), run_episode,
                            StalenessController(self.prompts_per_step, self.max_staleness),
                            group_size=self.group_size)


class LLMCollector:
    """Admit while `accepted + running < (eta + v + 1) * B`; deliver whole groups; never drop silently."""

    def __init__(self, loader, run_episode: Callable[[dict], Awaitable[EpisodeOutcome]],
                 controller: StalenessController, *, max_consecutive_failures: int = 64, group_size: int = 1):
        """`run_episode(row)` runs one episode and stores it (see `run_and_store`); rows come from `loader`.
        `max_consecutive_failures` groups in a row lost to failures (raised, or dropped by the failure policy)
        end the run naming the last error; `group_size`: see `CollectorSpec.group_size`."""
        self.loader = loader
        self.run_episode = run_episode
        self.controller = controller
        self.max_consecutive_failures = max_consecutive_failures
        self.filtered = 0
        self.next_group_id = 0
        self.group_size = group_size
        self.failed_by_cause: collections.Counter = collections.Counter()
        """Failed samples by cause (data/failures.py `CAUSES`)."""
        self.dropped_groups = 0
        self.resampled = 0
        self.consecutive_failures = 0
        self.last_error: str | None = None
        self.generated_tokens = 0
        self.finished = 0
        self._paused = False
        self._stopped = False
        self._wake = asyncio.Event()
        self._tasks: set[asyncio.Task] = set()
        self._t0 = time.perf_counter()
        self.fatal: str | None = None
        self._loop_task: asyncio.Task | None = None

    # ------------------------------------------------------------------ control
    def set_version(self, version: int) -> None:
        self.controller.set_version(version)
        self._wake.set()

    def on_dropped(self, n: int) -> None:
        """The buffer dropped n over-stale episodes: free their slots under the bound."""
        if n > 0:
            self.controller.on_dropped(n)
            self._wake.set()

    def pause(self) -> None:
        self._paused = True

    def resume(self) -> None:
        self._paused = False
        self._wake.set()

    def stop(self) -> None:
        self._stopped = True
        self._wake.set()

    @property
    def paused(self) -> bool:
        """True while admissions are paused (`pause`, `drain`) until `resume` or `start`."""
        return self._paused

    @property
    def loop_task(self) -> asyncio.Task | None:
        """The task `start` runs `run()` in (None before the first `start`); one task while it runs."""
        return self._loop_task

    def running(self) -> list[asyncio.Task]:
        """The episodes running now (each an asyncio task of `run_episode`)."""
        return list(self._tasks)

    async def drain(self, timeout_s: float) -> None:
        """Pause admissions and wait for every running episode to land in the buffer."""
        self.pause()
        if self._tasks:
            done, pending = await asyncio.wait(set(self._tasks), timeout=timeout_s)
            if pending:
                raise TimeoutError(f"{len(pending)} episodes still running after {timeout_s:.0f}s of drain")

    # ------------------------------------------------------------------ loop
    def start(self, on_death: Callable[[str], Any]) -> None:
        """Run `run()` as a task of the running event loop unless it runs already, and resume admitting. A loop
        that dies of an error calls `on_death(message)` (the buffer's `fail`: a waiting batch gets the error,
        not a timeout). Both backends start the collector this way."""
        if self._loop_task is None or self._loop_task.done():
            self._loop_task = asyncio.ensure_future(self.run())
            self._loop_task.add_done_callback(
                lambda t: None if t.cancelled() or t.exception() is None
                else on_death(f"collector loop died: {t.exception()}"))
        self.resume()

    def raise_if_dead(self) -> None:
        """Raise the error the loop `start` ran died of (nothing while it runs, or before it started)."""
        t = self._loop_task
        if t is not None and t.done() and not t.cancelled() and t.exception() is not None:
            raise RuntimeError(f"collector loop died: {t.exception()}")

    async def run(self) -> None:
        """Admit episodes whenever the bound allows; returns when stopped."""
        while not self._stopped:
            if self.fatal:
                raise RuntimeError(self.fatal)
            if not self._paused and self.controller.try_admit(1):
                row = self.loader.next_row()
                gid = self.next_group_id
                self.next_group_id += 1
                task = asyncio.ensure_future(self._episode({**row, "group_id": gid}))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
                continue
            self._wake.clear()
            await self._wake.wait()

    async def _episode(self, row: dict) -> None:
        accepted = False
        try:
            outcome = await self.run_episode(row)
            self.failed_by_cause.update(outcome.failures)
            self.resampled += outcome.resampled
            self.last_error = outcome.error or self.last_error
            if outcome.dropped:  # its slot goes back, a new prompt refills the batch
                self._group_lost(outcome.error or f"failed samples {outcome.failures}")
                return
            self.consecutive_failures = 0
            if not outcome.accepted:
                self.filtered += 1  # rejected: its slot goes back, a new prompt refills the batch
                return
            accepted = True
            self.finished += 1
            self.generated_tokens += outcome.generated_tokens
        except Exception as exc:  # noqa: BLE001 - a bad episode is counted, not fatal
            self.failed_by_cause[cause_of(exc)] += self.group_size
            self.last_error = f"{type(exc).__name__}: {exc}"
            log.warning("episode of group %s failed: %s", row.get("group_id"), self.last_error)
            self._group_lost(self.last_error)
        finally:
            self.controller.finish(1, accepted=accepted)
            self._wake.set()

    def _group_lost(self, error: str) -> None:
        """A group nothing trains on because its samples failed: counted; too many in a row end the run."""
        self.dropped_groups += 1
        self.consecutive_failures += 1
        if self.consecutive_failures >= self.max_consecutive_failures:
            self.fatal = f"{self.consecutive_failures} consecutive episodes failed; last: {error}"

    # ------------------------------------------------------------------ state
    @property
    def failed(self) -> int:
        """Failed samples, all causes."""
        return sum(self.failed_by_cause.values())

    def stats(self) -> dict[str, Any]:
        """Counters: `failed_episodes` (failed samples) and `failed_episodes/<cause>`, `dropped_groups`,
        `resampled_episodes`, finished / filtered groups, tokens, the last error and a fatal one."""
        elapsed = time.perf_counter() - self._t0
        by_cause = {f"failed_episodes/{cause}": n for cause, n in sorted(self.failed_by_cause.items())}
        return {**self.controller.stats(), "failed_episodes": self.failed, **by_cause,
                "dropped_groups": self.dropped_groups, "resampled_episodes": self.resampled,
                "finished_episodes": self.finished, "filtered_episodes": self.filtered,
                "generated_tokens": self.generated_tokens, "tokens_per_s": self.generated_tokens / max(elapsed, 1e-9),
                "last_error": self.last_error, "fatal": self.fatal}

    def state_dict(self) -> dict[str, Any]:
        """Loader position and group counter; call after drain() so nothing is in flight."""
        if self._tasks:
            raise RuntimeError("state_dict() needs a drained collector (episodes still running)")
        return {"loader": self.loader.state_dict(), "next_group_id": self.next_group_id,
                "controller": self.controller.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loader.load_state_dict(state["loader"])
        self.next_group_id = state["next_group_id"]
        self.controller.load_state_dict(state["controller"])
