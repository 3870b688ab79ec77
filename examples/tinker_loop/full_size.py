"""grpo.py's loop at full size: SmolLM2-135M-Instruct on reasoning-gym's chain_sum, at the SmolLM2 recipe's settings
(recipes/smollm2-135m_reasoning-gym_cpu.yaml: 8 prompts x 8 samples, 48 tokens at temperature 0.7, AdamW at 2e-5
with its warm-up and cosine schedule, group advantages over the std, PPO's clip 0.2), on-policy, no warm start.
The greedy held-out score (200 questions) before and after, as the job reports it.

    python examples/tinker_loop/full_size.py --steps 15            # `make models` first
    python jobs/grpo.py config=recipe:smollm2-135m_reasoning-gym_cpu rollout.max_staleness=0 trainer.steps=15

benchmarks/tinker_loop_vs_job.py runs both, seed by seed, back to back.
"""
import argparse, asyncio, json, statistics, sys  # noqa: E401
from pathlib import Path
from types import SimpleNamespace

from tinker import types as T

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
RECIPE = "config=recipe:smollm2-135m_reasoning-gym_cpu"
SMOLLM2 = ROOT / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"


def setting(cfg, task) -> SimpleNamespace:
    """The recipe's rows, scorer, sampling and optimizer, as grpo.run takes them."""
    from rayllm_rl.learner.optim import lr_scale

    o = cfg.optim

    def score(text, row):
        out = task.reward_fn("", text, [], [], **row)
        out = asyncio.run(out) if asyncio.iscoroutine(out) else out
        return float(out["reward"] if isinstance(out, dict) else out)

    def adam(step):  # the job's schedule (warm-up, cosine to min_lr_ratio at decay_steps), given each step
        return T.AdamParams(learning_rate=o.lr * lr_scale(o, step), beta1=o.beta1, beta2=o.beta2, eps=1e-8,
                            weight_decay=o.weight_decay, grad_clip_norm=o.grad_clip)

    return SimpleNamespace(rows=list(task.train), reward=score, sft_steps=0, demo=None, std=True, loss="ppo",
                           max_tokens=cfg.rollout.max_new_tokens, temperature=cfg.rollout.temperature, adam=adam)


def held_out(training, s, rows) -> float:
    """Greedy held-out score: one answer per question at temperature 0, the task's scorer."""
    tok = training.get_tokenizer()
    sampler = training.save_weights_and_get_sampling_client().result()
    params = T.SamplingParams(max_tokens=s.max_tokens, temperature=0.0, stop=[tok.eos_token_id])
    futures = [sampler.sample(T.ModelInput.from_ints(tok.apply_chat_template(
        r["messages"], add_generation_prompt=True, return_dict=True)["input_ids"]), 1, params) for r in rows]
    return statistics.fmean(s.reward(tok.decode(f.result().sequences[0].tokens, skip_special_tokens=True), r)
                            for f, r in zip(futures, rows))


def main(argv: list[str]) -> dict:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=15), p.add_argument("--seed", type=int, default=0)
    p.add_argument("--backend", default="local"), p.add_argument("overrides", nargs="*")
    a = p.parse_args(argv)
    sys.path.insert(0, str(HERE))
    import grpo
    from rayllm_rl.config import load_config
    from rayllm_rl.envs.task_registry import make_task
    from rayllm_rl.job.config import GRPOJobConfig
    from rayllm_rl.tinker import TinkerService

    overrides = [RECIPE, "rollout.temperature=0.7", "optim.decay_steps=150", f"trainer.seed={a.seed}", *a.overrides]
    cfg = load_config(GRPOJobConfig, [RECIPE, *overrides[1:]])
    task = make_task(cfg.task, cfg.data, cfg.trainer.seed)
    s = setting(cfg, task)
    with TinkerService(str(SMOLLM2), a.backend, overrides) as service:
        training = service.create_training_client(seed=a.seed)
        before = held_out(training, s, list(task.eval))
        out = grpo.run(training, s, a.steps, cfg.rollout.prompts_per_step, cfg.rollout.group_size, a.seed)
        after = held_out(training, s, list(task.eval))
    summary = {**out, "seed": a.seed, "held_out_before": before, "held_out_after": after,
               "held_out_gain_per_step": (after - before) / a.steps}
    print(json.dumps(summary), flush=True)
    return summary


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    main(sys.argv[1:])
