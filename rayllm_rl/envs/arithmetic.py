"""The built-in verifiable demo task: integer addition answered inside `<answer>` tags.

Every (a, b) pair is either train or held-out eval, never both, so eval measures
generalisation to prompts neither SFT nor RL ever saw.
"""
from __future__ import annotations

import random
import re
from typing import Any

ANSWER_RE = re.compile(r"<answer>\s*(-?\d+)\s*</answer>")


def arithmetic_reward(prompt: str, completions: str, prompt_ids: list[int], completion_ids: list[int],
                      answer: str | int | None = None, **row: Any) -> float:
    """1.0 if the first `<answer>N</answer>` equals the row's answer, else 0.0 (AReaL signature)."""
    if answer is None:
        raise ValueError("arithmetic_reward needs the row's 'answer' field")
    m = ANSWER_RE.search(completions)
    return 1.0 if m is not None and int(m.group(1)) == int(answer) else 0.0


def make_arithmetic_splits(max_operand: int = 20, eval_size: int = 128, seed: int = 0):
    """(train, eval) `datasets.Dataset`s of rows {messages, answer, a, b}; disjoint (a, b) pairs."""
    from datasets import Dataset

    pairs = [(a, b) for a in range(max_operand + 1) for b in range(max_operand + 1)]
    if eval_size >= len(pairs):
        raise ValueError(f"eval_size={eval_size} leaves no training pairs out of {len(pairs)}")
    random.Random(seed).shuffle(pairs)

    def rows(ps):
        return [{"messages": [{"role": "user", "content": f"{a}+{b}="}], "answer": str(a + b), "a": a, "b": b}
                for a, b in ps]

    return Dataset.from_list(rows(pairs[eval_size:])), Dataset.from_list(rows(pairs[:eval_size]))


def sft_target(row: dict[str, Any]) -> str:
    """The demonstration the SFT warm start imitates."""
    return f"<answer>{row['answer']}</answer>"


def make_task(data_cfg: Any = None, seed: int = 0, inputs: Any = None):
    """The registry's factory (`task=arithmetic`): disjoint train/eval pairs of operands up to `data.max_operand`,
    `data.eval_size` of them held out (defaults without a DataConfig: make_arithmetic_splits')."""
    from rayllm_rl.envs.task import Task

    kwargs = {} if data_cfg is None else {"max_operand": data_cfg.max_operand, "eval_size": data_cfg.eval_size}
    train, eval_ = make_arithmetic_splits(seed=seed, **kwargs)
    return Task("arithmetic", train, eval_, arithmetic_reward, sft_target)
