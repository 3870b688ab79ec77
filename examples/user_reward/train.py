"""Your reward function on your own JSONL rows, trained from Python (rayllm_rl.train with reward_fn=).

    python examples/user_reward/train.py                      # small: the offline tiny model, about a minute
    python examples/user_reward/train.py --full               # SmolLM2-135M-Instruct (`make models`),
                                                              # under 30 min on 2 cores
    python examples/user_reward/train.py trainer.steps=20     # any job override after the flags wins

It writes `rows.jsonl` and `held_out.jsonl` (one chat prompt in `messages` and the `answer` per line) under
--out, defines the reward `score` right here (Ray pickles it by value to the env workers), trains, and prints
one JSON line last: the held-out greedy reward before and after, and its parts.
"""
from __future__ import annotations

import argparse
import json
import random
import re
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SMOLLM2 = ROOT / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"

ANSWER = re.compile(r"<answer>\s*(-?\d+)\s*</answer>")
NUMBER = re.compile(r"-?\d+")


def score(prompt, completion, prompt_ids, completion_ids, answer, **columns):
    """Half for putting an answer in <answer> tags, half for the right number (the last tagged answer, else the
    completion's last number). Every other column of the row (`answer`, `demo`) comes as a keyword."""
    tagged = ANSWER.findall(completion)
    numbers = tagged or NUMBER.findall(completion.replace(",", ""))
    right = float(bool(numbers) and int(numbers[-1]) == int(answer))
    return {"reward": 0.5 * float(bool(tagged)) + 0.5 * right, "tagged": float(bool(tagged)), "right": right}


SMALL = ["sft.steps=60", "sft.batch_size=32", "sft.lr=1e-3", "data.sft_column=demo", "rollout.prompts_per_step=8",
         "rollout.group_size=8", "rollout.max_new_tokens=8", "trainer.steps=60", "optim.lr=2e-4",
         "trainer.eval_every=0", "trainer.log_every=20", "trainer.call_timeout_s=120", "data.eval_size=30"]
"""The offline tiny model (random weights): a short warm start on the `demo` column, then 60 GRPO steps."""

FULL = [f"model.path={SMOLLM2}", "model.dtype=float32", "rollout.prompts_per_step=8", "rollout.group_size=8",
        "rollout.max_new_tokens=48", "rollout.temperature=0.7", "optim.lr=2e-5", "optim.warmup_steps=5",
        "optim.max_tokens_per_micro_batch=2048", "trainer.steps=200", "trainer.time_budget_s=1440",
        "trainer.eval_every=10", "trainer.log_every=1", "trainer.checkpoint_every=0", "data.eval_size=200"]
"""SmolLM2-135M-Instruct with no warm start: the settings of recipes/smollm2-135m_reasoning-gym_cpu.yaml."""


def write_rows(out: Path, full: bool) -> tuple[Path, Path]:
    """Sums a + b as chat prompts, split once into training and held-out rows (no pair in both)."""
    top, held = (99, 200) if full else (9, 30)
    pairs = [(a, b) for a in range(top + 1) for b in range(top + 1)]
    random.Random(0).shuffle(pairs)

    def row(i, a, b):
        if full:  # a real instruct model reads a question; the tiny model knows the demo's "a+b=" form
            return {"messages": [{"role": "user", "content": f"What is {a} + {b}? Put the final answer inside "
                                                             "<answer></answer> tags."}], "answer": str(a + b)}
        demo = f"<answer>{a + b}</answer>" if i % 4 == 0 else str(a + b)  # the warm start tags a quarter of answers
        return {"messages": [{"role": "user", "content": f"{a}+{b}="}], "answer": str(a + b), "demo": demo}

    out.mkdir(parents=True, exist_ok=True)
    paths = out / "rows.jsonl", out / "held_out.jsonl"
    for path, part in zip(paths, (pairs[held:], pairs[:held])):
        path.write_text("".join(json.dumps(row(i, a, b)) + "\n" for i, (a, b) in enumerate(part)))
    return paths


def main(argv: list[str]) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--full", action="store_true", help="SmolLM2-135M-Instruct at the recipe's settings")
    parser.add_argument("--out", default="runs/examples/user_reward", help="where the rows and the run go")
    parser.add_argument("overrides", nargs="*", help="job overrides key.sub=value (they win)")
    args = parser.parse_args(argv)
    if args.full and not SMOLLM2.exists():
        raise SystemExit(f"--full trains {SMOLLM2}: run `make models` first")
    out = Path(args.out)
    rows, held = write_rows(out, args.full)

    from rayllm_rl import train

    summary = train(overrides=[*(FULL if args.full else SMALL), f"data.path={rows}", f"data.eval_path={held}",
                               f"trainer.run_dir={out / 'runs'}", *args.overrides], reward_fn=score)
    before, after = summary["eval_before"], summary["eval_after"]
    lines = (Path(summary["run_dir"]) / "metrics.jsonl").read_text().splitlines()
    rl = [r["reward"] for r in map(json.loads, lines) if r.get("phase") == "rl"]
    k = max(1, min(10, len(rl) // 3))
    result = {"example": "user_reward", "preset": "full" if args.full else "small", "rows": str(rows),
              "held_out_rows": summary["eval_prompts"], "backend": summary["backend"], "steps": summary["steps"],
              "held_out_reward_before": before["eval_reward"], "held_out_reward_after": after["eval_reward"],
              "held_out_reward_gain": summary["eval_reward_gain"],
              "held_out_right": [before["eval_right"], after["eval_right"]],
              "held_out_tagged": [before["eval_tagged"], after["eval_tagged"]],
              "train_reward_first_steps": statistics.fmean(rl[:k]) if rl else None,
              "train_reward_last_steps": statistics.fmean(rl[-k:]) if rl else None,
              "reward_calls": summary["reward_failures"].get("reward_calls", 0),
              "reward_errors": summary["reward_failures"].get("reward_errors", 0),
              "failed_episodes": summary["failed_episodes"], "wall_seconds": summary["wall_seconds"],
              "run_dir": summary["run_dir"]}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))  # a checkout without install: the package beside examples/
    main(sys.argv[1:])
