"""`task=verifiers`: a verifiers environment (classic API, verifiers <= 0.3.1) as the job's task.

The registry's factory (`make_task`) runs on the driver before any actor starts: it resolves the environment
(`verifiers_env.resolve_verifiers`: `data.verifiers.env_id` loaded with verifiers' `load_environment`, or the object
given to `train(environment=...)`), takes its dataset's rows (`verifiers_env.rows`), and returns a `Task` whose
reward is the rubric's (`verifiers_env.RubricReward`) and whose `workflow` plays the environment
(`verifiers_workflow.make_workflow`). The held-out rows (`data.eval_size`) are the environment's `eval_dataset`'s,
each evaluated as one greedy rollout; the SFT warm start imitates `data.verifiers.demonstration`'s scripted replies
played through the environment (`environments.demonstrations`).
"""
from __future__ import annotations

import functools
import json
from typing import Any


def demonstrations(source, reward, demonstrate, tokenizer, rows_: list[dict[str, Any]]):
    """`Task.demonstrate`: the SFT batch of `rows_`' scripted rollouts, each played by the task's own
    `VerifiersWorkflow`; `demonstrate` gets the environment's dataset row (the row's `vf_input`)."""
    from rayllm_rl.environments.demonstrations import demonstration_batch
    from rayllm_rl.environments.verifiers_workflow import VerifiersWorkflow
    from rayllm_rl.inference.protocol import SamplingParams

    def vf_row(row: dict[str, Any]):
        return demonstrate(json.loads(row["vf_input"]))

    def label(i: int, row: dict[str, Any]) -> str:
        vf_input = json.loads(row["vf_input"])
        return f"the dataset row {vf_input.get('example_id', i)} ({str(vf_input.get('question', ''))[:60]!r})"

    workflow = VerifiersWorkflow(source, reward, tokenizer, SamplingParams())  # the environment loaded once
    return demonstration_batch(lambda replies: workflow, vf_row, tokenizer, rows_, key="data.verifiers.demonstration",
                               label_of=label)


def make_task(data_cfg: Any = None, seed: int = 0, inputs: Any = None):
    """The registry's factory (`task=verifiers`); ValueError naming the key for what the environment or its rows
    lack."""
    from datasets import Dataset

    from rayllm_rl.envs.task import Task, in_memory
    from rayllm_rl.environments.verifiers_config import VerifiersConfig
    from rayllm_rl.environments.verifiers_env import RubricReward, component_names, eval_rows, resolve_verifiers, rows
    from rayllm_rl.environments.verifiers_workflow import make_workflow
    from rayllm_rl.environments.demonstrations import demonstrations_of

    cfg = VerifiersConfig() if data_cfg is None else data_cfg.verifiers
    cfg.check()
    source, env = resolve_verifiers(cfg, getattr(inputs, "environment", None))
    train = Dataset.from_list(rows(env, cfg.train_size, source.label))
    eval_size = 0 if data_cfg is None else (data_cfg.eval_size or 0)
    held = Dataset.from_list(eval_rows(env, eval_size, source.label)) if eval_size else train.select([])
    reward = RubricReward(component_names(env.rubric))
    demonstrate = demonstrations_of(cfg.demonstration, "data.verifiers.demonstration", demonstrations, source, reward)
    return Task("verifiers", in_memory(train), in_memory(held), reward,
                workflow=functools.partial(make_workflow, source=source), demonstrate=demonstrate)
