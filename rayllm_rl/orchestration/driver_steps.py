"""Driver steps that are not the training loop: SFT warm start, batch wait, checkpoint and resume."""
from __future__ import annotations

import dataclasses
import hashlib
import time
from pathlib import Path

import ray

from rayllm_rl.data.loader import PromptLoader
from rayllm_rl.data.sft import make_sft_batch
from rayllm_rl.objectives import SFTLoss
from rayllm_rl.orchestration.builders import sft_chats
from rayllm_rl.orchestration.cluster import Cluster
from rayllm_rl.orchestration.job_config import GRPOJobConfig
from rayllm_rl.orchestration.reporting import RunReporter


def sft_warm_start(cluster: Cluster, cfg: GRPOJobConfig, task, tokenizer, reporter: RunReporter) -> None:
    if cfg.sft.steps <= 0 or task.sft_target is None:
        return
    cluster.learner_call("reset_optimizer", dataclasses.replace(cfg.optim, lr=cfg.sft.lr, warmup_steps=cfg.sft.warmup_steps))
    loader, loss, t0 = PromptLoader(task.train, seed=cfg.trainer.seed + 1), SFTLoss(), time.perf_counter()
    for step in range(1, cfg.sft.steps + 1):
        batch = ray.put(make_sft_batch(tokenizer, sft_chats(task, loader.next_rows(cfg.sft.batch_size))))
        metrics = cluster.learner_call("train_step", batch, loss)[0]
        reporter.log({"phase": "sft", "sft_step": step, **metrics}, show=step % 50 == 0)
        if cfg.sft.time_budget_s and time.perf_counter() - t0 > cfg.sft.time_budget_s:
            reporter.log({"phase": "sft", "sft_step": step, "stopped": "sft.time_budget_s"}, show=True)
            break
    cluster.learner_call("reset_optimizer", cfg.optim)


def wait_for_batch(cluster: Cluster, n: int, version: int, poll_s: float = 0.005):
    """Poll the buffer until n episodes within the staleness bound are there (with a timeout).

    Episodes the buffer drops as over-stale give their slots back to the collector.
    """
    deadline = time.perf_counter() + cluster.timeout_s
    while time.perf_counter() < deadline:
        batch, dropped, depth = cluster.get(cluster.buffer.sample_and_drops.remote(n, version))
        if dropped:
            cluster.get(cluster.collector.on_dropped.remote(dropped))
        if batch is not None:
            return batch, depth
        cluster.get(cluster.collector.stats.remote())  # surfaces a dead collector loop
        time.sleep(poll_s)
    raise TimeoutError(f"no batch of {n} episodes within {cluster.timeout_s:.0f}s at version {version}")


def env_reward_counters(cluster: Cluster) -> dict[str, int]:
    """Reward calls, errors and timeouts summed over the env workers (a failing reward is counted, not fatal)."""
    total: dict[str, int] = {}
    for stats in cluster.get([w.stats.remote() for w in cluster.env_workers]):
        for k, v in stats.items():
            if k.startswith("reward_"):
                total[k] = total.get(k, 0) + v
    return total


def prompts_digest(batch) -> str:
    """Hash of the prompts a batch trains on, in group order (to check resume keeps data order)."""
    h = hashlib.sha1()
    for gid in sorted(set(batch["group_id"].tolist())):
        row = batch["input_ids"][batch["group_id"] == gid][0]
        first_gen = int(batch["loss_mask"][batch["group_id"] == gid][0].float().argmax())
        h.update(str(row[:first_gen].tolist()).encode())
    return h.hexdigest()[:16]


def save_checkpoint(cluster: Cluster, path: Path, step: int, version: int, model_path: str, reference=None) -> str:
    """Quiesce the collector, then save learner + data + buffer state (and the frozen reference policy,
    if the run has one) for an exact resume."""
    collector_state = cluster.get(cluster.collector.drain.remote(cluster.timeout_s))
    extra = {"step": step, "version": version, "collector": collector_state,
             "buffer": cluster.get(cluster.buffer.state_dict.remote())}
    cluster.learner_call("save_checkpoint", str(path), model_path, extra)
    if reference is not None:
        cluster.get(reference.save.remote(str(path)))
    cluster.get(cluster.collector.start.remote())
    return str(path)


def restore(cluster: Cluster, path: str) -> tuple[int, int]:
    extra = cluster.learner_call("load_checkpoint", path)[0]
    cluster.get(cluster.collector.load_state_dict.remote(extra["collector"]))
    cluster.get(cluster.buffer.load_state_dict.remote(extra["buffer"]))
    return extra["step"], extra["version"]
