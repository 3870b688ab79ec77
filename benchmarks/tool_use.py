"""A real model learns multi-turn tool use (issue Y, item 4): SmolLM2-135M-Instruct on the calculator environment
(examples/openenv_calculator: "What is 343 * 86?", a `calculator` and an `answer` action), an OpenEnv `Environment`
played in process, on this CPU.

Two runs of `examples/openenv_calculator/train.py --full`, each a subprocess, the same 64 held-out questions (the
seeds after the training rows'), each evaluated as one greedy episode:

- `base`: the model as it is (`--steps 0 sft.steps=0`, no step to schedule): its held-out success and tool use
  untrained;
- `run`: the example's `--full` preset: two SFT steps on demonstrated episodes, then GRPO within
  `trainer.time_budget_s`, the held-out evaluation after the warm start (`eval_before`) and after RL (`eval_after`).

Each part is kept as benchmarks/results/tool_use/<part>.json with its machine, commit, wall seconds and the CPU other
processes took; the run's also keeps its step records' reward and tool use per step, and the traces' last line (the
rows the viewer shows of one step, token by token; `rayllm-rl view <run_dir>` draws them).

    python benchmarks/tool_use.py                       # both parts (`make models` first; ~55 minutes)
    python benchmarks/tool_use.py --parts run -- rollout.prompts_per_step=4   # one part, overrides after --
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from machine import Contention, machine_info  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "tool_use"
EXAMPLE = ROOT / "examples" / "openenv_calculator" / "train.py"
RUN_TIMEOUT_S = 5400
PARTS = {"base": ["--steps", "0", "sft.steps=0", "optim.lr_schedule=constant"], "run": []}


def run_part(part: str, backend: str, overrides: list[str], python: str) -> dict:
    out = ROOT / "runs" / "benchmarks" / "tool_use" / part  # the run dirs (checkpoints too) stay out of git
    argv = [python, str(EXAMPLE), "--full", "--backend", backend, "--out", str(out), *PARTS[part], *overrides]
    Contention.mark_environment(f"tool-use-{part}")
    with Contention(f"tool-use-{part}") as cpu:
        proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} exited {proc.returncode}:\n{proc.stderr[-4000:]}")
    result = json.loads(next(x for x in reversed(proc.stdout.splitlines()) if x.startswith('{"example"')))
    records = [json.loads(x) for x in (Path(result["run_dir"]) / "metrics.jsonl").read_text().splitlines() if x]
    keys = ("step", "reward", "tool_calls", "invalid_actions", "env_done", "num_turns", "reward_calculated_answer",
            "wait_s", "train_s", "time_s")
    steps = [{k: r[k] for k in keys if k in r} for r in records if r.get("phase") == "rl"]
    sft = [{k: r[k] for k in ("sft_step", "loss", "time_s") if k in r} for r in records if r.get("phase") == "sft"]
    traces = Path(result["run_dir"]) / "traces.jsonl"
    lines = traces.read_text().splitlines() if traces.exists() else []
    sample = json.loads(lines[-1]) if lines else None
    return {"part": part, "argv": argv[1:], "machine": machine_info(), "result": result, "sft": sft, "steps": steps,
            "last_traces": sample, "our_cpu_s": round(cpu.ours_s, 1), "other_cpu_s": round(cpu.other_s, 1),
            "wall_s": round(cpu.wall_s, 1)}


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", nargs="+", choices=list(PARTS), default=list(PARTS))
    parser.add_argument("--backend", choices=("local", "ray"), default="ray",
                        help="ray: the --full preset serves with vLLM, which runs in Ray replica actors")
    parser.add_argument("--python", default=str(ROOT / ".venv-envs" / "bin" / "python"),
                        help="a Python with openenv (make builds .venv-envs)")
    parser.add_argument("overrides", nargs="*", help="job overrides for every part (after --)")
    args = parser.parse_args(argv)
    RESULTS.mkdir(parents=True, exist_ok=True)
    for part in args.parts:
        kept = run_part(part, args.backend, args.overrides, args.python)
        (RESULTS / f"{part}.json").write_text(json.dumps(kept, indent=1) + "\n")
        r = kept["result"]
        print(json.dumps({"part": part, "eval_before": r["eval_before"].get("eval_reward"),
                          "eval_after": r["eval_after"].get("eval_reward"), "steps": r["steps"],
                          "wall_s": kept["wall_s"], "other_cpu_s": kept["other_cpu_s"]}))


if __name__ == "__main__":
    main(sys.argv[1:])
