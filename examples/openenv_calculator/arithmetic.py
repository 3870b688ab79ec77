"""The calculator both environment forms share: the question a seed poses, and arithmetic evaluated safely.

`evaluate` walks the expression's `ast` and allows only numbers, + - * / // % **, unary signs and parentheses, so a
model's text is never run as Python (no `eval`): anything else is a ValueError saying what was refused.
"""
from __future__ import annotations

import ast
import json
import operator
import random

OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
             ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
SIGNS = {ast.UAdd: operator.pos, ast.USub: operator.neg}
MAX_EXPONENT = 100
"""Bigger powers are refused: `9 ** 9 ** 9` would take the worker's time and memory."""


def operands(seed: int | None) -> tuple[int, int]:
    """The seed's two factors: a three-digit and a two-digit number, which a small model cannot multiply in its head
    but can with the calculator."""
    rng = random.Random(seed)
    return rng.randint(100, 999), rng.randint(11, 99)


def question(seed: int | None) -> tuple[str, int]:
    """(the question, its answer) of a seed."""
    a, b = operands(seed)
    return f"What is {a} * {b}?", a * b


def tool_call(name: str, arguments: dict) -> str:
    """A reply that calls one tool, in the Hermes/Qwen form the job reads by default."""
    return f'<tool_call>{json.dumps({"name": name, "arguments": arguments})}</tool_call>'


def calculated_answer(environments, **kwargs) -> list[float]:
    """A TRL-style reward function used as a metric (weight 0 in train.py): 1.0 when the episode's calculator
    computed the answer (the tool called correctly), else 0.0. Both environment forms keep `calculated`."""
    return [float(env.answer_value in env.calculated) for env in environments]


def evaluate(expression: str) -> str:
    """The value of `expression` as text ("10063", "2.5"); ValueError naming what is wrong with it."""
    if not isinstance(expression, str) or not expression.strip():
        raise ValueError("the expression is empty: give arithmetic such as '347 * 29'")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        raise ValueError(f"{expression!r} is not arithmetic: use numbers, + - * / // % ** and parentheses") from None
    value = _value(tree.body)
    return str(int(value)) if float(value).is_integer() else str(value)


def _value(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in SIGNS:
        return SIGNS[type(node.op)](_value(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in OPERATORS:
        left, right = _value(node.left), _value(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise ValueError(f"the exponent {right} is over {MAX_EXPONENT}")
        try:
            return OPERATORS[type(node.op)](left, right)
        except ZeroDivisionError:
            raise ValueError("division by zero") from None
    raise ValueError(f"{ast.unparse(node)!r} is not allowed: only numbers, + - * / // % ** and parentheses")


def as_number(value: str) -> float:
    """An answer's number ("10,063" and " 10063 " too); ValueError saying it is not one."""
    try:
        return float(str(value).replace(",", "").strip())
    except ValueError:
        raise ValueError(f"the answer must be a number, got {value!r}") from None
