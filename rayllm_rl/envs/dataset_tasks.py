"""The factories of the built-in dataset tasks (gsm8k, math, ifeval): rows from `data.path` (or a dataset given in
Python), the task env's prompt format, row checks and reward. Each is one entry of `task_registry.TASKS`."""
from __future__ import annotations

from typing import Any, Callable

from rayllm_rl.envs.task import Task, load_split_rows


def _dataset_task(name: str, env_cls, make_messages: Callable[[dict], list], reward_fn, sft_target,
                  data_cfg: Any, seed: int, inputs: Any) -> Task:
    """A task whose rows `load_split_rows` reads, each checked against the env's `required_fields` and
    `check_row` (a malformed file fails naming the file and line); a hub dataset with several configs and
    none given reads the registry entry's `default_config`, else the error lists its configs."""
    from rayllm_rl.envs.task_registry import TASKS

    entry = TASKS[name]
    train, eval_ = load_split_rows(data_cfg, seed, inputs, task=name, make_messages=make_messages,
                                   required=env_cls.required_fields, check_row=env_cls.check_row,
                                   default_config=entry.default_config, example_path=entry.example_path)
    return Task(name, train, eval_, reward_fn, sft_target, env_cls)


def make_gsm8k(data_cfg: Any, seed: int = 0, inputs: Any = None) -> Task:
    """GSM8K (`question`, `answer` ending in `#### N`), scored by GSM8KRewardParser, with SFT demonstrations."""
    from rayllm_rl.envs.dataset_envs import GSM8KEnv, gsm8k_messages
    from rayllm_rl.rewards.gsm8k import GSM8KRewardParser, gsm8k_sft_target

    return _dataset_task("gsm8k", GSM8KEnv, gsm8k_messages, GSM8KRewardParser(), gsm8k_sft_target, data_cfg, seed,
                         inputs)


def make_math(data_cfg: Any, seed: int = 0, inputs: Any = None) -> Task:
    """MATH (`problem` + a boxed `solution`, or MATH-500's `answer`), checked by math-verify (MathRewardFn)."""
    from rayllm_rl.envs.dataset_envs import MATHEnv, math_prompt
    from rayllm_rl.rewards.math_answer import MathRewardFn

    return _dataset_task("math", MATHEnv, math_prompt, MathRewardFn(), None, data_cfg, seed, inputs)


def make_ifeval(data_cfg: Any, seed: int = 0, inputs: Any = None) -> Task:
    """IFEval (`prompt`, `instruction_id_list`, `kwargs`), scored by IFEvalScorer."""
    from rayllm_rl.envs.dataset_envs import IFEvalEnv, ifeval_prompt
    from rayllm_rl.rewards.ifeval import IFEvalScorer

    return _dataset_task("ifeval", IFEvalEnv, ifeval_prompt, IFEvalScorer(), None, data_cfg, seed, inputs)
