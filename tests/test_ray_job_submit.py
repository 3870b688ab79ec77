"""`ray job submit --working-dir . -- python jobs/grpo.py` against a local head with token auth."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytestmark = [pytest.mark.ray, pytest.mark.slow]


def test_job_submit_runs_and_prints_summary(tmp_path):
    out = subprocess.run(
        [sys.executable, "jobs/submit_local.py", "sft.steps=2", "trainer.steps=3", "data.eval_size=16",
         "trainer.eval_every=0", "rollout.prompts_per_step=4", f"trainer.run_dir={tmp_path}"],
        cwd=ROOT, capture_output=True, text=True, timeout=900,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "succeeded" in out.stderr
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    assert summary["steps"] == 3 and summary["version"] == 3 and summary["max_version_lag"] <= 1
    run = Path(summary["run_dir"])
    assert run.parent == tmp_path and (run / "metrics.jsonl").exists() and (run / "reward_curve.png").exists()
    assert (Path(summary["checkpoint"]) / "config.json").exists()
    leftovers = subprocess.run(["pgrep", "-f", "rayhead-"], capture_output=True, text=True).stdout.split()
    assert leftovers == [], f"ray processes left running: {leftovers}"
