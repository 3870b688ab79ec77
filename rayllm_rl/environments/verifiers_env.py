"""A verifiers environment (classic API, verifiers <= 0.3.1) as the job's environment: loading it, its rows, its
rubric as our reward.

- `resolve_verifiers` (driver, once): the environment from `data.verifiers.env_id` (verifiers' own
  `load_environment(env_id, **env_args)`) or the object given to `train(environment=...)`, checked: a
  `MultiTurnEnv` (`SingleTurnEnv` and `ToolEnv` are ones), a rubric that scores one rollout alone. The result,
  `VerifiersSource`, holds the environment object and rides to the env workers in the task's workflow (pickled to
  Ray's): an environment is built only on the driver, since verifiers' `Environment.__post_init__` installs
  SIGINT / SIGTERM handlers, which a Ray actor's thread cannot (and which `load_environment` here gives back to
  the job: `_keeping_signals`).
- `rows`: the environment's dataset (`env.get_dataset()`), each row carried whole as JSON (`vf_input`, what
  verifiers' `rollout(input, ...)` takes) beside its prompt chat (`messages`, for the logs and traces).
- `RubricReward`: the rubric's score of a finished rollout (`rubric.score_rollout(state)`): `state["reward"]` is
  the reward, each function's value (`state["metrics"]`) a component `reward_<name>`. verifiers logs a rubric
  function that raises and scores it 0; here its rubrics' functions are wrapped (`strict_rubric`) so that the
  raise reaches the `RewardCaller`, which fails the sample with cause `reward_raised` (never a silent 0).

Nothing here imports verifiers at module level: `is_verifiers_environment` reads class names.
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import inspect
import json
import signal
import threading
from typing import Any, Iterator

_RAISED: contextvars.ContextVar[list | None] = contextvars.ContextVar("rayllm_vf_rubric_raised", default=None)
"""While `RubricReward` scores: the (function name, exception) of each rubric function that raised."""


def is_verifiers_environment(obj: Any) -> bool:
    """Whether `obj` is an instance of verifiers' (classic) `Environment` (by its bases' names and modules)."""
    return any(k.__name__ == "Environment" and k.__module__.startswith("verifiers.") for k in type(obj).__mro__)


def rubrics_of(rubric: Any) -> list[Any]:
    """`rubric` and every rubric a `RubricGroup` holds, depth first."""
    return [rubric, *(r for sub in getattr(rubric, "rubrics", ()) or () for r in rubrics_of(sub))]


def _raising(fn: Any) -> Any:
    """`fn` (a rubric function, sync or async) recording what it raises in `_RAISED` before verifiers catches it.
    `functools.wraps` keeps its name and (through `__wrapped__`) the signature verifiers reads to pass arguments. The
    wrapper reaches `_RAISED` only through the module-level `_note` (which pickles by reference), so an environment
    whose rubric is made strict on the driver (the held-out evaluation's workflow) still pickles to the env workers."""
    if inspect.iscoroutinefunction(fn):
        @functools.wraps(fn)
        async def wrapper(*args: Any, **kwargs: Any) -> Any:
            try:
                return await fn(*args, **kwargs)
            except Exception as exc:
                _note(fn, exc)
                raise
    else:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            try:
                result = fn(*args, **kwargs)
            except Exception as exc:
                _note(fn, exc)
                raise
            return _noted(result, fn) if inspect.isawaitable(result) else result
    wrapper.rayllm_strict = True
    return wrapper


def _note(fn: Any, exc: Exception) -> None:
    """Record that rubric function `fn` raised `exc`, while `RubricReward` scores (`_RAISED` set)."""
    raised = _RAISED.get()
    if raised is not None:
        raised.append((getattr(fn, "__name__", repr(fn)), exc))


async def _noted(awaitable: Any, fn: Any) -> Any:
    try:
        return await awaitable
    except Exception as exc:
        _note(fn, exc)
        raise


def strict_rubric(rubric: Any) -> Any:
    """`rubric` with every function of it (and of the rubrics it groups) wrapped by `_raising`, once."""
    for r in rubrics_of(rubric):
        r.funcs = [f if getattr(f, "rayllm_strict", False) else _raising(f) for f in r.funcs]
    return rubric


class RubricFunctionError(RuntimeError):
    """A rubric function raised: the sample fails (cause `reward_raised`, through `RewardCaller`)."""


def component_names(rubric: Any) -> tuple[str, ...]:
    """`reward_<name>` of every function of the rubric (its weighted rewards and its metrics), in its order."""
    names = [getattr(f, "__name__", f"fn{i}") for r in rubrics_of(rubric) for i, f in enumerate(r.funcs)]
    return tuple(dict.fromkeys(f"reward_{n}" for n in names))


class RubricReward:
    """Our reward function over a verifiers rubric: `reward(prompt, completions, prompt_ids, completion_ids, *,
    state, rubric)` -> {"reward": state["reward"], "reward_<function>": its value, ...} after
    `rubric.score_rollout(state)`; RubricFunctionError when one of the rubric's functions raised."""

    def __init__(self, component_keys: tuple[str, ...]) -> None:
        self.component_keys = component_keys
        """Declared for `RewardCaller`: every trajectory carries the same components."""
        self.__name__ = "verifiers_rubric"

    async def __call__(self, prompt: str, completions: str, prompt_ids: list[int], completion_ids: list[int], *,
                       state: Any, rubric: Any, **row: Any) -> dict[str, float]:
        token = _RAISED.set([])
        try:
            await rubric.score_rollout(state)
            raised = list(_RAISED.get() or ())
        finally:
            _RAISED.reset(token)
        if raised:
            name, exc = raised[0]
            raise RubricFunctionError(f"rubric function {name} raised {type(exc).__name__}: {exc}") from exc
        metrics = {f"reward_{k}": float(v) for k, v in (state.get("metrics") or {}).items()}
        return {"reward": float(state["reward"]), **metrics}


@contextlib.contextmanager
def _keeping_signals() -> Iterator[None]:
    """The process's SIGINT / SIGTERM handlers as they were before the block (verifiers' `Environment` replaces them
    with its own teardown and `exit(143)`; the job's graceful stop keeps its own)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)


def load_environment(env_id: str, env_args: dict[str, Any]) -> Any:
    """verifiers' own `load_environment(env_id, **env_args)`, the job's signal handlers kept."""
    import verifiers as vf

    with _keeping_signals():
        return vf.load_environment(env_id, **env_args)


@dataclasses.dataclass(frozen=True)
class VerifiersSource:
    """The job's verifiers environment as the env workers get it: the object, built on the driver."""

    env: Any
    """The environment (`load_environment`'s, or the one given to `train(environment=...)`)."""
    label: str = ""
    """How errors and logs name it: the id, or the object's class."""
    timeout_s: float = 300.0
    tool_parser: str = ""
    """`data.verifiers.tool_parser` ('' = Hermes blocks), imported where the episodes run (`parser`)."""

    def parser(self) -> Any:
        """The tool-call parser the proxy reads replies with (None: Hermes)."""
        from rayllm_rl.object_path import import_object

        return import_object(self.tool_parser, "data.verifiers.tool_parser") if self.tool_parser else None

    def load(self) -> Any:
        """The environment, its rubric made strict (`strict_rubric`, once)."""
        strict_rubric(self.env.rubric)
        return self.env


def check_environment(env: Any, key: str) -> None:
    """ValueError naming `key` for what task=verifiers cannot play: not a verifiers (classic) Environment, not a
    MultiTurnEnv (its rollout loop is what runs each episode), or a rubric with group-level reward functions
    (each episode is scored alone, as verifiers' `run_rollout` does)."""
    if not is_verifiers_environment(env):
        raise ValueError(f"{key} is a {type(env).__name__}, not a verifiers Environment (classic API, verifiers "
                         "<= 0.3.1: vf.SingleTurnEnv, vf.MultiTurnEnv, vf.ToolEnv, ...)")
    import verifiers as vf

    if not isinstance(env, vf.MultiTurnEnv):
        raise ValueError(f"{key}: {type(env).__name__} is not a vf.MultiTurnEnv (SingleTurnEnv, ToolEnv and "
                         "MultiTurnEnv subclasses are played)")
    for rubric in rubrics_of(env.rubric):
        grouped = [getattr(f, "__name__", repr(f)) for f in rubric.funcs if rubric._is_group_func(f)]
        if grouped:
            raise ValueError(f"{key}: rubric functions {grouped} score a group of rollouts together (plural "
                             "arguments: states, completions, ...); task=verifiers scores each episode alone")


def resolve_verifiers(cfg: Any, given: Any = None) -> tuple[VerifiersSource, Any]:
    """(the `VerifiersSource` of `data.verifiers` (`cfg`) or of the object `given` to `train(environment=...)`,
    the environment loaded here). ValueError naming the key for none or both given, or an environment
    `check_environment` refuses."""
    named = [k for k, v in (("data.verifiers.env_id", cfg.env_id), ("environment=", given is not None)) if v]
    if len(named) != 1:
        raise ValueError("task=verifiers needs one environment: data.verifiers.env_id (a module exporting "
                         "load_environment) or train(environment=<a verifiers Environment>); "
                         + (f"got {' and '.join(named)}" if named else "none was given"))
    if cfg.env_id:
        env, label = load_environment(cfg.env_id, dict(cfg.env_args)), cfg.env_id
        key = f"data.verifiers.env_id={cfg.env_id!r}"
    elif cfg.env_args:
        raise ValueError("data.verifiers.env_args are the arguments of load_environment(env_id, ...); "
                         "train(environment=...) gives an environment already built")
    else:
        env, label, key = given, type(given).__name__, "environment="
    check_environment(env, key)
    return VerifiersSource(env, label, timeout_s=cfg.rollout_timeout_s, tool_parser=cfg.tool_parser), env


def _text(content: Any) -> str:
    if isinstance(content, list):  # content parts: their text
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return "" if content is None else str(content)


def rows(env: Any, train_size: int, label: str) -> list[dict[str, Any]]:
    """The environment's dataset rows (`train_size` of them, 0 = all): {"messages": the prompt chat as role /
    content text, "vf_input": the row as JSON}. ValueError when it has no dataset or a row no prompt."""
    dataset = env.get_dataset(n=train_size or -1)
    if dataset is None or len(dataset) == 0:
        raise ValueError(f"{label} has no dataset rows (its `dataset=` / `get_dataset()`): task=verifiers trains on "
                         "them")
    return _rows_of(dataset, label)


def eval_rows(env: Any, eval_size: int, label: str) -> list[dict[str, Any]]:
    """The first `eval_size` rows of the environment's `eval_dataset`, as `rows` makes them (`data.eval_size`).
    ValueError when it has none: verifiers' `get_eval_dataset` would fall back to the training rows, and a held-out
    evaluation on rows trained on would say nothing."""
    env.build_eval_dataset()
    if env.eval_dataset is None or len(env.eval_dataset) == 0:
        raise ValueError(f"data.eval_size={eval_size} but {label} has no eval_dataset: give the environment "
                         "`eval_dataset=` (rows never trained on), or set data.eval_size=0")
    return _rows_of(env.get_eval_dataset(n=eval_size), label)


def _rows_of(dataset, label: str) -> list[dict[str, Any]]:
    if "prompt" not in dataset.column_names:
        raise ValueError(f"{label}'s dataset has no `prompt` column (columns: {dataset.column_names})")
    out = []
    for row in dataset:
        prompt = row["prompt"]
        chat = ([{"role": "user", "content": prompt}] if isinstance(prompt, str) else
                [{"role": m["role"], "content": _text(m.get("content"))} for m in prompt])
        out.append({"messages": chat, "vf_input": json.dumps(row, default=str)})
    return out
