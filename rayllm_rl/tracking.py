"""Experiment trackers (`trackers.loggers`): TensorBoard, Weights & Biases (offline) and MLflow (local file store).

`RunReporter` writes metrics.jsonl itself (the `jsonl` logger) and hands every record to a `Trackers` fan-out:
each tracker logs the record's numeric fields as scalars named `<phase>/<field>` at the record's step
(`sft_step` for SFT records, `step` otherwise, a running index per phase for records with neither), and the
job's config once, flattened to dotted keys. A tracker that raises (at start, on a record, at close) is
reported once and dropped; the run goes on. Every close is bounded by a timeout. Only this module imports
tensorboard, wandb and mlflow, and only when the tracker is asked for.
"""
from __future__ import annotations

import abc
import json
import os
import time
from pathlib import Path
from typing import Any, Callable

from rayllm_rl.loop_thread import run_bounded

LOGGERS = ("jsonl", "tensorboard", "wandb", "mlflow")
"""Names `trackers.loggers` accepts: `jsonl` is RunReporter's metrics.jsonl, the others are classes below."""

DEFAULT_PROJECT = "rayllm_rl"
"""W&B project and MLflow experiment when the config names none."""


def check_logger_names(names: list[str] | tuple[str, ...], key: str = "trackers.loggers") -> None:
    """Raise ValueError naming `key` for an unknown or repeated logger name."""
    unknown = [n for n in names if n not in LOGGERS]
    if unknown:
        raise ValueError(f"{key}={list(names)}: unknown logger(s) {unknown}; allowed: {list(LOGGERS)}")
    repeated = sorted({n for n in names if list(names).count(n) > 1})
    if repeated:
        raise ValueError(f"{key}={list(names)}: {repeated} named more than once")


def flatten(config: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"a": {"b": 1}} -> {"a.b": 1}; lists and other leaves stay as they are."""
    out: dict[str, Any] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out.update(flatten(value, name + "."))
        else:
            out[name] = value
    return out


def scalars(record: dict[str, Any]) -> dict[str, float]:
    """The record's numeric fields (int/float, not bool, not None, not the step keys) as floats.
    Lists, strings and None are left to metrics.jsonl."""
    skip = {"phase", "step", "sft_step"}
    return {k: float(v) for k, v in record.items()
            if k not in skip and isinstance(v, (int, float)) and not isinstance(v, bool)}


class StepCounter:
    """The step each record is logged at: `sft_step` for SFT records, `step` otherwise; records of a phase
    that carries neither get a running index (0, 1, ...) of that phase."""

    def __init__(self):
        self._index: dict[str, int] = {}

    def __call__(self, record: dict[str, Any]) -> int:
        phase = str(record.get("phase", "run"))
        for key in (("sft_step", "step") if phase == "sft" else ("step", "sft_step")):
            if isinstance(record.get(key), int) and not isinstance(record.get(key), bool):
                return int(record[key])
        n = self._index.get(phase, 0)
        self._index[phase] = n + 1
        return n


def _text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, default=str)


class Tracker(abc.ABC):
    """One experiment tracker: `log_config` once, `log` per record, `close` at the end. Any of them may raise;
    `Trackers` reports it and drops the tracker."""

    name = ""

    @abc.abstractmethod
    def log_config(self, flat: dict[str, Any]) -> None:
        """The job's config, flattened to dotted keys."""

    @abc.abstractmethod
    def log(self, phase: str, values: dict[str, float], step: int, wall_time: float) -> None:
        """One record's scalars, named `<phase>/<field>`, at `step` (wall_time: seconds since the epoch)."""

    @abc.abstractmethod
    def close(self) -> None:
        """Flush and finish (called within `Trackers`' timeout)."""


class TensorBoardTracker(Tracker):
    """Event files under `<run_dir>/tensorboard` (torch's SummaryWriter); the config as a markdown table in
    the text tab (tag `config`). View: `tensorboard --logdir <run_dir>/tensorboard`."""

    name = "tensorboard"

    def __init__(self, run_dir: Path, options: Any):
        from torch.utils.tensorboard import SummaryWriter

        self.log_dir = run_dir / "tensorboard"
        self.writer = SummaryWriter(log_dir=str(self.log_dir), flush_secs=30)

    def log_config(self, flat: dict[str, Any]) -> None:
        rows = "\n".join(f"| {k} | {_text(v).replace('|', '/')} |" for k, v in flat.items())
        self.writer.add_text("config", "| key | value |\n| --- | --- |\n" + rows, global_step=0)

    def log(self, phase: str, values: dict[str, float], step: int, wall_time: float) -> None:
        for name, value in values.items():
            self.writer.add_scalar(f"{phase}/{name}", value, global_step=step, walltime=wall_time)

    def close(self) -> None:
        self.writer.close()


class WandbTracker(Tracker):
    """A W&B run under `<run_dir>/wandb` (offline by default: no login, no network; `wandb sync` uploads it
    later). Each phase gets its own x-axis (`<phase>/step`), as W&B's own step must only grow while SFT
    and RL steps each start from 1. Console capture, system stats, git and code saving are off."""

    name = "wandb"

    def __init__(self, run_dir: Path, options: Any):
        mode = getattr(options, "wandb_mode", "offline")
        if mode == "offline":
            os.environ["WANDB_MODE"] = "offline"  # wandb reads it in places the settings do not reach
        os.environ.setdefault("WANDB_SILENT", "true")
        import wandb

        settings = wandb.Settings(
            mode=mode, silent=True, console="off", x_disable_stats=True, x_disable_meta=True,
            x_disable_machine_info=True, x_save_requirements=False, disable_git=True, save_code=False,
            init_timeout=float(getattr(options, "timeout_s", 60.0)), reinit="create_new")
        self.run = wandb.init(project=getattr(options, "wandb_project", "") or DEFAULT_PROJECT,
                              name=run_dir.name, dir=str(run_dir), settings=settings)
        self._phases: set[str] = set()

    def log_config(self, flat: dict[str, Any]) -> None:
        self.run.config.update(flat, allow_val_change=True)

    def log(self, phase: str, values: dict[str, float], step: int, wall_time: float) -> None:
        if phase not in self._phases:
            self.run.define_metric(f"{phase}/step", hidden=True)
            self.run.define_metric(f"{phase}/*", step_metric=f"{phase}/step")
            self._phases.add(phase)
        self.run.log({f"{phase}/step": step, **{f"{phase}/{k}": v for k, v in values.items()}})

    def close(self) -> None:
        self.run.finish()


class MlflowTracker(Tracker):
    """An MLflow run in `trackers.mlflow_tracking_uri`, by default the file store `<run_dir>/mlruns` (MLflow
    keeps that backend in maintenance mode behind MLFLOW_ALLOW_FILE_STORE, which this sets for a file URI).
    Params: the flattened config, values cut to MLflow's length limit. View: `mlflow ui --backend-store-uri
    <run_dir>/mlruns`."""

    name = "mlflow"

    def __init__(self, run_dir: Path, options: Any):
        uri = getattr(options, "mlflow_tracking_uri", "") or (run_dir / "mlruns").resolve().as_uri()
        if uri.startswith("file:") or "://" not in uri:
            os.environ["MLFLOW_ALLOW_FILE_STORE"] = "true"
        from mlflow.tracking import MlflowClient

        self.tracking_uri = uri
        self.client = MlflowClient(tracking_uri=uri)
        experiment = getattr(options, "mlflow_experiment", "") or DEFAULT_PROJECT
        found = self.client.get_experiment_by_name(experiment)
        experiment_id = found.experiment_id if found is not None else self.client.create_experiment(experiment)
        self.run_id = self.client.create_run(experiment_id, run_name=run_dir.name,
                                             tags={"run_dir": str(run_dir)}).info.run_id

    def log_config(self, flat: dict[str, Any]) -> None:
        from mlflow.entities import Param
        from mlflow.utils.validation import MAX_PARAM_VAL_LENGTH, MAX_PARAMS_TAGS_PER_BATCH

        params = [Param(k, _text(v)[:MAX_PARAM_VAL_LENGTH]) for k, v in flat.items()]
        for i in range(0, len(params), MAX_PARAMS_TAGS_PER_BATCH):
            self.client.log_batch(self.run_id, params=params[i:i + MAX_PARAMS_TAGS_PER_BATCH])

    def log(self, phase: str, values: dict[str, float], step: int, wall_time: float) -> None:
        from mlflow.entities import Metric

        ms = int(wall_time * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(f"{phase}/{k}", v, ms, step) for k, v in values.items()])

    def close(self) -> None:
        self.client.set_terminated(self.run_id, "FINISHED")


TRACKER_CLASSES: dict[str, Callable[[Path, Any], Tracker]] = {
    "tensorboard": TensorBoardTracker, "wandb": WandbTracker, "mlflow": MlflowTracker}
"""The scalar trackers by logger name (`jsonl` is RunReporter's own file)."""


class Trackers:
    """The run's scalar trackers behind one interface. `say(line)` reports a dropped tracker; `record(r)`
    logs a `{"phase": "tracker_dropped", ...}` record (RunReporter.log), so the drop is in metrics.jsonl too.
    `dropped` lists {"tracker", "during", "error"} of each tracker dropped so far."""

    def __init__(self, names: list[str] | tuple[str, ...], run_dir: Path, options: Any = None,
                 say: Callable[[str], None] = print, record: Callable[[dict[str, Any]], None] | None = None,
                 factories: dict[str, Callable[[Path, Any], Tracker]] | None = None):
        check_logger_names(list(names))
        self.say, self.record = say, record
        self.timeout_s = float(getattr(options, "timeout_s", 60.0))
        self.dropped: list[dict[str, str]] = []
        self.steps = StepCounter()
        self.active: list[Tracker] = []
        factories = {**TRACKER_CLASSES, **(factories or {})}
        for name in names:
            if name == "jsonl":
                continue
            try:
                self.active.append(factories[name](run_dir, options))
            except Exception as e:  # noqa: BLE001 - a tracker that cannot start is dropped, the run goes on
                self._drop(name, "start", e)

    def _drop(self, name: str, during: str, error: BaseException, tracker: Tracker | None = None) -> None:
        if tracker is not None and tracker in self.active:
            self.active.remove(tracker)
        info = {"tracker": name, "during": during, "error": f"{type(error).__name__}: {error}"[:500]}
        self.dropped.append(info)
        self.say(f"WARNING: tracker {name!r} failed during {during} and is dropped; the run goes on "
                 f"({info['error']})")
        if self.record is not None:
            self.record({"phase": "tracker_dropped", **info})

    def _each(self, during: str, call: Callable[[Tracker], None]) -> None:
        for tracker in list(self.active):
            try:
                call(tracker)
            except Exception as e:  # noqa: BLE001 - one tracker's failure never stops the run
                self._drop(tracker.name, during, e, tracker)

    def log_config(self, config: dict[str, Any]) -> None:
        """The config, once, flattened to dotted keys."""
        flat = flatten(config)
        self._each("config", lambda t: t.log_config(flat))

    def log(self, record: dict[str, Any]) -> None:
        """One reporter record: its numeric fields at its step, named `<phase>/<field>`."""
        if record.get("phase") == "tracker_dropped":
            return  # said on the console and in metrics.jsonl; not a scalar series
        step, values = self.steps(record), scalars(record)
        if not values:
            return
        phase, now = str(record.get("phase", "run")), time.time()
        self._each("log", lambda t: t.log(phase, values, step, now))

    def close(self) -> None:
        """Close each tracker within the timeout; one that raises or hangs is reported and abandoned."""
        for tracker in list(self.active):
            try:
                run_bounded(tracker.close, self.timeout_s, f"{tracker.name}.close()")
            except BaseException as e:  # noqa: BLE001
                self._drop(tracker.name, "close", e, tracker)
            else:
                self.active.remove(tracker)

    def names(self) -> list[str]:
        return [t.name for t in self.active]

