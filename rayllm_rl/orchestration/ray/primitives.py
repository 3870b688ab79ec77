"""A plan of learners and replicas (`JobPlan.only("learner", "replica")`) as the job's own Ray actors, for a loop
of the user's own (`rayllm_rl.tinker`): started by the job's one build path (`cluster.build_cluster`), weights
synced over the job's transport (`Cluster.sync_weights`), every wait bounded by the job's timeouts. The in-process
twin is `orchestration/local/primitives.py`; both offer the same blocking calls.
"""
from __future__ import annotations

import itertools
from typing import Any, Mapping

import ray

from rayllm_rl.inference.protocol import LLMRequest, LLMResponse
from rayllm_rl.job.plan import JobPlan
from rayllm_rl.orchestration.ray.cluster import build_cluster
from rayllm_rl.orchestration.ray.groups import get_within
from rayllm_rl.orchestration.ray.session import init_ray


class RayRoles:
    """The learner ranks and the replicas as named actors. Joins RAY_ADDRESS (`ray job submit`) or starts a
    local Ray, as a job does; a Ray it started stops with `close`."""

    def __init__(self, plan: JobPlan, model_path: str):
        self.started_ray = not ray.is_initialized()
        init_ray(plan.config)
        self.plan, self.timeout_s = plan, plan.config.trainer.call_timeout_s
        self.cluster = None
        try:
            self.cluster = build_cluster(plan, model_path)  # a failed start shuts down what it started
        except BaseException:
            self.close()
            raise
        self._next_replica = itertools.cycle(range(len(self.cluster.replicas)))

    # ------------------------------------------------------------------ learner
    def forward_backward(self, batch, loss, backward: bool, sampling_mask) -> tuple[Any, dict[str, float]]:
        return self.cluster.learners.forward_backward(batch, loss, backward, sampling_mask)

    def optim_step(self, adam: Mapping[str, float]) -> dict[str, float]:
        return self.cluster.learners.optim_step(dict(adam))

    def save_state(self, path: str, extra: dict[str, Any]) -> None:
        self.cluster.learners.save_checkpoint(path, None, extra)

    def load_state(self, path: str, with_optimizer: bool) -> dict[str, Any]:
        extra = self.cluster.learners.load_checkpoint(path)
        if not with_optimizer:
            self.cluster.learners.reset_optimizer(self.plan.config.optim)
        return extra

    def learner_checksum(self) -> float:
        return self.cluster.learners.checksums()[0]

    # ------------------------------------------------------------------ weights and generation
    def sync_weights(self, version: int) -> dict[str, float]:
        return self.cluster.sync_weights(version)

    def generate(self, requests: list[LLMRequest]) -> list[LLMResponse]:
        """Each request to the next replica in turn (the samples of one prompt spread over the replicas)."""
        replicas = self.cluster.replicas
        refs = [replicas[next(self._next_replica)].agenerate.remote(r) for r in requests]
        return get_within(refs, self.timeout_s, f"inference replicas: generate {len(requests)} samples")

    def replica_checksums(self) -> list[float]:
        return self.cluster.replicas.checksums()

    def close(self) -> None:
        if self.cluster is not None:
            self.cluster.shutdown(namespace=self.plan.config.ray.namespace)
            self.cluster = None
        if self.started_ray and ray.is_initialized():
            ray.shutdown()
