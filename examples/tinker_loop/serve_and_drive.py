"""`rayllm-rl serve --backend ray` and, in another process, grpo.py's loop through the unmodified tinker SDK: what
a Ray job runs to serve Tinker's API on the cluster's roles and train against it.

    ray job submit --working-dir . -- python examples/tinker_loop/serve_and_drive.py --steps 10

The server joins the job's Ray (RAY_ADDRESS) and puts the learner and the replica on it; this process waits for its
listening line (bounded), runs the loop as a client (`grpo.py --base-url`), prints the loop's summary, then stops
the server (SIGTERM: it closes its roles) and exits with the server's status.
"""
import json, os, queue, secrets, signal, subprocess, sys, threading  # noqa: E401
from pathlib import Path

HERE = Path(__file__).resolve().parent
START_TIMEOUT_S, STOP_TIMEOUT_S = 600.0, 120.0


def main(argv: list[str]) -> int:
    from rayllm_rl.models.tiny import ensure_tiny_model

    key = f"tml-{secrets.token_hex(8)}"
    server = subprocess.Popen([sys.executable, "-m", "rayllm_rl", "serve", ensure_tiny_model(), "--backend", "ray",
                               "--api-key", key, "ray.dashboard=false"], stdout=subprocess.PIPE, text=True)
    lines: queue.Queue = queue.Queue()

    def read():
        for x in server.stdout:
            lines.put(x)
        lines.put(None)

    threading.Thread(target=read, daemon=True).start()
    try:
        while True:  # the listening line (a `Ray dashboard:` line may come first)
            line = lines.get(timeout=START_TIMEOUT_S)
            if line is None:
                raise SystemExit(f"rayllm-rl serve exited ({server.wait(30)}) before it listened")
            print(line, end="", flush=True)
            if line.startswith("rayllm-rl serve: listening on "):
                url = line.rsplit(" ", 1)[1].strip()
                break
        env = {**os.environ, "TINKER_API_KEY": key, "TINKER_TELEMETRY": "0"}
        client = subprocess.run([sys.executable, str(HERE / "grpo.py"), "--base-url", url, *argv], env=env,
                                capture_output=True, text=True, timeout=START_TIMEOUT_S)
        sys.stderr.write(client.stderr[-4000:])
        if client.returncode != 0:
            raise SystemExit(f"the client exited {client.returncode}")
        summary = json.loads(client.stdout.strip().splitlines()[-1])
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            code = server.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            server.kill()
            raise SystemExit(f"rayllm-rl serve did not stop within {STOP_TIMEOUT_S:g} s of SIGTERM") from None
    print(json.dumps({**summary, "server": "rayllm-rl serve --backend ray", "server_exit": code}), flush=True)
    return code


if __name__ == "__main__":
    sys.path.insert(0, str(HERE.parents[1]))
    sys.exit(main(sys.argv[1:]))
