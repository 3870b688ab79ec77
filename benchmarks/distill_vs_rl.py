"""Held-out score against RL time, on-policy distillation beside RL from the same start (issue W, item 4).

Reads two runs' `metrics.jsonl` (the RL run that made the teacher, and the distillation run whose student starts
where that RL run started), prints JSON and writes it with a figure to benchmarks/results/<name>.json / .png:
each run's held-out evaluations against its RL seconds (from the end of the first evaluation), the teacher's final
score, and the first evaluation of the distillation run at >= `--share` (0.9) of it, with its time as a fraction
of the RL run's whole RL time.

    python benchmarks/distill_vs_rl.py --rl benchmarks/results/smollm2_reasoning_gym/vllm_cosine_metrics.jsonl \
        --distill runs/smollm2-distill/<stamp>/metrics.jsonl --name smollm2_reasoning_gym/distill_vs_rl
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def eval_curve(metrics: Path) -> list[tuple[float, int, float]]:
    """(RL seconds, step, held-out score) of every evaluation in a run's metrics.jsonl; RL seconds count from the end
    of the evaluation before RL (step 0), so start-up and that evaluation are not in them (as in `rl_seconds`)."""
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    evals = [r for r in rows if "eval_reward" in r]
    if not evals or evals[0]["step"] != 0:
        raise ValueError(f"{metrics}: no evaluation at step 0 (the run's starting score) to count RL time from")
    t0 = float(evals[0]["time_s"])
    curve, seen = [], set()
    for r in evals:
        if r["step"] in seen:  # the final evaluation is logged twice when the last step was also an eval step
            continue
        seen.add(r["step"])
        curve.append((round(float(r["time_s"]) - t0, 1), int(r["step"]), float(r["eval_reward"])))
    return curve


def compare(rl: list, distill: list, share: float = 0.9) -> dict:
    """The teacher's score (the RL run's last evaluation), the RL run's RL time, and when the distillation run first
    reached `share` of that score (None if it did not)."""
    teacher, rl_time = rl[-1][2], rl[-1][0]
    target = share * teacher
    reached = next(((t, step, score) for t, step, score in distill if score >= target), None)
    return {"teacher_score": teacher, "rl_seconds": rl_time, "target": round(target, 4), "share": share,
            "start_score": distill[0][2], "distill_final": distill[-1][2],
            "distill_final_share": round(distill[-1][2] / teacher, 4), "distill_seconds": distill[-1][0],
            "distill_time_share": round(distill[-1][0] / rl_time, 4),
            "reached": None if reached is None else {"rl_seconds": reached[0], "step": reached[1], "score": reached[2],
                                                     "time_share": round(reached[0] / rl_time, 4)},
            "rl_curve": rl, "distill_curve": distill}


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for key, label in (("rl_curve", "RL (made the teacher)"), ("distill_curve", "on-policy distillation")):
        t, _, score = zip(*result[key])
        ax.plot([x / 60 for x in t], score, marker="o", label=label)
    ax.axhline(result["target"], ls="--", c="grey", label=f"{result['share']:.0%} of the teacher")
    ax.axvline(result["rl_seconds"] / 180, ls=":", c="grey", label="a third of RL's time")
    ax.set_xlabel("RL minutes (after the first evaluation)")
    ax.set_ylabel("held-out score")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rl", type=Path, required=True, help="the RL run's metrics.jsonl (the teacher's run)")
    ap.add_argument("--distill", type=Path, required=True, help="the distillation run's metrics.jsonl")
    ap.add_argument("--share", type=float, default=0.9, help="the share of the teacher's score to reach")
    ap.add_argument("--name", default="", help="write results/<name>.json and .png (nothing written if empty)")
    args = ap.parse_args(argv)
    result = compare(eval_curve(args.rl), eval_curve(args.distill), args.share)
    print(json.dumps(result, indent=1))
    if args.name:
        out = RESULTS / args.name
        out.parent.mkdir(parents=True, exist_ok=True)
        out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
        plot(result, out.with_suffix(".png"))
    return result


if __name__ == "__main__":
    main()
