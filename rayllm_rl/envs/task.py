"""A task bundles train/eval prompt datasets, a verifiable reward and optional SFT demonstrations.

Which tasks exist and how each is built: `task_registry.py`.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

@dataclasses.dataclass
class Task:
    """What a training job needs to know about a task, independent of the algorithm."""

    name: str
    train: Any
    """`datasets.Dataset` of prompt rows (a `messages` field plus reward fields); None in an env worker's
    task (`worker_part`), which gets its rows one per episode."""
    eval: Any
    """Held-out `datasets.Dataset` (never trained on); None in an env worker's task."""
    reward_fn: Callable[..., Any]
    """AReaL signature: reward_fn(prompt, completions, prompt_ids, completion_ids, **row) -> float or
    {"reward": float, **components}."""
    sft_target: Callable[[dict], str] | None = None
    """Row -> assistant demonstration text for the SFT warm start (None: no warm start)."""
    env_cls: Any = None
    """The task's DatasetChatEnv class (None: the task has no env)."""
    workflow: Callable[..., Any] | None = None
    """The task's own rollout workflow: a factory the job calls with the keywords it names of
    `workflows.custom.JOB_KEYWORDS` (the OpenEnv task's, which plays its environment); `rollout.workflow=auto`
    runs it (None: the built-in workflows)."""
    demonstrate: Callable[[Any, list], Any] | None = None
    """`(tokenizer, rows) -> SFT batch` for a task whose demonstrations are whole episodes (task=openenv: scripted
    replies played through the environment, `environments.demonstrations`): a trajectory TensorDict whose
    `loss_mask` marks the demonstrated replies' tokens. None: `sft_target`'s one reply per row, if any."""

    @functools.cached_property
    def make_env(self) -> Callable[..., Any] | None:
        """`make_env(tokenizer, seed=...)` -> the task's DatasetChatEnv scoring with `reward_fn` (batch 1, no
        dataset: each reset carries the episode's row), for the env workflow; None without an env. One
        factory per task (its envs share one RewardCaller's counters); `with_reward` makes a new task."""
        return None if self.env_cls is None else _row_fed_env_factory(self.env_cls, self.reward_fn)

    def worker_part(self) -> "Task":
        """This task without its rows: what an env worker needs (reward fn, env class, SFT target), shipped to it
        by value in its constructor arguments (Ray's cloudpickle: a reward defined in the user's script or
        notebook travels too). The driver loads and checks the rows once; workers get each row per episode."""
        return dataclasses.replace(self, train=None, eval=None, demonstrate=None)  # demonstrations: the driver's

    def with_reward(self, reward_fn: Callable[..., Any]) -> "Task":
        """This task scoring with `reward_fn` instead of its rule (its env, if any, too), e.g. the weighted
        rule + reward model + judge of `reward.*`; rows and SFT target unchanged."""
        return dataclasses.replace(self, reward_fn=reward_fn)


def _row_fed_env_factory(env_cls, reward_fn):
    """`make_env(tokenizer, seed=...)`: a batch-1 env fed the row of each episode by its caller (no dataset)."""
    from rayllm_rl.workflows.rewards import RewardCaller

    return functools.partial(_make_env, env_cls, RewardCaller(reward_fn))  # one caller: shared counters


def _make_env(env_cls, reward_fn, tokenizer, seed: int = 0):
    return env_cls(None, tokenizer, reward_fn=reward_fn, seed=seed)  # rows come with each reset


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


def load_split_rows(data_cfg: Any, seed: int, inputs: Any, *, task: str, make_messages: Callable[[dict], list],
                    required: tuple[str, ...] = (), check_row: Callable[[dict], None] | None = None,
                    default_config: str | None = None, example_path: str = ""):
    """(train, eval) `datasets.Dataset`s of a task that reads its rows, each with a `messages` column (the prompt
    chat, `make_messages(row)`), held in memory; every row checked (`required`, `check_row`) on the driver.

    Training rows: `train_dataset=` (a `datasets.Dataset` or a list of dicts given in Python) or `data.path`;
    held-out rows: `eval_dataset=` or `data.eval_path` (naming no split: its "test" split), a seeded sample of
    `data.eval_size` of them, else `data.eval_size` rows held out of the training rows. No eval prompt is a
    training prompt: an eval source that is the training source (same file, or same dataset, config and
    split) or shares prompts with it (the same `messages`) is refused naming how many; rows held out of the
    training source whose prompt is repeated in it take those repeats out of training (logged)."""
    from rayllm_rl.data.sources import EVAL_SPLIT, load_rows, source_identity, split_held_out

    train_obj, eval_obj = getattr(inputs, "train_dataset", None), getattr(inputs, "eval_dataset", None)
    train_src, train_key = (train_obj, "train_dataset") if train_obj is not None else (data_cfg.path, "data.path")
    if train_src is None or (isinstance(train_src, str) and not train_src):
        raise ValueError(f"task={task} reads its prompts from data.path (a local .jsonl/.json/.parquet/.csv file, a "
                         f"dataset folder or a hub dataset, e.g. data.path={example_path}) or from train(train_dataset="
                         "...); none was given")
    checks = {"required": required, "check_row": check_row, "default_config": default_config}
    rows = load_rows(train_src, data_cfg.split, field=train_key, **checks)
    held, eval_key = None, ""
    if eval_obj is not None:
        held, eval_key = load_rows(eval_obj, field="eval_dataset", **checks), "eval_dataset"
    elif data_cfg.eval_path:  # with no split named, its "test" split: never data.split's training rows
        held, eval_key = load_rows(data_cfg.eval_path, EVAL_SPLIT, field="data.eval_path", **checks), "data.eval_path"
        trained = source_identity(data_cfg.path, data_cfg.split, rows) if train_key == "data.path" else None
        if source_identity(data_cfg.eval_path, EVAL_SPLIT, held) == trained:
            where, config, split = trained
            raise ValueError(
                f"data.eval_path={data_cfg.eval_path!r} and data.path={data_cfg.path!r} (with data.split="
                f"{data_cfg.split!r}) are the same rows ({where}, config {config}, split {split}): the evaluation "
                "would score the policy on its training rows; point data.eval_path at a held-out split or "
                "file, or leave it empty to hold out data.eval_size rows of data.path")
    train, eval_ = split_held_out(rows, data_cfg.eval_size, seed, held)
    train = train.map(lambda row: {"messages": make_messages(row)})
    eval_ = eval_.map(lambda row: {"messages": make_messages(row)}) if len(eval_) else eval_
    labels = {"data.path": f"data.path={data_cfg.path!r}", "data.eval_path": f"data.eval_path={data_cfg.eval_path!r}"}
    train = _without_eval_prompts(train, eval_, labels.get(eval_key, eval_key), labels.get(train_key, train_key))
    return in_memory(train), in_memory(eval_)


def prompt_key(messages: Any) -> str:
    """A prompt chat as one comparable string (two prompts render the same under any chat template iff equal)."""
    import json

    return json.dumps([{"role": m["role"], "content": m["content"]} for m in messages], sort_keys=True)


def refuse_shared_prompts(train_prompts: set[str], eval_prompts: set[str], eval_key: str, train_key: str) -> None:
    """ValueError naming both keys and how many eval prompts (`prompt_key`s) are also training prompts, if any."""
    shared = eval_prompts & train_prompts
    if shared:
        raise ValueError(f"{eval_key}: {len(shared)} of its {len(eval_prompts)} distinct eval prompts are also "
                         f"training prompts ({train_key}; e.g. {sorted(shared)[0][:120]}): the evaluation would score "
                         "the policy on prompts it trains on; take them out of one of the two, or give no eval source "
                         "to hold out data.eval_size rows of the training rows")


def _without_eval_prompts(train, eval_, eval_key: str, train_key: str):
    """`train` minus its rows whose prompt is an eval prompt. From a separate eval source (`eval_key`) any
    such row is an error (`refuse_shared_prompts`); held out of the training source (`eval_key` ""), the
    training copies of a repeated prompt are dropped and logged."""
    if not len(eval_):
        return train
    held = {prompt_key(m) for m in eval_["messages"]}
    trained = [prompt_key(m) for m in train["messages"]]
    if eval_key:
        refuse_shared_prompts(set(trained), held, eval_key, train_key)
        return train
    keep = [i for i, key in enumerate(trained) if key not in held]
    if len(keep) == len(train):
        return train
    import logging

    logging.getLogger(__name__).warning(
        "%s: %d training rows repeat a held-out prompt and are not trained on", train_key, len(train) - len(keep))
    return train.select(keep)
