"""The job's environment, resolved once on the driver: which form it is and how each episode gets its own.

The one place that decides the form (`resolve_source`); nothing below it asks again:

- `openenv`: a subclass of OpenEnv's `Environment` (found by its bases' names, so this module needs no `openenv`
  import), run in the env worker's process, one instance per episode;
- `trl`: any other class or zero-argument factory whose instances have `reset` (TRL's `environment_factory`);
- `remote`: `data.openenv.base_url`, a running OpenEnv server, one `GenericEnvClient` session per episode.

The driver builds one probe instance (as TRL does), reads the tools to show in the prompt (a TRL environment's
methods; an OpenEnv action's fields when the reply is read as a tool call, from the Action class or the server's
`/schema`) and the Action class, and fails naming the key or the class when any of it is missing. The resolved
`EnvSource` is small and picklable (the class by reference, or by value when defined in a script or notebook): it
rides to the env workers in the task's workflow.
"""
from __future__ import annotations

import dataclasses
import inspect
import json
import urllib.request
from typing import Any, Callable, Literal

from rayllm_rl.environments.actions import ReplyReader, action_class_of, action_tool
from rayllm_rl.environments.calls import bounded

SCHEMA_TIMEOUT_S = 10.0
"""The driver's one request for a server's `/schema` (its Action's JSON schema)."""


def is_openenv_environment(cls: type) -> bool:
    """Whether `cls` subclasses OpenEnv's `openenv.core.env_server.interfaces.Environment` (by name and module)."""
    return any(k.__name__ == "Environment" and k.__module__.startswith(("openenv.", "openenv_core."))
               for k in cls.__mro__[1:])


@dataclasses.dataclass(frozen=True)
class EnvSource:
    """What builds one episode's session (`open`), with everything the driver resolved."""

    form: Literal["openenv", "trl", "remote"]
    factory: Any
    """The class or zero-argument factory (None for `remote`)."""
    label: str
    """How errors and logs name it: the class's name, or the server's URL."""
    reader: ReplyReader
    tools: tuple[dict, ...] = ()
    """Tool schemas listed in the prompt (OpenAI style); () = none."""
    action_cls: Any = None
    """The OpenEnv Action class a tool call's (or a parser's dict of) fields build; None for `remote` (the fields go
    as a dict) or when it cannot be told and a parser makes the action."""
    owns_reward: bool = True
    """Whether the environment gives a reward of its own (OpenEnv's `obs.reward`; a TRL class's `get_reward`)."""
    base_url: str = ""
    timeout_s: float = 60.0
    reset_kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)

    async def open(self):
        """A new environment and its session (`OpenEnvSession` / `ToolEnvSession`), built within `timeout_s`."""
        from rayllm_rl.environments.openenv_session import OpenEnvSession
        from rayllm_rl.environments.trl_session import ToolEnvSession

        if self.form == "remote":
            from openenv.core.generic_client import GenericEnvClient

            env, remote = GenericEnvClient(base_url=self.base_url, connect_timeout_s=self.timeout_s,
                                           message_timeout_s=self.timeout_s), True
        else:
            env, remote = await bounded(f"constructing {self.label}", self.factory, timeout_s=self.timeout_s), False
        if self.form == "trl":
            return ToolEnvSession(env, reader=self.reader, tools=list(self.tools), timeout_s=self.timeout_s,
                                  label=self.label)
        return OpenEnvSession(env, reader=self.reader, action_cls=self.action_cls, tools=list(self.tools),
                              timeout_s=self.timeout_s, reset_kwargs=self.reset_kwargs, remote=remote,
                              label=self.label)


def _parsers(cfg: Any) -> tuple[Callable | None, Callable | None]:
    from rayllm_rl.object_path import import_object

    return tuple(import_object(p, f"data.openenv.{k}") if p else None  # type: ignore[return-value]
                 for k, p in (("action_parser", cfg.action_parser), ("tool_parser", cfg.tool_parser)))


def _server_action_schema(base_url: str) -> dict[str, Any]:
    """The `action` JSON schema a running OpenEnv server publishes at GET /schema; ValueError naming the key when
    it cannot be read."""
    url = base_url.replace("ws://", "http://").replace("wss://", "https://").rstrip("/") + "/schema"
    try:
        with urllib.request.urlopen(url, timeout=SCHEMA_TIMEOUT_S) as response:
            return json.loads(response.read())["action"]
    except Exception as exc:  # noqa: BLE001 - unreachable server, not an OpenEnv server, no schema
        raise ValueError(f"data.openenv.base_url={base_url!r}: cannot read the action schema at {url} "
                         f"({type(exc).__name__}: {exc}); is the server running? (or set data.openenv.action_parser, "
                         "which needs no schema)") from exc


def resolve_source(cfg: Any, given: Any = None) -> EnvSource:
    """The `EnvSource` of `data.openenv` (`cfg`) and the object given in Python (`given`: a class or zero-argument
    factory, from `train(environment=...)`), checked. ValueError naming the key for a missing or doubly given
    environment, a TRL class without `reset` or with an undocumented tool, an OpenEnv environment whose Action
    class cannot be told when the reply is read as a tool call, or a parser given to a TRL environment."""
    from rayllm_rl.object_path import import_object

    action_parser, tool_parser = _parsers(cfg)
    reader = ReplyReader(action_parser, tool_parser, cfg.tool_name)
    common = {"reader": reader, "timeout_s": cfg.call_timeout_s, "reset_kwargs": dict(cfg.reset_kwargs)}
    named = [k for k, v in (("data.openenv.env", cfg.env), ("data.openenv.base_url", cfg.base_url),
                            ("environment=", given is not None)) if v]
    if len(named) != 1:
        raise ValueError("task=openenv needs one environment: data.openenv.env='package.module:Class' (an OpenEnv "
                         "Environment subclass or a TRL environment_factory class), data.openenv.base_url (a running "
                         "OpenEnv server) or train(environment=...) / GRPOTrainer(environment_factory=...); "
                         + (f"got {' and '.join(named)}" if named else "none was given"))
    if cfg.base_url:
        tools = () if action_parser else (action_tool(cfg.tool_name, _server_action_schema(cfg.base_url)),)
        return EnvSource("remote", None, cfg.base_url, base_url=cfg.base_url, tools=tools, **common)
    factory = import_object(cfg.env, "data.openenv.env") if cfg.env else given
    key = f"data.openenv.env={cfg.env!r}" if cfg.env else "environment="
    if not callable(factory):
        raise ValueError(f"{key} is a {type(factory).__name__}: give the environment's class (or a factory with no "
                         "arguments), not an instance: every episode builds its own")
    probe = factory()  # the driver's probe, as TRL's trainer builds one: a class that cannot be built fails here
    cls = type(probe)
    label = cls.__name__
    if is_openenv_environment(cls):
        action_cls = action_class_of(cls)
        if not action_parser and action_cls is None:
            raise ValueError(f"{key}: cannot tell the Action class of {label} (no Environment[Action, ...] base and no "
                             "annotation on step's action) to read the reply's tool call; annotate step(self, action: "
                             "MyAction) or set data.openenv.action_parser")
        if callable(getattr(probe, "close", None)):
            probe.close()
        tools = () if action_parser else (action_tool(cfg.tool_name, action_cls.model_json_schema(),
                                                      inspect.getdoc(action_cls) or ""),)
        return EnvSource("openenv", factory, label, tools=tools, action_cls=action_cls, **common)
    if not callable(getattr(probe, "reset", None)):
        raise ValueError(f"{key}: {label} is neither an OpenEnv Environment subclass nor a TRL environment_factory "
                         "class (it has no reset method)")
    if action_parser:
        raise ValueError(f"data.openenv.action_parser={cfg.action_parser!r} reads the action of an OpenEnv "
                         f"environment; {label} is a TRL environment, whose replies are tool calls (data.openenv."
                         "tool_parser)")
    from rayllm_rl.environments.trl_session import tool_schemas

    return EnvSource("trl", factory, label, tools=tuple(tool_schemas(cls)),
                     owns_reward=callable(getattr(probe, "get_reward", None)), **common)
