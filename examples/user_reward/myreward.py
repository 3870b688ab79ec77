"""The reward of examples/user_reward/train.py as a module, for the same job by import path:

    PYTHONPATH=examples/user_reward python jobs/grpo.py reward.fn=myreward:score data.path=rows.jsonl ...
"""
from __future__ import annotations

import re

ANSWER = re.compile(r"<answer>\s*(-?\d+)\s*</answer>")
NUMBER = re.compile(r"-?\d+")


def score(prompt, completion, prompt_ids, completion_ids, answer, **columns):
    """Half for putting an answer in <answer> tags, half for the right number (the last tagged answer, else the
    completion's last number). Every other column of the row comes as a keyword."""
    tagged = ANSWER.findall(completion)
    numbers = tagged or NUMBER.findall(completion.replace(",", ""))
    right = float(bool(numbers) and int(numbers[-1]) == int(answer))
    return {"reward": 0.5 * float(bool(tagged)) + 0.5 * right, "tagged": float(bool(tagged)), "right": right}
