"""One episode of a TRL `environment_factory` environment, with TRL's semantics, so a TRL user's class runs as is.

The class (TRL's docs/source/openenv.md, `GRPOTrainer(environment_factory=...)`): built with no argument, one
instance per episode; `reset(**row) -> str | None` gets every field of the row (its string is appended to the last
user message); every public method but `reset` and `get_reward` is a tool, its schema built from its signature and
Google-style docstring (`Args:`) by transformers' `get_json_schema`, as TRL does; an optional `get_reward()` is the
environment's own reward. A reply's tool calls run in order (sync ones in a worker thread, async ones awaited), their
results follow as `tool` messages; a reply without a call ends the episode. As in TRL, a tool that raises (or an
unknown tool, or a malformed call) answers `{"error": "..."}` to the model: that is the environment telling the
model its move was invalid, not a failed sample. What does fail the sample: `reset` or `get_reward` raising, any
call running past `data.openenv.call_timeout_s`.
"""
from __future__ import annotations

import inspect
from typing import Any, Callable

from rayllm_rl.environments.actions import ReplyReader
from rayllm_rl.environments.calls import EnvCallTimeout, bounded
from rayllm_rl.environments.openenv_session import Step

NOT_TOOLS = ("reset", "get_reward")
"""Public methods of a TRL environment that are not tools."""


def tool_methods(env_cls: type) -> dict[str, Callable[..., Any]]:
    """{name: function} of the class's tools: every public function on the class (read on the class, as TRL
    does, so properties are not evaluated) but `reset` and `get_reward`."""
    return {name: fn for name, fn in inspect.getmembers(env_cls, predicate=inspect.isfunction)
            if not name.startswith("_") and name not in NOT_TOOLS}


def tool_schemas(env_cls: type) -> list[dict[str, Any]]:
    """The OpenAI-style schema of each tool (transformers' `get_json_schema`, what TRL renders); ValueError naming
    the method when its docstring or type hints do not describe every argument."""
    from transformers.utils import get_json_schema

    out = []
    for name, fn in tool_methods(env_cls).items():
        try:
            out.append(get_json_schema(fn))
        except Exception as exc:  # noqa: BLE001 - transformers' DocstringParsingException / TypeHintParsingException
            raise ValueError(f"{env_cls.__name__}.{name} is a tool (a public method), but its schema cannot be built: "
                             f"{exc}. Give it a docstring with an `Args:` line per argument and type hints (TRL's "
                             "environment_factory contract), or make it private (_name)") from exc
    return out


def _result_text(result: Any) -> str:
    """A tool's result as the tool message's content, as TRL makes it (`str(result)`)."""
    return result if isinstance(result, str) else str(result)


class ToolEnvSession:
    """One episode of `env`, an instance of a TRL environment class."""

    def __init__(self, env: Any, *, reader: ReplyReader, tools: list[dict], timeout_s: float, label: str = "") -> None:
        self.env = env
        self.reader = reader
        self.tools = tools
        self.timeout_s = timeout_s
        self.label = label or type(env).__name__
        self.methods = {name: getattr(env, name) for name in tool_methods(type(env))}

    async def start(self, row: dict[str, Any]) -> str | None:
        """`reset(**row)`: the string it returns (None: nothing) is appended to the prompt's last user message."""
        out = await bounded(f"reset of {self.label}", self.env.reset, **row, timeout_s=self.timeout_s)
        if out is not None and not isinstance(out, str):
            raise TypeError(f"{self.label}.reset returned a {type(out).__name__}; TRL's contract is str or None")
        return out

    async def act(self, reply: str) -> Step:
        """Run the reply's tool calls; no call ends the episode."""
        calls = self.reader.tool_calls(reply)
        if not calls:
            return Step([], done=True)
        results = [await self._run(call) for call in calls]
        return Step([{"role": "tool", "content": content} for content, _ in results],
                    invalid=not all(ok for _, ok in results), tool_calls=len(calls))

    async def _run(self, call) -> tuple[str, bool]:
        """(one call's tool message content, whether it ran): its result, or `{"error": ...}` when it is malformed,
        names no tool or raises."""
        import json

        if call.error:
            return json.dumps({"error": call.error}), False
        fn = self.methods.get(call.name)
        if fn is None:
            return json.dumps({"error": f"Tool {call.name} not found."}), False
        try:
            return _result_text(await bounded(f"tool {call.name} of {self.label}", fn, **call.arguments,
                                              timeout_s=self.timeout_s)), True
        except EnvCallTimeout:
            raise  # a hung tool is a failed sample, not the model's mistake
        except Exception as exc:  # noqa: BLE001 - TRL feeds a tool's exception back to the model
            return json.dumps({"error": str(exc)}), False

    async def env_reward(self) -> float | None:
        """`get_reward()` when the class defines it (the environment owns its reward), else None."""
        fn = getattr(self.env, "get_reward", None)
        if not callable(fn):
            return None
        value = await bounded(f"get_reward of {self.label}", fn, timeout_s=self.timeout_s)
        return float(value)

    async def state(self) -> dict:
        """{}: TRL's contract has no state (the reward functions read the instance itself)."""
        return {}

    async def close(self) -> None:
        """Nothing to release: TRL's contract has no close (a public `close` method would be one of its tools), and
        the instance is dropped with the episode."""
