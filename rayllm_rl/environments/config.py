"""`data.openenv`: the keys of `task=openenv` (an OpenEnv environment, or a TRL `environment_factory` class).

Every key is checked on the driver before any actor starts (`OpenEnvConfig.check`): an import path that does not
import, an environment given two ways or none, a bound out of range each fail naming the key.
"""
from __future__ import annotations

import dataclasses
from typing import Any

from rayllm_rl.config import PosFloat, PosInt


@dataclasses.dataclass
class OpenEnvConfig:
    """task=openenv: which environment, how the model's reply becomes its action, and the rows' prompt."""

    env: str = ""
    """'package.module:Class' of the environment, built once per episode in the env worker: an OpenEnv
    `Environment` subclass (reset / step / state, and their async twins when it has them), or a TRL
    `environment_factory` class (`reset(**row) -> str | None` and public tool methods). Empty: the object given
    to `train(environment=...)` / `GRPOTrainer(environment_factory=...)`, or `base_url`."""
    base_url: str = ""
    """A running OpenEnv server (http://host:port), reached through OpenEnv's own `GenericEnvClient` (its
    WebSocket session API; needs the `openenv` extra). Exclusive with `env`."""
    action_parser: str = ""
    """'package.module:function' turning the model's reply text into the environment's action: `fn(text) ->
    Action` (or a dict of its fields, which a remote environment takes as is). Empty: the reply must be a tool
    call (`tool_parser`) whose arguments are the action's fields. A parser that raises makes an invalid action
    (fed back to the model, counted in `invalid_actions`), not a failed sample. OpenEnv environments only."""
    tool_parser: str = ""
    """'package.module:function' finding the tool calls in the reply: `fn(text) -> [(name, arguments dict), ...]`;
    empty = Hermes/Qwen `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks. A reply with no call
    ends a TRL environment's episode."""
    tool_name: str = "step"
    """The name of the one tool an OpenEnv environment exposes when `action_parser` is empty (its parameters are
    the action's fields)."""
    prompt: str = ""
    """The user message every episode starts with; the environment's first observation (OpenEnv's `reset`, or a
    TRL environment's `reset(**row)` string) is appended to it. Empty: the first observation is the user message."""
    system_prompt: str = ""
    """A system message before the prompt (the tool list, if any, follows it); empty = none."""
    train_size: PosInt = 1024
    """Rows generated: each carries `seed` (`seed` + its index), handed to `reset(seed=...)` (OpenEnv) or as a
    keyword with the row's other fields (TRL: `reset(**row)`). The `data.eval_size` held-out rows follow them
    (seeds `seed + train_size` on), so no held-out episode is ever trained on."""
    seed: int = 0
    """The first row's seed."""
    reset_kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)
    """Extra keywords of every reset (OpenEnv's `reset(seed=, episode_id=, **kwargs)`), e.g. a difficulty."""
    demonstration: str = ""
    """'package.module:function' giving a row's solved episode for the SFT warm start (`sft.steps`): `fn(row) ->
    [reply, ...]`, the text of each assistant turn in order, played through the environment
    (`environments.demonstrations`). Empty: no demonstrations (`sft.steps` > 0 then warns and skips the warm start)."""
    call_timeout_s: PosFloat = 60.0
    """One reset, step or tool call; past it the sample fails with cause `timeout` (docs/failed-episodes.md)."""

    def check(self) -> None:
        """Errors naming the key: both `env` and `base_url`, an import path that does not import, a URL that is
        not http(s)/ws(s). Whether an environment is given at all is checked with the job's objects
        (`environments.source.resolve_source`), since `train(environment=...)` may give it."""
        from rayllm_rl.object_path import import_object

        if self.env and self.base_url:
            raise ValueError(f"data.openenv.env={self.env!r} and data.openenv.base_url={self.base_url!r} both name "
                             "the environment: give one")
        if self.base_url and self.base_url.split("://", 1)[0] not in ("http", "https", "ws", "wss"):
            raise ValueError(f"data.openenv.base_url={self.base_url!r}: expected an http(s):// or ws(s):// URL of a "
                             "running OpenEnv server")
        for key in ("env", "action_parser", "tool_parser", "demonstration"):
            path = getattr(self, key)
            if path and not callable(import_object(path, f"data.openenv.{key}")):
                raise ValueError(f"data.openenv.{key}={path!r} is not callable")
        if not self.tool_name.isidentifier():
            raise ValueError(f"data.openenv.tool_name={self.tool_name!r}: a tool name is an identifier")
