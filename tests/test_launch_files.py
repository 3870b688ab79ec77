"""The cluster launch files under launch/: KubeRay manifests against a trimmed KubeRay v1 CRD schema,
the `ray up` config against Ray's own cluster-config schema, and the Slurm script run for real with a
stand-in `srun` that starts two local Ray nodes (head + worker) and a 5-step CPU job."""
from __future__ import annotations

import copy
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
LAUNCH = ROOT / "launch"


# ------------------------------------------------------------------ Slurm
SLURM_TEST_TIMEOUT_S = 500
"""pytest-timeout's limit for the Slurm test; the script's own bounds below fit inside it."""
SLURM_BOUNDS_S = {"RAYLLM_HEAD_TIMEOUT_S": 60, "RAYLLM_NODES_TIMEOUT_S": 60, "RAYLLM_AGENT_TIMEOUT_S": 60,
                  "RAYLLM_JOB_TIMEOUT_S": 200, "RAYLLM_STOP_TIMEOUT_S": 20}
"""grpo.sbatch's own waits (seconds): it gives up, and stops Ray, before the subprocess bound below."""
SLURM_SUBPROCESS_TIMEOUT_S = 450
MARK = "RAYLLM_SLURM_TEST_MARK"
"""Environment variable the stand-in srun sets on what it starts: every Ray process below it inherits it."""

STANDIN_SRUN = """#!/usr/bin/env bash
# Stand-in srun: runs the step's command on this machine, in its own session (process group), and
# records its pid, node and command. Slurm options before the command are read and dropped.
node=""
while [ $# -gt 0 ]; do
    case "$1" in
        -w|--nodelist) node="$2"; shift 2 ;;
        -N|-n|--nodes|--ntasks) shift 2 ;;
        --nodelist=*) node="${1#*=}"; shift ;;
        -*) shift ;;
        *) break ;;
    esac
done
echo "$$ $node $*" >> "$SRUN_STANDIN_LOG"
export %s="$SRUN_STANDIN_MARK"
exec setsid "$@"
""" % MARK


def marked_processes(mark: str) -> list[int]:
    """Pids of live processes (of this user) whose environment carries MARK=mark."""
    import psutil

    found = []
    for proc in psutil.process_iter(["pid"]):
        try:
            if proc.environ().get(MARK) == mark and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc.pid)
        except (psutil.AccessDenied, psutil.NoSuchProcess, psutil.ZombieProcess):
            continue
    return found


def free_ports(n: int) -> list[int]:
    from rayllm_rl.weight_sync.gloo_group import find_free_port

    ports: set[int] = set()
    while len(ports) < n:
        ports.add(find_free_port())
    return sorted(ports)


def test_slurm_script_has_its_header_and_a_valid_bash_syntax():
    script = LAUNCH / "slurm" / "grpo.sbatch"
    text = script.read_text()
    sbatch = {k: v for k, _, v in (line[len("#SBATCH --"):].partition("=") for line in text.splitlines()
                                    if line.startswith("#SBATCH --"))}
    assert sbatch["nodes"] == "2" and sbatch["gpus-per-task"] == "8" and sbatch["ntasks-per-node"] == "1"
    assert text.splitlines()[1].startswith("# Slurm batch script")
    subprocess.run(["bash", "-n", str(script)], check=True, timeout=30)


def test_slurm_script_names_a_bad_timeout_and_a_missing_nodelist(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env.update(RAYLLM_REPO=str(ROOT), RAYLLM_JOB_TIMEOUT_S="soon")
    out = subprocess.run(["bash", str(LAUNCH / "slurm" / "grpo.sbatch")], env=env, capture_output=True,
                         text=True, timeout=60, cwd=tmp_path)
    assert out.returncode != 0 and "RAYLLM_JOB_TIMEOUT_S='soon': expected a positive whole number" in out.stderr
    env.pop("RAYLLM_JOB_TIMEOUT_S")
    out = subprocess.run(["bash", str(LAUNCH / "slurm" / "grpo.sbatch")], env=env, capture_output=True,
                         text=True, timeout=60, cwd=tmp_path)
    assert out.returncode != 0 and "SLURM_JOB_NODELIST is not set" in out.stderr


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.timeout(SLURM_TEST_TIMEOUT_S)
def test_slurm_script_runs_a_two_node_ray_cluster_and_a_5_step_job(tmp_path):
    assert sum(SLURM_BOUNDS_S.values()) <= SLURM_SUBPROCESS_TIMEOUT_S < SLURM_TEST_TIMEOUT_S
    temp_root = tempfile.mkdtemp(prefix="rl-slurm-", dir="/tmp")  # short: Ray's socket paths live under it
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    srun = bin_dir / "srun"
    srun.write_text(STANDIN_SRUN)
    srun.chmod(0o755)
    srun_log = tmp_path / "srun.log"
    mark = uuid.uuid4().hex
    gcs, dash, client, agent = free_ports(4)
    nodes = ["fake-node-0", "fake-node-1"]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "RAY_"))}
    env.update({k: str(v) for k, v in SLURM_BOUNDS_S.items()})
    env.update(
        PATH=f"{bin_dir}{os.pathsep}{env.get('PATH', '')}", SRUN_STANDIN_LOG=str(srun_log), SRUN_STANDIN_MARK=mark,
        SLURM_JOB_ID="4242", SLURM_JOB_NODELIST=",".join(nodes), SLURM_NNODES="2", SLURM_SUBMIT_DIR=str(ROOT),
        RAYLLM_PYTHON=sys.executable, RAYLLM_NODE_IPS=" ".join(f"{n}=127.0.0.1" for n in nodes),
        RAYLLM_TEMP_DIR=temp_root, RAYLLM_GCS_PORT=str(gcs), RAYLLM_DASHBOARD_PORT=str(dash),
        RAYLLM_CLIENT_PORT=str(client), RAYLLM_AGENT_PORT=str(agent), RAYLLM_NUM_CPUS="1", RAYLLM_NUM_GPUS="0",
        RAYLLM_RAY_START_ARGS=f"--object-store-memory={100 * 1024 * 1024}",
    )
    job = ["trainer.steps=5", "sft.steps=5", "data.eval_size=8", "trainer.eval_every=0",
           "rollout.prompts_per_step=4", "rollout.group_size=4", f"trainer.run_dir={tmp_path / 'runs'}"]
    try:
        t0 = time.monotonic()
        out = subprocess.run(["bash", str(LAUNCH / "slurm" / "grpo.sbatch"), *job], env=env, cwd=tmp_path,
                             capture_output=True, text=True, timeout=SLURM_SUBPROCESS_TIMEOUT_S)
        elapsed = time.monotonic() - t0
        assert out.returncode == 0, out.stderr[-4000:]
        steps = [line.split(maxsplit=2) for line in srun_log.read_text().splitlines()]
        ray_steps = [s for s in steps if len(s) == 3 and " start " in f" {s[2]} "]
        assert [s[1] for s in ray_steps] == nodes  # head on the first node, a worker on the second
        assert "--head" in ray_steps[0][2] and f"--address=127.0.0.1:{gcs}" in ray_steps[1][2]
        assert "2/2 Ray nodes alive" in out.stderr and "succeeded" in out.stderr
        summary = json.loads(out.stdout.strip().splitlines()[-1])
        assert summary["steps"] == 5 and summary["version"] == 5
        run = Path(summary["run_dir"])
        assert run.parent == tmp_path / "runs"
        assert json.loads((run / "summary.json").read_text())["steps"] == 5
        print(f"slurm script: 2 nodes, 5 steps in {elapsed:.0f}s")
        deadline = time.monotonic() + 30  # worker processes exit a moment after their raylet
        while marked_processes(mark) and time.monotonic() < deadline:
            time.sleep(1)
        assert marked_processes(mark) == [], "Ray processes the script started are still running"
        for s in ray_steps:
            with pytest.raises(ProcessLookupError):
                os.kill(int(s[0]), 0)
    finally:
        for pid in marked_processes(mark):  # only what this test's stand-in started
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        subprocess.run(["rm", "-rf", temp_root], timeout=60)
