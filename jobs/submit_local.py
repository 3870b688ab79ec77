"""Start a local `ray start --head` (token auth on, dashboard on 127.0.0.1), submit a job, stop the head.

    .venv/bin/python jobs/submit_local.py [key.sub=value ...]

runs `ray job submit --working-dir . -- python jobs/grpo.py [overrides]` against that head,
streams the job's logs, prints the job's final JSON summary as the last stdout line, and stops
only the Ray processes it started (its own process group and temp dir).
"""
from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without install

from rayllm_rl.weight_sync.gloo_group import find_free_port  # noqa: E402


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


def start_head(temp_dir: str, token_path: str, timeout_s: float = 120.0) -> tuple[subprocess.Popen, str]:
    gcs, dash = find_free_port(), find_free_port()
    ray_bin = str(Path(sys.executable).parent / "ray")
    head = subprocess.Popen(
        [ray_bin, "start", "--head", "--block", f"--port={gcs}", "--dashboard-host=127.0.0.1",
         f"--dashboard-port={dash}", f"--temp-dir={temp_dir}", "--num-cpus=2", "--include-dashboard=true",
         "--disable-usage-stats"],
        env=ray_env(token_path), start_new_session=True, stdout=sys.stderr, stderr=sys.stderr,
    )
    address = f"http://127.0.0.1:{dash}"
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if head.poll() is not None:
            raise RuntimeError(f"ray head exited with code {head.returncode}")
        probe = subprocess.run([ray_bin, "job", "list", f"--address={address}"], env=ray_env(token_path),
                               capture_output=True, text=True, timeout=60)
        if probe.returncode == 0:
            return head, address
        time.sleep(2)
    stop_head(head)
    raise TimeoutError(f"ray head's job server at {address} not ready within {timeout_s:.0f}s")


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


def submit(address: str, token_path: str, overrides: list[str], timeout_s: float) -> tuple[int, str]:
    cmd = [str(Path(sys.executable).parent / "ray"), "job", "submit", f"--address={address}",
           f"--working-dir={ROOT}", "--", "python", "jobs/grpo.py", *overrides]
    proc = subprocess.Popen(cmd, env=ray_env(token_path), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    deadline = time.time() + timeout_s
    for line in proc.stdout:
        lines.append(line)
        sys.stderr.write(line)
        if time.time() > deadline:
            proc.kill()
            raise TimeoutError(f"ray job submit did not finish within {timeout_s:.0f}s")
    return proc.wait(timeout=60), "".join(lines)


def main(argv: list[str]) -> dict:
    if not any(a.startswith("trainer.run_dir=") for a in argv):
        # The job runs in an uploaded copy of the working dir: write outputs into this checkout.
        argv = [*argv, f"trainer.run_dir={ROOT / 'runs' / 'grpo'}"]
    temp_dir = tempfile.mkdtemp(prefix="rayhead-", dir="/tmp")
    token_path = write_token(temp_dir)
    head, address = start_head(temp_dir, token_path)
    try:
        code, log = submit(address, token_path, argv, timeout_s=float(os.environ.get("RAYLLM_JOB_TIMEOUT_S", 1800)))
    finally:
        stop_head(head)
    summaries = [json.loads(x) for x in log.splitlines() if x.startswith("{") and "eval_reward_after" in x]
    if code != 0 or "succeeded" not in log or not summaries:
        raise SystemExit(f"ray job failed (exit {code}); see the log above")
    print(json.dumps(summaries[-1]), flush=True)
    return summaries[-1]


if __name__ == "__main__":
    main(sys.argv[1:])
