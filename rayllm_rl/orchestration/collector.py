"""LLMCollector (plain asyncio): run many workflow episodes concurrently into one batch.

The Ray collector wraps the same logic; this class has no Ray dependency so tests and the
single-process trainer drive it directly.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import time
from typing import Any, Mapping

from tensordict import TensorDict

from rayllm_rl.data.trajectory import concat_padded, validate_trajectory
from rayllm_rl.inference.protocol import InferenceEngine
from rayllm_rl.workflows.base import RolloutWorkflow

log = logging.getLogger(__name__)


class LLMCollector:
    """Collects `dialog_turns_per_batch` trajectories per call from concurrent episodes."""

    def __init__(self, engine: InferenceEngine, workflow: RolloutWorkflow, loader, *,
                 dialog_turns_per_batch: int, max_concurrency: int = 256, max_failures: int = 16,
                 episode_filter=None, max_filtered: int = 10_000):
        self.engine = engine
        self.workflow = workflow
        self.loader = loader
        self.dialog_turns_per_batch = dialog_turns_per_batch
        self.max_concurrency = max_concurrency
        self.max_failures = max_failures
        self._group_ids = itertools.count()
        self.failed_episodes = 0
        self.episode_filter = episode_filter
        """Keep an episode only if this returns True (DAPO dynamic sampling); others are replaced."""
        self.max_filtered = max_filtered
        self.filtered_episodes = 0
        self.last_error: str | None = None

    async def _episode(self, row: Mapping[str, Any]) -> TensorDict | None:
        try:
            td = await self.workflow.arun_episode(self.engine, {**row, "group_id": next(self._group_ids)})
            validate_trajectory(td)
            return td
        except Exception as exc:  # noqa: BLE001 - one bad episode must not kill the batch
            self.failed_episodes += 1
            self.last_error = f"{type(exc).__name__}: {exc}"
            log.warning("episode failed (%s); row dropped: %s", self.last_error, {k: row[k] for k in list(row)[:4]})
            return None

    async def collect(self) -> TensorDict:
        """Run episodes until the batch holds `dialog_turns_per_batch` trajectories."""
        t0 = time.perf_counter()
        parts: list[TensorDict] = []
        have, failures_before = 0, self.failed_episodes
        pending: set[asyncio.Task] = set()
        per_episode = getattr(self.workflow, "group_size", 1)
        while have < self.dialog_turns_per_batch:
            need = self.dialog_turns_per_batch - have - sum(per_episode for _ in pending)
            while need > 0 and len(pending) < self.max_concurrency:
                pending.add(asyncio.ensure_future(self._episode(self.loader.next_row())))
                need -= per_episode
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                td = task.result()
                if td is not None and self.episode_filter is not None and not self.episode_filter(td):
                    self.filtered_episodes += 1
                    if self.filtered_episodes > self.max_filtered:
                        raise RuntimeError(f"more than {self.max_filtered} episodes filtered out; is every group uniform?")
                    continue
                if td is not None:
                    parts.append(td)
                    have += td.batch_size[0]
            if self.failed_episodes - failures_before > self.max_failures:
                for t in pending:
                    t.cancel()
                raise RuntimeError(f"more than {self.max_failures} episodes failed in one batch; last: {self.last_error}")
        for t in pending:  # over-provisioned episodes are kept for nothing: cancel them
            t.cancel()
        batch = concat_padded(parts)
        self.last_collect_seconds = time.perf_counter() - t0
        return batch
