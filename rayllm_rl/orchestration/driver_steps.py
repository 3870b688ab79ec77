"""Driver steps that are not the training loop: SFT on the learner actors, batch wait, checkpoint, resume."""
from __future__ import annotations

import hashlib
from pathlib import Path

import ray

from rayllm_rl.orchestration.cluster import Cluster
from rayllm_rl.orchestration.job_config import GRPOJobConfig
from rayllm_rl.orchestration.reporting import RunReporter
from rayllm_rl.orchestration.sft_warmup import sft_warm_start as run_sft


def sft_on_learner_actors(cluster: Cluster, cfg: GRPOJobConfig, task, tokenizer, reporter: RunReporter) -> None:
    """The shared SFT warm start (sft_warmup.sft_warm_start) on the learner actors."""
    run_sft(cfg, task, tokenizer, reporter,
            train_step=lambda batch, loss: cluster.learner_call("train_step", ray.put(batch), loss)[0],
            reset_optimizer=lambda optim: cluster.learner_call("reset_optimizer", optim))


def wait_for_batch(cluster: Cluster, n: int, version: int):
    """The buffer's next n episodes within the staleness bound: one awaited call, no polling.

    The buffer returns the slots of over-stale episodes to the collector itself, and fails this
    wait at once (naming the cause) if the collector's loop dies.
    """
    return cluster.get(cluster.buffer.get_batch.remote(n, version, cluster.timeout_s), timeout_s=cluster.timeout_s + 30)


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
