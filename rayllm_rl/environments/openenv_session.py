"""One episode of an OpenEnv environment: an `Environment` subclass run in this process, or a running server reached
through OpenEnv's own client.

The episode's contract with the workflow (`workflow.EnvWorkflow`), shared with `trl_session.ToolEnvSession`:
`start(row) -> str | None` (the first observation), `act(reply) -> Step` (the next turns, reward, done),
`env_reward()` (the reward the environment itself gave, here the sum of `obs.reward`), `state()` (its state at
the end, {} without one), `tools` (schemas shown in the prompt), `env` (what TRL-style reward functions get as
`environments=[...]`) and `close()`; all async.

In process, `reset` / `step` run in a worker thread, or the environment's own `reset_async` / `step_async` when it
overrides OpenEnv's defaults (which only call the sync ones). Remote, `GenericEnvClient(base_url)` (a WebSocket
session per episode) answers `StepResult(observation: dict, reward, done)`. Every call is bounded (`calls.bounded`).
"""
from __future__ import annotations

import dataclasses
from typing import Any

from rayllm_rl.environments.actions import InvalidAction, ReplyReader, observation_text
from rayllm_rl.environments.calls import bounded


@dataclasses.dataclass
class Step:
    """What one reply did: the turns that follow it (role/content messages; none once done), its reward, whether
    the episode ended, whether the reply held no valid action, and how many tool calls it made."""

    messages: list[dict[str, str]]
    reward: float = 0.0
    done: bool = False
    invalid: bool = False
    tool_calls: int = 0


def own_async(env: Any, name: str) -> Any:
    """`env.<name>` (reset_async / step_async) when a class of the user's defines it, else None: OpenEnv's default
    twin only calls the sync method, in the event loop, which a worker thread does without blocking it."""
    for klass in type(env).__mro__:
        if name in vars(klass):
            return getattr(env, name) if not klass.__module__.startswith("openenv.") else None
    return None


class OpenEnvSession:
    """One episode of `env` (an OpenEnv `Environment`, or a `GenericEnvClient` when `remote`)."""

    def __init__(self, env: Any, *, reader: ReplyReader, action_cls: type | None, tools: list[dict],
                 timeout_s: float, reset_kwargs: dict[str, Any], remote: bool = False, label: str = "") -> None:
        self.env = env
        self.reader = reader
        self.action_cls = action_cls
        self.tools = tools
        self.timeout_s = timeout_s
        self.reset_kwargs = dict(reset_kwargs)
        self.remote = remote
        self.label = label or type(env).__name__
        self.total = 0.0

    async def _call(self, name: str, *args: Any, **kwargs: Any) -> Any:
        fn = getattr(self.env, name) if self.remote else (own_async(self.env, f"{name}_async")
                                                          or getattr(self.env, name))
        return await bounded(f"{name} of {self.label}", fn, *args, timeout_s=self.timeout_s, remote=self.remote,
                             **kwargs)

    async def start(self, row: dict[str, Any]) -> str | None:
        """Reset with the row's seed (and `reset_kwargs`); the first observation's text."""
        obs = await self._call("reset", seed=row.get("seed"), **self.reset_kwargs)
        return observation_text(obs.observation if self.remote else obs)

    async def act(self, reply: str) -> Step:
        """Step with the reply's action; its observation is the next turn (`tool` after a tool call, else `user`)."""
        try:
            action = self.reader.action(reply, None if self.remote else self.action_cls)
        except InvalidAction as exc:
            return Step([{"role": "user", "content": f"Invalid action: {exc}"}], invalid=True)
        obs = await self._call("step", action)
        reward, done = float(obs.reward or 0.0), bool(obs.done)  # StepResult and Observation alike
        self.total += reward
        role = "tool" if self.reader.uses_tools else "user"
        text = observation_text(obs.observation if self.remote else obs)
        return Step([] if done else [{"role": role, "content": text}], reward, done,
                    tool_calls=int(self.reader.uses_tools))

    async def env_reward(self) -> float:
        """The episode's return: the sum of every step's `obs.reward` (None counts 0)."""
        return self.total

    async def state(self) -> dict[str, Any]:
        """The environment's `state` (OpenEnv's `State`: `episode_id`, `step_count`, ...) as a dict, read at the
        episode's end (in process the property, remote the client's `state()`)."""
        if self.remote:
            state = await self._call("state")
        else:
            state = await bounded(f"state of {self.label}", lambda: self.env.state, timeout_s=self.timeout_s)
        return dict(state) if isinstance(state, dict) else state.model_dump()

    async def close(self) -> None:
        """Close the environment (OpenEnv's `close`; the remote client's WebSocket), within the call bound."""
        if callable(getattr(self.env, "close", None)):
            await self._call("close")
