"""The user's reward function(s) as one task reward, and their check on a probe row before any actor starts.

Each function has the project's per-completion contract, TRL's keyword columns:

    fn(prompt, completion, prompt_ids, completion_ids, **columns) -> float | {"reward": float, **components}

called positionally for the first four, the row's columns (all but the prompt column) as keywords, sync or
async. One function's result is the reward as it is (its components logged as the built-in ones are).
Several are combined TRL's way (`reward_weights`): the reward is the weighted sum, and each function's own
value is logged as the component `reward_<name>` (its components as `<name>_<component>`). Each function
runs through its own `RewardCaller`: one that raises, hangs past its timeout or returns garbage is counted
(`reward_errors`, ...; with several, `reward_<name>_errors`, ...) and marks the trajectory failed (the `failed` key
of data/failures.py; `rollout.on_failure` decides what that does), never crashing the episode.
"""
from __future__ import annotations

import asyncio
import inspect
import re
from typing import Any, Callable, Mapping, Sequence

from rayllm_rl.data.failures import FAILED_KEY, score_failure
from rayllm_rl.workflows.rewards import RewardCaller

PROBE_COMPLETION = ""
"""The completion the probe scores: a reward must score any text, the empty one too."""

PROBE_TIMEOUT_S = 30.0
"""How long the probe waits for one call (a RewardCaller's default timeout)."""


def reward_names(fns: Sequence[Callable[..., Any]]) -> tuple[str, ...]:
    """A distinct identifier per function: its `__name__` (a callable object: its class name), `<lambda>` as
    `lambda`, repeats numbered (`score`, `score_2`)."""
    out: list[str] = []
    for fn in fns:
        raw = getattr(fn, "__name__", None) or type(fn).__name__
        name = re.sub(r"\W+", "_", raw).strip("_") or "reward"
        base, n = name, 2
        while name in out:
            name, n = f"{base}_{n}", n + 1
        out.append(name)
    return tuple(out)


class UserReward:
    """`fns` weighted by `weights` (one function: its result as it is, times its weight) as an AReaL-signature
    reward; `columns`: the row fields each function gets as keywords (None: every field)."""

    bounds_own_time = True
    """Each function has its own RewardCaller and timeout: the workflow adds none around them."""

    def __init__(self, fns: Sequence[Callable[..., Any]], weights: Sequence[float] | None = None,
                 columns: Sequence[str] | None = None, timeout_s: float = 30.0) -> None:
        self.fns = tuple(fns)
        if not self.fns:
            raise ValueError("UserReward needs at least one reward function")
        self.weights = tuple(float(w) for w in (weights if weights is not None else [1.0] * len(self.fns)))
        if len(self.weights) != len(self.fns):
            raise ValueError(f"{len(self.weights)} reward weights for {len(self.fns)} reward functions")
        self.names = reward_names(self.fns)
        self.columns = None if columns is None else tuple(columns)
        self.callers = [RewardCaller(fn, timeout_s=timeout_s) for fn in self.fns]

    @property
    def __name__(self) -> str:  # what a RewardCaller around it names in its warnings
        return "+".join(self.names)

    @property
    def component_keys(self) -> tuple[str, ...]:
        """The components every result carries, once known (declared by the functions or by `declare`)."""
        if len(self.callers) == 1:
            return tuple(self.callers[0].component_keys or ())
        return tuple(k for name, caller in zip(self.names, self.callers)
                     for k in (f"reward_{name}", *(f"{name}_{c}" for c in caller.component_keys or ())))

    def declare(self, per_fn: Sequence[Sequence[str]]) -> None:
        """Fix each function's component names (what it returned on the probe row), so that every trajectory
        carries the same keys from the first one on."""
        for caller, keys in zip(self.callers, per_fn):
            caller.component_keys = tuple(keys)

    def row_kwargs(self, row: Mapping[str, Any]) -> dict[str, Any]:
        """The keyword arguments the functions get from a row."""
        return dict(row) if self.columns is None else {k: row[k] for k in self.columns if k in row}

    async def __call__(self, prompt: str, completions: str, prompt_ids: Any, completion_ids: Any,
                       **row: Any) -> dict[str, float]:
        kwargs = self.row_kwargs(row)
        results = await asyncio.gather(*[c.score(prompt, completions, prompt_ids, completion_ids, **kwargs)
                                         for c in self.callers])
        if len(results) == 1:
            return {**results[0], "reward": self.weights[0] * results[0]["reward"]}
        out = {"reward": sum(w * r["reward"] for w, r in zip(self.weights, results))}
        for name, result in zip(self.names, results):
            out[f"reward_{name}"] = result["reward"]
            out.update({f"{name}_{k}": v for k, v in result.items() if k not in ("reward", FAILED_KEY)})
        failed = [score_failure(r) for r in results if score_failure(r)]
        return {**out, FAILED_KEY: failed[0]} if failed else out  # one function failed: the sum is no reward

    def counters(self) -> dict[str, int]:
        """Failures by kind: one function's add to the workflow's `reward_errors` etc.; several are told apart as
        `reward_<name>_errors`, `reward_<name>_timeouts`, `reward_<name>_nonfinite`."""
        if len(self.callers) == 1:
            return {k: v for k, v in self.callers[0].counters().items() if k != "reward_calls"}
        return {f"reward_{name}_{k.removeprefix('reward_')}": v for name, caller in zip(self.names, self.callers)
                for k, v in caller.counters().items() if k != "reward_calls"}

    def __repr__(self) -> str:
        return f"UserReward({', '.join(f'{n}*{w:g}' for n, w in zip(self.names, self.weights))})"


def check_call(fn: Callable[..., Any], where: str, kwargs: Mapping[str, Any]) -> None:
    """ValueError naming `where` when `fn(prompt, completion, prompt_ids, completion_ids, **kwargs)` cannot bind."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin without a signature: the probe call tells
        return
    try:
        signature.bind("", "", [], [], **kwargs)
    except TypeError as err:
        raise ValueError(f"{where}: cannot be called as fn(prompt, completion, prompt_ids, completion_ids, **columns) "
                         f"with the columns {sorted(kwargs)}: {err} (its signature: {signature}); take the four "
                         "positional arguments and the columns you need, plus **kwargs for the rest") from None


def probe(fn: Callable[..., Any], where: str, prompt: str, kwargs: Mapping[str, Any],
          timeout_s: float = PROBE_TIMEOUT_S) -> tuple[str, ...]:
    """Call `fn` once on a probe row (`prompt`, the empty completion, no ids, `kwargs`) with a timeout: its
    component names if it returns a number or a mapping with a numeric "reward"; else ValueError naming
    `where` and what it did (raised, timed out, returned something else)."""
    from rayllm_rl.loop_thread import run_bounded

    check_call(fn, where, kwargs)
    caller = RewardCaller(fn)

    def call():
        value = fn(prompt, PROBE_COMPLETION, [], [], **kwargs)
        return asyncio.run(value) if inspect.isawaitable(value) else value

    try:
        value = run_bounded(call, timeout_s, f"{where} on the probe row")
    except TimeoutError as err:
        raise ValueError(f"{where}: {err}: a reward must return within {timeout_s:g}s") from None
    except Exception as err:  # noqa: BLE001 - the user's code: say what it raised
        raise ValueError(f"{where} raised {type(err).__name__}: {err} on the probe (the first training row's columns "
                         f"{sorted(kwargs)}, completion {PROBE_COMPLETION!r}); a reward must score any completion, "
                         "the empty one too") from err
    try:
        caller.normalize(value)
    except ValueError as err:
        raise ValueError(f"{where} returned {type(value).__name__} {value!r:.120} on the probe row: expected a float, "
                         f"or a dict {{'reward': float, **components}} ({err})") from None
    return tuple(caller.component_keys or ())
