"""Run outputs: a timestamped run dir, metrics JSONL, progress on stderr, a reward-curve PNG.

The console holds one progress bar; while it is live, every line written to sys.stdout or sys.stderr
(the reporter's own lines, Python logging, actor output Ray forwards to the driver) is printed whole
above it: the bar is cleared, the line written, the bar drawn again.
"""
from __future__ import annotations

import hashlib
import json
import logging
import sys
import threading
import time
from pathlib import Path
from typing import Any


SUMMARY_KEYS = frozenset({
    "eval_reward_before", "eval_reward_after", "eval_reward_gain", "steps", "version", "backend", "algo",
    "max_staleness", "max_version_lag", "budget_cuts", "eval_prompts", "wall_seconds", "rl_seconds", "run_dir",
    "checkpoint", "eval_before", "eval_after", "failed_episodes", "episodes_rerun", "episodes_lost", "restarts",
    "recoveries", "buffer", "reward_failures", "replica_versions_held", "learner_checksums_equal_replicas"})
"""The summary's keys, the same on both backends (docs/ray-orchestration.md describes each)."""


class _AboveTheBar:
    """A text stream that writes whole lines above a live tqdm bar: clear the bar, write, redraw.

    Installed as sys.stdout/sys.stderr (and as the stream of logging handlers that wrote to them)
    while the bar is live; a partial line waits for its newline. Once detached it writes straight
    through, so a reference someone kept stays usable."""

    def __init__(self, stream, bar):
        self.stream, self.bar = stream, bar
        self._partial = ""
        self._lock = threading.RLock()  # Ray forwards actor output from its own thread

    def write(self, text: str) -> int:
        with self._lock:
            if self.bar is None:
                return self.stream.write(text)
            self._partial += text
            if "\n" in self._partial:
                lines, _, self._partial = self._partial.rpartition("\n")
                self.write_lines(lines + "\n")
        return len(text)

    def write_lines(self, text: str) -> None:
        """Write `text` (whole lines) above the bar."""
        with self._lock:
            bar = self.bar
            if bar is None:
                self.stream.write(text)
                self.stream.flush()
                return
            with bar.get_lock():
                bar.clear(nolock=True)
                self.stream.write(text)
                self.stream.flush()
                bar.refresh(nolock=True)

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


def _console_loggers() -> list[logging.Logger]:
    return [logging.getLogger(), *(lg for lg in logging.Logger.manager.loggerDict.values()
                                   if isinstance(lg, logging.Logger))]


class _Progress:
    """One tqdm bar on stderr (stdout stays clean for the final JSON line), with every console line
    printed above it while it is live (see `_AboveTheBar`)."""

    def __init__(self, total: int, desc: str):
        from tqdm import tqdm

        self.bar = tqdm(total=total, desc=desc, file=sys.stderr, dynamic_ncols=True, mininterval=1.0)
        self._streams: list[tuple[str, Any, _AboveTheBar]] = []
        self._handlers: list[tuple[logging.StreamHandler, Any, _AboveTheBar]] = []
        by_stream: dict[int, _AboveTheBar] = {}
        for name in ("stdout", "stderr"):
            stream = getattr(sys, name)
            proxy = _AboveTheBar(stream, self.bar)
            by_stream[id(stream)] = proxy
            self._streams.append((name, stream, proxy))
            setattr(sys, name, proxy)
        for logger in _console_loggers():  # handlers hold the stream they were given when made
            for handler in logger.handlers:
                proxy = by_stream.get(id(getattr(handler, "stream", None)))
                if proxy is not None and isinstance(handler, logging.StreamHandler):
                    self._handlers.append((handler, handler.stream, proxy))
                    handler.setStream(proxy)
        self.stderr = by_stream[id(self._streams[1][1])]
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
        for handler, stream, proxy in self._handlers:
            if handler.stream is proxy:
                handler.setStream(stream)
        for name, stream, proxy in self._streams:
            proxy.detach()
            if getattr(sys, name) is proxy:  # else someone replaced it since: leave theirs
                setattr(sys, name, stream)
        self._handlers, self._streams = [], []


class RunReporter:
    """Writes `metrics.jsonl`, `config.json`, `summary.json` and `reward_curve.png` in the run dir."""

    def __init__(self, root: str, config: dict[str, Any] | None = None):
        stamp = time.strftime("%Y%m%d-%H%M%S")
        self.run_dir = Path(root) / stamp
        n = 1
        while self.run_dir.exists():
            self.run_dir = Path(root) / f"{stamp}-{n}"
            n += 1
        self.run_dir.mkdir(parents=True)
        if config is not None:
            (self.run_dir / "config.json").write_text(json.dumps(config, indent=2, default=str))
        self._metrics = open(self.run_dir / "metrics.jsonl", "a", buffering=1)
        self.records: list[dict[str, Any]] = []
        self.t0 = time.perf_counter()
        self._bar: _Progress | None = None

    def log(self, record: dict[str, Any], show: bool = False) -> None:
        record = {"time_s": round(time.perf_counter() - self.t0, 3), **record}
        self.records.append(record)
        self._metrics.write(json.dumps(record, default=float) + "\n")
        if show:
            keys = [k for k in ("phase", "step", "sft_step", "reward", "eval_reward", "loss", "nll", "collect_s", "train_s") if k in record]
            parts = [f"{k}={record[k]:.4g}" if isinstance(record[k], float) else f"{k}={record[k]}" for k in keys]
            self.say(f"[{record['time_s']:7.1f}s] " + " ".join(parts))

    def say(self, line: str) -> None:
        """One line on stderr, above the progress bar if one is live."""
        if self._bar is not None and not self._bar.closed:
            self._bar.write(line)
        else:
            print(line, file=sys.stderr, flush=True)

    def progress(self, total: int, desc: str) -> _Progress:
        """The run's one progress bar; a bar still live (a rollback left it) is cleared away first."""
        if self._bar is not None:
            self._bar.close(leave=False)
        self._bar = _Progress(total, desc)
        return self._bar

    def close(self) -> None:
        """Close a live bar and the metrics file (idempotent; `finish` calls it)."""
        if self._bar is not None:
            self._bar.close()
        if not self._metrics.closed:
            self._metrics.close()

    def plot_rewards(self) -> Path | None:
        rl = [r for r in self.records if r.get("phase") == "rl" and "reward" in r]
        if not rl:
            return None
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 3.5))
        ax.plot([r["step"] for r in rl], [r["reward"] for r in rl], label="train reward (sampled)")
        ev = [r for r in self.records if "eval_reward" in r]
        if ev:
            ax.plot([r["step"] for r in ev], [r["eval_reward"] for r in ev], "o-", label="eval reward (greedy, held-out)")
        ax.set_xlabel("step")
        ax.set_ylabel("reward")
        ax.legend()
        fig.tight_layout()
        path = self.run_dir / "reward_curve.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        return path

    def finish(self, summary: dict[str, Any]) -> None:
        self.plot_rewards()
        (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        self.close()


def prompts_digest(batch) -> str:
    """Hash of the prompts a batch trains on, in group order (to check resume keeps data order)."""
    h = hashlib.sha1()
    for gid in sorted(set(batch["group_id"].tolist())):
        row = batch["input_ids"][batch["group_id"] == gid][0]
        first_gen = int(batch["loss_mask"][batch["group_id"] == gid][0].float().argmax())
        h.update(str(row[:first_gen].tolist()).encode())
    return h.hexdigest()[:16]
