"""Create the named actors of a job and wire the weight-sync group; every wait has a timeout. `Liveness` is the
driver's watch over them while it waits: which roles died, and a replica Ray restarted gets the version last synced
(it serves nothing until then)."""
from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import logging
import os
import time
from typing import Any

import ray

from rayllm_rl.orchestration.backend import RoleCrashed
from rayllm_rl.orchestration.fault_ledger import FaultLedger
from rayllm_rl.orchestration.ray.actors import EnvWorker, FrozenActor, InferenceReplica, LearnerWorker
from rayllm_rl.loop_thread import run_bounded
from rayllm_rl.orchestration.factories import build_episode_filter
from rayllm_rl.job.plan import JobPlan
from rayllm_rl.orchestration.ray.groups import ActorGroup, LearnerGroup, ReplicaGroup, get_within, wait_names_free
from rayllm_rl.orchestration.ray.placement import Placement, plan_placement
from rayllm_rl.orchestration.ray.reward_actors import start_reward_actors
from rayllm_rl.orchestration.ray.rollout_actors import RayLLMCollector, ReplayBufferActor
from rayllm_rl.orchestration.ray.turns import make_turns

log = logging.getLogger(__name__)

SERVICE_KINDS = ("reward-model", "judge")
"""Roles whose death costs scores (0 and a counter each), never a rollback: not watched by `dead_roles`."""


@dataclasses.dataclass
class Cluster:
    """One job's actors: a name -> handle map in the order they started (`handles`), each of a kind of
    `job.plan.KINDS` (`kinds`). The learner ranks, replicas and env workers are group views over it; liveness,
    teardown and the summary iterate it."""

    timeout_s: float
    sync_timeout_s: float
    start_timeout_s: float
    """The replicas' engines' start bound (`ray.engine_start_timeout_s`)."""
    handles: dict[str, Any] = dataclasses.field(default_factory=dict)
    kinds: dict[str, str] = dataclasses.field(default_factory=dict)
    transport: Any = None
    """The weight sync's `TransportInfo`, which the plan picked for the actors' nodes (set when the sync forms)."""
    collective_group: Any = None
    """Ray Direct Transport: the Ray collective group of learner rank 0 and the replicas."""
    placement: Placement | None = None
    replica_pids: list[int] = dataclasses.field(default_factory=list)
    """Each replica's process id when the weight-sync group last formed (a restart changes it)."""
    turns: Any = None
    """How generation and training share the hardware (turns.py: separate, or colocated turns)."""

    def add(self, role, handle) -> None:
        """Record `role`'s actor (as soon as it exists: a failed start shuts down what is recorded)."""
        self.handles[role.name], self.kinds[role.name] = handle, role.kind

    def of(self, *kinds: str) -> dict[str, Any]:
        """The actors of `kinds`, by name, in start order (a kind's own actors: in index order)."""
        return {name: h for name, h in self.handles.items() if self.kinds[name] in kinds}

    def one(self, kind: str) -> Any:
        """The actor of a kind the job has one of (the buffer, the collector), or None."""
        return next(iter(self.of(kind).values()), None)

    @property
    def replicas(self) -> ReplicaGroup:
        return ReplicaGroup(list(self.of("replica").values()), self.timeout_s, "inference replicas",
                            self.start_timeout_s)

    @property
    def learners(self) -> LearnerGroup:
        return LearnerGroup(list(self.of("learner").values()), self.timeout_s, "learner ranks")

    @property
    def env_workers(self) -> ActorGroup:
        return ActorGroup(list(self.of("env").values()), self.timeout_s, "env workers")

    @property
    def buffer(self) -> Any:
        return self.one("buffer")

    @property
    def collector(self) -> Any:
        return self.one("collector")

    @property
    def frozen(self) -> dict[str, Any]:
        """The frozen models' actors started so far (`start_frozen`), by name."""
        return self.of("frozen")

    @property
    def services(self) -> dict[str, Any]:
        """The `reward.*` actors by name (`reward-model-<i>`, `judge-<i>`): shut down with the job, but not roles
        whose death rolls it back."""
        return self.of(*SERVICE_KINDS)

    def get(self, refs, timeout_s: float | None = None):
        """ray.get with the job's timeout: a hang becomes a GetTimeoutError naming the wait."""
        return ray.get(refs, timeout=timeout_s or self.timeout_s)

    def roles(self) -> dict[str, Any]:
        """Every actor whose death rolls the job back, by its dashboard name (those started so far)."""
        return {name: h for name, h in self.handles.items() if self.kinds[name] not in SERVICE_KINDS}

    def dead_roles(self, timeout_s: float = 10.0) -> list[str]:
        """Names of the roles whose process is gone for good; a busy actor that does not answer in time, or one
        Ray is restarting, is not dead."""
        refs = {name: h.__ray_ready__.remote() for name, h in self.roles().items()}
        dead, deadline = [], time.monotonic() + timeout_s  # one bound for all pings, not one each
        for name, ref in refs.items():
            try:
                ray.get(ref, timeout=max(deadline - time.monotonic(), 0.1))
            except ray.exceptions.ActorDiedError:  # for good (a restarting actor is only unavailable)
                dead.append(name)
            except (ray.exceptions.ActorUnavailableError, ray.exceptions.GetTimeoutError):
                pass
        return dead

    def sync_weights(self, version: int) -> dict[str, float]:
        """Learners send (rank 0) while every replica receives into its back buffer. A pull transport:
        the replicas get the reference to rank 0's result, so they fetch once it has published (the
        driver passes references and the version, never bytes)."""
        info = self.transport
        # with Ray Direct Transport Ray keeps rank 0's result's tensors with it and sends them to each replica
        sent = self.learners.send_weights(version, info.tensor_transport)
        got = self.replicas.receive_weights(handoff_arg(info, sent[0]))
        # A replica's receive ends after rank 0's send (it waits for rank 0's result or its group's ack);
        # a Ray Direct Transport result cannot be fetched here: only the replicas receive its tensors.
        rdt = info.tensor_transport is not None
        waited = got + (sent[1:] if rdt else sent)
        done = self.get(waited, timeout_s=self.sync_timeout_s)  # a dead replica fails at once
        replicas = done[:len(got)]
        sent_stats = replicas[0]["sent"] if rdt else done[len(got)]["stats"]  # rank 0's result, wherever it is read
        return {**sent_stats, "stall_s": max(r["stall_s"] for r in replicas),
                "receive_s": max(r["receive_s"] for r in replicas)}

    def shutdown(self, close_timeout_s: float = 60.0, namespace: str | None = None) -> None:
        """Close sync groups, shared segments and engine cores, kill every actor; with `namespace`,
        also wait until their names are free again (so the job can be rebuilt under the same names)."""
        try:  # unlink shared segments, close sync groups and vLLM engine cores before the processes go
            closing = self.of("learner", "replica", *SERVICE_KINDS).values()
            self.get([a.close.remote() for a in closing], timeout_s=close_timeout_s)
        except Exception as exc:  # noqa: BLE001 - shutting down anyway
            log.info("closing the job's actors before killing them: %s", exc)
        leave_collective_group(self, timeout_s=close_timeout_s)
        for a in self.handles.values():
            ray.kill(a, no_restart=True)
        if self.placement is not None:
            self.placement.remove()
        names, self.handles, self.kinds = list(self.handles), {}, {}
        if namespace is not None:
            wait_names_free(names, namespace)


def handoff_arg(info, published):
    """What the driver passes each replica's `receive_weights` for learner rank 0's result `published`:
    nothing (a push transport's bytes travel in its group), the reference itself (Ray Direct Transport:
    Ray moves the result's tensors to the replica before the call runs), or `[reference]` (every other
    pull transport), which the replica awaits, so Ray schedules its call while rank 0 still publishes."""
    if not info.pulls:
        return None
    return published if info.tensor_transport is not None else [published]


INLINE_LIMIT_BYTES = int(os.environ.get("RAY_max_direct_call_object_size", 100 * 1024))
"""Ray inlines a task argument smaller than this in the task itself (its `max_direct_call_object_size`,
100 KiB by default); a larger one goes to the object store, owned by the caller."""


def check_inlined(role: str, args: tuple, names: tuple[str, ...] = (), hint: str = "") -> None:
    """A restartable actor's constructor arguments must be small enough for Ray to inline them: Ray
    re-runs the constructor on a restart with the same arguments, and one kept in the object store
    is gone once the driver drops its reference (the restart then fails). Also no ObjectRef or
    actor handle among them (pass a name the actor looks up). `names[i]` says what argument i is, `hint`
    what to do about one too big (default: pass a path or a name instead)."""
    from ray import cloudpickle

    for i, arg in enumerate(args):
        named = f"{i} ({names[i]})" if i < len(names) else str(i)
        ref = _first_ref(arg)
        if ref is not None:
            raise TypeError(f"{role}: constructor argument {named} holds a Ray reference ({type(ref).__name__}); a "
                            f"restart would depend on it staying in scope: pass a name the actor looks up instead")
        size = len(cloudpickle.dumps(arg))
        if size >= INLINE_LIMIT_BYTES:
            what = named if i < len(names) else f"{i} ({type(arg).__name__})"
            raise ValueError(f"{role}: constructor argument {what} pickles to {size} bytes, >= {INLINE_LIMIT_BYTES} "
                             f"(Ray's max_direct_call_object_size): Ray would keep it in the object store and a "
                             f"restart of this actor would fail once it is released; "
                             f"{hint or 'pass a path or a name the actor looks up instead'}")


def _first_ref(obj, depth: int = 0):
    """The first ObjectRef or actor handle in `obj`, looking into lists, tuples, dicts and partials."""
    if isinstance(obj, (ray.ObjectRef, ray.actor.ActorHandle)):
        return obj
    if depth > 4:
        return None
    if isinstance(obj, functools.partial):
        items = [obj.func, *obj.args, *obj.keywords.values()]
    elif isinstance(obj, dict):
        items = list(obj.values())
    elif isinstance(obj, (list, tuple, set)):
        items = list(obj)
    else:
        return None
    return next((r for r in (_first_ref(x, depth + 1) for x in items) if r is not None), None)


FAILED_START_CLOSE_S = 30.0
"""How long a failed start waits for its actors to close (shared segments, sync groups, engine cores) before
it kills them: an actor still busy starting does not answer, and the error is what the caller waits for."""


def build_cluster(plan: JobPlan, model_path: str, task=None, workflow_factory=None) -> Cluster:
    """Reserve the plan's GPUs and start its roles (`JobPlan.roles`) in their order: placement group, reward
    services, replicas, buffer, env workers, learners, collector; then the learners' setup and the weight-sync
    group. A start that fails at any stage shuts down what it started (each actor closed, bounded, then killed;
    the placement group removed; the names freed), then raises its own error. `task` and `workflow_factory`: the
    rollout roles' (None for a plan of learners and replicas alone, `JobPlan.only`)."""
    rc, call_timeout_s = plan.config.ray, plan.config.trainer.call_timeout_s
    placement = plan_placement(plan.layout, rc.sync_timeout_s, replica_labels=rc.replica_node_labels,
                               learner_labels=rc.learner_node_labels, env_worker_labels=rc.env_worker_node_labels)
    cluster = Cluster(call_timeout_s, rc.sync_timeout_s, rc.engine_start_timeout_s, placement=placement)
    try:
        start_reward_actors(plan, into=cluster)  # env workers look them up by name when they start
        start_roles(cluster, plan, model_path, RoleContext(plan, task, workflow_factory))
    except BaseException:
        try:
            cluster.shutdown(close_timeout_s=FAILED_START_CLOSE_S, namespace=rc.namespace)
        except Exception as exc:  # noqa: BLE001 - the start's own error is the one to raise
            log.warning("cleaning up a failed start: %s", exc)
        raise
    return cluster


@dataclasses.dataclass
class RoleContext:
    """What the starters need besides a role: the job's namespace and call timeout, its rollout task and the env
    workers' workflow factory, the batch pipeline the buffer runs."""

    plan: JobPlan
    task: Any = None
    workflow_factory: Any = None

    def __post_init__(self):
        self.namespace, self.timeout_s = self.plan.config.ray.namespace, self.plan.config.trainer.call_timeout_s
        self.env_args = None
        if any(a.kind == "env" for a in self.plan.actors):
            # An env worker holds no state a restart loses: Ray restarts a dead one, and the collector runs the
            # episodes it had in flight again (the buffer stores each episode id once). Its constructor takes names,
            # not handles, and small inlined arguments only, so a restart never depends on an object-store argument
            # the driver may have dropped.
            self.env_args = (self.workflow_factory, self.plan.names("replica"), self.plan.names("buffer")[0],
                             self.namespace, build_episode_filter(self.plan.config), self.timeout_s, 1,
                             self.plan.failure_policy())
            check_inlined("env worker", self.env_args,
                          names=("workflow factory: the job config and the task's worker part",))


def _start_replica(c: Cluster, role, ctx: RoleContext):
    # A replica Ray restarts refuses requests until the driver re-forms the sync group and sends it the current
    # weights (RayBackend.sync_weights).
    args = (role.spec, role.actor.threads)
    check_inlined("inference replica", args)
    return InferenceReplica.options(name=role.name, namespace=ctx.namespace, max_restarts=role.actor.restarts,
                                    **c.placement.replica_options[role.index]).remote(*args)


def _start_buffer(c: Cluster, role, ctx: RoleContext):
    return ReplayBufferActor.options(name=role.name, namespace=ctx.namespace, max_concurrency=1000,
                                     **c.placement.driver_node_options).remote(role.spec, ctx.plan.batch_pipeline)


def _start_env_worker(c: Cluster, role, ctx: RoleContext):
    return EnvWorker.options(name=role.name, namespace=ctx.namespace, max_concurrency=1000,
                             max_restarts=role.actor.restarts, **c.placement.env_worker_options).remote(*ctx.env_args)


def _start_learner(c: Cluster, role, ctx: RoleContext):
    return LearnerWorker.options(name=role.name, namespace=ctx.namespace,
                                 **c.placement.learner_options[role.index]).remote(
        role.index, ctx.plan.learner_ranks, role.actor.threads)


def _start_collector(c: Cluster, role, ctx: RoleContext):
    collector = RayLLMCollector.options(name=role.name, namespace=ctx.namespace, max_concurrency=1000,
                                        **c.placement.driver_node_options).remote(
        role.spec, ctx.task.train, list(c.env_workers), c.buffer,
        ctx.plan.failure_policy().deadline_s + ctx.timeout_s)  # every attempt, then the buffer's put
    c.buffer.set_collector.remote(collector)
    return collector


STARTERS = {"replica": _start_replica, "buffer": _start_buffer, "env": _start_env_worker, "learner": _start_learner,
            "collector": _start_collector}
"""How each kind of the "roles" phase starts: the Ray layer's one table of actor classes."""


def start_roles(cluster: Cluster, plan: JobPlan, model_path: str, ctx: RoleContext) -> None:
    """Start the roles of the plan's "roles" phase into `cluster`, one loop in the plan's order (each recorded as
    soon as it exists, so a failure at any point leaves the cluster knowing what to shut down), then set the
    learners up and form the weight sync."""
    roles = plan.roles(model_path, "roles")
    for role in roles:
        cluster.add(role, STARTERS[role.kind](cluster, role, ctx))
    cluster.turns = make_turns(plan.colocated, cluster)
    learner = next((r for r in roles if r.kind == "learner"), None)
    if learner is not None:
        host, port = cluster.learners.rendezvous()
        cluster.learners.setup(learner.spec, plan.loss, host, port)
    cluster.replicas.ready()  # vLLM: engine cores up before the group forms
    cluster.replica_pids = cluster.replicas.pids()
    if learner is not None and cluster.replica_pids:
        form_sync_group(cluster, plan)


def start_frozen(cluster: Cluster, plan: JobPlan, model_path: str, checkpoint: str | None) -> None:
    """An actor for each of the plan's frozen models (its "frozen" phase), named as the model. One loaded from its
    own path gets only small inlined arguments (Ray re-runs its constructor on a restart); one started from the
    policy gets `checkpoint`, or learner rank 0's gathered weights by reference (every rank joins the gather; no
    rank's tensors come to the driver). Each is waited for, so a failure names the model here, not at its first
    batch."""
    for role in plan.roles(model_path, "frozen"):
        spec, gathered, weights = role.spec, [], None
        if spec.saved:
            gathered = [] if checkpoint else cluster.learners.policy_weights()
            weights = checkpoint or gathered[0]
        else:
            check_inlined(role.name, (spec, model_path))
        handle = FrozenActor.options(name=role.name, namespace=plan.config.ray.namespace,
                                     max_restarts=role.actor.restarts, **cluster.placement.frozen_options).remote(
            spec, model_path, weights, role.actor.threads)
        cluster.add(role, handle)
        if gathered:  # the other ranks' copies: waited for, not fetched
            done, _ = ray.wait(gathered, num_returns=len(gathered), timeout=cluster.timeout_s, fetch_local=False)
            if len(done) < len(gathered):
                raise TimeoutError(f"the learners' weights for the frozen model {role.name!r} were not gathered "
                                   f"in {cluster.timeout_s:g}s")
        cluster.get(handle.pid.remote())


def form_sync_group(cluster: Cluster, plan: JobPlan) -> None:
    """The weight sync of learner rank 0 and every replica: the plan picks the transport for the nodes
    the actors landed on, and the registry builds both ends; each replica takes as many ranks as it has
    receiving processes."""
    from rayllm_rl.weight_sync.registry import make_spec, transport_info

    rc, learners, replicas = plan.config.ray, cluster.learners, cluster.replicas
    sync_host = learners.node_ip()
    transport = plan.pick_transport(sync_host, replicas.node_ips())
    cluster.transport = info = transport_info(transport)
    ranks = replicas.receiving_processes(transport)
    # a transport whose sender makes what the replicas read (Ray channels) gets their actors and nodes
    readers = list(zip(replicas, replicas.node_ids())) if info.needs_readers else ()
    spec = make_spec(transport, learners.weight_metadata(), receivers=sum(ranks),
                     timeout_s=rc.sync_timeout_s, bucket_bytes=int(rc.sync_bucket_mb * (1 << 20)),
                     host=sync_host, readers=readers)
    first = [1 + sum(ranks[:i]) for i in range(len(replicas))]
    # learner rank 0 opens its end first (a group binds its store: the replicas get the port it bound)
    spec = spec.with_init(learners.open_weight_sender(spec, timeout_s=rc.sync_timeout_s + 30))
    refs = learners.finish_weight_sender() + replicas.join_update_group([spec.for_rank(k) for k in first])
    get_within(refs, rc.sync_timeout_s + 30, f"the {transport} weight-sync group of learner rank 0 and "
               f"{len(replicas)} replica(s): form", "ray.sync_timeout_s")
    if spec.info.tensor_transport is not None:
        join_collective_group(cluster, spec.info.tensor_transport, rc.sync_timeout_s)


def join_collective_group(cluster: Cluster, backend: str, timeout_s: float) -> None:
    """The Ray collective group Ray Direct Transport sends over: learner rank 0 (rank 0) and every
    replica."""
    from ray.experimental.collective import create_collective_group

    leave_collective_group(cluster, timeout_s)
    members = [cluster.learners[0], *cluster.replicas]
    what = f"Ray's {backend} collective group of learner rank 0 and {len(cluster.replicas)} replica(s)"
    try:
        cluster.collective_group = run_bounded(lambda: create_collective_group(members, backend=backend),
                                               timeout_s, f"weight sync: {what} (ray.sync_timeout_s)")
    except TimeoutError:
        raise
    except Exception as exc:
        raise RuntimeError(f"weight sync: {what} did not form: {exc}") from exc


def leave_collective_group(cluster: Cluster, timeout_s: float) -> None:
    """Destroy the Ray collective group, if any (an actor keeps one group per backend: a new one for
    a restarted replica needs the old one gone); best effort, bounded."""
    from ray.experimental.collective import destroy_collective_group

    group, cluster.collective_group = cluster.collective_group, None
    if group is None:
        return
    try:
        run_bounded(lambda: destroy_collective_group(group), timeout_s, "destroying Ray's collective group")
    except Exception:  # noqa: BLE001 - tearing a group down: its members may be dead already
        pass


def restarted_replicas(cluster: Cluster, timeout_s: float = 120.0) -> list[int]:
    """Indices of the replicas Ray restarted since the group formed (a new process id); waits for a
    restarting one to come back, at most `timeout_s`."""
    deadline, restarted = time.monotonic() + timeout_s, []
    for i, r in enumerate(cluster.replicas):
        while True:
            try:
                pid = ray.get(r.pid.remote(), timeout=max(deadline - time.monotonic(), 1.0))
                break
            except ray.exceptions.ActorUnavailableError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)
        if pid != cluster.replica_pids[i]:
            restarted.append(i)
    return restarted


def rejoin_sync_group(cluster: Cluster, plan: JobPlan, restarted: list[int]) -> None:
    """After replicas were restarted: start their engines, then form the weight-sync group again
    with every member (the old group lost a member and cannot be repaired)."""
    cluster.replicas.ready(restarted)
    cluster.get(cluster.learners.close_refs(), timeout_s=cluster.sync_timeout_s + 30)
    cluster.replicas.leave_update_group(cluster.sync_timeout_s + 30)
    cluster.replica_pids = cluster.replicas.pids()
    form_sync_group(cluster, plan)



class Liveness:
    """Dead roles and restarted replicas of one cluster, checked every `every_s` while the driver waits."""

    def __init__(self, cluster: Cluster, plan: JobPlan, faults: FaultLedger, every_s: float = 10.0):
        """`faults`: counts the replicas Ray restarted."""
        self.cluster, self.plan, self.faults = cluster, plan, faults
        self.every_s = every_s
        """While waiting for a batch, a drain or an eval, check every this many seconds that no role died
        (and send the current weights to a replica Ray restarted)."""
        self.synced: int | None = None
        """The version the replicas were last sent: a replica Ray restarts since gets it again."""

    def dead_roles(self) -> list[str]:
        return self.cluster.dead_roles()

    def rejoin_restarted(self, version: int | None) -> dict[str, float] | None:
        """If Ray restarted replicas since the group formed, form the group again with the new
        processes and send them `version` (they refuse requests until then); None if none were,
        or if no version was synced yet (the first sync forms the group with them)."""
        if version is None:
            return None
        restarted = restarted_replicas(self.cluster)
        if not restarted:
            return None
        self.faults.replicas_restarted(len(restarted))
        rejoin_sync_group(self.cluster, self.plan, restarted)
        return self.cluster.sync_weights(version)

    def await_live(self, job, what: str, bounded: bool = True):
        """Wait for `job` (an ObjectRef, or a Future of work on the driver), at most the job's timeout
        + 30 s if `bounded`, while it may need the replicas: every `every_s`, a dead role ends the
        wait (RoleCrashed) and a replica Ray restarted (its process died, or its node was lost) gets
        the version last synced, without which it serves nothing (with no other replica, what is
        waited for would never finish)."""
        c, local = self.cluster, isinstance(job, concurrent.futures.Future)
        deadline = time.monotonic() + c.timeout_s + 30
        while not (concurrent.futures.wait([job], timeout=self.every_s).done if local
                   else ray.wait([job], timeout=self.every_s)[0]):
            dead = self.dead_roles()
            if dead:
                raise RoleCrashed(dead, RuntimeError(f"waiting for the {what}"))
            self.rejoin_restarted(self.synced)
            if bounded and time.monotonic() > deadline:
                raise TimeoutError(f"no {what} in {c.timeout_s + 30:g}s")
        return job.result() if local else c.get(job, None)
