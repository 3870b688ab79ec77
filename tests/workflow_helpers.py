"""Workflows of a user's own, importable by path (`rollout.workflow=workflow_helpers:...`), for test_custom_workflow."""
from __future__ import annotations

from rayllm_rl.workflows.rlvr import RLVRWorkflow


class Sized(RLVRWorkflow):
    """The built-in single-turn workflow under another name, recording what the job handed it: each trajectory
    carries `made_group_size` (the `group_size` keyword) and `bonus` (a `workflow_kwargs` entry)."""

    def __init__(self, reward_fn, tokenizer, sampling, group_size: int, bonus: float = 0.0):
        super().__init__(reward_fn, tokenizer, sampling, group_size=group_size)
        self.bonus = bonus

    async def arun_episode(self, engine, data):
        td = await super().arun_episode(engine, data)
        td["made_group_size"] = td["rewards"] * 0 + float(self.group_size)
        td["bonus"] = td["rewards"] * 0 + float(self.bonus)
        return td


def make_sized(reward_fn, tokenizer, sampling, group_size, **extra):
    """A factory taking **extra: it gets every job keyword."""
    return Sized(reward_fn, tokenizer, sampling, group_size)


class NoEpisode:
    """A class without `arun_episode`."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer


class SyncEpisode:
    """`arun_episode` that is not `async def`."""

    def arun_episode(self, engine, data):
        return None


class NeedsPath:
    """A required parameter the job does not pass."""

    def __init__(self, tokenizer, data_dir):
        self.data_dir = data_dir

    async def arun_episode(self, engine, data):
        return None
