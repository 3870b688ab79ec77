"""Start a local `ray start --head` (token auth on, dashboard on 127.0.0.1), submit a job, stop the head.

    .venv/bin/python jobs/submit_local.py [key.sub=value ...]

runs `ray job submit --working-dir . -- python jobs/grpo.py [overrides]` against that head,
streams the job's logs, prints the job's final JSON summary as the last stdout line, and stops
only the Ray processes it started (its own process group and temp dir).

The head binds every port it listens on itself (GCS, dashboard, job agent: port 0) and starts no
Ray client server; the GCS and dashboard addresses are read back from where Ray publishes them
(launch/ray_head/rayllm_ray_head.py). No port is picked here and bound later by another process.

Every wait is bounded (seconds, from the environment):
  RAYLLM_HEAD_TIMEOUT_S   (120)  until the head is up and its dashboard answers the job API
  RAYLLM_AGENT_TIMEOUT_S  (120)  until the head's job agent accepts the submission
  RAYLLM_JOB_TIMEOUT_S   (1800)  until the job ends, once submitted
The auth token lives in the head's own temp dir (RAY_AUTH_TOKEN_PATH); nothing in HOME is used.
"""
from __future__ import annotations

import json
import os
import queue
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "launch" / "ray_head"))
sys.path.insert(0, str(ROOT))  # run from a checkout without install

import rayllm_ray_head  # noqa: E402
from rayllm_rl.orchestration.ray.actor_env import runtime_env_json  # noqa: E402  (imports nothing heavy)

RAY_BIN = str(Path(sys.executable).parent / "ray")
AGENT_NOT_READY = "No available agent to submit job"
"""What the dashboard answers a submission while its job agent has not registered yet."""
SUBMITTED = "submitted successfully"
"""What `ray job submit` prints once the job exists (a later failure is the job's, never retried)."""
PROBE_TIMEOUT_S = 30.0
"""Bound on one `ray job list` probe."""
RETRY_PAUSE_S = 1.0


def env_seconds(name: str, default: float) -> float:
    """A positive number of seconds from the environment; ValueError naming the variable otherwise."""
    raw = os.environ.get(name, "")
    try:
        value = float(raw) if raw else default
    except ValueError:
        raise ValueError(f"{name}={raw!r}: expected a number of seconds") from None
    if value <= 0:
        raise ValueError(f"{name}={raw!r}: expected a positive number of seconds")
    return value


def ray_env(token_path: str) -> dict[str, str]:
    """Token auth on, with this run's own token file (nothing read from or written to HOME)."""
    env = dict(os.environ, RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=token_path)
    env.pop("RAY_AUTH_TOKEN", None)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"  # `python` = this venv
    env.pop("RAY_ADDRESS", None)
    return env


def write_token(temp_dir: str) -> str:
    """A fresh auth token for this head, readable only by this user."""
    path = os.path.join(temp_dir, "auth_token")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32))
    return path


def head_env(token_path: str) -> dict[str, str]:
    """`ray_env` plus the start hook that leaves out the Ray client server (no port 0 for it in Ray)."""
    env = ray_env(token_path)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (rayllm_ray_head.HOOK_DIR, env.get("PYTHONPATH")) if p)
    env["RAY_START_HOOK"] = rayllm_ray_head.HOOK
    # The head is stopped only after its job ended: Ray's SIGTERM drain (for Serve on Kubernetes) would only
    # wait out its 30 s (measured: the stop took 30.1 s with it).
    env["RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S"] = "0"
    return env


def start_head(temp_dir: str, token_path: str, timeout_s: float) -> tuple[subprocess.Popen, str]:
    """Start the head in its own process group; (process, dashboard address) once its job API answers.

    The GCS, the dashboard and the job agent bind port 0 themselves: a port picked free here could be
    taken (another Ray on this machine, Ray's own random ports) before the head binds it. A failed start
    stops the head and raises the original error."""
    head = subprocess.Popen(
        [RAY_BIN, "start", "--head", "--block", "--port=0", "--dashboard-host=127.0.0.1", "--dashboard-port=0",
         "--dashboard-agent-listen-port=0", f"--temp-dir={temp_dir}", "--num-cpus=2", "--include-dashboard=true",
         "--disable-usage-stats"],
        env=head_env(token_path), start_new_session=True, stdout=sys.stderr, stderr=sys.stderr,
    )
    try:
        deadline = time.monotonic() + timeout_s
        gcs = wait_for_gcs_address(head, temp_dir, deadline)
        address = read_dashboard_address(gcs, token_path, deadline)
        wait_for_dashboard(head, address, token_path, max(1.0, deadline - time.monotonic()))
    except BaseException:
        stop_head(head)
        raise
    return head, address


def wait_for_gcs_address(head: subprocess.Popen, temp_dir: str, deadline: float) -> str:
    """The GCS host:port `ray start` writes to its temp dir once the head is up (dashboard included).

    RuntimeError if the head exits first, TimeoutError (naming RAYLLM_HEAD_TIMEOUT_S) at `deadline`."""
    while True:
        address = rayllm_ray_head.read_gcs_address(temp_dir)
        if address:
            return address
        if head.poll() is not None:
            raise RuntimeError(f"ray head exited with code {head.returncode} before it was up; "
                               f"see {os.path.join(temp_dir, 'session_latest', 'logs')}")
        if time.monotonic() >= deadline:
            raise TimeoutError(f"ray head was not up (no {rayllm_ray_head.ADDRESS_FILE} in {temp_dir}) within "
                               "RAYLLM_HEAD_TIMEOUT_S; raise it on a slow machine, or see the head's logs in "
                               f"{os.path.join(temp_dir, 'session_latest', 'logs')}")
        time.sleep(0.5)


def read_dashboard_address(gcs: str, token_path: str, deadline: float) -> str:
    """The dashboard's http address, as it published it in the head's GCS (a subprocess with the head's auth)."""
    timeout_s = max(1.0, min(PROBE_TIMEOUT_S, deadline - time.monotonic()))
    try:
        out = subprocess.run([sys.executable, rayllm_ray_head.__file__, "dashboard", gcs, str(timeout_s)],
                             env=ray_env(token_path), capture_output=True, text=True, timeout=timeout_s + 10)
    except subprocess.TimeoutExpired:
        raise TimeoutError(f"could not read the dashboard address from the GCS at {gcs} "
                           f"within {timeout_s:.0f}s") from None
    if out.returncode != 0 or not out.stdout.strip().startswith("http://"):
        raise RuntimeError(f"could not read the dashboard address from the GCS at {gcs}: "
                           f"{last_line(out.stderr or out.stdout) or f'exit {out.returncode}'}")
    return out.stdout.strip()


def wait_for_dashboard(head: subprocess.Popen, address: str, token_path: str, timeout_s: float) -> None:
    """Poll `ray job list` (the dashboard's job API, through token auth) until it answers.

    This says the dashboard is up; its job agent may register later, which `submit` handles.
    RuntimeError if the head exits, TimeoutError after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    last = ""
    while True:
        if head.poll() is not None:
            raise RuntimeError(f"ray head exited with code {head.returncode} before its dashboard answered")
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError(f"ray head's job API at {address} did not answer within {timeout_s:.0f}s; "
                               f"last answer: {last or '(none)'}")
        try:
            probe = subprocess.run([RAY_BIN, "job", "list", f"--address={address}"], env=ray_env(token_path),
                                   capture_output=True, text=True, timeout=min(PROBE_TIMEOUT_S, remaining))
        except subprocess.TimeoutExpired:
            last = "`ray job list` did not return"
            continue
        if probe.returncode == 0:
            return
        last = last_line(probe.stderr or probe.stdout)
        time.sleep(min(RETRY_PAUSE_S, max(0.0, deadline - time.monotonic())))


def stop_head(head: subprocess.Popen) -> None:
    """Stop the head and everything it started (its own process group), nothing else."""
    try:
        os.killpg(head.pid, signal.SIGTERM)
        head.wait(timeout=30)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        pass
    try:
        os.killpg(head.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    try:
        head.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass


def last_line(text: str) -> str:
    lines = [line.strip() for line in (text or "").splitlines() if line.strip()]
    return lines[-1][:300] if lines else ""


def agent_not_ready(log: str) -> bool:
    """The submission was refused because the job agent has not registered: no job was created."""
    return AGENT_NOT_READY in log and SUBMITTED not in log


def submit(address: str, token_path: str, overrides: list[str], agent_timeout_s: float,
           job_timeout_s: float, logs_dir: str = "", entrypoint: list[str] | None = None) -> tuple[int, str]:
    """`ray job submit` of `python jobs/grpo.py OVERRIDES` (or `entrypoint`), streaming the job's logs to stderr;
    (exit code, output).

    A submission refused with "No available agent to submit job" is retried every few seconds
    until `agent_timeout_s`, then TimeoutError (pointing at the agent's log under `logs_dir`); the
    job itself must end within `job_timeout_s`."""
    agent_deadline = time.monotonic() + agent_timeout_s
    attempt = 0
    while True:
        attempt += 1
        code, log = submit_once(address, token_path, overrides, job_timeout_s, entrypoint)
        if code == 0 or not agent_not_ready(log):
            return code, log
        if time.monotonic() + RETRY_PAUSE_S >= agent_deadline:
            raise TimeoutError(f"the job agent of the ray head at {address} did not accept the job within "
                               f"{agent_timeout_s:.0f}s ({attempt} submissions refused: {AGENT_NOT_READY!r}); "
                               f"see {os.path.join(logs_dir, 'dashboard_agent.log') if logs_dir else 'the agent log'} "
                               "for why it did not start, or raise RAYLLM_AGENT_TIMEOUT_S on a slow machine")
        sys.stderr.write(f"submit_local: job agent not registered yet (try {attempt}); retrying in "
                         f"{RETRY_PAUSE_S:.0f}s\n")
        time.sleep(RETRY_PAUSE_S)


def submit_once(address: str, token_path: str, overrides: list[str], timeout_s: float,
                entrypoint: list[str] | None = None) -> tuple[int, str]:
    """One `ray job submit` run; its output is echoed to stderr as it comes. TimeoutError after `timeout_s`."""
    # the actors' environment in the job's runtime env: they start in the job's own workers (actors.JobEnvActorClass)
    cmd = [RAY_BIN, "job", "submit", f"--address={address}", f"--working-dir={ROOT}",
           f"--runtime-env-json={runtime_env_json()}", "--", *(entrypoint or ["python", "jobs/grpo.py", *overrides])]
    proc = subprocess.Popen(cmd, env=ray_env(token_path), cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        log = stream_output(proc, time.monotonic() + timeout_s)
    except TimeoutError:
        proc.kill()
        proc.wait(timeout=30)
        raise TimeoutError(f"ray job submit did not finish within {timeout_s:.0f}s "
                           "(RAYLLM_JOB_TIMEOUT_S)") from None
    return proc.wait(timeout=60), log


def stream_output(proc: subprocess.Popen, deadline: float) -> str:
    """Echo `proc`'s stdout lines to stderr until it closes; TimeoutError at `deadline`, even when silent."""
    lines: queue.Queue = queue.Queue()

    def pump() -> None:
        for line in proc.stdout:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=pump, daemon=True).start()
    out: list[str] = []
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError
        try:
            line = lines.get(timeout=min(remaining, 5.0))
        except queue.Empty:
            continue
        if line is None:
            return "".join(out)
        out.append(line)
        sys.stderr.write(line)


def main(argv: list[str]) -> dict:
    if not any(a.startswith("trainer.storage_root=") for a in argv) and not os.environ.get("RAYLLM_STORAGE_ROOT"):
        # The job runs in an uploaded copy of the working dir (its own default root: ~/rayllm_results on the
        # head): on this one machine, a relative trainer.run_dir goes into this checkout (runs/grpo/<stamp>).
        argv = [*argv, f"trainer.storage_root={ROOT}"]
    head_timeout_s = env_seconds("RAYLLM_HEAD_TIMEOUT_S", 120.0)
    agent_timeout_s = env_seconds("RAYLLM_AGENT_TIMEOUT_S", 120.0)
    job_timeout_s = env_seconds("RAYLLM_JOB_TIMEOUT_S", 1800.0)
    temp_dir = tempfile.mkdtemp(prefix="rayhead-", dir="/tmp")
    token_path = write_token(temp_dir)
    head, address = start_head(temp_dir, token_path, head_timeout_s)
    try:
        code, log = submit(address, token_path, argv, agent_timeout_s, job_timeout_s,
                           logs_dir=os.path.join(temp_dir, "session_latest", "logs"))
    finally:
        stop_head(head)
    summaries = [json.loads(x) for x in log.splitlines() if x.startswith("{") and "eval_reward_after" in x]
    if code != 0 or "succeeded" not in log or not summaries:
        raise SystemExit(f"ray job failed (exit {code}); see the log above and the head's logs in {temp_dir}")
    shutil.rmtree(temp_dir, ignore_errors=True)
    print(json.dumps(summaries[-1]), flush=True)
    return summaries[-1]


if __name__ == "__main__":
    main(sys.argv[1:])
