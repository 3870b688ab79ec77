"""An OpenAI-SDK agent with a calculator tool (calc_agent.py) trained as it is: rollout.workflow=openai_agent.

    python examples/openai_agent_tool/train.py                   # small: the offline tiny model, about a minute
    python examples/openai_agent_tool/train.py --full            # SmolLM2-135M-Instruct (`make models`)
    python examples/openai_agent_tool/train.py trainer.steps=20  # any job override after the flags wins

Prints one JSON line last: steps and policy versions trained, tokens generated, completions per conversation (more
than one: the model called the calculator and answered after its result), and the held-out greedy reward.
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
AGENT = ["rollout.workflow=openai_agent", "rollout.agent=calc_agent:solve"]

SMALL = ["sft.steps=40", "sft.batch_size=32", "sft.lr=1e-3", "data.sft_column=demo", "rollout.prompts_per_step=4",
         "rollout.group_size=4", "rollout.max_new_tokens=16", "trainer.steps=10", "optim.lr=2e-4",
         "trainer.eval_every=0", "trainer.log_every=5", "trainer.call_timeout_s=120", "data.eval_size=30"]
"""The offline tiny model after a short warm start: it rarely calls the tool; the run shows the agent trains."""

FULL = [f"model.path={SMOLLM2}", "model.dtype=float32", "rollout.prompts_per_step=8", "rollout.group_size=8",
        "rollout.max_new_tokens=64", "rollout.temperature=0.7", "optim.lr=2e-5", "optim.warmup_steps=5",
        "optim.max_tokens_per_micro_batch=2048", "trainer.steps=200", "trainer.time_budget_s=2700",
        "trainer.eval_every=15", "trainer.log_every=1", "trainer.checkpoint_every=0", "data.eval_size=200"]
"""SmolLM2-135M-Instruct with no warm start (recipes/smollm2-135m_reasoning-gym_cpu.yaml's settings)."""


def write_rows(out: Path, full: bool) -> tuple[Path, Path]:
    """Products a * b (worth a calculator) as chat prompts with their answer, split once into train and held-out."""
    top, held = (99, 200) if full else (9, 30)
    pairs = [(a, b) for a in range(2, top + 1) for b in range(2, top + 1)]
    random.Random(0).shuffle(pairs)

    def row(a, b):
        question = f"What is {a} * {b}?" if full else f"{a}*{b}="
        return {"messages": [{"role": "user", "content": question}], "answer": str(a * b),
                **({} if full else {"demo": f"<answer>{a * b}</answer>"})}

    out.mkdir(parents=True, exist_ok=True)
    paths = out / "rows.jsonl", out / "held_out.jsonl"
    for path, part in zip(paths, (pairs[held:], pairs[:held])):
        path.write_text("".join(json.dumps(row(a, b)) + "\n" for a, b in part))
    return paths


def main(argv: list[str]) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--full", action="store_true", help="SmolLM2-135M-Instruct at the recipe's settings")
    parser.add_argument("--out", default="runs/examples/openai_agent_tool", help="where the rows and the run go")
    parser.add_argument("overrides", nargs="*", help="job overrides key.sub=value (they win)")
    args = parser.parse_args(argv)
    if args.full and not SMOLLM2.exists():
        raise SystemExit(f"--full trains {SMOLLM2}: run `make models` first")
    out = Path(args.out)
    rows, held = write_rows(out, args.full)

    from calc_agent import SYSTEM, score  # beside this script: Ray's workers import calc_agent from here too
    from rayllm_rl import train

    # the tool's description as every row's system line: the warm start, the agent and the evaluation see one prompt
    summary = train(overrides=[*(FULL if args.full else SMALL), *AGENT, f"data.system_prompt={SYSTEM}",
                               f"data.path={rows}", f"data.eval_path={held}", f"trainer.run_dir={out / 'runs'}",
                               *args.overrides], reward_fn=score)
    lines = (Path(summary["run_dir"]) / "metrics.jsonl").read_text().splitlines()
    rl = [r for r in map(json.loads, lines) if r.get("phase") == "rl"]
    result = {"example": "openai_agent_tool", "preset": "full" if args.full else "small", "backend": summary["backend"],
              "steps": summary["steps"], "version": summary["version"],
              "token_versions": sorted({v for r in rl for v in r["token_versions"]}),
              "generated_tokens": sum(r["gen_tokens"] for r in rl), "trajectories": sum(r["seqs"] for r in rl),
              "completions_per_conversation": (round(statistics.fmean(r["num_completions"] for r in rl), 4)
                                               if rl else None),
              "train_reward": round(statistics.fmean(r["reward"] for r in rl), 4) if rl else None,
              "held_out_reward_before": summary["eval_reward_before"],
              "held_out_reward_after": summary["eval_reward_after"],
              "failed_episodes": summary["failed_episodes"],
              "reward_errors": summary["reward_failures"].get("reward_errors"),
              "wall_seconds": summary["wall_seconds"], "run_dir": summary["run_dir"]}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))  # a checkout without install: the package beside examples/
    main(sys.argv[1:])
