"""Run outputs: a timestamped run dir, metrics JSONL, progress on stderr, a reward-curve PNG.

The console holds one progress bar; while it is live, every line written to sys.stdout or sys.stderr
(the reporter's own lines, Python logging, actor output Ray forwards to the driver) is printed whole
above it: the bars are cleared, the line written, the bars drawn again. Another tqdm bar made meanwhile
(a library's) draws below ours as tqdm nests bars; `hf_progress_bars_off` keeps the HF libraries' off.
"""
from __future__ import annotations

import contextlib
import json
import logging
import sys
import threading
import time
import warnings
from pathlib import Path
from typing import Any, Callable, Iterator


SUMMARY_KEYS = frozenset({
    "eval_reward_before", "eval_reward_after", "eval_reward_gain", "steps", "version", "backend", "algo",
    "max_staleness", "max_version_lag", "budget_cuts", "eval_prompts", "wall_seconds", "rl_seconds", "run_dir",
    "checkpoint", "eval_before", "eval_after", "failed_episodes", "episode_failures", "episodes_rerun",
    "episodes_lost", "restarts", "recoveries", "buffer", "reward_failures", "replica_versions_held", "weight_transport",
    "learner_checksums_equal_replicas", "reward_services", "mismatch", "stopped_by", "callback_errors"})
"""The summary's keys, the same on both backends (docs/ray-orchestration.md describes each)."""


class _AboveTheBar:
    """A text stream that writes whole lines above the live tqdm bars: clear them, write, redraw.

    Installed as sys.stdout/sys.stderr (and as the stream of logging handlers that wrote to them)
    while our bar is live; a partial line waits for its newline. A tqdm bar made meanwhile (its file
    defaults to sys.stderr, so this stream) is drawn as tqdm draws nested bars: its writes, cursor
    moves included, go straight to the real stream. Once detached it writes straight through, so a
    reference someone kept stays usable."""

    def __init__(self, stream, bar):
        self.stream, self.bar = _unwrap(stream), bar
        self._partial = ""
        self._lock = threading.RLock()  # Ray forwards actor output from its own thread

    def write(self, text: str) -> int:
        # a tqdm bar draws under tqdm's lock: taking ours too would order the locks against write_lines
        if self.bar is None or _from_tqdm(sys._getframe(1)):
            return self.stream.write(text)
        with self._lock:
            self._partial += text
            if "\n" in self._partial:
                lines, _, self._partial = self._partial.rpartition("\n")
                self.write_lines(lines + "\n")
        return len(text)

    def write_lines(self, text: str) -> None:
        """Write `text` (whole lines) above the bars drawn on this console."""
        from tqdm import tqdm

        with self._lock:
            if self.bar is None:
                self.stream.write(text)
                self.stream.flush()
                return
            with tqdm.get_lock():
                bars = [b for b in list(tqdm._instances) if not b.disable and _unwrap(b.fp) is self.stream]
                for b in bars:
                    b.clear(nolock=True)
                self.stream.write(text)
                self.stream.flush()
                for b in bars:
                    b.refresh(nolock=True)

    def flush(self) -> None:
        self.stream.flush()

    def detach(self) -> None:
        """The bar is gone: write what is left of a partial line and pass everything through."""
        with self._lock:
            self.bar = None
            if self._partial:
                self.stream.write(self._partial)
                self._partial = ""
            self.stream.flush()

    def __getattr__(self, name: str):  # fileno, isatty, encoding, buffer...: the real stream's
        return getattr(self.stream, name)


def _unwrap(stream):
    """The real stream under tqdm's file wrapper and any `_AboveTheBar` (a second reporter's bar, or a
    tqdm bar made while ours is live, gets the console's own stream, not a wrapper of it)."""
    while True:
        inner = getattr(stream, "_wrapped", None) if type(stream).__module__.startswith("tqdm") else None
        if isinstance(stream, _AboveTheBar):
            inner = stream.stream
        if inner is None:
            return stream
        stream = inner


def _from_tqdm(frame) -> bool:
    """True when the write comes from tqdm (a bar drawing itself: its file wrapper lives in tqdm.utils)."""
    return str(frame.f_globals.get("__name__", "")).startswith("tqdm")


def _given_back(stream):
    """What to put back in place of our wrapper: `stream`, or what a detached wrapper passes through to."""
    while isinstance(stream, _AboveTheBar) and stream.bar is None:
        stream = stream.stream
    return stream


def _console_loggers() -> list[logging.Logger]:
    loggers = list(logging.Logger.manager.loggerDict.values())  # a copy: other threads add loggers
    return [logging.getLogger(), *(lg for lg in loggers if isinstance(lg, logging.Logger))]


@contextlib.contextmanager
def hf_progress_bars_off() -> Iterator[None]:
    """Turn off the progress bars of huggingface_hub, transformers and datasets (download, "Loading
    weights", "Map", "Flattening the indices" on the driver's console) for the block; puts back those
    that were on. An environment variable forcing them on (HF_HUB_DISABLE_PROGRESS_BARS=0, ...) wins."""
    import datasets
    import huggingface_hub.utils as hub_utils
    from transformers.utils import logging as hf_logging

    on = {"hub": not hub_utils.are_progress_bars_disabled(), "transformers": hf_logging.is_progress_bar_enabled(),
          "datasets": datasets.is_progress_bar_enabled()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "Cannot disable progress bars: environment variable ... has priority"
        hf_logging.disable_progress_bar()  # and huggingface_hub's
        datasets.disable_progress_bars()
    try:
        yield
    finally:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if on["transformers"]:
                hf_logging.enable_progress_bar()
            if on["hub"]:
                hub_utils.enable_progress_bars()
            elif on["transformers"]:
                hub_utils.disable_progress_bars()  # transformers' switch turned the hub's on too
            if on["datasets"]:
                datasets.enable_progress_bars()


@contextlib.contextmanager
def hub_download_bars() -> Iterator[None]:
    """huggingface_hub's download bars on for the block (the driver fetching the model before any bar of its own
    is live), put back as they were after; HF_HUB_DISABLE_PROGRESS_BARS=1 in the environment still wins."""
    import huggingface_hub.utils as hub_utils

    was_off = hub_utils.are_progress_bars_disabled()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the environment variable has priority: said once by the hub
        hub_utils.enable_progress_bars()
    try:
        yield
    finally:
        if was_off:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                hub_utils.disable_progress_bars()


class _Progress:
    """One tqdm bar on stderr (stdout stays clean for the final JSON line), with every console line
    printed above it while it is live (see `_AboveTheBar`)."""

    def __init__(self, total: int, desc: str):
        from tqdm import tqdm

        self.bar = tqdm(total=total, desc=desc, file=_unwrap(sys.stderr), dynamic_ncols=True, mininterval=1.0)
        self._streams: list[tuple[str, Any, _AboveTheBar]] = []
        self._handlers: list[tuple[logging.StreamHandler, Any, _AboveTheBar]] = []
        by_stream: dict[int, _AboveTheBar] = {}  # by the real stream: a live wrapper of it is replaced too
        for name in ("stdout", "stderr"):
            stream = getattr(sys, name)
            proxy = _AboveTheBar(stream, self.bar)
            by_stream[id(proxy.stream)] = proxy
            self._streams.append((name, stream, proxy))
            setattr(sys, name, proxy)
        for logger in _console_loggers():  # handlers hold the stream they were given when made
            for handler in logger.handlers:
                if not isinstance(handler, logging.StreamHandler) or "stream" not in vars(handler):
                    continue  # e.g. logging's _StderrHandler: its stream property reads sys.stderr, ours now
                proxy = by_stream.get(id(_unwrap(handler.stream)))
                if proxy is not None:
                    self._handlers.append((handler, handler.stream, proxy))
                    handler.setStream(proxy)
        self.stderr = self._streams[1][2]
        """Lines written here appear above the bar."""

    def update(self, n: int, **postfix: float) -> None:
        self.bar.set_postfix({k: f"{v:.3f}" for k, v in postfix.items()}, refresh=False)
        self.bar.update(n)

    def write(self, line: str) -> None:
        """Print one line above the bar (on stderr)."""
        self.stderr.write_lines(line.rstrip("\n") + "\n")

    @property
    def closed(self) -> bool:
        return not self._streams

    def close(self, leave: bool = True) -> None:
        """Close the bar (`leave`: keep its last state on the console) and give the console back;
        idempotent."""
        if self.closed:
            return
        self.bar.leave = leave
        self.bar.close()
        for _, _, proxy in self._streams:
            proxy.detach()
        for handler, stream, proxy in self._handlers:
            if handler.stream is proxy:
                handler.setStream(_given_back(stream))
        for name, stream, proxy in self._streams:
            if getattr(sys, name) is proxy:  # else someone replaced it since: leave theirs
                setattr(sys, name, _given_back(stream))
        self._handlers, self._streams = [], []


class RunReporter:
    """Writes `metrics.jsonl`, `config.json`, `summary.json` and `reward_curve.png` in the run dir, and hands
    every record and the config to the experiment trackers of `trackers.loggers` (rayllm_rl.tracking)."""

    def __init__(self, root: str, config: dict[str, Any] | None = None, trackers: Any = None):
        """`trackers`: the job's TrackersConfig (its `loggers` and tracker options); None = `["jsonl"]` only."""
        from rayllm_rl.tracking import Trackers

        loggers = list(getattr(trackers, "loggers", None) or ["jsonl"])
        stamp = time.strftime("%Y%m%d-%H%M%S")
        self.run_dir = Path(root) / stamp
        n = 1
        while self.run_dir.exists():
            self.run_dir = Path(root) / f"{stamp}-{n}"
            n += 1
        self.run_dir.mkdir(parents=True)
        if config is not None:
            (self.run_dir / "config.json").write_text(json.dumps(config, indent=2, default=str))
        self._metrics = open(self.run_dir / "metrics.jsonl", "a", buffering=1) if "jsonl" in loggers else None
        self._said_no_plot = False  # the missing-matplotlib warning, once
        self.records: list[dict[str, Any]] = []
        self.t0 = time.perf_counter()
        self._bar: _Progress | None = None
        self.trackers: Trackers | None = None  # a tracker that fails to start logs its drop before this is set
        self.trackers = Trackers(loggers, self.run_dir, trackers, say=self.say, record=self.log)
        """TensorBoard / W&B / MLflow of `trackers.loggers`; `.dropped` lists those that failed."""
        if config is not None:
            self.trackers.log_config(config)

    def log(self, record: dict[str, Any], show: bool = False) -> None:
        record = {"time_s": round(time.perf_counter() - self.t0, 3), **record}
        self.records.append(record)
        if self._metrics is not None:
            self._metrics.write(json.dumps(record, default=float) + "\n")
        if self.trackers is not None:
            self.trackers.log(record)
        if "eval_reward" in record:  # the curve on disk is current after every evaluation, not only at the end
            self.plot_rewards()
        if show:
            keys = [k for k in ("phase", "step", "sft_step", "reward", "eval_reward", "loss", "nll", "collect_s",
                                "train_s") if k in record]
            parts = [f"{k}={record[k]:.4g}" if isinstance(record[k], float) else f"{k}={record[k]}" for k in keys]
            self.say(f"[{record['time_s']:7.1f}s] " + " ".join(parts))

    def say(self, line: str) -> None:
        """One line on stderr, above the progress bar if one is live."""
        if self._bar is not None and not self._bar.closed:
            self._bar.write(line)
        else:
            print(line, file=sys.stderr, flush=True)

    @property
    def bar(self) -> _Progress | None:
        """The run's progress bar: the last one `progress` (or `task_progress`, with no bar live) made; None
        before the first. It may be closed (check `.closed`)."""
        return self._bar

    def progress(self, total: int, desc: str) -> _Progress:
        """The run's one progress bar; a bar still live (a rollback left it) is cleared away first."""
        if self._bar is not None:
            self._bar.close(leave=False)
        self._bar = _Progress(total, desc)
        return self._bar

    @contextlib.contextmanager
    def task_progress(self, total: int, desc: str) -> Iterator[Callable[[int], None]]:
        """Progress of one piece of work (an eval, the SFT warm start): yields `tick(n=1)`. Its own bar when no
        bar is live (closed, left on the console, at the end); while the RL bar is live, `desc done/total` in
        that bar's postfix instead, so the console keeps one bar. `tick` may be called from another thread."""
        live = self._bar if self._bar is not None and not self._bar.closed else None
        if live is None:
            own = self._bar = _Progress(total, desc)
            try:
                yield lambda n=1: own.update(n)
            finally:
                own.close(leave=True)
            return
        done, drawn = [0], [0.0]
        before = live.bar.postfix

        def tick(n: int = 1) -> None:
            done[0] += n
            live.bar.set_postfix_str(f"{desc} {done[0]}/{total}", refresh=False)
            if done[0] >= total or time.monotonic() - drawn[0] >= live.bar.mininterval:  # a drawing a second at most
                drawn[0] = time.monotonic()
                live.bar.refresh()

        try:
            yield tick
        finally:
            live.bar.postfix = before

    def close(self) -> None:
        """Close a live bar, the trackers (each within its timeout) and the metrics file (idempotent;
        `finish` calls it)."""
        if self._bar is not None:
            self._bar.close()
        if self.trackers is not None:
            self.trackers.close()
        if self._metrics is not None and not self._metrics.closed:
            self._metrics.close()

    def plot_rewards(self) -> Path | None:
        """`reward_curve.png`: the sampled training reward per step and the held-out eval reward. Drawn on a bare
        `Figure` (its own Agg canvas), never through pyplot: the process's matplotlib backend (a notebook's inline
        one) stays as it was."""
        rl = [r for r in self.records if r.get("phase") == "rl" and "reward" in r]
        if not rl:
            return None
        from rayllm_rl.extras import installed

        if not installed("matplotlib"):  # the core install: metrics.jsonl holds the same numbers
            if not self._said_no_plot:
                self._said_no_plot = True
                logging.getLogger(__name__).warning("no reward_curve.png: it needs matplotlib "
                                                    "(pip install 'rayllm_rl[trackers]')")
            return None
        from matplotlib.figure import Figure

        fig = Figure(figsize=(6, 3.5))
        ax = fig.subplots()
        ax.plot([r["step"] for r in rl], [r["reward"] for r in rl], label="train reward (sampled)")
        ev = [r for r in self.records if "eval_reward" in r]
        if ev:
            ax.plot([r["step"] for r in ev], [r["eval_reward"] for r in ev], "o-",
                    label="eval reward (greedy, held-out)")
        ax.set_xlabel("step")
        ax.set_ylabel("reward")
        ax.legend()
        fig.tight_layout()
        path = self.run_dir / "reward_curve.png"
        fig.savefig(path, dpi=100)
        return path

    def finish(self, summary: dict[str, Any]) -> None:
        self.plot_rewards()
        (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        self.close()
