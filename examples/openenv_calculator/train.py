"""Train on the calculator environment (calculator_env.py, or its TRL twin calculator_trl.py) from Python.

    python examples/openenv_calculator/train.py                    # small: the offline tiny model, seconds
    python examples/openenv_calculator/train.py --form trl         # the TRL environment_factory class instead
    python examples/openenv_calculator/train.py --full             # SmolLM2-135M-Instruct (`make models`):
                                                                   # SFT on demonstrations, then GRPO, evaluated
    python examples/openenv_calculator/train.py --steps 50 --backend ray rollout.group_size=8  # overrides win

Needs openenv for the OpenEnv form (`pip install 'rayllm_rl[openenv]'`, or `.venv-envs`); the TRL form needs
none. Prints one JSON line last: steps, the reward over the first and last steps, turns and tool calls per episode,
invalid actions, how often the environment ended the episode (an answer) rather than `rollout.max_turns`, the share
of episodes whose calculator computed the answer (`calculated_answer`, a 0-weight reward function: a metric), and
the held-out evaluation (one greedy episode per held-out seed) before RL and after.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
SMOLLM2 = ROOT / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"

COMMON = ["task=openenv", "sft.steps=0", "data.eval_size=0", "trainer.eval_every=0", "trainer.call_timeout_s=120"]
SMALL = ["rollout.prompts_per_step=2", "rollout.group_size=4", "rollout.max_new_tokens=8", "rollout.max_turns=3",
         "trainer.steps=10", "trainer.log_every=100", "data.openenv.train_size=64"]
"""The offline tiny model (random weights): the mechanics only, it never writes a tool call (every reply is an
invalid action, fed back), so every reward is 0."""
FULL = [f"model.path={SMOLLM2}", "model.dtype=float32", "inference.engine=vllm", "trainer.backend=ray",
        "rollout.prompts_per_step=4", "rollout.group_size=8", "rollout.max_new_tokens=48", "rollout.max_turns=3",
        "rollout.temperature=0.7",
        "optim.lr=3e-5", "optim.warmup_steps=2", "optim.max_tokens_per_micro_batch=2048", "trainer.steps=200",
        "trainer.time_budget_s=1980", "trainer.log_every=1", "trainer.checkpoint_every=0",
        "trainer.call_timeout_s=600",
        "data.openenv.system_prompt=Solve the question with the tools: call the calculator, then give the answer.",
        "sft.steps=2", "sft.batch_size=8", "sft.lr=5e-5", "sft.warmup_steps=0", "data.eval_size=64",
        "trainer.eval_every=0"]
"""SmolLM2-135M-Instruct, up to 3 turns of 48 tokens an episode, 4 x 8 episodes a step, within 45 minutes on 2 CPU
cores: two SFT steps on 8 demonstrated episodes each (`demonstration` of the form's module), since the model never
writes a tool call on its own (docs/environments.md) and a group whose rewards are all 0 has nothing for GRPO to
compare; then GRPO for `trainer.time_budget_s`, vLLM's CPU engine serving the episodes' turns; the 64 held-out
questions evaluated after the warm start and after RL."""
TOOLS_LINE = ("{% if tools %}<|im_start|>system\nTools: {% for t in tools %}{{ t.function.name }}"
              "({{ t.function.parameters.properties | list | join(', ') }}) {% endfor %}<|im_end|>\n{% endif %}")
"""A one-line tool list for the tiny model's chat template: the Hermes `<tools>` block a template without tools
gets would not fit its 512 positions (a real model's template renders `tools=` its own way)."""


def tiny_model_with_tools(out: Path) -> str:
    """A copy of the offline tiny model whose chat template renders `tools=` as `TOOLS_LINE`."""
    import shutil

    from rayllm_rl.models.tiny import ensure_tiny_model

    path = out / "tiny-model-with-tools"
    if not path.exists():
        shutil.copytree(ensure_tiny_model(), path)
        template = path / "chat_template.jinja"
        template.write_text(TOOLS_LINE + template.read_text())
    return str(path)


def environment(form: str):
    """(the environment class of the form asked for, its module's name) (imported here: only the OpenEnv form needs
    openenv)."""
    sys.path.insert(0, str(HERE))  # arithmetic.py and the environments beside this script
    if form == "trl":
        from calculator_trl import CalculatorToolEnv
        return CalculatorToolEnv, "calculator_trl"
    from calculator_env import CalculatorEnv
    return CalculatorEnv, "calculator_env"


def main(argv: list[str]) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--form", choices=("openenv", "trl"), default="openenv", help="which environment class")
    parser.add_argument("--full", action="store_true", help="SmolLM2-135M-Instruct at the recipe's settings")
    parser.add_argument("--steps", type=int, help="RL steps (default: 10 small, 200 --full)")
    parser.add_argument("--backend", choices=("local", "ray"), help="trainer.backend (default: the job's)")
    parser.add_argument("--out", default="runs/examples/openenv_calculator", help="where the run goes")
    parser.add_argument("overrides", nargs="*", help="job overrides key.sub=value (they win)")
    args = parser.parse_args(argv)
    if args.full and not SMOLLM2.exists():
        raise SystemExit(f"--full trains {SMOLLM2}: run `make models` first")
    flags = [f"trainer.steps={args.steps}"] * (args.steps is not None)
    flags += [f"trainer.backend={args.backend}"] * (args.backend is not None)

    from rayllm_rl import train

    env, module = environment(args.form)
    from arithmetic import calculated_answer

    preset = ([*FULL, f"data.openenv.demonstration={module}:demonstration"] if args.full else
              [f"model.path={tiny_model_with_tools(Path(args.out))}", *SMALL])
    summary = train(overrides=[*COMMON, *preset, f"trainer.run_dir={args.out}", *flags, *args.overrides],
                    environment=env, reward_fn=[calculated_answer], reward_weights=[0.0])
    lines = (Path(summary["run_dir"]) / "metrics.jsonl").read_text().splitlines()
    rl = [r for r in map(json.loads, lines) if r.get("phase") == "rl"]
    k = max(1, min(10, len(rl) // 3))
    mean = lambda key, part: round(statistics.fmean(r[key] for r in part), 4) if part else None  # noqa: E731
    result = {"example": "openenv_calculator", "form": args.form, "preset": "full" if args.full else "small",
              "backend": summary["backend"], "steps": summary["steps"],
              "reward": [mean("reward", rl[:k]), mean("reward", rl[-k:])], "turns": mean("num_turns", rl),
              "tool_calls": mean("tool_calls", rl), "invalid_actions": mean("invalid_actions", rl),
              "env_done": mean("env_done", rl), "calculated_answer": mean("reward_calculated_answer", rl),
              "eval_before": summary["eval_before"], "eval_after": summary["eval_after"],
              "failed_episodes": summary["failed_episodes"],
              "wall_seconds": summary["wall_seconds"], "run_dir": summary["run_dir"]}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))  # a checkout without install: the package beside examples/
    main(sys.argv[1:])
