"""Single-process GRPO-family training: engine, collector and learner in one asyncio program.

SFT warm start -> greedy eval -> [collect -> advantages -> learner step -> weight update] x N
-> greedy eval -> checkpoint. The Ray driver runs the same steps with actors.
"""
from __future__ import annotations

import asyncio
import dataclasses
import random
import time
from pathlib import Path

import torch

from rayllm_rl.data.loader import PromptLoader
from rayllm_rl.inference.transformers_engine import TransformersEngine
from rayllm_rl.learner.learner import Learner
from rayllm_rl.learner.reference import ReferenceModel
from rayllm_rl.models.tiny import ensure_tiny_model
from rayllm_rl.orchestration.batch_prep import reward_component_means, rewards_to_advantages
from rayllm_rl.orchestration.factories import build_episode_filter, build_task, build_workflow, needs_reference
from rayllm_rl.orchestration.sft_warmup import sft_warm_start as run_sft
from rayllm_rl.orchestration.collector import LLMCollector
from rayllm_rl.orchestration.job_config import GRPOJobConfig
from rayllm_rl.orchestration.reporting import RunReporter
from rayllm_rl.workflows.evaluation import evaluate_greedy


def seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)


def sft_warm_start(learner: Learner, task, tokenizer, cfg: GRPOJobConfig, reporter: RunReporter) -> None:
    """The shared SFT warm start (sft_warmup.sft_warm_start) on the in-process learner."""
    run_sft(cfg, task, tokenizer, reporter, learner.train_step, learner.reset_optimizer)


async def train_local(cfg: GRPOJobConfig) -> dict:
    """Run a whole job in this process; returns the summary dict."""
    t_start = time.perf_counter()
    seed_everything(cfg.trainer.seed)
    if cfg.trainer.num_threads > 0:
        torch.set_num_threads(cfg.trainer.num_threads)
    reporter = RunReporter(cfg.trainer.run_dir, config=dataclasses.asdict(cfg))
    model_path = cfg.model.path or ensure_tiny_model()
    task = build_task(cfg)
    engine = TransformersEngine(model_path, seed=cfg.trainer.seed)
    tokenizer = engine.tokenizer
    learner = Learner(model_path, cfg.optim, temperature=cfg.rollout.temperature, seed=cfg.trainer.seed)

    sft_warm_start(learner, task, tokenizer, cfg, reporter)
    engine.update_weights(learner.named_tensors(), version=0)
    reference = None
    if needs_reference(cfg):  # frozen copy of the policy RL starts from (after the SFT warm start)
        reference = ReferenceModel(model_path, temperature=cfg.rollout.temperature,
                                   named_tensors=learner.named_tensors())
    evaluate = lambda: evaluate_greedy(engine, tokenizer, task.eval, task.reward_fn, cfg.rollout.max_new_tokens)  # noqa: E731
    eval_before = await evaluate()
    before = eval_before["eval_reward"]
    reporter.log({"phase": "eval", "step": 0, **eval_before}, show=True)

    workflow = build_workflow(cfg, task, tokenizer)
    collector = LLMCollector(engine, workflow, PromptLoader(task.train, seed=cfg.trainer.seed),
                             dialog_turns_per_batch=cfg.rollout.prompts_per_step * cfg.rollout.group_size,
                             episode_filter=build_episode_filter(cfg))
    loss = cfg.algo.build_loss(cfg.rollout.max_new_tokens)
    t_rl = time.perf_counter()
    step = version = 0  # this loop owns the policy version: RL starts at 0, +1 per update
    progress = reporter.progress(total=cfg.trainer.steps, desc="grpo")
    while step < cfg.trainer.steps:
        batch = await collector.collect()
        rewards_to_advantages(batch, cfg, reference.compute_logprobs if reference is not None else None)
        t0 = time.perf_counter()
        metrics = await asyncio.to_thread(learner.train_step, batch, loss)
        t_train = time.perf_counter() - t0
        version += 1
        engine.update_weights(learner.named_tensors(), version=version)
        step += 1
        record = {"phase": "rl", "step": step, "version": engine.version,
                  "reward": float(batch["rewards"].mean()), "seqs": batch.batch_size[0],
                  "gen_tokens": int(batch["loss_mask"].sum()), "collect_s": collector.last_collect_seconds,
                  "train_s": t_train, **reward_component_means(batch), **metrics}
        if cfg.trainer.eval_every and step % cfg.trainer.eval_every == 0:
            record["eval_reward"] = (await evaluate())["eval_reward"]
        reporter.log(record, show=step % cfg.trainer.log_every == 0)
        progress.update(1, reward=record["reward"])
        if cfg.trainer.time_budget_s and time.perf_counter() - t_rl > cfg.trainer.time_budget_s:
            break
    progress.close()
    eval_after = await evaluate()
    after = eval_after["eval_reward"]
    reporter.log({"phase": "eval", "step": step, **eval_after}, show=True)
    ckpt = learner.save_pretrained(Path(reporter.run_dir) / "checkpoints" / f"step_{step}", tokenizer)
    summary = {
        "eval_reward_before": before, "eval_reward_after": after,
        "eval_reward_gain": after - before, "steps": step, "algo": cfg.algo.name,
        "eval_prompts": len(task.eval), "wall_seconds": round(time.perf_counter() - t_start, 1),
        "rl_seconds": round(time.perf_counter() - t_rl, 1), "run_dir": str(reporter.run_dir),
        "checkpoint": ckpt, "reward_errors": workflow.reward.num_errors,
        "reward_timeouts": workflow.reward.num_timeouts, "eval_before": eval_before, "eval_after": eval_after,
        "failed_episodes": collector.failed_episodes,
    }
    reporter.finish(summary)
    return summary


