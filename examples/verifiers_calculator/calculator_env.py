"""The calculator task of examples/openenv_calculator as a verifiers `ToolEnv` (classic API, verifiers 0.3.1).

`load_environment(**kwargs)` is verifiers' environment-module convention, so the same object comes from Python
(`train(environment=load_environment())`) or by id (`data.verifiers.env_id=calculator_env`, this folder on
`PYTHONPATH`). The questions and the arithmetic are the OpenEnv example's (`arithmetic.py`, imported from its folder):
"What is 343 * 86?", a `calculator(expression)` tool walked with `ast` (never `eval`); verifiers' own loop runs the
tool calls and ends the episode at a reply without one (the answer) or at `max_turns`. The rubric scores the last
reply's last number against the row's answer (1.0 / 0.0); `ToolEnv` adds its 0-weight metrics (`num_turns`,
`total_tool_calls`, `calculator_calls`).
"""
from __future__ import annotations

import re
import sys
from pathlib import Path

import verifiers as vf
from datasets import Dataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "openenv_calculator"))  # arithmetic.py, shared
from arithmetic import as_number, evaluate, question, tool_call  # noqa: E402

SYSTEM_PROMPT = "Solve the question with the calculator tool, then reply with the number alone."
NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")
QUESTION = re.compile(r"What is (\d+) \* (\d+)\?")


def calculator(expression: str) -> str:
    """Evaluate arithmetic.

    Args:
        expression: Numbers with + - * / // % ** and parentheses, e.g. "347 * 29".

    Returns:
        The value.
    """
    return evaluate(expression)


def rows(num_questions: int, seed: int) -> Dataset:
    """`num_questions` rows {"question", "answer"} of the seeds `seed`, `seed + 1`, ... (the OpenEnv example's
    question of each seed; the answer as text, as verifiers' rows carry it)."""
    if num_questions < 1:
        raise ValueError(f"num_questions must be at least 1, got {num_questions}")
    out = []
    for i in range(num_questions):
        text, answer = question(seed + i)
        out.append({"question": text, "answer": str(answer)})
    return Dataset.from_list(out)


def final_number(completion) -> float | None:
    """The last number of the last assistant reply ("10,063" read as 10063), or None when it has none."""
    replies = [m for m in completion if m.role == "assistant"]
    found = NUMBER.findall((replies[-1].content or "") if replies else "")
    return as_number(found[-1]) if found else None


def correct_answer(completion, answer: str, **kwargs) -> float:
    """1.0 when the last reply's last number is the row's answer, else 0.0."""
    return float(final_number(completion) == as_number(answer))


def demonstration(row: dict) -> list[str]:
    """A row's solved rollout, for the SFT warm start (`data.verifiers.demonstration=calculator_env:demonstration`;
    `row` is the dataset's): the calculator's call of the product, then the number alone."""
    a, b = (int(x) for x in QUESTION.fullmatch(row["question"]).groups())
    return [tool_call("calculator", {"expression": f"{a} * {b}"}), str(a * b)]


def load_environment(num_questions: int = 64, seed: int = 0, max_turns: int = 4,
                     system_prompt: str = SYSTEM_PROMPT, eval_questions: int = 0, **kwargs) -> vf.ToolEnv:
    """The calculator `ToolEnv`: `num_questions` multiplications from `seed`, at most `max_turns` model turns, a
    tool error answered to the model as `Error: ...` (bad input it can correct); `eval_questions` held-out ones (the
    seeds after the training rows') as its `eval_dataset`. Other keywords go to `vf.ToolEnv`."""
    held = rows(eval_questions, seed + num_questions) if eval_questions else None
    return vf.ToolEnv(dataset=rows(num_questions, seed), eval_dataset=held, tools=[calculator], max_turns=max_turns,
                      system_prompt=system_prompt, error_formatter=lambda e: f"Error: {e}",
                      rubric=vf.Rubric(funcs=[correct_answer], weights=[1.0]), **kwargs)
