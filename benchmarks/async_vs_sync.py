"""Asynchronous (eta=2) vs synchronous (eta=0) GRPO on the same workload, one torch thread per actor.

Runs the Ray driver twice on the tiny model (no SFT, fixed steps) and reports throughput
(trained sequences per second of RL) and the learner's idle fraction (1 - train time / RL
time). Goals: async >= 1.6x sync, learner idle <= 10%.

    .venv/bin/python benchmarks/async_vs_sync.py [--steps 30] [--replicas 1] [--out ...]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def run(eta: int, args, run_root: str) -> dict:
    from rayllm_rl.config import load_config
    from rayllm_rl.orchestration.driver import train
    from rayllm_rl.job.config import GRPOJobConfig
    from rayllm_rl.job.plan import make_plan

    cfg = load_config(GRPOJobConfig, [
        "sft.steps=0", f"trainer.steps={args.steps}", "trainer.eval_every=0", "trainer.log_every=1000",
        "data.eval_size=16", f"rollout.prompts_per_step={args.prompts}", f"rollout.group_size={args.group}",
        f"rollout.max_new_tokens={args.new_tokens}", f"rollout.max_staleness={eta}",
        f"ray.num_replicas={args.replicas}", f"ray.num_env_workers={args.replicas}",
        f"trainer.run_dir={run_root}/eta{eta}", "trainer.time_budget_s=0",
    ])
    summary = train(make_plan(cfg))
    records = [json.loads(x) for x in (Path(summary["run_dir"]) / "metrics.jsonl").read_text().splitlines()]
    rl = [r for r in records if r["phase"] == "rl"][args.warmup_steps:]  # skip start-up steps
    span = rl[-1]["time_s"] - rl[0]["time_s"] + (rl[0]["wait_s"] + rl[0]["train_s"])
    train_s = sum(r["train_s"] for r in rl)
    seqs = sum(r["seqs"] for r in rl)
    return {"eta": eta, "steps_measured": len(rl), "seconds": round(span, 2), "seqs_per_s": seqs / span,
            "learner_idle_fraction": 1 - train_s / span, "mean_wait_s": sum(r["wait_s"] for r in rl) / len(rl),
            "mean_train_s": train_s / len(rl), "mean_sync_s": sum(r["sync_seconds"] for r in rl) / len(rl),
            "mean_stall_s": sum(r["stall_s"] for r in rl) / len(rl),
            "max_staleness_seen": max(r["staleness_max"] for r in rl)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup-steps", type=int, default=3)
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=10)
    p.add_argument("--replicas", type=int, default=1)
    p.add_argument("--out", default="benchmarks/results/async_vs_sync.json")
    args = p.parse_args()
    import ray

    root = f"/tmp/rayllm-bench-{os.getpid()}"
    results = {}
    for eta in (0, 2):
        ray.init(address="local", _temp_dir=root, include_dashboard=False,
                 runtime_env={"env_vars": {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}})
        try:
            results[f"eta{eta}"] = run(eta, args, f"{root}/runs")
        finally:
            ray.shutdown()
        time.sleep(1)
    sync, asyn = results["eta0"], results["eta2"]
    out = {"workload": vars(args), "sync": sync, "async": asyn,
           "throughput_ratio": asyn["seqs_per_s"] / sync["seqs_per_s"],
           "async_learner_idle_fraction": asyn["learner_idle_fraction"],
           "goals": {"throughput_ratio": 1.6, "learner_idle_fraction": 0.10},
           "cpu_count": os.cpu_count()}
    out["meets_goals"] = out["throughput_ratio"] >= 1.6 and out["async_learner_idle_fraction"] <= 0.10
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2))
    print(json.dumps(out))


if __name__ == "__main__":
    main()
