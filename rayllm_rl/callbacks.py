"""Callbacks: user code the driver calls at the start, after each RL step, after each evaluation and at the end.

A `Callback` overrides the hooks it needs (TRL's names). They run in order in the driver's process, on
either backend (nothing is sent to an actor). A hook that raises is reported with its traceback and
counted (`callback_errors` in the summary); the run goes on. A hook that sets
`control.should_training_stop` ends the run after that step, as a normal end (final checkpoint, drain,
eval, summary), and the summary's `stopped_by` names it. docs/callbacks.md has the whole story.
"""
from __future__ import annotations

import copy
import dataclasses
import sys
import traceback
from typing import Any, Iterable

from rayllm_rl.object_path import import_object

HOOKS = ("on_train_begin", "on_step_end", "on_evaluate", "on_train_end")


@dataclasses.dataclass
class Control:
    """What a hook may ask of the loop; one object, shared by every callback of the run."""

    should_training_stop: bool = False
    """Set True to end the run after the current step (a stop cannot be taken back)."""
    reason: str = ""
    """Why, in words: the summary's `stopped_by` reports it."""

    def stop(self, reason: str = "") -> None:
        """`should_training_stop = True`, saying why."""
        self.should_training_stop, self.reason = True, reason


@dataclasses.dataclass(frozen=True)
class RunInfo:
    """What `on_train_begin` is told: the run, once its roles are up, before the SFT warm start."""

    config: Any
    """The validated job config (GRPOJobConfig, presets filled)."""
    run_dir: str
    """Where metrics.jsonl, checkpoints/ and summary.json go."""
    model_path: str
    """The model directory every role loaded."""
    max_steps: int
    """trainer.steps: the step the run ends at unless stopped."""


class Callback:
    """Base class of a callback: each hook does nothing until overridden. `name` (default: the class
    name) is how the summary and the console refer to it."""

    name: str = ""

    def on_train_begin(self, state: RunInfo) -> None:
        """Once, when the roles are up, before the SFT warm start and the first evaluation."""

    def on_step_end(self, record: dict[str, Any], control: Control) -> None:
        """After each RL step is logged: `record` is the step's record, as in metrics.jsonl (no `time_s`)."""

    def on_evaluate(self, record: dict[str, Any], control: Control) -> None:
        """After each evaluation (before RL, every trainer.eval_every steps, at the end): `{"phase": "eval",
        "step": ..., "eval_reward": ..., ...}`."""

    def on_train_end(self, summary: dict[str, Any]) -> None:
        """Once, when a run ends normally (not when it fails): the summary about to be written."""


class CallbackList:
    """The run's callbacks, called in order on the driver; catches what they raise and keeps the stop."""

    def __init__(self, callbacks: Iterable[Any] = (), paths: Iterable[str] = ()):
        """`callbacks`: objects, classes (called with no arguments) or "package.module:Name" strings;
        `paths`: trainer.callbacks, each a class or factory called with no arguments. A bad one fails here,
        before any role starts, naming it."""
        made = [_make(obj, f"callbacks[{i}]") for i, obj in enumerate(callbacks or ())]
        made += [_make(path, f"trainer.callbacks[{i}]") for i, path in enumerate(paths or ())]
        self.items: list[tuple[str, Any]] = []
        for cb in made:
            base = getattr(cb, "name", "") or type(cb).__name__
            taken = sum(1 for n, _ in self.items if n == base or n.startswith(base + "#"))
            self.items.append((f"{base}#{taken + 1}" if taken else base, cb))
        self.control = Control()
        self.errors = {name: 0 for name, _ in self.items}
        self.stopped_by: dict[str, Any] | None = None
        self._say = lambda line: print(line, file=sys.stderr, flush=True)
        self._log = lambda record, show=False: None

    def __len__(self) -> int:
        return len(self.items)

    def stopped(self, step: int) -> bool:
        """True once a callback has asked to stop at or before `step` (after a rollback to an earlier
        checkpoint the run trains up to that step again, then stops)."""
        return self.stopped_by is not None and step >= self.stopped_by["step"]

    def train_begin(self, state: RunInfo, reporter) -> None:
        """`on_train_begin`; from here on errors and the stop are said and logged through `reporter`
        (a RunReporter: its console lines and metrics.jsonl)."""
        self._say, self._log = reporter.say, reporter.log
        self._call("on_train_begin", 0, state)

    def step_end(self, record: dict[str, Any]) -> bool:
        """`on_step_end` of each callback; True when the run stops after this step."""
        self._call("on_step_end", record["step"], record, self.control)
        return self.stopped(record["step"])

    def evaluate(self, step: int, result: dict[str, Any]) -> dict[str, Any]:
        """`on_evaluate` with the eval record of `result` (backend.evaluate()'s) at `step`; returns `result`."""
        self._call("on_evaluate", step, {"phase": "eval", "step": step, **result}, self.control)
        return result

    def train_end(self, summary: dict[str, Any]) -> None:
        """Put `stopped_by` and `callback_errors` in `summary`, then `on_train_end` (its errors counted too)."""
        summary.update(stopped_by=self.stopped_by, callback_errors=dict(self.errors))
        self._call("on_train_end", summary["steps"], summary)
        summary["callback_errors"] = dict(self.errors)

    def _call(self, hook: str, step: int, *args) -> None:
        for name, cb in self.items:
            method = getattr(cb, hook, None)
            if method is None:
                continue
            asked = self.control.should_training_stop
            try:
                method(*(copy.deepcopy(a) if isinstance(a, dict) else a for a in args))  # theirs to change
            except Exception as exc:  # a callback cannot break the run (Ctrl-C, SystemExit still end it)
                self._failed(name, hook, step, exc)
            if self.control.should_training_stop and not asked and self.stopped_by is None:
                self._stop(name, hook, step)

    def _failed(self, name: str, hook: str, step: int, exc: Exception) -> None:
        self.errors[name] += 1
        where = f"callback {name!r} raised in {hook} at step {step}"
        if self.errors[name] == 1:  # the first traceback in full; after it one line each
            detail = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)).rstrip()
            self._say(f"WARNING: {where}; the run goes on (later errors of it: one line each)\n{detail}")
        else:
            self._say(f"WARNING: {where} ({self.errors[name]} errors so far): {type(exc).__name__}: {exc}")
        self._log({"phase": "callback_error", "step": step, "callback": name, "hook": hook,
                   "error": f"{type(exc).__name__}: {exc}"})

    def _stop(self, name: str, hook: str, step: int) -> None:
        self.stopped_by = {"callback": name, "hook": hook, "step": step, "reason": self.control.reason}
        why = f": {self.control.reason}" if self.control.reason else ""
        self._log({"phase": "stop", "step": step,
                   "stopped": f"callback {name!r} stopped the run in {hook} at step {step}{why}"}, show=True)


def _make(obj: Any, key: str) -> Any:
    """One callback of `callbacks=` or `trainer.callbacks`: a path is imported and called (a class or a
    factory), a class called; an object is used as it is."""
    from_path = isinstance(obj, str)
    if from_path:
        obj = _import(obj, key)
    if from_path or isinstance(obj, type):
        try:
            obj = obj()
        except Exception as exc:
            raise ValueError(f"{key}: calling {obj!r} with no arguments failed: {type(exc).__name__}: {exc}") from exc
    if not any(callable(getattr(obj, hook, None)) for hook in HOOKS):
        raise TypeError(f"{key}={obj!r} has none of the hooks {', '.join(HOOKS)}; subclass "
                        "rayllm_rl.callbacks.Callback")
    return obj


def check_callback_paths(paths: Iterable[str], key: str = "trainer.callbacks") -> None:
    """Each "package.module:Name" imports and names a class or factory (config validation, before any actor
    starts); the error names the key and the item."""
    for i, path in enumerate(paths):
        _import(path, f"{key}[{i}]")


def _import(path: str, key: str) -> Any:
    try:
        obj = import_object(path)
    except ValueError as exc:
        raise ValueError(f"{key}: {exc}") from None
    if not callable(obj):
        raise ValueError(f"{key}={path!r} names {obj!r}, not a class or factory")
    return obj
