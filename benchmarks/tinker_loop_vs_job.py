"""A loop of your own on Tinker's primitives against the job, at full size (issue X, item 4): SmolLM2-135M-Instruct
on chain_sum at the SmolLM2 recipe's settings, on-policy, seed by seed, the two back to back (their order turning
each seed), on one backend:

- the job: `jobs/grpo.py config=recipe:smollm2-135m_reasoning-gym_cpu rollout.max_staleness=0 trainer.steps=N`;
- the loop: `examples/tinker_loop/full_size.py --steps N` (grpo.py's loop, the same rows, scorer, sampling, AdamW
  schedule, group advantages over the std and PPO's clip, through `TinkerService`).

Each side's gain per step (the greedy held-out score, 200 questions, after N steps minus before, over N), its
training reward per step, and its sequences per second (N x 64 over the RL seconds: the held-out evaluations are
off the clock on both). Each run is kept as benchmarks/results/tinker_loop_vs_job/<side>_seed<k>.json, with the
machine, the commit and the CPU other processes took during it, so seeds can be run in separate sittings (a seed at
15 steps takes ~20 minutes a pair on a 2-core machine); summary.json gathers every kept run of the same steps and
backend.

    python benchmarks/tinker_loop_vs_job.py --steps 15 --seeds 0 1            # `make models` first
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from machine import Contention, machine_info  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "tinker_loop_vs_job"
RECIPE = "config=recipe:smollm2-135m_reasoning-gym_cpu"
RUN_TIMEOUT_S = 3600


def last_json(text: str, key: str) -> dict:
    return json.loads(next(x for x in reversed(text.splitlines()) if x.startswith("{") and f'"{key}"' in x))


def run(argv: list[str], run_id: str) -> tuple[str, dict]:
    Contention.mark_environment(run_id)
    with Contention(run_id) as cpu:
        proc = subprocess.run([sys.executable, *argv], cwd=ROOT, capture_output=True, text=True,
                              timeout=RUN_TIMEOUT_S)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} exited {proc.returncode}:\n{proc.stderr[-4000:]}")
    return proc.stdout, {"our_cpu_s": round(cpu.ours_s, 1), "other_cpu_s": round(cpu.other_s, 1),
                         "wall_s": round(cpu.wall_s, 1)}


def job(steps: int, seed: int, backend: str, out: Path) -> dict:
    stdout, cpu = run(["jobs/grpo.py", RECIPE, "rollout.max_staleness=0", f"trainer.steps={steps}",
                       "optim.decay_steps=150", "trainer.eval_every=0", f"trainer.seed={seed}",
                       f"trainer.backend={backend}", f"trainer.run_dir={out / f'job_seed{seed}'}",
                       "trainer.checkpoint_every=0"], f"job-{seed}")
    s = last_json(stdout, "eval_reward_after")
    rows = [json.loads(x) for x in (Path(s["run_dir"]) / "metrics.jsonl").read_text().splitlines() if x.strip()]
    rewards = [r["reward"] for r in rows if r.get("phase") == "rl"]
    return {"side": "job", "seed": seed, "held_out_before": s["eval_reward_before"],
            "held_out_after": s["eval_reward_after"], "held_out_gain_per_step": s["eval_reward_gain"] / steps,
            "rewards": rewards, "rl_seconds": s["rl_seconds"], "sequences_per_s": steps * 64 / s["rl_seconds"],
            "cpu": cpu}


def loop(steps: int, seed: int, backend: str, out: Path) -> dict:
    stdout, cpu = run(["examples/tinker_loop/full_size.py", "--steps", str(steps), "--seed", str(seed), "--backend",
                       backend, f"trainer.run_dir={out / f'loop_seed{seed}'}"], f"loop-{seed}")
    s = last_json(stdout, "held_out_gain_per_step")
    return {"side": "tinker_loop", "seed": seed, **{k: s[k] for k in (
        "held_out_before", "held_out_after", "held_out_gain_per_step", "rewards", "sequences_per_s")}, "cpu": cpu}


def main(argv: list[str]) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=15)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    p.add_argument("--backend", choices=("local", "ray"), default="local")
    p.add_argument("--sides", nargs="+", choices=("job", "tinker_loop"), default=["job", "tinker_loop"],
                   help="run only these (a kept run of the other side stays in the summary)")
    a = p.parse_args(argv)
    RESULTS.mkdir(parents=True, exist_ok=True)
    out, t0 = ROOT / "runs" / "tinker_loop_vs_job", time.time()
    for seed in a.seeds:
        order = (job, loop) if seed % 2 == 0 else (loop, job)  # the order turns with the seed
        for side in [f for f in order if {job: "job", loop: "tinker_loop"}[f] in a.sides]:
            r = {**side(a.steps, seed, a.backend, out), "steps": a.steps, "backend": a.backend,
                 "machine": machine_info()}
            (RESULTS / f"{r['side']}_seed{seed}.json").write_text(json.dumps(r, indent=1))
            print(json.dumps({k: v for k, v in r.items() if k not in ("rewards", "machine")}), flush=True)
    runs = sorted((json.loads(f.read_text()) for f in RESULTS.glob("*_seed*.json")),
                  key=lambda r: (r["seed"], r["side"]))
    runs = [r for r in runs if r["steps"] == a.steps and r["backend"] == a.backend]

    def of(side: str, key: str) -> list[float]:
        return [r[key] for r in runs if r["side"] == side]

    table = {side: {"held_out_gain_per_step": of(side, "held_out_gain_per_step"),
                    "mean_gain_per_step": statistics.fmean(of(side, "held_out_gain_per_step")),
                    "train_reward_mean": [statistics.fmean(r) for r in of(side, "rewards")],
                    "sequences_per_s": of(side, "sequences_per_s")} for side in ("job", "tinker_loop")}
    summary = {"steps": a.steps, "seeds": sorted({r["seed"] for r in runs}), "backend": a.backend,
               "machine": machine_info(), "runs": runs,
               "table": table, "wall_s_this_sitting": round(time.time() - t0, 1)}
    (RESULTS / "summary.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps(table))
    return summary


if __name__ == "__main__":
    main(sys.argv[1:])
