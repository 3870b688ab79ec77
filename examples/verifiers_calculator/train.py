"""Train on the calculator as a verifiers ToolEnv (calculator_env.py) from Python: `train(environment=...)`.

    python examples/verifiers_calculator/train.py                  # small: the offline tiny model, seconds
    python examples/verifiers_calculator/train.py --full           # SmolLM2-135M-Instruct (`make models`)
    python examples/verifiers_calculator/train.py --steps 50 --backend ray rollout.group_size=8  # overrides win

Needs verifiers 0.3.1 (`pip install 'rayllm_rl[verifiers]'` in a venv without the `mcp` extra, or `.venv-envs`).
Prints one JSON line last: steps, the reward over the first and last steps, turns and tool calls per episode (the
ToolEnv's own metrics), the share of right answers, the held-out evaluation before RL and after (`--full`: 64
questions, one greedy rollout each, after an SFT warm start on demonstrations), and the failed episodes.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
SMOLLM2 = ROOT / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"

COMMON = ["task=verifiers", "sft.steps=0", "data.eval_size=0", "trainer.eval_every=0", "trainer.call_timeout_s=120"]
SMALL = ["rollout.prompts_per_step=2", "rollout.group_size=4", "rollout.max_new_tokens=8", "trainer.steps=10",
         "trainer.log_every=100", "trainer.seed=0"]
"""The offline tiny model (random weights): the mechanics only. It writes no tool call, so each episode is one reply
(verifiers ends it: no tool called) and every reward is 0; a seed at which it never replies with nothing (verifiers
aborts a rollout on an empty reply: a failed sample)."""
FULL = [f"model.path={SMOLLM2}", "model.dtype=float32", "inference.engine=vllm", "trainer.backend=ray",
        "rollout.prompts_per_step=4", "rollout.group_size=8", "rollout.max_new_tokens=48", "rollout.temperature=0.7",
        "optim.lr=3e-5", "optim.warmup_steps=2", "optim.max_tokens_per_micro_batch=2048", "trainer.steps=200",
        "trainer.time_budget_s=1980", "trainer.log_every=1", "trainer.checkpoint_every=0",
        "trainer.call_timeout_s=600", "sft.steps=2", "sft.batch_size=8", "sft.lr=5e-5", "sft.warmup_steps=0",
        "data.verifiers.demonstration=calculator_env:demonstration", "data.eval_size=64", "trainer.eval_every=0"]
"""SmolLM2-135M-Instruct at the OpenEnv example's `--full` settings (examples/openenv_calculator/train.py): two SFT
steps on 8 demonstrated rollouts each (`calculator_env.demonstration`), GRPO within 33 minutes on Ray with vLLM's CPU
engine, 64 held-out questions (`eval_questions`) evaluated after the warm start and after RL."""
FULL_SYSTEM_PROMPT = (
    'Solve the question with the calculator. Call it by writing <tool_call>{"name": "calculator", "arguments": '
    '{"expression": "347 * 29"}}</tool_call>, read its result, then reply with the number alone.')
"""SmolLM2's chat template does not render `tools=` (the proxy shows the tools through it only), so the system
prompt names the tool and its Hermes call format, which the proxy reads into the `tool_calls` ToolEnv runs."""


def tiny_model_with_tools(out: Path) -> str:
    """The OpenEnv example's copy of the tiny model whose chat template lists `tools=` on one line (its train.py,
    loaded under a name of its own)."""
    spec = importlib.util.spec_from_file_location("openenv_calculator_train", ROOT / "examples" /
                                                  "openenv_calculator" / "train.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.tiny_model_with_tools(out)


def main(argv: list[str]) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--full", action="store_true", help="SmolLM2-135M-Instruct at the recipe's settings")
    parser.add_argument("--steps", type=int, help="RL steps (default: 10 small, 200 --full)")
    parser.add_argument("--backend", choices=("local", "ray"), help="trainer.backend (default: the job's)")
    parser.add_argument("--questions", type=int, default=64, help="rows of the environment's dataset")
    parser.add_argument("--max-turns", type=int, help="the ToolEnv's max_turns (default 3)")
    parser.add_argument("--out", default="runs/examples/verifiers_calculator", help="where the run goes")
    parser.add_argument("overrides", nargs="*", help="job overrides key.sub=value (they win)")
    args = parser.parse_args(argv)
    if args.full and not SMOLLM2.exists():
        raise SystemExit(f"--full trains {SMOLLM2}: run `make models` first")
    flags = [f"trainer.steps={args.steps}"] * (args.steps is not None)
    flags += [f"trainer.backend={args.backend}"] * (args.backend is not None)

    sys.path.insert(0, str(HERE))  # calculator_env.py beside this script
    from calculator_env import load_environment

    from rayllm_rl import train

    env_args = {"num_questions": args.questions, "max_turns": args.max_turns or 3}
    if args.full:
        env_args.update(system_prompt=FULL_SYSTEM_PROMPT, eval_questions=64)
    preset = FULL if args.full else [f"model.path={tiny_model_with_tools(Path(args.out))}", *SMALL]
    summary = train(overrides=[*COMMON, *preset, f"trainer.run_dir={args.out}", *flags, *args.overrides],
                    environment=load_environment(**env_args))
    lines = (Path(summary["run_dir"]) / "metrics.jsonl").read_text().splitlines()
    rl = [r for r in map(json.loads, lines) if r.get("phase") == "rl"]
    k = max(1, min(10, len(rl) // 3))
    mean = lambda key, part: round(statistics.fmean(r[key] for r in part), 4) if part else None  # noqa: E731
    result = {"example": "verifiers_calculator", "preset": "full" if args.full else "small",
              "backend": summary["backend"], "steps": summary["steps"],
              "reward": [mean("reward", rl[:k]), mean("reward", rl[-k:])], "turns": mean("num_turns", rl),
              "tool_calls": mean("reward_total_tool_calls", rl), "correct": mean("reward_correct_answer", rl),
              "eval_before": summary["eval_before"], "eval_after": summary["eval_after"],
              "failed_episodes": summary["failed_episodes"], "wall_seconds": summary["wall_seconds"],
              "run_dir": summary["run_dir"]}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))  # a checkout without install: the package beside examples/
    main(sys.argv[1:])
