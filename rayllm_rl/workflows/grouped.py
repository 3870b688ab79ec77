"""Group sampling for single-trajectory workflows: n episodes of one prompt share a group_id."""
from __future__ import annotations

import asyncio
import random
from typing import Any, Mapping

from tensordict import TensorDict

from rayllm_rl.data.trajectory import concat_padded
from rayllm_rl.inference.protocol import InferenceEngine
from rayllm_rl.workflows.base import RolloutWorkflow


class GroupedWorkflow(RolloutWorkflow):
    """Runs `group_size` concurrent episodes of `workflow` on the same row (same `group_id`),
    so GRPO's group baseline applies to agents that return one trajectory per episode
    (e.g. MultiTurnWorkflow)."""

    def __init__(self, workflow: RolloutWorkflow, group_size: int):
        if group_size < 1:
            raise ValueError(f"group_size must be >= 1, got {group_size}")
        self.workflow = workflow
        self.group_size = group_size

    @property
    def reward(self):
        return self.workflow.reward

    async def arun_episode(self, engine: InferenceEngine, data: Mapping[str, Any]) -> TensorDict:
        row = dict(data)
        row.setdefault("group_id", random.getrandbits(62))
        trajs = await asyncio.gather(*[self.workflow.arun_episode(engine, row) for _ in range(self.group_size)])
        return concat_padded(trajs)
