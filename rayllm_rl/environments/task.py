"""`task=openenv`: an OpenEnv environment (or a TRL `environment_factory` class) as the job's task.

The registry's factory (`make_task`) runs on the driver before any actor starts: it resolves the environment
(`source.resolve_source`: its form, tools and Action class, from `data.openenv` and `train(environment=...)`),
generates the rows (`data.openenv.train_size` of them, each a `seed` and the prompt chat), and returns a `Task`
whose `workflow` plays the environment (`make_workflow`: `group_size` episodes of `EnvWorkflow` per row). The
task's reward is the episode's (`rewards.EpisodeReward`): the environment's own plus the TRL-style reward functions
of `reward.fn` / `reward_fn=`.

The held-out rows (`data.eval_size`) are seeds after the training rows'; the job's evaluation plays them greedily
through the same workflow, one episode each (`workflows.evaluation.evaluate_episodes`). The SFT warm start imitates
`data.openenv.demonstration`'s scripted replies played through the environment (`environments.demonstrations`).
"""
from __future__ import annotations

import functools
from typing import Any

from rayllm_rl.environments.rewards import EpisodeReward


def rows(cfg: Any, start: int = 0, count: int | None = None) -> list[dict[str, Any]]:
    """Generated rows: `{"messages": [system?, user prompt?], "seed": seed + i}` for `start <= i < start + count`
    (default: the `train_size` training rows)."""
    chat = ([{"role": "system", "content": cfg.system_prompt}] if cfg.system_prompt else []) + (
        [{"role": "user", "content": cfg.prompt}] if cfg.prompt else [])
    count = cfg.train_size if count is None else count
    return [{"messages": chat, "seed": cfg.seed + i} for i in range(start, start + count)]


def make_workflow(tokenizer, sampling, group_size: int, max_turns: int, task, sample_timeout_s=None, *, source):
    """The task's rollout workflow (built in each env worker with the job's keywords, `factories.build_workflow`):
    `group_size` independent episodes of the row, one `group_id`; each sample that fails (or runs past
    `rollout.sample_timeout_s`) fails alone."""
    from rayllm_rl.environments.workflow import EnvWorkflow
    from rayllm_rl.workflows.grouped import GroupedWorkflow

    return GroupedWorkflow(EnvWorkflow(source, task.reward_fn, tokenizer, sampling, max_turns=max_turns), group_size,
                           timeout_s=sample_timeout_s)


def demonstrations(source, reward, demonstrate, tokenizer, rows_: list[dict[str, Any]]):
    """`Task.demonstrate`: the SFT batch of `rows_`' scripted episodes, each played by the task's own `EnvWorkflow`
    (a script of n replies may take n turns; the environment must end the episode by then)."""
    from rayllm_rl.environments.demonstrations import demonstration_batch
    from rayllm_rl.environments.workflow import EnvWorkflow
    from rayllm_rl.inference.protocol import SamplingParams

    def workflow(replies: int):  # one turn more than the script: a script that stops short is refused, not cut
        return EnvWorkflow(source, reward, tokenizer, SamplingParams(), max_turns=replies + 1)

    return demonstration_batch(workflow, demonstrate, tokenizer, rows_, key="data.openenv.demonstration")


def make_task(data_cfg: Any = None, seed: int = 0, inputs: Any = None):
    """The registry's factory (`task=openenv`); ValueError naming the key for what the environment or the rows lack."""
    from datasets import Dataset

    from rayllm_rl.environments.config import OpenEnvConfig
    from rayllm_rl.environments.source import resolve_source
    from rayllm_rl.envs.task import Task, in_memory
    from rayllm_rl.environments.demonstrations import demonstrations_of

    cfg = OpenEnvConfig() if data_cfg is None else data_cfg.openenv
    cfg.check()
    source = resolve_source(cfg, getattr(inputs, "environment", None))
    reward = EpisodeReward(getattr(inputs, "reward_fns", ()) or (), getattr(inputs, "reward_weights", ()) or ())
    if not reward.reward_funcs and not source.owns_reward:
        raise ValueError(f"{source.label} has no get_reward() and no reward function was given: give TRL-style "
                         "reward functions (reward.fn=package.module:fn or reward_fn=; each gets environments=[...]) "
                         "or define get_reward() on the environment")
    eval_size = 0 if data_cfg is None else (data_cfg.eval_size or 0)
    train = Dataset.from_list(rows(cfg))
    held = Dataset.from_list(rows(cfg, cfg.train_size, eval_size)) if eval_size else train.select([])
    demonstrate = demonstrations_of(cfg.demonstration, "data.openenv.demonstration", demonstrations, source, reward)
    return Task("openenv", in_memory(train), in_memory(held), reward,
                workflow=functools.partial(make_workflow, source=source), demonstrate=demonstrate)
