"""The direct data path without Ray: an awaitable buffer (no polling) and a collector whose
episodes are delivered by whoever ran them (the Ray env workers put straight into the buffer)."""
from __future__ import annotations

import asyncio
import time

import pytest
from datasets import Dataset

from rayllm_rl.data.loader import PromptLoader
from rayllm_rl.rollout.replay_buffer import AwaitableEpisodeBuffer, ReplayBuffer
from rayllm_rl.rollout.collector import EpisodeOutcome, LLMCollector
from rayllm_rl.rollout.staleness import StalenessController
from test_staleness import _episode


def test_get_batch_wakes_when_episodes_arrive():
    async def go():
        buf = AwaitableEpisodeBuffer(ReplayBuffer(8, 1))
        waiter = asyncio.ensure_future(buf.get_batch(2, 0, timeout_s=10))
        await asyncio.sleep(0.05)
        assert not waiter.done()
        await buf.put(_episode(0, [0, 0]), 5)
        await asyncio.sleep(0.05)
        assert not waiter.done(), "one episode is not a batch of two"
        t0 = time.perf_counter()
        await buf.put(_episode(1, [0, 0]), 5)
        batch, left = await waiter
        return batch, left, time.perf_counter() - t0

    batch, left, latency = asyncio.run(go())
    assert sorted(set(batch["group_id"].tolist())) == [0, 1] and left == 0
    assert latency < 0.5, "the waiter is woken by the put, not by a poll interval"


def test_put_waits_for_room_and_never_drops():
    async def go():
        buf = AwaitableEpisodeBuffer(ReplayBuffer(1, None))
        await buf.put(_episode(0, [0]), 5)
        writer = asyncio.ensure_future(buf.put(_episode(1, [0]), 5))
        await asyncio.sleep(0.05)
        assert not writer.done(), "the buffer is full: the writer waits"
        first, _ = await buf.get_batch(1, 0, 5)
        await asyncio.wait_for(writer, 2)
        second, _ = await buf.get_batch(1, 0, 5)
        return first, second

    first, second = asyncio.run(go())
    assert first["group_id"].tolist() == [0] and second["group_id"].tolist() == [1]


def test_stale_episodes_are_dropped_and_reported():
    dropped = []

    async def go():
        buf = AwaitableEpisodeBuffer(ReplayBuffer(8, 1), on_dropped=dropped.append)
        await buf.put(_episode(0, [0, 0]), 5)  # oldest token v0: stale at v2 with eta=1
        await buf.put(_episode(1, [1, 2]), 5)
        await buf.put(_episode(2, [2]), 5)
        return await buf.get_batch(2, 2, 5)

    batch, left = asyncio.run(go())
    assert dropped == [1]
    assert sorted(set(batch["group_id"].tolist())) == [1, 2] and left == 0


def test_a_failed_producer_ends_the_wait_with_its_reason():
    async def go():
        buf = AwaitableEpisodeBuffer(ReplayBuffer(8, 1))
        waiter = asyncio.ensure_future(buf.get_batch(1, 0, timeout_s=60))
        await asyncio.sleep(0.05)
        buf.fail("collector loop died: 64 consecutive episodes failed")
        t0 = time.perf_counter()
        with pytest.raises(RuntimeError, match="64 consecutive episodes failed"):
            await waiter
        return time.perf_counter() - t0

    assert asyncio.run(go()) < 0.5  # woken by `fail`, not by the once-a-second re-check


def test_waits_are_bounded():
    async def go():
        buf = AwaitableEpisodeBuffer(ReplayBuffer(1, None))
        with pytest.raises(TimeoutError, match="fewer than 1 episodes"):
            await buf.get_batch(1, 0, timeout_s=0.2)
        await buf.put(_episode(0, [0]), 1)
        with pytest.raises(TimeoutError, match="still full"):
            await buf.put(_episode(1, [0]), 0.2)

    asyncio.run(go())


def test_collector_counts_episodes_its_runners_delivered():
    """The runner stores (or filters) the episode; the collector only counts and frees slots."""
    stored = []

    async def run_episode(row):
        await asyncio.sleep(0)
        if row["group_id"] % 3 == 2:
            return EpisodeOutcome(accepted=False)
        stored.append(row["group_id"])
        return EpisodeOutcome(accepted=True, generated_tokens=5)

    async def go():
        ctl = StalenessController(4, 0)
        col = LLMCollector(PromptLoader(Dataset.from_list([{"q": i} for i in range(50)]), seed=0), run_episode, ctl)
        task = asyncio.ensure_future(col.run())
        for _ in range(100):
            await asyncio.sleep(0.01)
            if len(stored) >= 4:
                break
        col.stop()
        await asyncio.wait_for(task, 5)
        return col.stats()

    stats = asyncio.run(go())
    assert len(stored) == 4, "eta=0 at version 0 admits exactly one batch of accepted episodes"
    assert stats["finished_episodes"] == 4 and stats["generated_tokens"] == 20
    assert stats["filtered_episodes"] == 1  # groups 0,1,3,4 stored; group 2 filtered and refilled


def test_a_dying_collector_loop_fails_the_buffer_waiting_for_a_batch():
    """`LLMCollector.start` (both backends start the loop this way): 3 failed episodes in a row end the loop (the
    4th, admitted with them, may fail first),
    `on_death` gets the reason and fails the buffer, so the waiting batch gets the error at once, not a timeout;
    `raise_if_dead` raises it too. A second `start` while the loop runs starts no second loop."""
    async def run_episode(row):
        raise ValueError(f"bad row {row['group_id']}")

    async def go():
        buf = AwaitableEpisodeBuffer(ReplayBuffer(8, 0))
        col = LLMCollector(PromptLoader(Dataset.from_list([{"q": i} for i in range(50)]), seed=0), run_episode,
                           StalenessController(4, 0), max_consecutive_failures=3)
        waiter = asyncio.ensure_future(buf.get_batch(4, 0, timeout_s=60))
        col.raise_if_dead()  # not started: nothing to raise
        col.start(buf.fail)
        first = col.loop_task
        col.start(buf.fail)
        assert col.loop_task is first, "start while the loop runs must not start a second one"
        t0 = time.perf_counter()
        with pytest.raises(RuntimeError,
                           match=r"collector loop died: [34] consecutive episodes failed; last: ValueError: bad row"):
            await waiter
        with pytest.raises(RuntimeError, match=r"collector loop died: [34] consecutive"):
            col.raise_if_dead()
        return time.perf_counter() - t0

    assert asyncio.run(go()) < 5.0
