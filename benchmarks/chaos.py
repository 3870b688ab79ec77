"""Chaos: the embedded default job on a local Ray while a random role's process is SIGKILLed
every ~`--every` seconds (after RL has started: a crash during the SFT warm start has no
checkpoint to roll back to and ends the run).

Reports each kill, the summary's restarts per role, rollbacks, episodes re-run and lost, and
the learning gain; goal: episodes lost 0 and gain >= 0.25.

    .venv/bin/python benchmarks/chaos.py [--every 60] [--seed 0] [key.sub=value ...]

The last stdout line is the JSON result; it is also written, indented, to `--out`.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

ROLES = ("env-0", "inference-0", "learner-0", "collector", "replay-buffer")
NAMESPACE = "rayllm_chaos"


def rl_started(tmp: Path) -> bool:
    return any('"phase": "rl"' in p.read_text() for p in tmp.glob("*/metrics.jsonl"))


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--every", type=float, default=60.0, help="mean seconds between kills (+-25%%)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--roles", default=",".join(ROLES))
    p.add_argument("--out", default="benchmarks/results/chaos.json")
    args, overrides = p.parse_known_args(argv)

    import ray

    from rayllm_rl.api.entry import train

    run_root = Path(tempfile.mkdtemp(prefix="rayllm-chaos-"))
    ray.init(address="local", _temp_dir=str(run_root / "ray"), include_dashboard=False,
             runtime_env={"env_vars": {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}})
    out: dict = {}
    job = threading.Thread(target=lambda: out.update(summary=train(overrides=[
        f"trainer.run_dir={run_root}/runs", f"ray.namespace={NAMESPACE}", "trainer.time_budget_s=0",
        "trainer.max_recoveries=50", *overrides])), daemon=True)
    t0 = time.monotonic()
    job.start()
    rng, kills = random.Random(args.seed), []
    while job.is_alive() and not rl_started(run_root / "runs"):
        job.join(1.0)
    while job.is_alive():
        job.join(args.every * rng.uniform(0.75, 1.25))
        if not job.is_alive():
            break
        role = rng.choice(args.roles.split(","))
        try:
            pid = ray.get(ray.get_actor(role, namespace=NAMESPACE).pid.remote(), timeout=30)
            os.kill(pid, signal.SIGKILL)
            kills.append({"t_s": round(time.monotonic() - t0, 1), "role": role, "pid": pid})
        except Exception as exc:  # noqa: BLE001 - the role may be mid-rebuild: try again next time
            kills.append({"t_s": round(time.monotonic() - t0, 1), "role": role, "skipped": repr(exc)[:200]})
        print(f"[chaos] {kills[-1]}", file=sys.stderr, flush=True)
    ray.shutdown()
    s = out.get("summary")
    result = {"kills": kills, "finished": s is not None, "wall_s": round(time.monotonic() - t0, 1)}
    if s is not None:
        result.update({k: s[k] for k in ("steps", "version", "eval_reward_before", "eval_reward_after",
                                         "eval_reward_gain", "restarts", "recoveries", "episodes_rerun",
                                         "episodes_lost", "failed_episodes", "learner_checksums_equal_replicas")})
        result["meets_goal"] = s["episodes_lost"] == 0 and s["eval_reward_gain"] >= 0.25
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1, default=str))
    print(json.dumps(result, default=str), flush=True)
    return result


if __name__ == "__main__":
    main()
