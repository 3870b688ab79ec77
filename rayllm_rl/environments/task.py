"""`task=openenv`: an OpenEnv environment (or a TRL `environment_factory` class) as the job's task.

The registry's factory (`make_task`) runs on the driver before any actor starts: it resolves the environment
(`source.resolve_source`: its form, tools and Action class, from `data.openenv` and `train(environment=...)`),
generates the rows (`data.openenv.train_size` of them, each a `seed` and the prompt chat), and returns a `Task`
whose `workflow` plays the environment (`make_workflow`: `group_size` episodes of `EnvWorkflow` per row). The
task's reward is the episode's (`rewards.EpisodeReward`): the environment's own plus the TRL-style reward functions
of `reward.fn` / `reward_fn=`.

There is no held-out evaluation: the greedy evaluation scores one completion of a row's prompt with the task's
reward, while an environment's prompt is only known once it is reset and its reward once it is played
(`data.eval_size` must be 0; each step's record carries the episodes' rewards).
"""
from __future__ import annotations

import functools
from typing import Any

from rayllm_rl.environments.rewards import EpisodeReward


def rows(cfg: Any) -> list[dict[str, Any]]:
    """The generated rows: `{"messages": [system?, user prompt?], "seed": seed + i}` for i < train_size."""
    chat = ([{"role": "system", "content": cfg.system_prompt}] if cfg.system_prompt else []) + (
        [{"role": "user", "content": cfg.prompt}] if cfg.prompt else [])
    return [{"messages": chat, "seed": cfg.seed + i} for i in range(cfg.train_size)]


def make_workflow(tokenizer, sampling, group_size: int, max_turns: int, task, sample_timeout_s=None, *, source):
    """The task's rollout workflow (built in each env worker with the job's keywords, `factories.build_workflow`):
    `group_size` independent episodes of the row, one `group_id`; each sample that fails (or runs past
    `rollout.sample_timeout_s`) fails alone."""
    from rayllm_rl.environments.workflow import EnvWorkflow
    from rayllm_rl.workflows.grouped import GroupedWorkflow

    return GroupedWorkflow(EnvWorkflow(source, task.reward_fn, tokenizer, sampling, max_turns=max_turns), group_size,
                           timeout_s=sample_timeout_s)


def make_task(data_cfg: Any = None, seed: int = 0, inputs: Any = None):
    """The registry's factory (`task=openenv`); ValueError naming the key for what the environment or the rows lack."""
    from datasets import Dataset

    from rayllm_rl.environments.config import OpenEnvConfig
    from rayllm_rl.environments.source import resolve_source
    from rayllm_rl.envs.task import Task, in_memory

    cfg = OpenEnvConfig() if data_cfg is None else data_cfg.openenv
    if data_cfg is not None and data_cfg.eval_size:
        raise ValueError(f"data.eval_size={data_cfg.eval_size}: task=openenv has no held-out greedy evaluation (an "
                         "environment's prompt is known only once it is reset, its reward once it is played); set "
                         "data.eval_size=0")
    cfg.check()
    source = resolve_source(cfg, getattr(inputs, "environment", None))
    reward = EpisodeReward(getattr(inputs, "reward_fns", ()) or (), getattr(inputs, "reward_weights", ()) or ())
    if not reward.reward_funcs and not source.owns_reward:
        raise ValueError(f"{source.label} has no get_reward() and no reward function was given: give TRL-style "
                         "reward functions (reward.fn=package.module:fn or reward_fn=; each gets environments=[...]) "
                         "or define get_reward() on the environment")
    train = Dataset.from_list(rows(cfg))
    return Task("openenv", in_memory(train), in_memory(train.select([])), reward,
                workflow=functools.partial(make_workflow, source=source))
