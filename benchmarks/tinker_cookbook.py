"""tinker-cookbook's arithmetic RL recipe, unmodified, against `rayllm-rl serve` on this machine (issue X, item 5).

The cookbook (`tinker-cookbook==0.5.8`, the newest this workplace's PyPI installs) pins `transformers<=5.5.4`, which
conflicts with ours, so it lives in its own venv, `.venv-cookbook/` in the repository root (made here when missing:
the CPU `torch==2.13.0` first, from this machine's wheel directory, then `tinker-cookbook[math-rl]==0.5.8`; the
math-rl extra because `recipes/math_rl/train.py` imports the math env's grader even for `env=arithmetic`). Then:

1. the model: SmolLM2-135M-Instruct's GGUF (`--model`, default `models/...Q4_1.gguf`, `make models`) resolved to
   its cached Hugging Face conversion, a local directory: the cookbook's `model_name` must be one, its tokenizer
   loads with `AutoTokenizer.from_pretrained` when `os.path.isdir(model_name)` (`tokenizer_utils._get_hf_tokenizer`)
   and it is also the server's base model name;
2. `rayllm-rl serve <dir> --port 0 --api-key KEY` (our venv), in a scratch directory;
3. `python -m tinker_cookbook.recipes.math_rl.train env=arithmetic model_name=<dir> renderer_name=qwen3_instruct
   loss_fn=importance_sampling base_url=http://127.0.0.1:PORT ...` (the cookbook's venv; `TINKER_API_KEY` set,
   `TINKER_TELEMETRY=0`). `qwen3_instruct` renders ChatML, `<|im_start|>role\\n...<|im_end|>\\n`, token for token as
   SmolLM2's chat template does given a system message (the recipe sends none, so the template's default system
   prompt is absent), and stops on the `<|im_end|>` token id (2 in SmolLM2's vocabulary);
4. `GET /api/v1/rayllm/timings` (the server's accumulated HTTP, codec and service time), then SIGTERM.

Writes benchmarks/results/<--name>/ (default tinker_cookbook): `summary.json` (the command lines, seconds per
step, the reward curve, where the time went, the machine: `benchmarks/machine.py`, and the CPU other processes
took meanwhile), `metrics.jsonl` and `config.json` (the cookbook's own), `server_timings.json`, and the tails of
both processes' output. Prints the summary as JSON.

    .venv/bin/python benchmarks/tinker_cookbook.py [--steps 60] [--groups-per-batch 4] [--group-size 8] \
        [--learning-rate 3e-4] [--lora-rank 8]
"""
from __future__ import annotations

import argparse
import json
import os
import queue
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
RESULTS = ROOT / "benchmarks" / "results"
COOKBOOK = "tinker-cookbook[math-rl]==0.5.8"
TORCH = "torch==2.13.0"
API_KEY = "tml-rayllm-bench"
LISTENING = "rayllm-rl serve: listening on http://127.0.0.1:"
SERVE_START_S = 300.0
"""How long the server may take to say it listens."""
STOP_S = 150.0
"""How long the server may take to stop after SIGTERM (it closes the service within 120 s, main.py)."""


def cookbook_python(venv: Path) -> Path:
    """The cookbook venv's python, the venv made and filled first when it cannot import the cookbook."""
    python = venv / "bin" / "python"
    if python.exists() and subprocess.run([str(python), "-c", "import tinker_cookbook.recipes.math_rl.train"],
                                          capture_output=True, timeout=300).returncode == 0:
        return python
    print(f"tinker_cookbook: making {venv} ({TORCH}, then {COOKBOOK})", file=sys.stderr, flush=True)
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    for spec in (TORCH, COOKBOOK):  # torch first: the CPU wheel on disk, not a CUDA build from the index
        subprocess.run([str(python), "-m", "pip", "install", "-q", spec], check=True, timeout=1800)
    return python


def versions(python: Path) -> dict:
    code = ("import importlib.metadata as m, json; print(json.dumps({p: m.version(p) for p in "
            "('tinker', 'tinker-cookbook', 'tml-renderers', 'transformers', 'torch')}))")
    return json.loads(subprocess.run([str(python), "-c", code], capture_output=True, text=True, check=True,
                                     timeout=120).stdout)


class Process:
    """A child whose output lines go to a log file and a queue (read by a thread, so no wait blocks on a pipe)."""

    def __init__(self, argv: list[str], cwd: Path, env: dict, log: Path):
        self.argv, self.log = argv, log
        self.lines: queue.Queue = queue.Queue()
        self._file = open(log, "w")
        self.proc = subprocess.Popen(argv, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, bufsize=1, start_new_session=True)
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        for line in self.proc.stdout:
            self._file.write(line)
            self._file.flush()
            self.lines.put(line)
        self.lines.put(None)

    def wait_for(self, prefix: str, timeout_s: float) -> str:
        """The first output line starting with `prefix`; RuntimeError naming the log if it exits or times out."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                line = self.lines.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                break
            if line is None:
                raise RuntimeError(f"{self.argv[:4]} exited ({self.proc.wait(30)}) before saying {prefix!r}; "
                                   f"see {self.log}")
            if line.startswith(prefix):
                return line.strip()
        raise RuntimeError(f"{self.argv[:4]} did not say {prefix!r} within {timeout_s:g} s; see {self.log}")

    def stop(self, timeout_s: float = STOP_S) -> int | None:
        """SIGTERM, then SIGKILL of its process group if it has not exited within `timeout_s`."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(30)
        self._file.close()
        return self.proc.returncode

    def tail(self, n: int = 40) -> list[str]:
        return self.log.read_text(errors="replace").splitlines()[-n:]


def server_timings(url: str) -> dict:
    req = urllib.request.Request(f"{url}/api/v1/rayllm/timings", headers={"X-API-Key": API_KEY})
    with urllib.request.urlopen(req, timeout=30) as response:
        return json.loads(response.read())


def cookbook_argv(python: Path, args, model_dir: str, url: str, log_path: Path) -> list[str]:
    return [str(python), "-m", "tinker_cookbook.recipes.math_rl.train", "env=arithmetic", f"model_name={model_dir}",
            f"renderer_name={args.renderer}", "loss_fn=importance_sampling", f"base_url={url}",
            f"log_path={log_path}", f"groups_per_batch={args.groups_per_batch}", f"group_size={args.group_size}",
            f"max_tokens={args.max_tokens}", f"lora_rank={args.lora_rank}", f"learning_rate={args.learning_rate}",
            f"max_steps={args.steps}", f"eval_every={args.eval_every}", f"save_every={args.save_every}",
            "behavior_if_log_dir_exists=delete", *args.cookbook_set]


def _mean(xs: list[float]) -> float | None:
    return round(statistics.fmean(xs), 4) if xs else None


def summarize(rows: list[dict], timings: dict, wall_s: float) -> dict:
    """Seconds per step, the reward curve and where the time went, from the cookbook's metrics and the server's
    timings. Steps after the first are the steady state (the first also pays the first sample's and the first
    optimizer step's warm-up)."""
    steps = [r for r in rows if "time/total" in r]
    per_step = [float(r["time/total"]) for r in steps]
    steady = per_step[1:] or per_step
    k = max(1, min(5, len(steps) // 4))
    reward = [round(float(r["env/all/reward/total"]), 4) for r in steps]
    correct = [round(float(r["env/all/correct"]), 4) for r in steps]
    fmt = [round(float(r["env/all/format"]), 4) for r in steps]
    client = {key: round(sum(float(r.get(f"time/{key}", 0.0)) for r in steps), 3)
              for key in ("total", "sampling", "train_step", "save_checkpoint")}
    service = timings.get("service", {})
    startup = {"create_training_client", "get_info"}
    saves = {"save_state", "save_weights_for_sampler"}  # checkpoints: the final one, after the last step
    lanes = timings.get("lanes", {})
    learner_s = lanes.get("training", {}).get("busy_s", 0.0) - sum(service.get(k, {}).get("busy_s", 0.0)
                                                                    for k in startup | saves)
    engine_s = lanes.get("sampling", {}).get("busy_s", 0.0)
    handling_s = timings.get("handling_s", 0.0)
    codec_s = sum(c["total_s"] for c in timings.get("codec", {}).values())
    total = client["total"] or 1e-9
    outside = total - engine_s - learner_s
    n = max(len(steps), 1)
    return {
        "steps": len(steps), "wall_s": round(wall_s, 1),
        "s_per_step": {"mean": _mean(per_step), "median": round(statistics.median(per_step), 3) if per_step else None,
                       "mean_after_first": _mean(steady), "first": per_step[0] if per_step else None},
        "reward_curve": reward, "correct_curve": correct, "format_curve": fmt,
        "reward_first_k_mean": _mean(reward[:k]), "reward_last_k_mean": _mean(reward[-k:]),
        "correct_first_k_mean": _mean(correct[:k]), "correct_last_k_mean": _mean(correct[-k:]),
        "format_first_k_mean": _mean(fmt[:k]), "format_last_k_mean": _mean(fmt[-k:]), "k": k,
        "time_split": {
            "client_step_s": client,
            "engine_busy_s": round(engine_s, 3), "learner_busy_s": round(learner_s, 3),
            "outside_service_s": round(outside, 3),
            "per_step_s": {"total": round(total / n, 3), "engine": round(engine_s / n, 3),
                           "learner": round(learner_s / n, 3), "outside_service": round(outside / n, 3)},
            "shares_of_step_time": {"engine": round(engine_s / total, 4), "learner": round(learner_s / total, 4),
                                    "outside_service": round(outside / total, 4)},
            "server_http_handling_s": round(handling_s, 3), "server_codec_s": round(codec_s, 3),
            "server_startup_s": {k: service[k]["busy_s"] for k in startup if k in service},
            "server_checkpoint_s": {k: service[k]["busy_s"] for k in saves if k in service},
            "note": "client_step_s sums the cookbook's own per-step times (time/total: sampling, training, the "
                    "weight sync, its bookkeeping). engine_busy_s and learner_busy_s are the wall seconds the "
                    "server had a call outstanding on the engine (sample) or on the learner (the training lane: "
                    "forward_backward, optim_step and the weight sync; start-up calls and checkpoints excluded); the "
                    "cookbook's sync loop never runs the two at once. outside_service_s is the step time left: "
                    "no call was on the engine or the learner (HTTP round trips, the SDK, the cookbook's own "
                    "work, gaps). server_http_handling_s is the server's own time on requests (arrival to "
                    "response, less the long polls' waiting; the protobuf codec, server_codec_s, inside it): most "
                    "of it overlaps the engine's work (later samples arrive while earlier ones run), so it is not "
                    "a part of the step time to add."}}


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="models/SmolLM2-135M-Instruct.Q4_1.gguf",
                    help="a GGUF file, an HF directory or a hub id (resolved as model.path is)")
    ap.add_argument("--steps", type=int, default=60, help="the cookbook's max_steps")
    ap.add_argument("--groups-per-batch", type=int, default=4)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=5, help="the recipe's default (an answer and <|im_end|>)")
    ap.add_argument("--lora-rank", type=int, default=8, help="0 = full fine-tuning (the server allows it)")
    ap.add_argument("--learning-rate", type=float, default=3e-4)
    ap.add_argument("--renderer", default="qwen3_instruct")
    ap.add_argument("--eval-every", type=int, default=0, help="the arithmetic env has no test set: 0")
    ap.add_argument("--save-every", type=int, default=0, help="periodic checkpoints (0: only the final one)")
    ap.add_argument("--cookbook-set", nargs="*", default=[], metavar="key=value", help="more cookbook settings")
    ap.add_argument("--serve-set", nargs="*", default=[], metavar="key.sub=value", help="overrides for the roles")
    ap.add_argument("--backend", default="local", choices=("local", "ray"))
    ap.add_argument("--venv", default=str(ROOT / ".venv-cookbook"))
    ap.add_argument("--timeout", type=float, default=2700.0, help="seconds the cookbook may run")
    ap.add_argument("--name", default="tinker_cookbook", help="results/<name>/")
    return ap.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    from machine import Contention, machine_info

    from rayllm_rl.hub import resolve_model_path

    python = cookbook_python(Path(args.venv))
    model_dir = resolve_model_path(str(ROOT / args.model) if (ROOT / args.model).exists() else args.model)
    run_id = f"tinker_cookbook-{os.getpid()}-{time.time():.0f}"
    Contention.mark_environment(run_id)
    out = RESULTS / args.name
    out.mkdir(parents=True, exist_ok=True)
    result: dict = {"argv": sys.argv[1:] if argv is None else list(argv), "model": args.model, "model_dir": model_dir,
                    "machine": machine_info(), "cookbook_versions": versions(python)}
    with tempfile.TemporaryDirectory(prefix="tinker_cookbook-") as tmp_name:
        tmp = Path(tmp_name)
        env = dict(os.environ, TINKER_API_KEY=API_KEY, TINKER_TELEMETRY="0", PYTHONUNBUFFERED="1")
        serve = [sys.executable, "-m", "rayllm_rl", "serve", model_dir, "--port", "0", "--api-key", API_KEY,
                 "--backend", args.backend, "--state-dir", str(tmp / "state"), *args.serve_set]
        server = Process(serve, tmp, env, tmp / "serve.log")
        timings: dict = {}
        try:
            url = server.wait_for(LISTENING, SERVE_START_S).split(" on ", 1)[1]
            log_path = tmp / "cookbook"
            train = cookbook_argv(python, args, model_dir, url, log_path)
            result["commands"] = {"serve": " ".join(serve), "cookbook": " ".join(train),
                                  "env": "TINKER_API_KEY=" + API_KEY + " TINKER_TELEMETRY=0"}
            print(f"tinker_cookbook: {result['commands']['cookbook']}", file=sys.stderr, flush=True)
            t0 = time.perf_counter()
            with Contention(run_id) as contention:
                cookbook = Process(train, tmp, env, tmp / "cookbook.log")
                try:
                    code = cookbook.proc.wait(args.timeout)
                except subprocess.TimeoutExpired:
                    code = None
                    cookbook.stop(30)
                cookbook.stop(30)
            wall_s = time.perf_counter() - t0
            result["cookbook_exit"] = code
            result["contention"] = contention.report()
            timings = server_timings(url)
        finally:
            result["serve_exit"] = server.stop()
        for src, dst in ((log_path / "metrics.jsonl", "metrics.jsonl"), (log_path / "config.json", "config.json")):
            if src.exists():
                shutil.copyfile(src, out / dst)
        (out / "server_timings.json").write_text(json.dumps(timings, indent=1) + "\n")
        (out / "cookbook_tail.log").write_text("\n".join(cookbook.tail(60)) + "\n")
        (out / "serve_tail.log").write_text("\n".join(server.tail(40)) + "\n")
        metrics = log_path / "metrics.jsonl"
        rows = [json.loads(x) for x in metrics.read_text().splitlines() if x.strip()] if metrics.exists() else []
    result["settings"] = {k: getattr(args, k) for k in ("steps", "groups_per_batch", "group_size", "max_tokens",
                                                         "lora_rank", "learning_rate", "renderer", "backend")}
    result["summary"] = summarize(rows, timings, wall_s) if rows else {"error": "the cookbook wrote no metrics"}
    result["ok"] = result["cookbook_exit"] == 0 and bool(rows)
    (out / "summary.json").write_text(json.dumps(result, indent=1, default=str) + "\n")
    print(json.dumps(result, default=str))
    return result


if __name__ == "__main__":
    main()
