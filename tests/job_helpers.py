"""Running a job's loop on what a test set up (its own Ray, or none): `driver.train` of the config's plan; and
reading what a run wrote (its step records, its traced rows)."""
from __future__ import annotations

import json
from pathlib import Path

from rayllm_rl.orchestration import driver
from rayllm_rl.job.plan import make_plan


def run_job(cfg, inputs=None, **kwargs) -> dict:
    """The driver's loop over `make_plan(cfg, inputs)` (the config resolved or not); returns the summary.
    Unlike `rayllm_rl.train` it neither starts nor stops Ray."""
    return driver.train(make_plan(cfg, inputs), inputs, **kwargs)


def rl_records(summary) -> list[dict]:
    """The run's RL step records (`metrics.jsonl` of `summary["run_dir"]`, phase "rl")."""
    lines = (Path(summary["run_dir"]) / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["phase"] == "rl"]


def trace_samples(summary) -> list[dict]:
    """The run's decoded trace rows (`traces.jsonl`: a few trained rows per step, token by token)."""
    lines = (Path(summary["run_dir"]) / "traces.jsonl").read_text().splitlines()
    return [sample for line in lines for sample in json.loads(line).get("samples", ())]
