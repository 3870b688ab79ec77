"""An OpenEnv `Environment` for multi-turn tool use: a multiplication to answer, with a calculator to call first.

`reset(seed)` asks "What is 347 * 29?" (the operands drawn from the seed). Each step is one `CalculatorAction`:
`tool="calculator"` evaluates `argument` (arithmetic only, `arithmetic.evaluate`) and shows the value, reward 0;
`tool="answer"` ends the episode with reward 1.0 when `argument` is the right number, else 0.0. Bad input (an
expression that is not arithmetic, an answer that is not a number) is shown to the model as the next observation,
so it can try again. rayllm_rl plays it with `train(environment=CalculatorEnv)` or
`data.openenv.env=calculator_env:CalculatorEnv`: each reply is a tool call of `step` whose arguments are the action's
fields (docs/environments.md).
"""
from __future__ import annotations

from typing import Literal

from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State
from pydantic import Field

from arithmetic import as_number, evaluate, operands, question, tool_call


class CalculatorAction(Action):
    """Use the calculator, or give the final answer."""

    tool: Literal["calculator", "answer"] = Field(description="'calculator' to evaluate, 'answer' to finish")
    argument: str = Field(description="the arithmetic to evaluate (e.g. '347 * 29'), or the final number")


class CalculatorObservation(Observation):
    text: str = Field(description="the question, the calculator's value, or what was wrong")


class CalculatorEnv(Environment[CalculatorAction, CalculatorObservation, State]):
    """One multiplication per episode; the calculator is free, the answer ends it."""

    def __init__(self) -> None:
        super().__init__()
        self._state = State()
        self.answer_value, self.calculated = 0, set()

    def reset(self, seed=None, episode_id=None, **kwargs) -> CalculatorObservation:
        self._state = State(episode_id=episode_id, step_count=0)
        text, self.answer_value = question(seed)
        self.calculated = set()
        return CalculatorObservation(text=text + " Use the calculator, then answer.")

    def step(self, action: CalculatorAction, timeout_s=None, **kwargs) -> CalculatorObservation:
        self._state.step_count += 1
        try:
            if action.tool == "calculator":
                value = evaluate(action.argument)
                self.calculated.add(as_number(value))
                return CalculatorObservation(text=value, reward=0.0)
            right = as_number(action.argument) == self.answer_value
        except ValueError as exc:
            return CalculatorObservation(text=f"Error: {exc}", reward=0.0)
        return CalculatorObservation(text="Correct." if right else "Wrong.", reward=float(right), done=True)

    @property
    def state(self) -> State:
        return self._state


def demonstration(row: dict) -> list[str]:
    """A row's solved episode, for the SFT warm start (`data.openenv.demonstration=calculator_env:demonstration`):
    the calculator's call of the product, then the answer."""
    a, b = operands(row.get("seed"))
    return [tool_call("step", {"tool": "calculator", "argument": f"{a} * {b}"}),
            tool_call("step", {"tool": "answer", "argument": str(a * b)})]
