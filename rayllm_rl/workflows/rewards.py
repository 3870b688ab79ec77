"""Calling user reward functions safely: sync or async, with a timeout, never crashing a worker.

A reward function has AReaL's signature `reward_fn(prompt, completions, prompt_ids,
completion_ids, **row)` and returns either a number or a mapping with a "reward" entry plus named
components (e.g. GSM8K's `reward_answer`, `reward_think`, `reward_right`, `reward_contained`,
`success`). Components travel with the trajectory as per-sequence keys and are reported as
metrics; only "reward" is optimised. A reward that fails is not a 0: its scores carry the
`failed` key (data/failures.py), which marks the trajectory failed for `rollout.on_failure`.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import logging
import math
from typing import Any, Callable, Mapping

from rayllm_rl.data.failures import FAILED_KEY, code_of

log = logging.getLogger(__name__)


REWARD_ARGS = frozenset({"prompt", "completions", "prompt_ids", "completion_ids"})
"""The positional arguments of a reward function: a row field of the same name is not passed as a keyword."""


def component_keys_of(reward_fn: Callable[..., Any]) -> tuple[str, ...]:
    """The component names a reward function declares (`component_keys` attribute), else ()."""
    return tuple(getattr(reward_fn, "component_keys", ()) or ())


class NonFiniteReward(ValueError):
    """A reward function returned NaN or an infinity (for the reward or a component)."""


class RewardCaller:
    """Wraps a reward function: `await caller.score(...)` -> {"reward": float, **components}.

    A reward that raises or returns a non-number / a mapping without "reward" (`num_errors`),
    returns NaN or an infinity as its reward or a component (`num_nonfinite`), or exceeds
    `timeout_s` or raises `TimeoutError` (the bound of a function that keeps its own, `bounds_own_time`:
    `num_timeouts`) yields a *failed* score: reward 0.0 (components 0.0) plus
    `failed` = the code of its cause (reward_raised, reward_nonfinite, reward_timeout;
    data/failures.py), a logged warning and an increment of that counter; the episode goes on and
    `rollout.on_failure` decides what the trajectory does (`zero` keeps the 0). A result that
    already carries `failed` (a `UserReward` or `CombinedReward` whose part failed) keeps it.
    The components returned are exactly `component_keys` (from the reward function's
    `component_keys` attribute, else learned from its first mapping result), so every trajectory
    of a task has the same keys; missing ones read 0.0 and undeclared extras are dropped. A sync
    reward runs in a worker thread when `in_thread` (the default) so its timeout bites; a thread
    cannot be killed, so CPU-bound checkers that may not terminate should isolate themselves in a
    process (see MathVerifier).
    """

    def __init__(self, reward_fn: Callable[..., Any], timeout_s: float = 30.0, in_thread: bool = True):
        self.reward_fn = reward_fn
        # a reward function that bounds its own time (e.g. MathRewardFn kills its verifier) gets no outer timeout
        self.timeout_s = None if getattr(reward_fn, "bounds_own_time", False) else timeout_s
        self.in_thread = in_thread
        self.is_async = inspect.iscoroutinefunction(reward_fn) or inspect.iscoroutinefunction(
            getattr(reward_fn, "__call__", None)
        )
        self.component_keys: tuple[str, ...] | None = component_keys_of(reward_fn) or None
        self.num_calls = 0
        self.num_errors = 0
        self.num_timeouts = 0
        self.num_nonfinite = 0

    @property
    def name(self) -> str:
        return getattr(self.reward_fn, "__name__", type(self.reward_fn).__name__)

    def normalize(self, value: Any) -> dict[str, float]:
        """A reward function's result as {"reward", *component_keys} floats.

        ValueError if malformed (not a number, a mapping without "reward"); NonFiniteReward if the
        reward or a component is NaN or infinite."""
        failed = 0.0
        if isinstance(value, Mapping):
            if "reward" not in value:
                raise ValueError(f"reward function {self.name} returned a mapping without 'reward': {sorted(value)}")
            if self.component_keys is None:
                self.component_keys = tuple(k for k in value if k not in ("reward", FAILED_KEY))
            out = {"reward": self._number("reward", value["reward"])}
            out.update({k: self._number(k, value.get(k, 0.0)) for k in self.component_keys})
            failed = self._number(FAILED_KEY, value.get(FAILED_KEY, 0.0))
        else:
            out = {"reward": self._number("reward", value)}
            out.update({k: 0.0 for k in self.component_keys or ()})
        bad = {k: v for k, v in out.items() if not math.isfinite(v)}
        if bad:
            raise NonFiniteReward(f"reward function {self.name} returned non-finite {bad}")
        return {**out, FAILED_KEY: failed} if failed else out

    def _number(self, key: str, value: Any) -> float:
        """`value` as a float; ValueError naming `key` for None, a string or anything float() refuses."""
        if value is None or isinstance(value, (str, bytes)):
            raise ValueError(f"reward function {self.name} returned {value!r:.80} for {key!r}; expected a number")
        try:
            return float(value)
        except (TypeError, ValueError) as err:
            raise ValueError(f"reward function {self.name} returned {type(value).__name__} {value!r:.80} "
                             f"for {key!r}; expected a number") from err

    def failed(self) -> dict[str, float]:
        """Reward and components 0.0 (what a trajectory reads before its reward is known)."""
        return {"reward": 0.0, **{k: 0.0 for k in self.component_keys or ()}}

    def failure(self, cause: str) -> dict[str, float]:
        """`failed()` marked failed with `cause` (data/failures.py `CAUSES`): the trajectory is a failed sample."""
        return {**self.failed(), FAILED_KEY: float(code_of(cause))}

    async def score(self, prompt: str, completions: str, prompt_ids: list[int],
                    completion_ids: list[int], **row: Any) -> dict[str, float]:
        self.num_calls += 1
        try:
            if self.is_async:
                coro = self.reward_fn(prompt, completions, prompt_ids, completion_ids, **row)
                value = await asyncio.wait_for(coro, self.timeout_s)
            elif self.in_thread:
                call = asyncio.to_thread(self.reward_fn, prompt, completions, prompt_ids, completion_ids, **row)
                value = await asyncio.wait_for(call, self.timeout_s)
            else:
                value = self.reward_fn(prompt, completions, prompt_ids, completion_ids, **row)
            return self.normalize(value)
        except asyncio.TimeoutError as exc:  # our bound, or one the reward function keeps itself (it raises)
            return self._timed_out(exc)
        except NonFiniteReward as exc:
            return self._nonfinite(exc)
        except Exception as exc:  # noqa: BLE001 - a user reward must never crash the worker
            return self._raised(exc)

    def score_sync(self, prompt: str, completions: str, prompt_ids: list[int],
                   completion_ids: list[int], **row: Any) -> dict[str, float]:
        """`score` for callers without an event loop (ChatEnv transforms); same timeout and counters."""
        if self.is_async:
            return asyncio.run(self.score(prompt, completions, prompt_ids, completion_ids, **row))
        self.num_calls += 1
        pool = concurrent.futures.ThreadPoolExecutor(max_workers=1)
        try:
            fut = pool.submit(self.reward_fn, prompt, completions, prompt_ids, completion_ids, **row)
            return self.normalize(fut.result(timeout=self.timeout_s))
        except concurrent.futures.TimeoutError as exc:
            return self._timed_out(exc)
        except NonFiniteReward as exc:
            return self._nonfinite(exc)
        except Exception as exc:  # noqa: BLE001
            return self._raised(exc)
        finally:
            pool.shutdown(wait=False)

    def _timed_out(self, exc: BaseException) -> dict[str, float]:
        """A failed score of cause `reward_timeout`: our bound ran out (`exc` says nothing), or the reward function's
        own did (it raised `TimeoutError` saying which, e.g. MathRewardFn's math-verify check)."""
        self.num_timeouts += 1
        bound = str(exc) or f"after {self.timeout_s:.1f}s"
        log.warning("reward function %s timed out (%s); the trajectory failed (reward_timeout)", self.name, bound)
        return self.failure("reward_timeout")

    def _nonfinite(self, exc: NonFiniteReward) -> dict[str, float]:
        self.num_nonfinite += 1
        log.warning("%s; the trajectory failed (reward_nonfinite)", exc)
        return self.failure("reward_nonfinite")

    def _raised(self, exc: Exception) -> dict[str, float]:
        self.num_errors += 1
        log.warning("reward function %s raised %s: %s; the trajectory failed (reward_raised)", self.name,
                    type(exc).__name__, exc)
        return self.failure("reward_raised")

    async def __call__(self, prompt: str, completions: str, prompt_ids: list[int],
                       completion_ids: list[int], **row: Any) -> float:
        """The scalar reward only (see `score` for the components)."""
        return (await self.score(prompt, completions, prompt_ids, completion_ids, **row))["reward"]

    def counters(self) -> dict[str, int]:
        """Calls and failures by kind, as reported in a run's summary (`reward_failures`), plus the reward
        function's own `counters()` if it has them (a `CombinedReward`'s parts; a shared name adds up)."""
        out = {"reward_calls": self.num_calls, "reward_errors": self.num_errors, "reward_timeouts": self.num_timeouts,
               "reward_nonfinite": self.num_nonfinite}
        inner = getattr(self.reward_fn, "counters", None)
        for key, value in (inner() if callable(inner) else {}).items():
            out[key] = out.get(key, 0) + value
        return out


def workflow_reward_counters(workflow) -> dict[str, int]:
    """The reward calls and failures of `workflow.reward` (a RewardCaller, or anything with `counters()`), for the
    summary's `reward_failures`; {} when it has none (a workflow of the user's own may keep anything there)."""
    counters = getattr(getattr(workflow, "reward", None), "counters", None)
    return dict(counters()) if callable(counters) else {}
