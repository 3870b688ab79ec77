"""A crashed env worker costs a restart, not the run: Ray restarts it, the collector runs its
in-flight episodes again, and the buffer stores each episode once."""
from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest
import ray

from rayllm_rl.config import load_config
from rayllm_rl.orchestration.job_config import GRPOJobConfig

pytestmark = [pytest.mark.ray, pytest.mark.slow]


@pytest.fixture(scope="module")
def local_ray():
    ray.init(address="local", _temp_dir=f"/tmp/rayllm-ft-{os.getpid()}", include_dashboard=False, num_cpus=2,
             runtime_env={"env_vars": {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}})
    yield
    ray.shutdown()


def rl_records(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [r for r in map(json.loads, path.read_text().splitlines()) if r.get("phase") == "rl"]


def test_env_worker_sigkill_restarts_and_loses_no_episode(local_ray, tmp_path):
    from rayllm_rl.orchestration.driver import train

    steps, B = 8, 4
    cfg = load_config(GRPOJobConfig, [
        "sft.steps=2", "data.eval_size=8", "data.max_operand=9", f"rollout.prompts_per_step={B}",
        "rollout.group_size=4", "rollout.max_new_tokens=6", f"trainer.steps={steps}", "trainer.eval_every=0",
        "rollout.max_staleness=1", f"trainer.run_dir={tmp_path}", "ray.call_timeout_s=120",
        "ray.namespace=rayllm_ft_test",
    ])
    out: dict = {}
    runner = threading.Thread(target=lambda: out.update(summary=train(cfg)), daemon=True)
    runner.start()
    run_dirs: list[Path] = []
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and not out:  # kill env-0 once RL step 2 is logged
        run_dirs = [p for p in tmp_path.iterdir() if p.is_dir()]
        if run_dirs and len(rl_records(run_dirs[0])) >= 2:
            break
        time.sleep(0.2)
    assert not out and run_dirs, "the run ended (or never started) before the fault could be injected"
    worker = ray.get_actor("env-0", namespace="rayllm_ft_test")  # found by name from another handle
    old_pid = ray.get(worker.pid.remote(), timeout=30)
    os.kill(old_pid, signal.SIGKILL)
    runner.join(timeout=400)
    assert "summary" in out, "the run did not finish after its env worker was killed"
    summary = out["summary"]
    assert summary["steps"] == steps and summary["restarts"]["env"] >= 1
    assert summary["episodes_lost"] == 0 and summary["failed_episodes"] == 0
    records = rl_records(Path(summary["run_dir"]))
    trained = [gid for r in records for gid in r["episode_ids"]]
    assert len(trained) == steps * B and len(set(trained)) == len(trained), "an episode was trained twice"
    assert summary["learner_checksums_equal_replicas"]
