"""RL throughput of the whole loop: Ray and the single-process backend at eta=0 and eta=1, one run.

Same driver and workload for all: the untrained tiny model (no SFT), `--prompts` prompts x
`--group` samples x `--new-tokens` tokens per step, `--steps` steps, one torch thread per actor
(Ray) and the same total threads for the single process. Reports trained sequences per second of
RL over the steps after `--warmup-steps`, and a per-step time breakdown: `generation_wait` (the
driver waiting for a batch: generation the learner step could not overlap), `training`, `sync`
(weights into the engines) and `control` (the rest of the step: round trips, advantages, metrics).

Goal: Ray eta=1 >= 1.3x the single-process backend (`local_eta0`, the synchronous one-process
loop, and `local_eta1`, the same process overlapping generation with training in a thread).

    .venv/bin/python benchmarks/end_to_end.py [--steps 40] [--out benchmarks/results/end_to_end.json]

The last stdout line is the JSON result; it is also written, indented, to `--out`.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

GOAL = 1.3


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--warmup-steps", type=int, default=3, help="first steps left out (start-up)")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=10)
    p.add_argument("--modes", default="local_eta0,local_eta1,ray_eta0,ray_eta1")
    p.add_argument("--out", default="benchmarks/results/end_to_end.json")
    return p.parse_args(argv)


def config(mode: str, args, run_root: str):
    from rayllm_rl.config import load_config
    from rayllm_rl.job.config import GRPOJobConfig

    kind, eta = mode.split("_eta")
    backend = [f"trainer.backend={kind}", f"rollout.max_staleness={eta}"]
    if kind == "local":
        backend.append("trainer.num_threads=2")
    return load_config(GRPOJobConfig, [
        "sft.steps=0", f"trainer.steps={args.steps}", "trainer.eval_every=0", "trainer.log_every=1000",
        "trainer.time_budget_s=0", "data.eval_size=16", f"rollout.prompts_per_step={args.prompts}",
        f"rollout.group_size={args.group}", f"rollout.max_new_tokens={args.new_tokens}",
        f"trainer.run_dir={run_root}/{mode}", *backend,
    ])


def measure(mode: str, args, run_root: str) -> dict:
    from rayllm_rl.api.entry import train

    summary = train(config(mode, args, run_root))
    records = [json.loads(x) for x in (Path(summary["run_dir"]) / "metrics.jsonl").read_text().splitlines()]
    rl = [r for r in records if r["phase"] == "rl"]
    kept = rl[args.warmup_steps:]
    # Step i's wall time: from the previous step's record to this one's.
    walls = [b["time_s"] - a["time_s"] for a, b in zip(rl[args.warmup_steps - 1:], kept)]
    span = sum(walls)
    seqs = sum(r["seqs"] for r in kept)
    mean = lambda key: statistics.fmean(r[key] for r in kept)  # noqa: E731
    step = statistics.fmean(walls)
    breakdown = {"generation_wait": mean("wait_s"), "training": mean("train_s"), "sync": mean("sync_seconds")}
    breakdown["control"] = step - sum(breakdown.values())
    return {"mode": mode, "steps_measured": len(kept), "seconds": round(span, 2), "seqs_per_s": seqs / span,
            "step_s": step, "breakdown_s": {k: round(v, 4) for k, v in breakdown.items()},
            "max_version_lag": summary.get("max_version_lag", 0), "failed_episodes": summary["failed_episodes"]}


def main(argv=None) -> dict:
    args = parse_args(argv)
    run_root = tempfile.mkdtemp(prefix="rayllm-e2e-")
    results = {m: measure(m, args, run_root) for m in args.modes.split(",")}
    out = {"workload": {"prompts": args.prompts, "group": args.group, "new_tokens": args.new_tokens,
                        "steps": args.steps, "warmup_steps": args.warmup_steps, "model": "untrained tiny Qwen2"},
           "machine": {"cpu_count": os.cpu_count(), "platform": platform.platform()}, "results": results, "goal": GOAL}
    for base in ("local_eta0", "local_eta1"):
        for m in results:
            if base in results and m != base and m.startswith("ray"):
                out[f"{m}_vs_{base}"] = results[m]["seqs_per_s"] / results[base]["seqs_per_s"]
    ratios = [v for k, v in out.items() if k.startswith("ray_eta1_vs_")]
    if ratios:
        out["meets_goal"] = min(ratios) >= GOAL
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))
    print(json.dumps(out), flush=True)
    return out


if __name__ == "__main__":
    main()
