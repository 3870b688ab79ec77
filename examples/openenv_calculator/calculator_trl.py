"""The same game as TRL's `environment_factory` (no openenv import): `reset(**row)` poses the question, the public
methods `calculator` and `answer` are the model's tools (their docstrings are the tools' schemas), and `get_reward()`
is 1.0 after a right answer, else 0.0.

Run it unchanged with `GRPOTrainer(model, environment_factory=CalculatorToolEnv, args=[...])` here or in TRL. As
TRL does, a tool that raises answers the model `{"error": "..."}` (bad input it can correct); a reply without a
tool call ends the episode.
"""
from __future__ import annotations

from arithmetic import as_number, evaluate, operands, question, tool_call


class CalculatorToolEnv:
    """One multiplication per episode; `calculator` is free, `answer` is final."""

    def __init__(self) -> None:
        self.answer_value, self.reward, self.answered, self.calculated = 0, 0.0, False, set()

    def reset(self, **row) -> str:
        text, self.answer_value = question(row.get("seed"))
        self.reward, self.answered, self.calculated = 0.0, False, set()
        return text + " Use the calculator, then answer."

    def calculator(self, expression: str) -> str:
        """
        Evaluate arithmetic.

        Args:
            expression: Numbers with + - * / // % ** and parentheses, e.g. "347 * 29".

        Returns:
            The value.
        """
        value = evaluate(expression)
        self.calculated.add(as_number(value))
        return value

    def answer(self, value: str) -> str:
        """
        Give the final answer (once).

        Args:
            value: The number that answers the question.

        Returns:
            Whether it is right.
        """
        if self.answered:
            raise ValueError("the answer was already given")
        right = as_number(value) == self.answer_value
        self.reward, self.answered = float(right), True
        return "Correct." if right else "Wrong."

    def get_reward(self) -> float:
        return self.reward


def demonstration(row: dict) -> list[str]:
    """A row's solved episode (`data.openenv.demonstration=calculator_trl:demonstration`): the calculator's call,
    the answer's call, then a reply without a tool call, which ends a TRL environment's episode."""
    a, b = operands(row.get("seed"))
    return [tool_call("calculator", {"expression": f"{a} * {b}"}), tool_call("answer", {"value": str(a * b)}),
            f"The answer is {a * b}."]
