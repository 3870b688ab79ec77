"""A multi-turn environment of your own (tutor.py) trained through `train(workflow=...)`.

    python examples/multi_turn_env/train.py                   # small: the offline tiny model, about a minute
    python examples/multi_turn_env/train.py --full            # SmolLM2-135M-Instruct (`make models`)
    python examples/multi_turn_env/train.py trainer.steps=40  # any job override after the flags wins

The tutor answers every wrong try with "too high" / "too low" for up to rollout.max_turns tries. Prints one JSON line
last: tries per conversation, the solve rates, the tutor's tokens the learner saw (masked: no loss, no version),
and the held-out greedy first try before and after.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SMOLLM2 = ROOT / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"

SMALL = ["sft.steps=60", "sft.batch_size=32", "sft.lr=1e-3", "data.sft_column=demo", "rollout.prompts_per_step=8",
         "rollout.group_size=4", "rollout.max_new_tokens=8", "rollout.max_turns=3", "trainer.steps=20",
         "optim.lr=2e-4", "trainer.eval_every=0", "trainer.log_every=10", "trainer.call_timeout_s=120",
         "data.eval_size=30"]
"""The offline tiny model: a short warm start on the `demo` column (it then answers with a number), 20 steps."""

FULL = [f"model.path={SMOLLM2}", "model.dtype=float32", "rollout.prompts_per_step=8", "rollout.group_size=8",
        "rollout.max_new_tokens=48", "rollout.max_turns=3", "rollout.temperature=0.7", "optim.lr=2e-5",
        "optim.warmup_steps=5", "optim.max_tokens_per_micro_batch=2048", "trainer.steps=200",
        "trainer.time_budget_s=2700", "trainer.eval_every=15", "trainer.log_every=1", "trainer.checkpoint_every=0",
        "data.eval_size=200"]
"""SmolLM2-135M-Instruct with no warm start (recipes/smollm2-135m_reasoning-gym_cpu.yaml's settings), 3 tries."""


def write_rows(out: Path, full: bool) -> tuple[Path, Path]:
    """Sums a + b as chat prompts with their answer, split once into training and held-out rows."""
    top, held = (99, 200) if full else (9, 30)
    pairs = [(a, b) for a in range(top + 1) for b in range(top + 1)]
    random.Random(0).shuffle(pairs)

    def row(a, b):
        if full:
            return {"messages": [{"role": "user", "content": f"What is {a} + {b}? Answer with a number."}],
                    "answer": str(a + b)}
        return {"messages": [{"role": "user", "content": f"{a}+{b}="}], "answer": str(a + b),
                "demo": f"<answer>{a + b}</answer>"}

    out.mkdir(parents=True, exist_ok=True)
    paths = out / "rows.jsonl", out / "held_out.jsonl"
    for path, part in zip(paths, (pairs[held:], pairs[:held])):
        path.write_text("".join(json.dumps(row(a, b)) + "\n" for a, b in part))
    return paths


def tutor_tokens(run_dir: Path) -> dict:
    """What the learner saw of the tutor, from the run's traces.jsonl (a few trained rows per step): over rows with
    more than one try, the tokens after the first answer that the model did not write (the tutor's), how many of
    them carry a policy version (none should), whether the tutor's words are in the masked or in the trained text,
    and one such conversation with the model's own tokens in [brackets]."""
    masked = versioned = rows = 0
    words_masked = words_trained = False
    example = ""
    for line in (run_dir / "traces.jsonl").read_text().splitlines():
        for sample in json.loads(line).get("samples", []):
            if sample["components"].get("turns", 1) < 2:
                continue
            rows += 1
            parts = list(zip(sample["tokens"], sample["trained"], sample["versions"]))
            masked += sum(1 for _, t, _ in parts if not t)
            versioned += sum(1 for _, t, v in parts if not t and v >= 0)
            words_masked |= "Try again" in "".join(tok for tok, t, _ in parts if not t)
            words_trained |= "Try again" in "".join(tok for tok, t, _ in parts if t)
            example = example or "".join(f"[{tok}]" if t else tok for tok, t, _ in parts)
    return {"traced_rows_with_feedback": rows, "tutor_tokens": masked, "tutor_tokens_with_a_version": versioned,
            "tutor_words_masked": words_masked, "tutor_words_trained": words_trained, "example": example}


def main(argv: list[str]) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--full", action="store_true", help="SmolLM2-135M-Instruct at the recipe's settings")
    parser.add_argument("--out", default="runs/examples/multi_turn_env", help="where the rows and the run go")
    parser.add_argument("overrides", nargs="*", help="job overrides key.sub=value (they win)")
    args = parser.parse_args(argv)
    if args.full and not SMOLLM2.exists():
        raise SystemExit(f"--full trains {SMOLLM2}: run `make models` first")
    out = Path(args.out)
    rows, held = write_rows(out, args.full)

    from rayllm_rl import train
    from tutor import answered_right, make_workflow  # beside this script: Ray's workers import it from here too

    summary = train(overrides=[*(FULL if args.full else SMALL), f"data.path={rows}", f"data.eval_path={held}",
                               f"trainer.run_dir={out / 'runs'}", *args.overrides],
                    reward_fn=answered_right, workflow=make_workflow)
    lines = (Path(summary["run_dir"]) / "metrics.jsonl").read_text().splitlines()
    rl = [r for r in map(json.loads, lines) if r.get("phase") == "rl"]
    k = max(1, min(10, len(rl) // 3))
    mean = lambda key, part: round(statistics.fmean(r[key] for r in part), 4) if part else None  # noqa: E731
    config = json.loads((Path(summary["run_dir"]) / "config.json").read_text())
    result = {"example": "multi_turn_env", "preset": "full" if args.full else "small",
              "workflow": config["rollout"]["workflow"], "max_turns": config["rollout"]["max_turns"],
              "backend": summary["backend"], "steps": summary["steps"], "version": summary["version"],
              "tries_per_conversation": mean("turns", rl), "solved": [mean("solved", rl[:k]), mean("solved", rl[-k:])],
              "solved_first_try": [mean("solved_first_try", rl[:k]), mean("solved_first_try", rl[-k:])],
              "train_reward": [mean("reward", rl[:k]), mean("reward", rl[-k:])],
              "held_out_first_try_before": summary["eval_reward_before"],
              "held_out_first_try_after": summary["eval_reward_after"],
              "feedback": tutor_tokens(Path(summary["run_dir"])),
              "failed_episodes": summary["failed_episodes"], "max_version_lag": summary["max_version_lag"],
              "wall_seconds": summary["wall_seconds"], "run_dir": summary["run_dir"]}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))  # a checkout without install: the package beside examples/
    main(sys.argv[1:])
