"""The model's reply -> what the environment takes: an OpenEnv `Action` (by a parser, or from a tool call) or a TRL
environment's tool calls; and the tool schemas shown in the prompt.

One place decides how a reply is read (`ReplyReader`): `data.openenv.action_parser` (text -> Action or dict) when
set, else a tool call found by `data.openenv.tool_parser` (default: Hermes/Qwen `<tool_call>` blocks, the MCP tools'
parser) whose arguments are the action's fields. A reply that yields no valid action is an `InvalidAction`: the
model's mistake, fed back to it as the next turn, not the environment's failure.
"""
from __future__ import annotations

import json
import typing
from typing import Any, Callable, Sequence

from rayllm_rl.tools.mcp_tools import ToolCall, parse_tool_calls

_OBSERVATION_BOOKKEEPING = ("done", "reward", "metadata")
"""Fields of an OpenEnv Observation (and Action) that are the protocol's, not what the model reads or writes."""


class InvalidAction(ValueError):
    """The reply holds no valid action (no or a malformed tool call, a parser that refused it, fields the action
    rejects): fed back to the model, counted in `invalid_actions`."""


def user_tool_calls(parser: Callable[[str], Any], text: str) -> list[ToolCall]:
    """The calls a user's `tool_parser` found: `[(name, arguments), ...]` as `ToolCall`s; TypeError naming the
    parser for anything else (a bug of the parser, so the sample fails as `raised`)."""
    out = []
    for item in parser(text) or ():
        if not (isinstance(item, Sequence) and len(item) == 2 and isinstance(item[0], str)
                and isinstance(item[1], dict)):
            raise TypeError(f"tool_parser {getattr(parser, '__name__', parser)!r} returned {item!r:.100}; expected "
                            "a list of (name: str, arguments: dict)")
        out.append(ToolCall(item[0], dict(item[1])))
    return out


class ReplyReader:
    """Reads a reply with the job's parsers (None = the defaults: tool calls in `<tool_call>` blocks)."""

    def __init__(self, action_parser: Callable[[str], Any] | None = None,
                 tool_parser: Callable[[str], Any] | None = None, tool_name: str = "step") -> None:
        self.action_parser = action_parser
        self.tool_parser = tool_parser
        self.tool_name = tool_name

    def tool_calls(self, text: str) -> list[ToolCall]:
        """Every tool call of `text`, in order; a malformed one carries its `error`."""
        return user_tool_calls(self.tool_parser, text) if self.tool_parser else parse_tool_calls(text)

    def action(self, text: str, action_cls: type | None) -> Any:
        """The OpenEnv action of reply `text`: the parser's result (a dict of fields becomes `action_cls(**fields)`),
        or the one tool call's arguments as `action_cls(**arguments)`; with `action_cls` None (a remote environment)
        the fields as a dict. InvalidAction otherwise."""
        if self.action_parser is not None:
            try:
                action = self.action_parser(text)
            except Exception as exc:  # noqa: BLE001 - the parser refusing a reply is the model's invalid action
                raise InvalidAction(f"the reply is not an action ({type(exc).__name__}: {exc})") from exc
            if action is None:
                raise InvalidAction("the reply is not an action")
            return self._build(action_cls, action) if isinstance(action, dict) else action
        calls = self.tool_calls(text)
        if not calls:
            raise InvalidAction(f"no tool call: call the tool {self.tool_name!r} with the action's fields")
        call = calls[0]
        if call.error or call.name != self.tool_name:
            raise InvalidAction(call.error or f"unknown tool {call.name!r}; the tool is {self.tool_name!r}")
        return self._build(action_cls, call.arguments)

    @staticmethod
    def _build(action_cls: type | None, fields: dict[str, Any]) -> Any:
        """`action_cls(**fields)` (InvalidAction naming what it refused), or the fields as a dict without a class."""
        if action_cls is None:
            return dict(fields)
        try:
            return action_cls(**fields)
        except Exception as exc:  # noqa: BLE001 - pydantic's ValidationError: fields the action refuses
            raise InvalidAction(f"{action_cls.__name__} refused the arguments: {exc}") from exc

    @property
    def uses_tools(self) -> bool:
        """Whether an OpenEnv environment's action comes from a tool call (so the prompt lists the tool)."""
        return self.action_parser is None


def action_class_of(env_cls: type) -> type | None:
    """The Action class an OpenEnv environment class takes: `Environment[ActT, ...]`'s first argument in its bases,
    else the annotation of `step`'s `action`; None when neither says."""
    for klass in env_cls.__mro__:
        for base in getattr(klass, "__orig_bases__", ()):
            args = typing.get_args(base)
            if args and isinstance(args[0], type):
                return args[0]
    try:
        hint = typing.get_type_hints(env_cls.step).get("action")
    except Exception:  # noqa: BLE001 - an annotation that does not resolve says nothing
        hint = None
    return hint if isinstance(hint, type) else None


def action_tool(name: str, schema: dict[str, Any], description: str = "") -> dict[str, Any]:
    """The OpenAI-style tool of an action whose JSON schema is `schema` (a pydantic `model_json_schema()`, or a
    server's `/schema` `action` entry), without the protocol's `metadata` field."""
    properties = {k: v for k, v in (schema.get("properties") or {}).items() if k not in _OBSERVATION_BOOKKEEPING}
    required = [k for k in schema.get("required") or () if k in properties]
    params: dict[str, Any] = {"type": "object", "properties": properties, "required": required}
    if schema.get("$defs"):
        params["$defs"] = schema["$defs"]
    return {"type": "function", "function": {"name": name, "description": description or schema.get(
        "description", "") or "Take one action in the environment.", "parameters": params}}


def observation_fields(obs: Any) -> dict[str, Any]:
    """What an observation says to the model: its fields but done / reward / metadata (a pydantic Observation, a
    remote server's dict, or an object with attributes)."""
    if isinstance(obs, dict):
        data = obs
    elif hasattr(obs, "model_dump"):
        data = obs.model_dump()
    else:
        data = dict(vars(obs))
    return {k: v for k, v in data.items() if k not in _OBSERVATION_BOOKKEEPING}


def observation_text(obs: Any) -> str:
    """The observation as the next turn's text: a string observation as is; one field as its value; several as
    JSON (the model sees every field the environment sent)."""
    if isinstance(obs, str):
        return obs
    fields = observation_fields(obs)
    if len(fields) == 1:
        value = next(iter(fields.values()))
        return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False, default=str)
    return json.dumps(fields, ensure_ascii=False, default=str)
