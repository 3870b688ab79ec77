"""RayBackend: the driver's calls (backend.Backend) on a job's actors; every wait has a timeout."""
from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import logging
import pickle
import threading
from typing import Any

import ray

from rayllm_rl.orchestration.backend import ROLE_KINDS, RoleCrashed, backend_summary
from rayllm_rl.orchestration.fault_ledger import FaultLedger
from rayllm_rl.orchestration.ray.cluster import (
    FAILED_START_CLOSE_S, Cluster, Liveness, build_cluster, check_inlined, start_frozen,
)
from rayllm_rl.orchestration.ray.session import init_ray, session_for_job
from rayllm_rl.hub import resolve_model_path
from rayllm_rl.envs.task import Task
from rayllm_rl.orchestration.factories import build_evaluation, build_workflow
from rayllm_rl.job.config import GRPOJobConfig
from rayllm_rl.job.plan import JobPlan
from rayllm_rl.orchestration.ray.router import ReplicaRouter
from rayllm_rl.orchestration.ray.reward_actors import (
    env_worker_reward_counters, ray_reward_scorers, reward_service_stats,
)
from rayllm_rl.orchestration.ray.tool_services import ray_python_tools
from rayllm_rl.workflows.custom import CustomWorkflow

log = logging.getLogger(__name__)


def make_workflow(cfg: GRPOJobConfig, model_path: str, worker_task: Task, custom: CustomWorkflow | None = None):
    """Top-level (picklable) factory run inside each EnvWorker: `worker_task` is the driver's task without its
    rows (`Task.worker_part`: reward fn, env class) and `custom` the user's own workflow (its class, factory or
    instance), both shipped by value in the env worker's constructor arguments, so a reward or a workflow
    defined in the user's script reaches it too (the collector hands each episode its row); the tokenizer from
    `model_path` resolved on this node, and the `reward.*` scorers over the reward-model and judge actors."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(model_path, cfg.model.revision))
    return build_workflow(cfg, worker_task, tokenizer, make_tools=ray_python_tools,
                          reward_scorers=ray_reward_scorers(cfg), custom=custom)


WORKER_TASK_HINT = ("keep large data (a lookup table, a model) out of the reward's closure and attributes: load it "
                    "inside the reward from a path (once per process, e.g. functools.cache)")
"""What to do about a task's worker part too big to inline in the env workers' constructor arguments."""


def shipped_workflow(custom: CustomWorkflow | None) -> CustomWorkflow | None:
    """The user's workflow, checked to ride in an env worker's constructor arguments (`check_inlined`); one too
    big (an instance holding a tokenizer or a model, a closure over a large object) fails naming it."""
    if custom is not None:
        check_inlined("env worker", (custom,), names=(f"the workflow of {custom.label}",),
                      hint="pass a class or factory (the job hands it the tokenizer, reward and sampling in each env "
                           "worker) and load large data inside it from a path")
    return custom


def worker_part(task: Task) -> Task:
    """`task.worker_part()`, checked to ride in an env worker's constructor arguments (`check_inlined`: inlined
    by Ray, so a restart finds it; no ObjectRef); one too big fails naming the task and what to do."""
    part = task.worker_part()
    check_inlined("env worker", (part,), names=(f"task {part.name!r} without its rows: reward fn, env class, "
                                                "SFT target",), hint=WORKER_TASK_HINT)
    return part


def _crash_aware(method):
    """A failed call whose cause is a dead actor raises RoleCrashed naming it (else the error as is)."""
    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        try:
            return method(self, *args, **kwargs)
        except (ray.exceptions.RayError, TimeoutError) as exc:
            dead = self.live.dead_roles()
            if dead:
                raise RoleCrashed(dead, exc) from exc
            raise
    return wrapper


class RayBackend:
    """Replicas, env workers, learners, buffer and collector as named Ray actors (see cluster.py)."""

    session = staticmethod(session_for_job)

    def __init__(self, plan: JobPlan, model_path: str, task, tokenizer, workflow: CustomWorkflow | None = None):
        """`workflow`: the user's own rollout workflow (`JobInputs.workflow`), built in each env worker."""
        from rayllm_rl.orchestration.ray.metrics import RayMetrics

        self.workflow = shipped_workflow(workflow)  # too big to inline fails before Ray starts
        init_ray(plan.config)
        self.plan, self.cfg = plan, plan.config
        self.model_path, self.task, self.tokenizer = model_path, task, tokenizer
        self.evaluation = build_evaluation(self.cfg, task, tokenizer)
        self._driver_bytes = 0
        """Data the driver fetched from or sent to the roles since `driver_bytes()` last read it."""
        self.faults = FaultLedger(ROLE_KINDS)
        """Restarts (env workers and replicas restarted by Ray, roles rebuilt by `recover`), episodes
        re-run and lost, and the checkpoint baseline: the collector reports, the ledger counts."""
        self._build()  # a failed build shuts down what it started (cluster.build_cluster)
        try:
            self._metrics = RayMetrics()
        except BaseException:
            self.cluster.shutdown(close_timeout_s=FAILED_START_CLOSE_S, namespace=self.cfg.ray.namespace)
            raise

    def _build(self) -> None:
        cfg, worker_task = self.cfg, worker_part(self.task)
        self.cluster: Cluster = build_cluster(self.plan, self.model_path, self.task, functools.partial(
            make_workflow, cfg, self.model_path, worker_task, self.workflow))
        self._pending_version = None  # the last version told the collector, awaited at the next one
        self.live = Liveness(self.cluster, self.plan, self.faults)
        """Dead roles and restarted replicas, checked while the driver waits (`live.every_s`)."""

    def recover(self, crash: RoleCrashed) -> None:
        """Kill what is left of the job and start every role afresh (the driver restores a checkpoint)."""
        try:  # what the collector saw since the last look, before it is replaced
            self._take_fault_events(timeout_s=30)
        except ray.exceptions.RayError:  # the collector itself is gone: its unreported events went with it
            pass
        self.faults.rolled_back(crash.roles)
        self.cluster.shutdown(close_timeout_s=5, namespace=self.cfg.ray.namespace)  # the names free for the next
        self._build()

    def _take_fault_events(self, timeout_s: float | None = None, note_pids: bool = True) -> None:
        """Fold the collector's fault events into the ledger (with `note_pids`, every env worker's process id
        asked now: a restart no episode ran into is seen too)."""
        c = self.cluster
        self.faults.record(c.get(c.collector.take_fault_events.remote(note_pids), timeout_s=timeout_s))

    def _through_driver(self, obj):
        """Count `obj` (what the driver fetched, or is about to send) in `driver_bytes`; returns it."""
        self._driver_bytes += int(obj.bytes()) if hasattr(obj, "bytes") else len(pickle.dumps(obj, protocol=5))
        return obj

    def driver_bytes(self) -> int:
        out, self._driver_bytes = self._driver_bytes, 0
        return out

    @_crash_aware
    def train_step(self, batch, loss=None) -> dict[str, float]:
        """`batch`: `next_batch`'s reference (the learners fetch it from the buffer's node), or a
        TensorDict made here (the SFT warm start's), put once for every rank."""
        if not isinstance(batch, ray.ObjectRef):
            batch = ray.put(self._through_driver(batch))
        step = lambda: self.cluster.learners.train_step(batch, loss)  # noqa: E731
        return self._through_driver(self.cluster.turns.train(step))[0]

    @_crash_aware
    def reset_optimizer(self, optim_cfg) -> None:
        self.cluster.learners.reset_optimizer(optim_cfg)

    @_crash_aware
    def sync_weights(self, version: int) -> dict[str, float]:
        """Stream `version` to every replica. If a replica's process died and Ray restarted it, the
        sync fails: form the group again with the new process and send the current weights once more."""

        def sync():
            try:
                return self.cluster.sync_weights(version)
            except (ray.exceptions.RayError, TimeoutError):
                out = self.live.rejoin_restarted(version)
                if out is None:
                    raise
                return out

        out = self.cluster.turns.hand_over(sync)  # colocated: the replicas' weights wake first
        self.live.synced = version
        if self._pending_version is not None:  # the collector's version, pipelined: the previous call is awaited
            self.cluster.get(self._pending_version)  # (bounded) and this one left in flight
        self._pending_version = self.cluster.collector.set_version.remote(version)
        return self._through_driver(out)

    @_crash_aware
    def start_collector(self) -> None:
        self.cluster.get(self.cluster.collector.start.remote())

    @_crash_aware
    def next_batch(self, n_episodes: int, version: int):
        """One awaited call: the buffer returns over-stale episodes' slots to the collector itself, and
        fails this wait at once (naming the cause) if the collector's loop dies. Every `live.every_s`
        while waiting: a dead role ends the wait, and a restarted replica gets the current weights
        (it serves nothing until then, so with one replica the batch would never fill)."""
        c = self.cluster
        batch, meta = c.buffer.take_batch.remote(n_episodes, version, c.timeout_s, c.frozen)
        meta = self.live.await_live(meta, f"batch of {n_episodes} episodes at version {version}")
        return batch, self._through_driver(meta)

    @_crash_aware
    def start_frozen(self, checkpoint: str | None) -> None:
        """The plan's frozen models, each an actor named as the model (`cluster.start_frozen`)."""
        start_frozen(self.cluster, self.plan, self.model_path, checkpoint)

    @_crash_aware
    def evaluate(self, progress=None) -> dict[str, Any]:
        """Greedy eval over the replicas, on a thread of its own: this one keeps the liveness check,
        so a replica restarted before or during the eval gets the current weights (each request is
        bounded by the router's timeout). `progress(n)`: called on that thread as answers come back."""
        self.live.rejoin_restarted(self.live.synced)
        router = ReplicaRouter(self.cluster.replicas, self.cluster.timeout_s)
        done: concurrent.futures.Future = concurrent.futures.Future()

        def run() -> None:
            try:
                done.set_result(asyncio.run(self.evaluation(router, progress=progress)))
            except BaseException as exc:  # noqa: BLE001 - handed to the waiting thread
                done.set_exception(exc)

        threading.Thread(target=run, name="evaluate", daemon=True).start()
        return self.live.await_live(done, "evaluation", bounded=False)

    @_crash_aware
    def collector_stats(self) -> dict[str, Any]:
        return self._through_driver(self.cluster.get(self.cluster.collector.stats.remote()))

    @_crash_aware
    def role_states(self) -> dict[str, Any]:
        c, dead = self.cluster, self.live.dead_roles()
        if dead:  # a checkpoint now would keep what the dead role cost (episodes given up): roll back instead
            raise RoleCrashed(dead, RuntimeError("found dead before a checkpoint"))
        self._take_fault_events(note_pids=False)  # the checkpoint's baseline counts every episode lost before it
        return {"collector": c.get(c.collector.state_dict.remote()), "buffer": c.get(c.buffer.state_dict.remote())}

    @_crash_aware
    def load_role_states(self, states: dict[str, Any]) -> None:
        c = self.cluster
        c.get(c.collector.load_state_dict.remote(states["collector"]))
        c.get(c.buffer.load_state_dict.remote(states["buffer"]))

    @_crash_aware
    def save_models(self, path: str, extra: dict[str, Any]) -> None:
        c = self.cluster
        c.learners.save_checkpoint(path, self.model_path, extra)
        c.get([c.frozen[spec.name].save.remote(path) for spec in self.plan.frozen
               if spec.saved and spec.name in c.frozen])

    @_crash_aware
    def load_models(self, path: str) -> dict[str, Any]:
        return self.cluster.learners.load_checkpoint(path)

    @_crash_aware
    def drain(self) -> None:
        if self._pending_version is not None:
            self.cluster.get(self._pending_version)
        self.live.await_live(self.cluster.collector.drain.remote(self.cluster.timeout_s), "collector's drain")

    def summary_stats(self) -> dict[str, Any]:
        c = self.cluster
        sums = c.learners.checksums() + c.replicas.checksums()
        self._take_fault_events()
        col = self.collector_stats()
        return backend_summary(collector=col, faults=self.faults,
                               buffer=c.get(c.buffer.stats.remote()),
                               reward_failures=env_worker_reward_counters(c.env_workers),
                               versions_held=c.replicas.versions_held(),
                               transport=None if c.transport is None else c.transport.name,
                               checksums_equal=len(set(sums)) == 1,
                               reward_services=reward_service_stats(c.services, c.timeout_s))

    def publish(self, record: dict[str, Any]) -> None:
        self._metrics.update(record)

    def shutdown(self) -> None:
        try:
            self.cluster.shutdown(close_timeout_s=60.0, namespace=self.cfg.ray.namespace)
        except TimeoutError as exc:  # the run is over and recorded; a slow name release only warns
            log.warning("shutdown: %s", exc)
