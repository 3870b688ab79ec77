"""A task bundles train/eval prompt datasets, a verifiable reward and optional SFT demonstrations."""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

TASKS = ("arithmetic", "gsm8k", "math", "ifeval", "reasoning_gym")


@dataclasses.dataclass
class Task:
    """What a training job needs to know about a task, independent of the algorithm."""

    name: str
    train: Any
    """`datasets.Dataset` of prompt rows (a `messages` field plus reward fields); None in an env worker's
    task (`make_worker_task`), which gets its rows one per episode."""
    eval: Any
    """Held-out `datasets.Dataset` (never trained on); None in an env worker's task."""
    reward_fn: Callable[..., Any]
    """AReaL signature: reward_fn(prompt, completions, prompt_ids, completion_ids, **row) -> float or
    {"reward": float, **components}."""
    sft_target: Callable[[dict], str] | None = None
    """Row -> assistant demonstration text for the SFT warm start (None: no warm start)."""
    env_cls: Any = None
    """The task's DatasetChatEnv class (None: the task has no env)."""

    @functools.cached_property
    def make_env(self) -> Callable[..., Any] | None:
        """`make_env(tokenizer, seed=...)` -> the task's DatasetChatEnv scoring with `reward_fn` (batch 1, no
        dataset: each reset carries the episode's row), for the env workflow; None without an env. One
        factory per task (its envs share one RewardCaller's counters); `with_reward` makes a new task."""
        return None if self.env_cls is None else _row_fed_env_factory(self.env_cls, self.reward_fn)

    def with_reward(self, reward_fn: Callable[..., Any]) -> "Task":
        """This task scoring with `reward_fn` instead of its rule (its env, if any, too), e.g. the weighted
        rule + reward model + judge of `reward.*`; rows and SFT target unchanged."""
        return dataclasses.replace(self, reward_fn=reward_fn)


DEFAULT_CONFIGS: dict[str, str | None] = {"gsm8k": "main", "math": "default", "ifeval": None}
"""Config used when `data.path` names a hub dataset with several configs and none: GSM8K's "main"
(openai/gsm8k: main, socratic); "default", the all-subjects config of DigitalLearningGmbH/MATH-lighteval
(EleutherAI/hendrycks_math has only per-subject configs: the error lists them); google/IFEval has one."""

KNOWN_DATASETS = {"gsm8k": "openai/gsm8k", "math": "DigitalLearningGmbH/MATH-lighteval", "ifeval": "google/IFEval"}
"""The hub dataset each task's format follows, suggested when `data.path` is empty."""


def _task_parts(name: str):
    """(env class, prompt builder, reward fn, SFT target) of a dataset task."""
    from rayllm_rl.envs import dataset_envs

    make_messages, reward_fn, sft_target = {
        "gsm8k": lambda: (dataset_envs.gsm8k_messages, _gsm8k_reward(), _gsm8k_sft()),
        "math": lambda: (dataset_envs.math_prompt, _math_reward(), None),
        "ifeval": lambda: (dataset_envs.ifeval_prompt, _ifeval_reward(), None),
    }[name]()
    return dataset_envs.ENVS[name], make_messages, reward_fn, sft_target


def _row_fed_env_factory(env_cls, reward_fn):
    """`make_env(tokenizer, seed=...)`: a batch-1 env fed the row of each episode by its caller (no dataset)."""
    from rayllm_rl.workflows.rewards import RewardCaller

    return functools.partial(_make_env, env_cls, RewardCaller(reward_fn))  # one caller: shared counters


def _dataset_task(name: str, data_cfg: Any, seed: int) -> Task:
    """gsm8k / math / ifeval: rows from `data_cfg.path` (+ `eval_path` or a held-out slice).

    `eval_path` naming no split reads its "test" split (`EVAL_SPLIT`); an `eval_path` that is the same
    rows as `path` (same file, or same dataset, config and split) is refused with a ValueError.

    Every row of both sources is checked here, on the driver before any actor starts, against the
    task env's `required_fields` and `check_row`: a malformed file raises ValueError naming the
    file and line (see `load_rows`); a hub dataset with several configs and none given uses the
    task's DEFAULT_CONFIGS entry if it has it, else the error lists its configs."""
    from rayllm_rl.data.sources import EVAL_SPLIT, add_messages, load_rows, source_identity, split_held_out

    if not data_cfg.path:
        raise ValueError(f"task={name} reads its prompts from data.path (a local .jsonl/.json/.parquet file, a "
                         f"dataset folder or a hub dataset, e.g. data.path={KNOWN_DATASETS[name]}); none was given")
    env_cls, make_messages, reward_fn, sft_target = _task_parts(name)
    checks = {"required": env_cls.required_fields, "check_row": env_cls.check_row,
              "default_config": DEFAULT_CONFIGS[name]}
    rows = load_rows(data_cfg.path, data_cfg.split, **checks)
    held = None
    if data_cfg.eval_path:  # with no split named, its "test" split: never data.split's training rows
        held = load_rows(data_cfg.eval_path, EVAL_SPLIT, field="data.eval_path", **checks)
        trained = source_identity(data_cfg.path, data_cfg.split, rows)
        if source_identity(data_cfg.eval_path, EVAL_SPLIT, held) == trained:
            where, config, split = trained
            raise ValueError(
                f"data.eval_path={data_cfg.eval_path!r} and data.path={data_cfg.path!r} (with data.split="
                f"{data_cfg.split!r}) are the same rows ({where}, config {config}, split {split}): the evaluation "
                "would score the policy on its training rows; point data.eval_path at a held-out split or "
                "file, or leave it empty to hold out data.eval_size rows of data.path")
    train, eval_ = split_held_out(rows, data_cfg.eval_size, seed, held)
    train, eval_ = add_messages(train, make_messages), add_messages(eval_, make_messages) if len(eval_) else eval_
    return Task(name, in_memory(train), in_memory(eval_), reward_fn, sft_target, env_cls)


def in_memory(dataset):
    """`dataset` with its rows held in memory (an InMemoryTable, no indices mapping), so that pickling it
    (Ray sending `task.train` to the collector, on any node) carries the rows. A dataset read by
    `load_dataset`, `.map` or `train_test_split` is backed by arrow files in this machine's `datasets`
    cache, and its pickle holds only their paths, which another node does not have. GSM8K's 7.5k rows
    with their `messages` column pickle to about 8 MB."""
    if len(dataset) == 0:  # flatten_indices maps no batch and keeps the file-backed table
        from datasets import Dataset

        return Dataset.from_dict({c: [] for c in dataset.column_names}, features=dataset.features)
    return dataset.flatten_indices(keep_in_memory=True)


def make_worker_task(name: str, data_cfg: Any = None) -> Task:
    """The part of a task an env worker needs: its reward fn and env factory, no dataset (`train` and
    `eval` are None). The driver loads and checks the rows once; workers get each row per episode.
    `data_cfg` (a DataConfig) is read by the tasks whose reward depends on it (reasoning_gym)."""
    if name == "arithmetic":
        from rayllm_rl.envs.arithmetic import arithmetic_reward, sft_target

        return Task("arithmetic", None, None, arithmetic_reward, sft_target)
    if name == "reasoning_gym":
        from rayllm_rl.envs import reasoning_gym_task as rg

        return Task(name, None, None, rg.make_reward(_rg_config(data_cfg)), None, rg.ReasoningGymEnv)
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; available: {list(TASKS)}")
    env_cls, _, reward_fn, sft_target = _task_parts(name)
    return Task(name, None, None, reward_fn, sft_target, env_cls)


def _rg_config(data_cfg: Any):
    """The `data.reasoning_gym` section of a DataConfig (its defaults when none is given)."""
    from rayllm_rl.envs.reasoning_gym_task import ReasoningGymConfig

    return ReasoningGymConfig() if data_cfg is None else data_cfg.reasoning_gym


def _make_env(env_cls, reward_fn, tokenizer, seed: int = 0):
    return env_cls(None, tokenizer, reward_fn=reward_fn, seed=seed)  # rows come with each reset


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
    if name == "reasoning_gym":
        from rayllm_rl.envs import reasoning_gym_task as rg

        cfg = _rg_config(data_cfg)
        train, eval_ = rg.make_splits(cfg, 200 if data_cfg is None else data_cfg.eval_size)
        return Task(name, in_memory(train), in_memory(eval_), rg.make_reward(cfg), None, rg.ReasoningGymEnv)
    if name in TASKS:
        return _dataset_task(name, data_cfg, seed)
    raise ValueError(f"unknown task {name!r}; available: {list(TASKS)}")
