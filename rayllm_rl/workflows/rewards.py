"""Calling user reward functions safely: sync or async, with a timeout, never crashing a worker."""
from __future__ import annotations

import asyncio
import inspect
import logging
from typing import Any, Callable

log = logging.getLogger(__name__)


class RewardCaller:
    """Wraps `reward_fn(prompt, completions, prompt_ids, completion_ids, **row) -> float`.

    A reward that raises, returns a non-number, or exceeds `timeout_s` yields `0.0`, a logged
    warning, and a counter increment (`num_errors`, `num_timeouts`); the episode goes on.
    """

    def __init__(self, reward_fn: Callable[..., Any], timeout_s: float = 30.0, in_thread: bool = False):
        self.reward_fn = reward_fn
        self.timeout_s = timeout_s
        self.in_thread = in_thread
        """Run a sync reward in a worker thread (needed for the timeout to bite on slow code)."""
        self.is_async = inspect.iscoroutinefunction(reward_fn) or inspect.iscoroutinefunction(
            getattr(reward_fn, "__call__", None)
        )
        self.num_calls = 0
        self.num_errors = 0
        self.num_timeouts = 0

    async def __call__(self, prompt: str, completions: str, prompt_ids: list[int],
                       completion_ids: list[int], **row: Any) -> float:
        self.num_calls += 1
        name = getattr(self.reward_fn, "__name__", type(self.reward_fn).__name__)
        try:
            if self.is_async:
                coro = self.reward_fn(prompt, completions, prompt_ids, completion_ids, **row)
                value = await asyncio.wait_for(coro, self.timeout_s)
            elif self.in_thread:
                call = asyncio.to_thread(self.reward_fn, prompt, completions, prompt_ids, completion_ids, **row)
                value = await asyncio.wait_for(call, self.timeout_s)
            else:
                value = self.reward_fn(prompt, completions, prompt_ids, completion_ids, **row)
            return float(value)
        except asyncio.TimeoutError:
            self.num_timeouts += 1
            log.warning("reward function %s timed out after %.1fs; reward set to 0", name, self.timeout_s)
        except Exception as exc:  # noqa: BLE001 - a user reward must never crash the worker
            self.num_errors += 1
            log.warning("reward function %s raised %s: %s; reward set to 0", name, type(exc).__name__, exc)
        return 0.0

    def counters(self) -> dict[str, int]:
        return {"reward_calls": self.num_calls, "reward_errors": self.num_errors, "reward_timeouts": self.num_timeouts}
