"""Run outputs: a timestamped run dir, metrics JSONL, progress on stderr, a reward-curve PNG."""
from __future__ import annotations

import hashlib
import json
import sys
import time
from pathlib import Path
from typing import Any


SUMMARY_KEYS = frozenset({
    "eval_reward_before", "eval_reward_after", "eval_reward_gain", "steps", "version", "backend", "algo",
    "max_staleness", "max_version_lag", "budget_cuts", "eval_prompts", "wall_seconds", "rl_seconds", "run_dir",
    "checkpoint", "eval_before", "eval_after", "failed_episodes", "episodes_rerun", "episodes_lost", "restarts",
    "recoveries", "buffer", "reward_failures", "replica_versions_held", "learner_checksums_equal_replicas"})
"""The summary's keys, the same on both backends (docs/ray-orchestration.md describes each)."""


class _Progress:
    """A tqdm bar on stderr (stdout stays clean for the final JSON line)."""

    def __init__(self, total: int, desc: str):
        from tqdm import tqdm

        self.bar = tqdm(total=total, desc=desc, file=sys.stderr, dynamic_ncols=True, mininterval=1.0)

    def update(self, n: int, **postfix: float) -> None:
        self.bar.set_postfix({k: f"{v:.3f}" for k, v in postfix.items()}, refresh=False)
        self.bar.update(n)

    def close(self) -> None:
        self.bar.close()


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

    def log(self, record: dict[str, Any], show: bool = False) -> None:
        record = {"time_s": round(time.perf_counter() - self.t0, 3), **record}
        self.records.append(record)
        self._metrics.write(json.dumps(record, default=float) + "\n")
        if show:
            keys = [k for k in ("phase", "step", "sft_step", "reward", "eval_reward", "loss", "nll", "collect_s", "train_s") if k in record]
            parts = [f"{k}={record[k]:.4g}" if isinstance(record[k], float) else f"{k}={record[k]}" for k in keys]
            print(f"[{record['time_s']:7.1f}s] " + " ".join(parts), file=sys.stderr, flush=True)

    def progress(self, total: int, desc: str) -> _Progress:
        return _Progress(total, desc)

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
        self._metrics.close()


def prompts_digest(batch) -> str:
    """Hash of the prompts a batch trains on, in group order (to check resume keeps data order)."""
    h = hashlib.sha1()
    for gid in sorted(set(batch["group_id"].tolist())):
        row = batch["input_ids"][batch["group_id"] == gid][0]
        first_gen = int(batch["loss_mask"][batch["group_id"] == gid][0].float().argmax())
        h.update(str(row[:first_gen].tolist()).encode())
    return h.hexdigest()[:16]
