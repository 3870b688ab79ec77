"""A plan of learners and replicas (`JobPlan.only("learner", "replica")`) as the job's own Ray actors, for a loop
of the user's own (`rayllm_rl.tinker`): started by the job's one build path (`cluster.build_cluster`), weights
synced over the job's transport (`Cluster.sync_weights`), every wait bounded by the job's timeouts. The in-process
twin is `orchestration/local/primitives.py`; both offer the same blocking calls.
"""
from __future__ import annotations

import contextlib
import itertools
from typing import Any, Mapping

import ray

from rayllm_rl.inference.protocol import LLMRequest, LLMResponse
from rayllm_rl.job.plan import JobPlan
from rayllm_rl.orchestration.backend import ROLE_KINDS, RoleCrashed
from rayllm_rl.orchestration.fault_ledger import FaultLedger
from rayllm_rl.orchestration.ray.cluster import Liveness, build_cluster
from rayllm_rl.orchestration.ray.groups import get_within
from rayllm_rl.orchestration.ray.session import init_ray


@contextlib.contextmanager
def learner_loss_named():
    """A learner rank that died takes the weights and optimizer state with it: `RoleCrashed` naming the learner
    ranks, which the caller answers with `recover` (every role rebuilt) and its last saved state."""
    try:
        yield
    except ray.exceptions.RayActorError as exc:
        raise RoleCrashed(["learner"], exc) from exc


class RayRoles:
    """The learner ranks and the replicas as named actors. Joins RAY_ADDRESS (`ray job submit`) or starts a
    local Ray, as a job does; a Ray it started stops with `close`.

    A replica that dies during a call fails that call (RuntimeError naming it); Ray restarts it (the plan's
    `max_restarts`), and the next call re-forms the sync group with the new process and sends it the version the
    replicas hold (`Liveness.rejoin_restarted`), so it works. A learner rank holds the only copy of the weights
    and optimizer state, and its FSDP group dies with it: its death raises `RoleCrashed`, and `recover` rebuilds
    every role by the one build path (as `RayBackend.recover` does), for the caller to restore its last save."""

    @staticmethod
    def prepare(config) -> bool:
        """Join or start the job's Ray now (on the caller's thread: a server does it on its main thread, before it
        sets its own signal handlers, which Ray's start would replace); whether it started one."""
        started = not ray.is_initialized()
        init_ray(config)
        return started

    def __init__(self, plan: JobPlan, model_path: str, owns_runtime: bool | None = None):
        """`owns_runtime`: stop Ray on `close` (None: if this call starts it)."""
        started = self.prepare(plan.config)
        self.started_ray = started if owns_runtime is None else owns_runtime
        self.plan, self.timeout_s, self.model_path = plan, plan.config.trainer.call_timeout_s, model_path
        self.cluster = None
        try:
            self.cluster = build_cluster(plan, model_path)  # a failed start shuts down what it started
        except BaseException:
            self.close()
            raise
        self._next_replica = itertools.cycle(range(len(self.cluster.replicas)))
        self.faults = FaultLedger(ROLE_KINDS)
        self.live = Liveness(self.cluster, plan, self.faults)
        self._replica_failed = False

    # ------------------------------------------------------------------ learner
    def forward_backward(self, batch, loss, backward: bool, sampling_mask) -> tuple[Any, dict[str, float]]:
        with learner_loss_named():
            return self.cluster.learners.forward_backward(batch, loss, backward, sampling_mask)

    def optim_step(self, adam: Mapping[str, float]) -> dict[str, float]:
        with learner_loss_named():
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
        self._rejoin_restarted()
        out = self.cluster.sync_weights(version)
        self.live.synced = version
        return out

    def generate(self, requests: list[LLMRequest]) -> list[LLMResponse]:
        """Each request to the next replica in turn (the samples of one prompt spread over the replicas)."""
        self._rejoin_restarted()
        replicas = self.cluster.replicas
        picked = [next(self._next_replica) for _ in requests]
        refs = [replicas[i].agenerate.remote(r) for i, r in zip(picked, requests)]
        try:
            return get_within(refs, self.timeout_s, f"inference replicas: generate {len(requests)} samples")
        except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError) as exc:
            self._replica_failed = True
            names = sorted({self.plan.names("replica")[i] for i in picked})
            raise RuntimeError(f"an inference replica ({', '.join(names)}) died during this call; Ray restarts it "
                               f"and the next call gets it the current weights: {type(exc).__name__}") from exc

    def _rejoin_restarted(self) -> None:
        """After a call a replica failed: wait for Ray's restart, re-form the sync group, resend the weights."""
        if self._replica_failed:
            self.live.rejoin_restarted(self.live.synced)
            self._replica_failed = False

    def replica_checksums(self) -> list[float]:
        return self.cluster.replicas.checksums()

    def recover(self, crash: RoleCrashed) -> None:
        """Every role afresh after `crash` (the old ones killed, their names freed), from the base weights."""
        self.faults.rolled_back(crash.roles)
        self.cluster.shutdown(close_timeout_s=5, namespace=self.plan.config.ray.namespace)
        self.cluster = build_cluster(self.plan, self.model_path)
        self.live = Liveness(self.cluster, self.plan, self.faults)
        self._next_replica = itertools.cycle(range(len(self.cluster.replicas)))

    def close(self) -> None:
        if self.cluster is not None:
            self.cluster.shutdown(namespace=self.plan.config.ray.namespace)
            self.cluster = None
        if self.started_ray and ray.is_initialized():
            ray.shutdown()
