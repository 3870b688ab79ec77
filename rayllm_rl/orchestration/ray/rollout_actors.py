"""The rollout side's actor shells: `replay-buffer` (`ReplayBufferActor`, over `rollout.replay_buffer`) and
`collector` (`RayLLMCollector`, over `rollout.collector.LLMCollector`), each built from the plan's spec; and
`score_with_restarts`, how the buffer gets a frozen model's logprobs of a batch (scored again after a restart)."""
from __future__ import annotations

import asyncio
import time
from typing import Any

import ray

from rayllm_rl.algorithm.batch_prep import prepare_batch
from rayllm_rl.orchestration.fault_ledger import ENV_PID, LOST, RERUN
from rayllm_rl.orchestration.ray.actors import ActorProcess, ray_actor


@ray_actor
class ReplayBufferActor(ActorProcess):
    """`replay-buffer`: bounded, version-aware episode buffer; env workers put, the driver awaits batches."""

    def __init__(self, spec, pipeline):
        """`spec`: the plan's `rollout.replay_buffer.BufferSpec`; `pipeline`: its batch stages."""
        self.pipeline = pipeline
        """The job's batch stages (`batch_prep.BatchPipeline`, from the job plan), run here on every batch taken."""
        self.waiting = spec.build(on_dropped=self._tell_collector)
        self.buffer = self.waiting.buffer
        self.collector = None
        self.stored_ids: set[int] = set()
        """Episode ids stored so far: an episode re-run after its env worker died is stored once."""
        self.duplicate_puts = 0

    def set_collector(self, collector) -> None:
        """Over-stale episodes dropped at sampling give their slots back to this collector."""
        self.collector = collector

    def _tell_collector(self, n: int) -> None:
        if self.collector is not None:
            self.collector.on_dropped.remote(n)  # fire and forget: the collector only frees slots

    async def put(self, episode, timeout_s: float, episode_id: int | None = None) -> bool:
        """Store `episode`; False (and not stored) if an episode with this id already was."""
        if episode_id is not None:
            if episode_id in self.stored_ids:
                self.duplicate_puts += 1
                return False
            self.stored_ids.add(episode_id)
        await self.waiting.put(episode, timeout_s)
        return True

    async def get_batch(self, n_episodes: int, current_version: int, timeout_s: float):
        """(batch of the oldest n episodes within the bound, episodes left); waits, no polling."""
        return await self.waiting.get_batch(n_episodes, current_version, timeout_s)

    @ray.method(num_returns=2)
    async def take_batch(self, n_episodes: int, current_version: int, timeout_s: float, frozen=None):
        """`get_batch`, made a training batch here (`batch_prep.prepare_batch`: the frozen models the pipeline's
        stages need score it, `frozen`: name -> actor handle, then the stages run): two results, the batch (the
        learners take its reference) and its metadata (all the driver fetches)."""
        batch, depth = await self.waiting.get_batch(n_episodes, current_version, timeout_s)
        handles = dict(frozen or {})

        async def score(name, td):
            if name not in handles:
                raise ValueError(f"the batch pipeline needs the frozen model {name!r}, which is not started "
                                 f"(started: {sorted(handles)})")
            return await score_with_restarts(handles[name], td, timeout_s, name)

        batch, meta = await prepare_batch(self.pipeline, batch, current_version, score)
        return batch, {**meta, "buffer_depth": depth}

    async def fail(self, reason: str) -> None:  # async: on the loop, so the waiters wake at once
        self.waiting.fail(reason)

    def stats(self) -> dict[str, Any]:
        return {**self.buffer.stats(), "duplicate_puts": self.duplicate_puts}

    def state_dict(self) -> dict[str, Any]:
        return self.buffer.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.buffer.load_state_dict(state)


async def score_with_restarts(scorer, batch, timeout_s: float, name: str = "frozen model") -> tuple[Any, int]:
    """(`scorer.compute_logprobs(batch)`, how many times the batch was scored again): a scorer whose process
    dies while scoring is restarted by Ray (its `max_restarts`), and once it answers again it scores the batch
    again; one gone for good (ActorDiedError on a ping), or no answer within `timeout_s` in all, raises."""
    deadline, rescored = time.monotonic() + timeout_s, 0
    while True:
        try:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"the {name} scored no batch within {timeout_s:g}s (trainer.call_timeout_s), "
                                   f"after {rescored} restart(s)")
            return await asyncio.wait_for(scorer.compute_logprobs.remote(batch), left), rescored
        except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError):
            while time.monotonic() < deadline:  # until the restarted process answers
                try:
                    await asyncio.wait_for(scorer.pid.remote(), max(deadline - time.monotonic(), 0.1))
                    break
                except ray.exceptions.ActorDiedError:
                    raise  # for good: no restart left (the driver's liveness check names it)
                except (ray.exceptions.RayActorError, asyncio.TimeoutError):
                    await asyncio.sleep(0.5)
            rescored += 1


@ray_actor
class RayLLMCollector(ActorProcess):
    """`collector`, the actor shell of `LLMCollector`: admits episodes under the staleness bound and spreads them over
    the env workers, which put them straight into the buffer; a collector loop that dies fails the buffer's waiters."""

    def __init__(self, spec, dataset, env_workers: list, buffer, episode_timeout_s: float = 600.0,
                 max_episode_attempts: int = 3):
        """`spec`: the plan's `rollout.collector.CollectorSpec`; episodes of `dataset` run on `env_workers`,
        which put them into `buffer`."""
        self.env_workers = list(env_workers)
        self.in_flight = [0] * len(env_workers)
        self.buffer = buffer
        self.timeout_s = episode_timeout_s
        self.max_episode_attempts = max_episode_attempts
        self.fault_events: list[tuple] = []
        """What this collector saw go wrong since the backend last took them (`take_fault_events`): the
        backend's FaultLedger (orchestration/fault_ledger.py) does the accounting, not this actor."""
        self.collector = spec.build(dataset, self._run_episode)

    async def _run_episode(self, row: dict):
        """Run on the least-busy env worker; if that worker's process dies, run the episode again
        (same id: the buffer stores it once) on whichever worker is then least busy."""
        for attempt in range(1, self.max_episode_attempts + 1):
            i = min(range(len(self.env_workers)), key=lambda k: self.in_flight[k])
            self.in_flight[i] += 1
            try:
                return await asyncio.wait_for(self.env_workers[i].run_episode.remote(row), self.timeout_s)
            except asyncio.TimeoutError as exc:
                if isinstance(exc, ray.exceptions.RayError):
                    raise  # a timeout inside the worker, with its own message
                raise TimeoutError(f"episode {row.get('group_id')}: env worker {i} returned nothing within "
                                   f"{self.timeout_s:g}s (every attempt at rollout.episode_timeout_s, then "
                                   "trainer.call_timeout_s for the buffer)") from None
            except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError) as exc:
                if attempt == self.max_episode_attempts:  # counted as failed too
                    self.fault_events.append((LOST, row.get("group_id")))
                    raise RuntimeError(f"episode {row.get('group_id')}: its env worker died {attempt} times") from exc
                self.fault_events.append((RERUN, row.get("group_id")))
                await self._wait_while_restarting(i)
                await self._note_pid(i)
            finally:
                self.in_flight[i] -= 1

    async def _wait_while_restarting(self, i: int) -> None:
        """Wait until env worker i answers again, is dead for good, or `timeout_s` passed: calls made
        while Ray restarts it fail at once, and a restart (a new process, imports, the workflow
        built again) takes seconds; without this wait they would use up the episode's attempts."""
        deadline = time.monotonic() + self.timeout_s
        while time.monotonic() < deadline:
            try:
                await asyncio.wait_for(self.env_workers[i].pid.remote(), max(deadline - time.monotonic(), 0.1))
                return
            except ray.exceptions.ActorDiedError:  # for good: the next attempt goes elsewhere or fails
                return
            except (ray.exceptions.RayActorError, asyncio.TimeoutError):  # unavailable: restarting
                await asyncio.sleep(0.5)

    async def _note_pid(self, i: int) -> None:
        """Report env worker i's current process id (a new one means Ray restarted it)."""
        try:
            pid = await asyncio.wait_for(self.env_workers[i].pid.remote(), self.timeout_s)
        except (ray.exceptions.RayError, asyncio.TimeoutError):  # still restarting: asked again next time
            return
        self.fault_events.append((ENV_PID, i, pid))

    async def note_pids(self) -> None:
        """Ask every env worker for its process id now (a restart no episode ran into is seen too)."""
        await asyncio.gather(*(self._note_pid(i) for i in range(len(self.env_workers))))

    async def take_fault_events(self, note_pids: bool = True) -> list[tuple]:
        """The fault events since the last call (then forgotten here), after asking every env worker for its
        process id if `note_pids`; answers even after the loop died (the backend takes them before a
        rollback replaces this collector)."""
        if note_pids:
            await self.note_pids()
        events, self.fault_events = self.fault_events, []
        return events

    async def start(self) -> bool:
        await self.note_pids()
        self.collector.start(self.buffer.fail.remote)
        return True

    def set_version(self, version: int) -> None:
        self.collector.set_version(version)

    def on_dropped(self, n: int) -> None:
        self.collector.on_dropped(n)

    async def drain(self, timeout_s: float) -> None:
        await self.collector.drain(timeout_s)

    def state_dict(self) -> dict:
        return self.collector.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.collector.load_state_dict(state)

    def stats(self) -> dict:
        self.collector.raise_if_dead()
        return self.collector.stats()
