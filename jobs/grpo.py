"""GRPO-family training job. `python jobs/grpo.py [config=file.yaml] [key.sub=value ...] [--dry-run [--json]]`.

With no arguments it runs the embedded default on a local Ray (CPU): the offline tiny
Qwen2, the built-in arithmetic task with its demo preset (an SFT warm start, 10-token answers,
a 7-minute RL budget), then asynchronous GRPO (rollout.max_staleness=1). Fields shown as None
below take the task's preset (TASK PRESETS at the end); a value given in YAML or on the command
line always wins. Ready-made configs: recipes/*.yaml. Under `ray job submit --working-dir . --
python jobs/grpo.py` it joins that cluster. `trainer.backend=local` runs everything in one process.
The last stdout line is a JSON summary.

--dry-run validates the config and prints the job's plan (data sources, actors, CPUs/GPUs, placement,
weight transport, engine, learner and KV-cache memory estimates) without starting Ray or loading any
weights or rows; --json prints it as one JSON object instead.
"""
from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without install

from rayllm_rl.config import describe, load_config  # noqa: E402
from rayllm_rl.orchestration.job_config import GRPOJobConfig  # noqa: E402

FLAGS = ("--dry-run", "--json")


def main(argv: list[str]) -> dict:
    if any(a in ("-h", "--help") for a in argv):
        from rayllm_rl.orchestration.plan_text import describe_presets

        print(__doc__, describe(GRPOJobConfig()), describe_presets(), sep="\n")
        sys.exit(0)
    flags = {a for a in argv if a.startswith("--")}
    if flags - set(FLAGS):
        raise SystemExit(f"unknown flag(s) {sorted(flags - set(FLAGS))}; flags: {', '.join(FLAGS)}, -h/--help")
    if "--json" in flags and "--dry-run" not in flags:
        raise SystemExit("--json goes with --dry-run (the job itself always ends with a JSON summary line)")
    cfg = load_config(GRPOJobConfig, [a for a in argv if a not in flags])
    if "--dry-run" in flags:  # a plan for the job's machines: this one need not have their packages
        from rayllm_rl.orchestration.plan_text import dry_run

        return dry_run(cfg.validate(environment=False), as_json="--json" in flags)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    from rayllm_rl.orchestration.entry import train  # validates first: cross-field mistakes fail before any actor

    summary = train(cfg)
    sys.stdout.write(json.dumps(summary, default=str) + "\n")
    sys.stdout.flush()
    return summary


if __name__ == "__main__":
    main(sys.argv[1:])
