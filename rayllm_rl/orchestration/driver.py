"""The Ray driver: SFT warm start, then asynchronous GRPO with bounded staleness.

    build actors -> SFT on learners -> sync v0 -> eval -> start collector ->
    [sample B episodes (<= eta versions old) -> advantages -> learner step -> v += 1 ->
     stream weights to replicas (double buffer) -> tell collector v] x N -> eval -> checkpoint

The same loop is synchronous for max_staleness = 0 (the collector then admits exactly one
batch per version) and asynchronous for max_staleness >= 1.
"""
from __future__ import annotations

import asyncio
import dataclasses
import functools
import time
from pathlib import Path

import ray

from rayllm_rl.data.replay_buffer import batch_staleness_stats
from rayllm_rl.models.tiny import ensure_tiny_model
from rayllm_rl.orchestration.actors import ReferenceActor
from rayllm_rl.orchestration.batch_prep import reward_component_means, rewards_to_advantages
from rayllm_rl.orchestration.cluster import build_cluster, init_ray
from rayllm_rl.orchestration.driver_steps import (
    env_reward_counters,
    prompts_digest,
    restore,
    save_checkpoint,
    sft_on_learner_actors,
    wait_for_batch,
)
from rayllm_rl.orchestration.factories import build_task, build_workflow, needs_reference
from rayllm_rl.orchestration.job_config import GRPOJobConfig
from rayllm_rl.orchestration.metrics import RayMetrics
from rayllm_rl.orchestration.reporting import RunReporter
from rayllm_rl.orchestration.router import ReplicaRouter
from rayllm_rl.workflows.evaluation import evaluate_greedy


def make_workflow(cfg: GRPOJobConfig, model_path: str):
    """Top-level (picklable) factory run inside each EnvWorker."""
    from transformers import AutoTokenizer

    return build_workflow(cfg, build_task(cfg), AutoTokenizer.from_pretrained(model_path))


def train(cfg: GRPOJobConfig) -> dict:
    t_start = time.perf_counter()
    init_ray(cfg)
    reporter = RunReporter(cfg.trainer.run_dir, config=dataclasses.asdict(cfg))
    metrics = RayMetrics()
    model_path = cfg.model.path or ensure_tiny_model()
    task = build_task(cfg)
    cluster = build_cluster(cfg, model_path, task, functools.partial(make_workflow, cfg, model_path))
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    if cfg.resume:
        step, version = restore(cluster, cfg.resume)
    else:
        sft_on_learner_actors(cluster, cfg, task, tokenizer, reporter)
        step, version = 0, 0
    cluster.sync_weights(version)
    cluster.get(cluster.collector.set_version.remote(version))
    ref = ref_fn = None
    if needs_reference(cfg):  # frozen: the policy after the SFT warm start, or the one the checkpoint saved
        weights = cfg.resume or cluster.learner_call("named_tensors")[0]
        ref = ReferenceActor.options(name="reference").remote(model_path, cfg.rollout.temperature, weights,
                                                              cfg.ray.threads_per_actor)
        ref_fn = lambda b: cluster.get(ref.compute_logprobs.remote(b))  # noqa: E731
    evaluate = lambda: asyncio.run(evaluate_greedy(  # noqa: E731
        ReplicaRouter(cluster.replicas, cluster.timeout_s), tokenizer, task.eval, task.reward_fn, cfg.rollout.max_new_tokens))
    eval_before = evaluate()
    before = eval_before["eval_reward"]
    reporter.log({"phase": "eval", "step": step, **eval_before}, show=True)

    cluster.get(cluster.collector.start.remote())
    t_rl, B = time.perf_counter(), cfg.rollout.prompts_per_step
    pending, col = cluster.collector.set_version.remote(version), {"tokens_per_s": None}
    progress = reporter.progress(total=cfg.trainer.steps, desc=f"grpo eta={cfg.rollout.max_staleness}")
    progress.update(step)
    while step < cfg.trainer.steps:
        t0 = time.perf_counter()
        batch, depth = wait_for_batch(cluster, B, version)
        t_wait = time.perf_counter() - t0
        rewards_to_advantages(batch, cfg, ref_fn)
        lag = batch_staleness_stats(batch, version)
        versions_trained = sorted(set(batch["versions"][batch["loss_mask"]].tolist()))
        train_metrics = cluster.learner_call("train_step", ray.put(batch))[0]
        t_train = time.perf_counter() - t0 - t_wait
        version += 1
        sync = cluster.sync_weights(version)
        cluster.get(pending)  # the previous step's set_version (bounded wait)
        pending = cluster.collector.set_version.remote(version)
        step += 1
        if step % cfg.trainer.log_every == 0 or step == cfg.trainer.steps:
            col = cluster.get(cluster.collector.stats.remote())
        record = {"phase": "rl", "step": step, "version": version, "reward": float(batch["rewards"].mean()),
                  "seqs": batch.batch_size[0], "wait_s": t_wait, "train_s": t_train,
                  "advantage_abs_mean": float(batch["advantages"].abs().mean()),
                  "staleness_mean": lag["mean_lag"], "staleness_max": lag["max_lag"],
                  "sync_seconds": sync["sync_s"], "stall_s": sync["stall_s"], "tokens_per_s": col["tokens_per_s"],
                  "buffer_depth": depth, "token_versions": versions_trained,
                  "data_sha": prompts_digest(batch), **reward_component_means(batch), **train_metrics}
        if cfg.trainer.eval_every and step % cfg.trainer.eval_every == 0:
            record["eval_reward"] = evaluate()["eval_reward"]
        reporter.log(record, show=step % cfg.trainer.log_every == 0)
        metrics.update(record)
        progress.update(1, reward=record["reward"])
        if cfg.trainer.checkpoint_every and step % cfg.trainer.checkpoint_every == 0 and step < cfg.trainer.steps:
            save_checkpoint(cluster, Path(reporter.run_dir) / "checkpoints" / f"step_{step}", step, version, model_path, ref)
        if cfg.trainer.time_budget_s and time.perf_counter() - t_rl > cfg.trainer.time_budget_s:
            break
    progress.close()
    cluster.get(pending)
    ckpt = save_checkpoint(cluster, Path(reporter.run_dir) / "checkpoints" / f"step_{step}", step, version, model_path, ref)
    cluster.get(cluster.collector.drain.remote(cluster.timeout_s))
    eval_after = evaluate()
    after = eval_after["eval_reward"]
    reporter.log({"phase": "eval", "step": step, **eval_after}, show=True)
    col = cluster.get(cluster.collector.stats.remote())
    lags = [r["staleness_max"] for r in reporter.records if r.get("phase") == "rl"]
    summary = {"eval_reward_before": before, "eval_reward_after": after, "eval_reward_gain": after - before,
               "steps": step, "version": version, "algo": cfg.algo.name, "max_staleness": cfg.rollout.max_staleness,
               "max_version_lag": max(lags, default=0), "eval_prompts": len(task.eval),
               "wall_seconds": round(time.perf_counter() - t_start, 1), "rl_seconds": round(time.perf_counter() - t_rl, 1),
               "run_dir": str(reporter.run_dir), "checkpoint": ckpt, "failed_episodes": col["failed_episodes"],
               "buffer": cluster.get(cluster.buffer.stats.remote()), "eval_before": eval_before, "eval_after": eval_after,
               "reward_failures": env_reward_counters(cluster),
               "replica_versions_held": cluster.get([r.version_history.remote() for r in cluster.replicas]),
               "learner_checksums_equal_replicas": len(set(cluster.get(
                   [l.checksum.remote() for l in cluster.learners] + [r.checksum.remote() for r in cluster.replicas]))) == 1}
    reporter.finish(summary)
    cluster.shutdown()
    return summary
