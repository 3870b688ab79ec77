"""Create the named actors of a job and wire the weight-sync group; every wait has a timeout."""
from __future__ import annotations

import dataclasses
import os
import uuid
from typing import Any

import ray

from rayllm_rl.orchestration.actors import (
    EnvWorker,
    InferenceReplica,
    LearnerWorker,
    RayLLMCollector,
    ReplayBufferActor,
)
from rayllm_rl.orchestration.builders import build_episode_filter
from rayllm_rl.orchestration.job_config import GRPOJobConfig


def init_ray(cfg: GRPOJobConfig) -> None:
    """Join RAY_ADDRESS / cfg.ray.address, or start a local Ray (auth stays on, dashboard on 127.0.0.1)."""
    if ray.is_initialized():
        return
    address = cfg.ray.address or os.environ.get("RAY_ADDRESS", "")
    runtime_env = {"env_vars": {"TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": str(cfg.ray.threads_per_actor)}}
    if address:  # e.g. under `ray job submit`: keep the job's own runtime env (working_dir)
        ray.init(address=address, log_to_driver=True)
    else:
        ray.init(address="local", _temp_dir=cfg.ray.temp_dir or None, include_dashboard=False,
                 runtime_env=runtime_env, log_to_driver=True)


@dataclasses.dataclass
class Cluster:
    """Handles of one job's actors."""

    replicas: list[Any]
    env_workers: list[Any]
    learners: list[Any]
    buffer: Any
    collector: Any
    timeout_s: float
    sync_timeout_s: float
    transport: str = "gloo"

    def get(self, refs, timeout_s: float | None = None):
        """ray.get with the job's timeout: a hang becomes a GetTimeoutError naming the wait."""
        return ray.get(refs, timeout=timeout_s or self.timeout_s)

    def learner_call(self, method: str, *args) -> list:
        return self.get([getattr(l, method).remote(*args) for l in self.learners])

    def sync_weights(self, version: int) -> dict[str, float]:
        """Learners stream (rank 0 sends) while every replica receives into its back buffer."""
        sent = [l.sync_weights.remote(version) for l in self.learners]
        got = [r.receive_weights.remote() for r in self.replicas]
        out = self.get(sent + got, timeout_s=self.sync_timeout_s)
        learner0, replicas = out[0], out[len(self.learners):]
        return {**learner0, "stall_s": max(r["stall_s"] for r in replicas),
                "receive_s": max(r["receive_s"] for r in replicas)}

    def shutdown(self) -> None:
        try:  # unlink shared segments and close sync groups before the processes go
            self.get([l.close.remote() for l in self.learners], timeout_s=30)
        except Exception:  # noqa: BLE001 - shutting down anyway
            pass
        for a in self.replicas + self.env_workers + self.learners + [self.buffer, self.collector]:
            ray.kill(a, no_restart=True)


def build_cluster(cfg: GRPOJobConfig, model_path: str, task, workflow_factory) -> Cluster:
    rc, threads = cfg.ray, cfg.ray.threads_per_actor
    seed = cfg.trainer.seed
    replicas = [InferenceReplica.options(name=f"inference-{i}").remote(model_path, seed + i, threads)
                for i in range(rc.num_replicas)]
    env_workers = [EnvWorker.options(name=f"env-{i}", max_concurrency=1000).remote(
        workflow_factory, replicas, rc.call_timeout_s, 1) for i in range(rc.num_env_workers)]
    learners = [LearnerWorker.options(name=f"learner-{r}").remote(r, rc.num_learners, threads)
                for r in range(rc.num_learners)]
    batch = cfg.rollout.prompts_per_step
    capacity = rc.buffer_episodes or 2 * (cfg.rollout.max_staleness + 1) * batch
    buffer = ReplayBufferActor.options(name="replay-buffer").remote(capacity, cfg.rollout.max_staleness)
    collector = RayLLMCollector.options(name="collector", max_concurrency=1000).remote(
        task.train, env_workers, buffer, batch, cfg.rollout.max_staleness, seed, rc.call_timeout_s,
        build_episode_filter(cfg))
    cluster = Cluster(replicas, env_workers, learners, buffer, collector, rc.call_timeout_s, rc.sync_timeout_s)

    host, port = cluster.get(learners[0].address.remote())
    cluster.learner_call("setup", model_path, cfg.optim, cfg.algo, cfg.rollout.temperature, seed, host, port,
                         cfg.rollout.max_new_tokens)
    # Weight-sync group: learner rank 0 (rank 0 of the group) + every replica, beside FSDP's group.
    sync_host, sync_port = cluster.get(learners[0].address.remote())
    transport = rc.sync_transport
    if transport == "auto":  # shared memory when every replica lives on learner rank 0's node
        ips = set(cluster.get([r.node_ip.remote() for r in replicas]))
        transport = "shm" if ips == {sync_host} else "gloo"
    if transport not in ("shm", "gloo"):
        raise ValueError(f"ray.sync_transport must be auto, shm or gloo, got {rc.sync_transport!r}")
    cluster.transport = transport
    prefix = f"rayllm_{uuid.uuid4().hex[:12]}"
    segments = [f"{prefix}_0", f"{prefix}_1"]
    world, bucket = 1 + len(replicas), int(rc.sync_bucket_mb * (1 << 20))
    refs = [l.init_weight_sender.remote(transport, sync_host, sync_port, world, bucket, rc.sync_timeout_s, prefix)
            for l in learners]
    refs += [r.init_weight_receiver.remote(transport, sync_host, sync_port, i + 1, world, bucket,
                                           rc.sync_timeout_s, segments) for i, r in enumerate(replicas)]
    cluster.get(refs, timeout_s=rc.sync_timeout_s + 30)
    return cluster
