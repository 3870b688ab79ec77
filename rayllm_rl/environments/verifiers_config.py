"""`data.verifiers`: the keys of `task=verifiers` (a verifiers environment of the classic API, verifiers <= 0.3.1).

Checked on the driver before any actor starts (`VerifiersConfig.check`); whether an environment is given at all is
checked with the job's objects (`environments.verifiers_env.resolve_verifiers`), since `train(environment=...)` may
give it.
"""
from __future__ import annotations

import dataclasses
import importlib.util
from typing import Any

from rayllm_rl.config import NonNegInt, PosFloat


def env_module_name(env_id: str) -> str:
    """The module verifiers' `load_environment(env_id)` imports: '-' read as '_', an 'org/' prefix dropped."""
    return env_id.replace("-", "_").split("/")[-1]


@dataclasses.dataclass
class VerifiersConfig:
    """task=verifiers: which environment, its `load_environment` arguments, its replies' tool calls, how many of its
    rows, each rollout's bound."""

    env_id: str = ""
    """The environment's id, loaded with verifiers' own `load_environment(env_id, **env_args)`: an importable module
    (`env_id` with '-' read as '_', an 'org/' prefix dropped) exporting `load_environment(**kwargs) -> Environment`,
    as a pip-installed Environments-Hub package does. Empty: the object given to `train(environment=...)`."""
    env_args: dict[str, Any] = dataclasses.field(default_factory=dict)
    """Keyword arguments of its `load_environment`."""
    tool_parser: str = ""
    """'package.module:function' finding the tool calls in a reply when the environment offers tools: `fn(text) ->
    [(name, arguments dict), ...]`, made OpenAI `tool_calls` for verifiers; empty = Hermes/Qwen
    `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks (agents/openai_proxy.py)."""
    train_size: NonNegInt = 0
    """Rows taken from the environment's dataset (`env.get_dataset(n=train_size)`); 0 = every row."""
    demonstration: str = ""
    """'package.module:function' giving a row's solved rollout for the SFT warm start (`sft.steps`): `fn(row) ->
    [reply, ...]`, the text of each assistant turn in order, with `row` the environment's dataset row (`prompt`,
    `answer`, `info`, ...), played through the environment (`environments.demonstrations`). Empty: none."""
    rollout_timeout_s: PosFloat = 300.0
    """One rollout (every turn, tool call and `env_response` of an episode, and each chat completion); past it the
    sample fails with cause `timeout` (docs/failed-episodes.md). The rubric scores within 30 s (`RewardCaller`'s
    bound)."""

    def check(self) -> None:
        """Errors naming the key: an `env_id` whose module is not importable, a `tool_parser` that does not import."""
        from rayllm_rl.object_path import import_object

        for key in ("tool_parser", "demonstration"):
            path = getattr(self, key)
            if path and not callable(import_object(path, f"data.verifiers.{key}")):
                raise ValueError(f"data.verifiers.{key}={path!r} is not callable")
        if self.env_id and importlib.util.find_spec(env_module_name(self.env_id)) is None:
            raise ValueError(f"data.verifiers.env_id={self.env_id!r}: no module {env_module_name(self.env_id)!r} to "
                             "import (install the environment's package, e.g. `pip install <its package>`; an "
                             "Environments-Hub id needs its package installed first)")
