"""`task=verifiers`: a verifiers environment (classic API, verifiers <= 0.3.1) as the job's task.

The registry's factory (`make_task`) runs on the driver before any actor starts: it resolves the environment
(`verifiers_env.resolve_verifiers`: `data.verifiers.env_id` loaded with verifiers' `load_environment`, or the object
given to `train(environment=...)`), takes its dataset's rows (`verifiers_env.rows`), and returns a `Task` whose
reward is the rubric's (`verifiers_env.RubricReward`) and whose `workflow` plays the environment
(`verifiers_workflow.make_workflow`). No held-out evaluation: a rollout's reward is known once it is played
(`data.eval_size` must be 0).
"""
from __future__ import annotations

import functools
from typing import Any


def make_task(data_cfg: Any = None, seed: int = 0, inputs: Any = None):
    """The registry's factory (`task=verifiers`); ValueError naming the key for what the environment or its rows
    lack."""
    from datasets import Dataset

    from rayllm_rl.envs.task import Task, in_memory
    from rayllm_rl.environments.verifiers_config import VerifiersConfig
    from rayllm_rl.environments.verifiers_env import RubricReward, component_names, resolve_verifiers, rows
    from rayllm_rl.environments.verifiers_workflow import make_workflow

    cfg = VerifiersConfig() if data_cfg is None else data_cfg.verifiers
    if data_cfg is not None and data_cfg.eval_size:
        raise ValueError(f"data.eval_size={data_cfg.eval_size}: task=verifiers has no held-out greedy evaluation (a "
                         "rollout's reward is known once the environment has played it); set data.eval_size=0")
    cfg.check()
    source, env = resolve_verifiers(cfg, getattr(inputs, "environment", None))
    train = Dataset.from_list(rows(env, cfg.train_size, source.label))
    return Task("verifiers", in_memory(train), in_memory(train.select([])), RubricReward(component_names(env.rubric)),
                workflow=functools.partial(make_workflow, source=source))
