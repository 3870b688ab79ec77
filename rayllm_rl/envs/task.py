"""A task bundles train/eval prompt datasets, a verifiable reward and optional SFT demonstrations."""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

TASKS = ("arithmetic", "gsm8k", "math", "ifeval")


@dataclasses.dataclass
class Task:
    """What a training job needs to know about a task, independent of the algorithm."""

    name: str
    train: Any
    """`datasets.Dataset` of prompt rows (a `messages` field plus reward fields)."""
    eval: Any
    """Held-out `datasets.Dataset` (never trained on)."""
    reward_fn: Callable[..., Any]
    """AReaL signature: reward_fn(prompt, completions, prompt_ids, completion_ids, **row) -> float or
    {"reward": float, **components}."""
    sft_target: Callable[[dict], str] | None = None
    """Row -> assistant demonstration text for the SFT warm start (None: no warm start)."""
    make_env: Callable[..., Any] | None = None
    """`make_env(tokenizer, seed=...)` -> the task's DatasetChatEnv (batch 1), for the env workflow."""


def _dataset_task(name: str, data_cfg: Any, seed: int) -> Task:
    """gsm8k / math / ifeval: rows from `data_cfg.path` (+ `eval_path` or a held-out slice).

    Every row of both files is checked here, on the driver before any actor starts, against the
    task env's `required_fields` and `check_row`: a malformed file raises ValueError naming the
    file and line (see `load_rows`)."""
    from rayllm_rl.data.sources import add_messages, load_rows, split_held_out
    from rayllm_rl.envs import dataset_envs

    if not data_cfg.path:
        raise ValueError(f"task={name} reads its prompts from data.path (a local .jsonl/.parquet file or a "
                         "dataset name); none was given")
    env_cls = dataset_envs.ENVS[name]
    make_messages, reward_fn, sft_target = {
        "gsm8k": lambda: (dataset_envs.gsm8k_messages, _gsm8k_reward(), _gsm8k_sft()),
        "math": lambda: (dataset_envs.math_prompt, _math_reward(), None),
        "ifeval": lambda: (dataset_envs.ifeval_prompt, _ifeval_reward(), None),
    }[name]()
    checks = {"required": env_cls.required_fields, "check_row": env_cls.check_row}
    rows = load_rows(data_cfg.path, data_cfg.split, **checks)
    held = load_rows(data_cfg.eval_path, data_cfg.split, **checks) if data_cfg.eval_path else None
    train, eval_ = split_held_out(rows, data_cfg.eval_size, seed, held)
    from rayllm_rl.workflows.rewards import RewardCaller

    make_env = functools.partial(_make_env, env_cls, train, RewardCaller(reward_fn))  # one caller: shared counters
    return Task(name, add_messages(train, make_messages), add_messages(eval_, make_messages) if len(eval_) else eval_,
                reward_fn, sft_target, make_env)


def _make_env(env_cls, dataset, reward_fn, tokenizer, seed: int = 0):
    return env_cls(dataset, tokenizer, reward_fn=reward_fn, seed=seed, check_rows=False)  # checked in _dataset_task


def _gsm8k_reward():
    from rayllm_rl.rewards.gsm8k import GSM8KRewardParser

    return GSM8KRewardParser()


def _gsm8k_sft():
    from rayllm_rl.rewards.gsm8k import gsm8k_sft_target

    return gsm8k_sft_target


def _math_reward():
    from rayllm_rl.rewards.math_answer import MathRewardFn

    return MathRewardFn()


def _ifeval_reward():
    from rayllm_rl.rewards.ifeval import IFEvalScorer

    return IFEvalScorer()


def make_task(name: str, data_cfg: Any = None, seed: int = 0) -> Task:
    """Build a registered task by name; `data_cfg` is a DataConfig (path, eval_path, eval_size, ...)."""
    if name == "arithmetic":
        from rayllm_rl.envs.arithmetic import arithmetic_reward, make_arithmetic_splits, sft_target

        kwargs = {} if data_cfg is None else {"max_operand": data_cfg.max_operand, "eval_size": data_cfg.eval_size}
        train, eval_ = make_arithmetic_splits(seed=seed, **kwargs)
        return Task("arithmetic", train, eval_, arithmetic_reward, sft_target)
    if name in TASKS:
        return _dataset_task(name, data_cfg, seed)
    raise ValueError(f"unknown task {name!r}; available: {list(TASKS)}")
