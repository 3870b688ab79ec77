"""The cluster launch files under launch/: KubeRay manifests against a trimmed KubeRay v1 CRD schema,
the `ray up` config against Ray's own cluster-config schema, and the Slurm script run for real with a
stand-in `srun` that starts two local Ray nodes (head + worker) and a 5-step CPU job."""
from __future__ import annotations

import copy
import json
import os
import re
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


# ------------------------------------------------------------------ every file's header
LAUNCH_FILES = ["kuberay/rayjob.yaml", "kuberay/raycluster.yaml", "kuberay/Dockerfile",
                "kuberay/schema/trim_crd.py", "ray-up/cluster.yaml", "slurm/grpo.sbatch"]


@pytest.mark.parametrize("name", LAUNCH_FILES)
def test_every_launch_file_opens_with_what_it_is_the_hardware_and_how_to_run_it(name):
    text = (LAUNCH / name).read_text()
    head = text.split('"""')[1].lower() if name.endswith(".py") else "\n".join(
        line for line in text.splitlines()[:20] if line.startswith("#")).lower()
    assert "hardware" in head and ("run" in head or "apply" in head or "build" in head), name


# ------------------------------------------------------------------ KubeRay
SCHEMAS = LAUNCH / "kuberay" / "schema"


def kuberay(name: str) -> tuple[dict, dict]:
    """(manifest, its trimmed KubeRay schema)."""
    manifest = yaml.safe_load((LAUNCH / "kuberay" / f"{name}.yaml").read_text())
    return manifest, json.loads((SCHEMAS / f"{name}.v1.json").read_text())


def errors(instance: dict, schema: dict) -> list[str]:
    import jsonschema

    validator = jsonschema.Draft202012Validator(schema)
    return [f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(instance)]


def cluster_spec(manifest: dict) -> dict:
    return manifest["spec"]["rayClusterSpec"] if manifest["kind"] == "RayJob" else manifest["spec"]


@pytest.mark.parametrize("name", ["rayjob", "raycluster"])
def test_kuberay_manifest_matches_the_kuberay_v1_crd_schema(name):
    import jsonschema

    manifest, schema = kuberay(name)
    jsonschema.Draft202012Validator.check_schema(schema)
    assert errors(manifest, schema) == []
    assert (manifest["apiVersion"] == "ray.io/v1"
            and manifest["kind"] == {"rayjob": "RayJob", "raycluster": "RayCluster"}[name])


@pytest.mark.parametrize("name", ["rayjob", "raycluster"])
def test_kuberay_schema_rejects_a_wrong_type_a_misspelled_field_and_a_missing_required_one(name):
    manifest, schema = kuberay(name)
    spec = lambda m: cluster_spec(m)  # noqa: E731
    wrong_type = copy.deepcopy(manifest)
    spec(wrong_type)["workerGroupSpecs"][0]["replicas"] = "two"
    assert any("workerGroupSpecs.0.replicas: 'two' is not of type 'integer'" in e for e in errors(wrong_type, schema))
    misspelled = copy.deepcopy(manifest)
    group = spec(misspelled)["workerGroupSpecs"][0]
    group["groupNmae"] = group.pop("groupName")
    found = errors(misspelled, schema)
    assert any("'groupName' is a required property" in e for e in found)
    assert any("'groupNmae' was unexpected" in e for e in found)
    bad_gpu = copy.deepcopy(manifest)
    limits = spec(bad_gpu)["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]["resources"]["limits"]
    limits["nvidia.com/gpu"] = "eight"
    assert any("does not match" in e and "nvidia.com/gpu" in e for e in errors(bad_gpu, schema))
    bad_auth = copy.deepcopy(manifest)
    spec(bad_auth)["authOptions"]["mode"] = "tokens"
    assert any("authOptions.mode: 'tokens' is not one of ['disabled', 'token']" in e for e in errors(bad_auth, schema))
    no_template = copy.deepcopy(manifest)
    del spec(no_template)["headGroupSpec"]["template"]
    assert any("'template' is a required property" in e for e in errors(no_template, schema))


def test_rayjob_runs_grpo_on_as_many_gpus_as_its_recipe_plans():
    """The entrypoint is jobs/grpo.py with a recipe that exists; the worker pods hold exactly the GPUs the
    recipe's placement group asks for; RayCluster and RayJob describe the same cluster, token auth on."""
    import shlex

    from rayllm_rl.config import load_config
    from rayllm_rl.job.config import GRPOJobConfig
    from rayllm_rl.job.describe import describe_job

    job, _ = kuberay("rayjob")
    cluster, _ = kuberay("raycluster")
    assert cluster["spec"] == job["spec"]["rayClusterSpec"]
    argv = shlex.split(job["spec"]["entrypoint"])
    assert argv[:2] == ["python", "/app/jobs/grpo.py"]
    overrides = [a.replace("config=/app/", f"config={ROOT}/") for a in argv[2:]]
    recipe = Path(overrides[0].split("=", 1)[1])
    assert recipe.exists() and recipe.parent == ROOT / "recipes"
    plan = describe_job(load_config(GRPOJobConfig, overrides))
    spec = cluster_spec(job)
    pods = [(g["replicas"], g["template"]["spec"]["containers"][0]["resources"]) for g in spec["workerGroupSpecs"]]
    gpus = sum(n * int(r["limits"].get("nvidia.com/gpu", 0)) for n, r in pods)
    assert gpus == plan["placement"]["total_gpus"] == 16
    assert all(r["limits"] == r["requests"] for _, r in pods)
    assert spec["authOptions"]["mode"] == "token"
    head = spec["headGroupSpec"]["template"]["spec"]["containers"][0]
    assert ("nvidia.com/gpu" not in head["resources"]["limits"]
            and spec["headGroupSpec"]["rayStartParams"]["num-gpus"] == "0")
    dockerfile = (LAUNCH / "kuberay" / "Dockerfile").read_text()
    assert f"FROM rayproject/ray:{spec['rayVersion']}-" in dockerfile
    images = {c["image"] for g in [spec["headGroupSpec"], *spec["workerGroupSpecs"]]
              for c in g["template"]["spec"]["containers"]}
    assert (images == {"registry.example.com/rayllm-rl:0.1.0"}
            and "-t registry.example.com/rayllm-rl:0.1.0" in dockerfile)
    assert plan["placement"]["strategy"] == "PACK" and len(spec["workerGroupSpecs"]) == 1


# ------------------------------------------------------------------ ray up
def ray_schema() -> dict:
    import ray.autoscaler

    return json.loads((Path(ray.autoscaler.__file__).parent / "ray-schema.json").read_text())


def test_ray_up_config_matches_rays_cluster_schema_and_the_recipes_gpus():
    import jsonschema

    config = yaml.safe_load((LAUNCH / "ray-up" / "cluster.yaml").read_text())
    schema = ray_schema()
    jsonschema.Draft7Validator(schema).validate(config)  # the draft Ray's own validate_config uses
    types = config["available_node_types"]
    assert config["head_node_type"] in types and types[config["head_node_type"]]["resources"]["GPU"] == 0
    workers = [t for name, t in types.items() if name != config["head_node_type"]]
    assert sum(t["min_workers"] * t["resources"]["GPU"] for t in workers) == 16  # math_qwen2.5-7b_2nodes
    assert len(config["provider"]["worker_ips"]) == config["max_workers"] == sum(t["max_workers"] for t in workers)
    starts = config["head_start_ray_commands"] + config["worker_start_ray_commands"]
    assert all("RAY_AUTH_MODE=token" in c for c in starts if " start " in c)
    assert "--dashboard-host=127.0.0.1" in " ".join(config["head_start_ray_commands"])
    assert any("pip install" in c and "rayllm_rl[vllm]" in c for c in config["setup_commands"])


def test_rays_schema_rejects_a_mutated_ray_up_config():
    import jsonschema

    config = yaml.safe_load((LAUNCH / "ray-up" / "cluster.yaml").read_text())
    validator = jsonschema.Draft7Validator(ray_schema())
    misspelled = copy.deepcopy(config)
    misspelled["head_start_ray_comands"] = misspelled.pop("head_start_ray_commands")
    assert any("'head_start_ray_comands' was unexpected" in e.message for e in validator.iter_errors(misspelled))
    wrong_type = copy.deepcopy(config)
    wrong_type["available_node_types"]["gpu_worker"]["resources"]["GPU"] = "8"
    assert any("'8' is not of type 'integer'" in e.message for e in validator.iter_errors(wrong_type))
    no_provider_type = copy.deepcopy(config)
    del no_provider_type["provider"]["type"]
    assert any("'type' is a required property" in e.message for e in validator.iter_errors(no_provider_type))


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


def test_slurm_script_has_its_header_and_a_valid_bash_syntax():
    script = LAUNCH / "slurm" / "grpo.sbatch"
    text = script.read_text()
    sbatch = {k: v for k, _, v in (line[len("#SBATCH --"):].partition("=") for line in text.splitlines()
                                    if line.startswith("#SBATCH --"))}
    assert sbatch["nodes"] == "2" and sbatch["gpus-per-task"] == "8" and sbatch["ntasks-per-node"] == "1"
    assert text.splitlines()[1].startswith("# Slurm batch script")
    subprocess.run(["bash", "-n", str(script)], check=True, timeout=30)


def test_slurm_script_names_a_bad_timeout_a_missing_nodelist_and_a_bad_port(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env.update(RAYLLM_REPO=str(ROOT), RAYLLM_JOB_TIMEOUT_S="soon")
    out = subprocess.run(["bash", str(LAUNCH / "slurm" / "grpo.sbatch")], env=env, capture_output=True,
                         text=True, timeout=60, cwd=tmp_path)
    assert out.returncode != 0 and "RAYLLM_JOB_TIMEOUT_S='soon': expected a positive whole number" in out.stderr
    env.pop("RAYLLM_JOB_TIMEOUT_S")
    out = subprocess.run(["bash", str(LAUNCH / "slurm" / "grpo.sbatch")], env=env, capture_output=True,
                         text=True, timeout=60, cwd=tmp_path)
    assert out.returncode != 0 and "SLURM_JOB_NODELIST is not set" in out.stderr
    out = subprocess.run(["bash", str(LAUNCH / "slurm" / "grpo.sbatch")], env=dict(env, RAYLLM_GCS_PORT="auto"),
                         capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert out.returncode != 0 and "RAYLLM_GCS_PORT='auto': expected a port number, or 0" in out.stderr


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
    nodes = ["fake-node-0", "fake-node-1"]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "RAY_"))}
    env.update({k: str(v) for k, v in SLURM_BOUNDS_S.items()})
    env.update(
        PATH=f"{bin_dir}{os.pathsep}{env.get('PATH', '')}", SRUN_STANDIN_LOG=str(srun_log), SRUN_STANDIN_MARK=mark,
        SLURM_JOB_ID="4242", SLURM_JOB_NODELIST=",".join(nodes), SLURM_NNODES="2", SLURM_SUBMIT_DIR=str(ROOT),
        RAYLLM_PYTHON=sys.executable, RAYLLM_NODE_IPS=" ".join(f"{n}=127.0.0.1" for n in nodes),
        RAYLLM_TEMP_DIR=temp_root, RAYLLM_GCS_PORT="0", RAYLLM_DASHBOARD_PORT="0",  # the head binds its ports
        RAYLLM_CLIENT_PORT="0", RAYLLM_AGENT_PORT="0", RAYLLM_NUM_CPUS="1", RAYLLM_NUM_GPUS="0",
        RAYLLM_RAY_START_ARGS=f"--object-store-memory={100 * 1024 * 1024}",
    )
    job = ["trainer.steps=5", "sft.steps=5", "data.eval_size=8", "trainer.eval_every=0",
           "rollout.prompts_per_step=4", "rollout.group_size=4", f"trainer.run_dir={tmp_path / 'runs'}"]
    try:
        t0 = time.monotonic()
        with open(tmp_path / "stdout", "w") as stdout, open(tmp_path / "stderr", "w") as stderr:
            script = subprocess.Popen(["bash", str(LAUNCH / "slurm" / "grpo.sbatch"), *job], env=env,
                                      cwd=tmp_path, stdout=stdout, stderr=stderr)
            seen = 0  # the most marked processes alive at once: the leftover check below is not vacuous
            while script.poll() is None and time.monotonic() - t0 < SLURM_SUBPROCESS_TIMEOUT_S:
                seen = max(seen, len(marked_processes(mark)))
                time.sleep(0.5)
            if script.poll() is None:
                script.kill()
            code = script.wait(timeout=30)
        elapsed = time.monotonic() - t0
        out = subprocess.CompletedProcess(script.args, code, (tmp_path / "stdout").read_text(),
                                          (tmp_path / "stderr").read_text())
        assert out.returncode == 0, out.stderr[-4000:]
        assert seen >= 6, f"only {seen} marked processes seen (2 ray start, their GCS, raylets, workers...)"
        steps = [line.split(maxsplit=2) for line in srun_log.read_text().splitlines()]
        ray_steps = [s for s in steps if len(s) == 3 and " start " in f" {s[2]} "]
        assert [s[1] for s in ray_steps] == nodes  # head on the first node, a worker on the second
        # The ports the head bound itself, read back by the script, are the ones Ray published.
        up = re.search(r"head up: GCS 127\.0\.0\.1:(\d+), dashboard http://127\.0\.0\.1:(\d+) on fake-node-0",
                       out.stderr)
        assert up, [line for line in out.stderr.splitlines() if line.startswith("grpo.sbatch:")]
        gcs, dash = int(up[1]), int(up[2])
        assert gcs > 0 and dash > 0 and gcs != dash
        head_temp = Path(temp_root) / "fake-node-0"
        assert (head_temp / "ray_current_cluster").read_text().strip().rpartition(":")[2] == str(gcs)
        assert "--head" in ray_steps[0][2] and "--port=0" in ray_steps[0][2] and "--dashboard-port=0" in ray_steps[0][2]
        assert f"--address=127.0.0.1:{gcs}" in ray_steps[1][2]
        assert "--ray-client-server-port" not in ray_steps[0][2] and not list(
            head_temp.glob("session_*/logs/ray_client_server*"))  # RAYLLM_CLIENT_PORT=0: none started
        assert "2/2 Ray nodes alive" in out.stderr and "succeeded" in out.stderr
        summary = json.loads(out.stdout.strip().splitlines()[-1])
        assert summary["steps"] == 5 and summary["version"] == 5
        run = Path(summary["run_dir"])
        assert run.parent == tmp_path / "runs"
        assert json.loads((run / "summary.json").read_text())["steps"] == 5
        print(f"slurm script: 2 nodes, 5 steps in {elapsed:.0f}s; at most {seen} of its processes alive at once")
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
