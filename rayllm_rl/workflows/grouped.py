"""Group sampling for single-trajectory workflows: n episodes of one prompt share a group_id."""
from __future__ import annotations

import asyncio
import random
from typing import Any, Mapping

from tensordict import TensorDict

from rayllm_rl.data.failures import ATTEMPT_KEY, SAMPLES_KEY, guard_sample
from rayllm_rl.data.trajectory import concat_padded
from rayllm_rl.inference.protocol import InferenceEngine
from rayllm_rl.workflows.base import RolloutWorkflow


class GroupedWorkflow(RolloutWorkflow):
    """Runs `group_size` concurrent episodes of `workflow` on the same row (same `group_id`),
    so GRPO's group baseline applies to agents that return one trajectory per episode
    (e.g. MultiTurnWorkflow). The episodes are independent: one that raises, or runs past `timeout_s`
    (None: the collector's bound on the whole group applies), is a failed sample (its placeholder row,
    data/failures.py), and the others go on. A re-run of the collector's (`num_samples` in the row) runs
    that many."""

    def __init__(self, workflow: RolloutWorkflow, group_size: int, timeout_s: float | None = None):
        if group_size < 1:
            raise ValueError(f"group_size must be >= 1, got {group_size}")
        self.workflow = workflow
        self.group_size = group_size
        self.timeout_s = timeout_s

    @property
    def reward(self):
        return self.workflow.reward

    async def arun_episode(self, engine: InferenceEngine, data: Mapping[str, Any]) -> TensorDict:
        row = {k: v for k, v in data.items() if k not in (SAMPLES_KEY, ATTEMPT_KEY)}
        row.setdefault("group_id", random.getrandbits(62))
        n = int(data.get(SAMPLES_KEY, self.group_size))
        trajs = await asyncio.gather(*[
            guard_sample(self.workflow.arun_episode(engine, row), int(row["group_id"]), row.get("prompt_ids"),
                         self.timeout_s) for _ in range(n)])
        return concat_padded(trajs)
