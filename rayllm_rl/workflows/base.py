"""The rollout contract (AReaL): `arun_episode(engine, data) -> TensorDict` of trajectories."""
from __future__ import annotations

import abc
from typing import Any, Mapping

from tensordict import TensorDict

from rayllm_rl.inference.protocol import InferenceEngine


class RolloutWorkflow(abc.ABC):
    """One episode = one prompt's worth of trajectories (a group for group sampling).

    The returned TensorDict follows `rayllm_rl.data.trajectory` (right-padded `[n, T]` token
    keys plus `rewards`, `group_id`); extra per-sequence keys (reward components) may ride along.
    """

    @abc.abstractmethod
    async def arun_episode(self, engine: InferenceEngine, data: Mapping[str, Any]) -> TensorDict:
        """Run one episode against `engine` for the dataset row `data`."""
