"""An agent written with the OpenAI SDK that may call a calculator tool, trained as it is.

    rollout.workflow=openai_agent rollout.agent=calc_agent:solve reward.fn=calc_agent:score   (PYTHONPATH: this folder)

`solve(client, data)` is plain agent code: it offers the model a `calculator` tool; when the model asks for it
(a Hermes `<tool_call>{"name": ..., "arguments": ...}</tool_call>` block, which the endpoint returns as OpenAI
`tool_calls`), the agent runs it and sends the result back as a `tool` message, then takes the model's final
answer. The job trains on exactly the tokens the engine produced; the tool's result is masked out of the loss.
`score` (the task's reward) scores the last completion.
"""
from __future__ import annotations

import ast
import json
import operator
import re

CALCULATOR = {"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an arithmetic expression: numbers, + - * / // % ** and parentheses.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}

SYSTEM = ('You may use a calculator: write <tool_call>{"name": "calculator", "arguments": {"expression": "12*7"}}'
          "</tool_call> and its result comes back. Give the final answer inside <answer></answer> tags.")

MAX_TOOL_CALLS = 2
"""Tool rounds per conversation; the completion after the last one is the answer."""

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow, ast.USub: operator.neg,
        ast.UAdd: operator.pos}


def calculator(expression: str) -> str:
    """The tool: the value of an arithmetic expression (no names, no calls; exponents up to 100), or an error text
    the model reads. Never raises."""
    def value(node):
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node.value
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](value(node.operand))
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            left, right = value(node.left), value(node.right)
            if isinstance(node.op, ast.Pow) and abs(right) > 100:
                raise ValueError("exponent too large")
            return _OPS[type(node.op)](left, right)
        raise ValueError(f"not arithmetic: {ast.dump(node)[:40]}")

    try:
        result = value(ast.parse(str(expression), mode="eval").body)
    except (SyntaxError, ValueError, ZeroDivisionError, OverflowError, RecursionError) as exc:
        return f"error: {exc}"
    return str(int(result)) if float(result).is_integer() else f"{result:.6g}"


async def solve(client, data) -> None:
    """The agent: ask with the calculator offered; run each tool call it makes and send the result back; stop at a
    reply without a tool call. The task's reward scores that last reply, so nothing is returned."""
    messages = [dict(m) for m in data["messages"]]
    if not any(m["role"] == "system" for m in messages):
        messages.insert(0, {"role": "system", "content": SYSTEM})
    for _ in range(MAX_TOOL_CALLS + 1):
        reply = (await client.chat.completions.create(model="policy", messages=messages, tools=[CALCULATOR])
                 ).choices[0].message
        calls = reply.tool_calls or []
        messages.append({"role": "assistant", "content": reply.content or "",
                         **({"tool_calls": [c.model_dump() for c in calls]} if calls else {})})
        if not calls:
            return
        for call in calls:
            if call.function.name == "calculator":
                args = json.loads(call.function.arguments or "{}")  # the endpoint passes only well-formed JSON
                result = calculator(args.get("expression", "") if isinstance(args, dict) else args)
            else:
                result = f"error: no tool named {call.function.name!r}"
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})


ANSWER = re.compile(r"<answer>\s*(-?\d+)\s*</answer>")
NUMBER = re.compile(r"-?\d+")


def score(prompt, completion, prompt_ids, completion_ids, answer, **columns):
    """The task's reward on the agent's last reply: half for an answer in <answer> tags, half for the right number
    (the last tagged answer, else the last number)."""
    tagged = ANSWER.findall(completion)
    numbers = tagged or NUMBER.findall(completion.replace(",", ""))
    right = float(bool(numbers) and int(numbers[-1]) == int(answer))
    return {"reward": 0.5 * float(bool(tagged)) + 0.5 * right, "tagged": float(bool(tagged)), "right": right}
