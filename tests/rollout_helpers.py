"""One batch of episodes collected in the test's process: the collector and buffer of a run at
version 0 with no staleness, for tests of workflows, filters and the learner."""
from __future__ import annotations

import asyncio
from typing import Any

from tensordict import TensorDict

from rayllm_rl.rollout.collector import LLMCollector, run_and_store
from rayllm_rl.rollout.replay_buffer import AwaitableEpisodeBuffer, ReplayBuffer
from rayllm_rl.rollout.staleness import StalenessController


async def collect_batch(engine, workflow, loader, n_episodes: int, *, episode_filter=None,
                        timeout_s: float = 300.0, failures=None) -> tuple[TensorDict, dict[str, Any]]:
    """`n_episodes` episodes of `workflow` on `engine`; returns the padded batch and the collector's stats.
    `failures`: the `rollout.failures.FailurePolicy` episodes run under (None: the default)."""
    buffer = AwaitableEpisodeBuffer(ReplayBuffer(n_episodes, 0))
    collector = LLMCollector(loader, lambda row: run_and_store(
        workflow, engine, row, lambda td: buffer.put(td, timeout_s), episode_filter, failures),
        StalenessController(n_episodes, 0))
    loop_task = asyncio.ensure_future(collector.run())
    batch_task = asyncio.ensure_future(buffer.get_batch(n_episodes, 0, timeout_s))
    try:
        await asyncio.wait({loop_task, batch_task}, return_when=asyncio.FIRST_COMPLETED)
        if not batch_task.done():  # the loop ended first: too many failures
            raise loop_task.exception() or RuntimeError("collector stopped before the batch was full")
        batch, _ = batch_task.result()
    finally:
        collector.stop()
        tasks = [loop_task, batch_task, *collector.running()]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return batch, collector.stats()
