"""Where the job's GPU actors go: one placement group for inference replicas and FSDP learner ranks.

`plan_placement` reserves the job's `GpuLayout` (decided once from the `ray.*` GPU settings, by
`placement_rules.gpu_layout`) and returns the kwargs of `ActorClass.options(**opts)` for every
replica and learner rank, so the caller creates actors exactly as before and only merges these
options in.

* All GPU counts 0 (the default, and every CPU test): no placement group; each actor gets
  `{"num_cpus": 0}`, which is what the actors already declare today.
* Any GPU requested: one placement group, strategy PACK, bundle i = replica i and bundle
  num_replicas + r = learner rank r. It is reserved up front (atomically, all bundles or none),
  so a job that cannot get all its GPUs fails within `timeout_s` with the request and the
  cluster's resources in the message, instead of hanging on a half-started set of actors.
  Each actor is pinned to its bundle and asks for `num_gpus=` its share and `num_cpus=0`.
  Ray rejects a bundle whose every resource is 0, so a role with 0 GPUs (e.g. CPU learners
  next to GPU replicas) gets a bundle of `CPU_ONLY_BUNDLE_CPUS` CPU: it stays in the group
  (PACK keeps it near the GPU actors, which matters for same-node weight transports) while
  its actors still request no resources themselves.

Colocated (`ray.placement=colocated`): bundle i holds replica i and learner rank i, one GPU, each
asking half of it, so Ray hands both the same device (one CUDA_VISIBLE_DEVICES). They take turns on it
(orchestration/ray/turns.py). Otherwise (separate):

Distinct GPUs: GPU counts must be whole numbers, and a whole-GPU bundle takes whole GPU
instances, so no two actors ever share a device. Fractions are rejected on purpose: Ray packs
fractional bundles onto the same GPU, two FSDP/NCCL ranks cannot share one device, and a vLLM
replica takes most of its GPU's memory by default.

Tensor parallelism: a replica with `tensor_parallel_size` > 1 requests all `gpus_per_replica`
GPUs for its one actor; Ray sets CUDA_VISIBLE_DEVICES to those devices and vLLM is expected to
run its TP workers inside the actor's visible devices (the actor captures child tasks into its
bundle, so Ray-spawned helpers stay there too). What of this has run on real GPUs: docs/inference-engines.md
("Never run on a GPU").

Node labels (`ray.replica_node_labels`, `ray.learner_node_labels`, `ray.env_worker_node_labels`): each
role's actors get them as Ray's `label_selector`, so Ray starts them, and restarts them after a crash
or a lost node, only on nodes carrying those labels; with GPUs the same selectors go on the bundles
(`bundle_label_selector`). `wait_for_labelled_nodes` fails the job within the placement timeout,
naming the key and every node's labels, when no live node carries a role's labels (the actor would
otherwise wait forever to be scheduled). The collector and the replay buffer hold state no restart
brings back, so they stay on the driver's node (`Placement.driver_node_options`), whose loss ends the
job anyway, instead of wherever Ray puts an actor that asks for no resources (another node, which
would then take them down with it). A frozen model (the reference, the teacher) goes with
the learners' labels, or else stays on the driver's node; with one-GPU learner ranks it goes into learner
rank 0's bundle instead, with `FROZEN_SHARE` of its GPU (taken from the learner's share), and runs there
in the learner's dtype.

Note (Ray 2.60, ray-project/ray#54868): an actor with 0 GPUs does not get CUDA_VISIBLE_DEVICES
cleared by default, so on a GPU node a "CPU" actor would see every GPU; the job's actors start with
RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO=1 (actors.ACTOR_ENV_VARS), which makes Ray clear it for them.
"""
from __future__ import annotations

import dataclasses
import os
import re
import time
from typing import Any

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy, PlacementGroupSchedulingStrategy

from rayllm_rl.job.placement_rules import STRATEGY, GpuLayout, node_matches


class PlacementError(RuntimeError):
    """The placement group could not be reserved within the timeout."""


@dataclasses.dataclass
class Placement:
    """Actor options for every replica and learner rank, and the placement group holding them."""

    replica_options: list[dict[str, Any]]
    """`InferenceReplica.options(**replica_options[i])` for replica i."""
    learner_options: list[dict[str, Any]]
    """`LearnerWorker.options(**learner_options[r])` for learner rank r."""
    placement_group: PlacementGroup | None = None
    """The reserved group, or None when no GPU is requested."""
    env_worker_options: dict[str, Any] = dataclasses.field(default_factory=dict)
    """Merged into every `EnvWorker.options(...)` (its node labels, if any)."""
    driver_node_options: dict[str, Any] = dataclasses.field(default_factory=dict)
    """Merged into the options of the roles that stay with the driver (collector, replay buffer)."""
    frozen_options: dict[str, Any] = dataclasses.field(default_factory=dict)
    """Merged into `FrozenActor.options(...)` for every frozen model: learner rank 0's bundle with a GPU share
    (one-GPU learner ranks), else the learners' labels, or the driver's node."""

    def remove(self) -> None:
        """Release the placement group (kills actors still in it); safe to call twice."""
        if self.placement_group is not None:
            remove_placement_group(self.placement_group)
            self.placement_group = None


def _actor_options(pg: PlacementGroup, index: int, gpus: float) -> dict[str, Any]:
    """Options pinning an actor (and the tasks/actors it spawns) to bundle `index` of `pg`."""
    strategy = PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=index,
                                                placement_group_capture_child_tasks=True)
    return {"num_cpus": 0, "num_gpus": gpus, "scheduling_strategy": strategy}


def _with_labels(options: dict[str, Any], labels: dict[str, str] | None) -> dict[str, Any]:
    """`options` plus Ray's `label_selector` for `labels` (none when empty)."""
    return {**options, "label_selector": dict(labels)} if labels else options


def wait_for_labelled_nodes(selectors: dict[str, dict[str, str] | None], timeout_s: float,
                            poll_s: float = 1.0) -> None:
    """Wait (at most `timeout_s`: an autoscaler may be adding the node) until, for every `ray.<key>`
    in `selectors` with labels, some live node carries them; else raise PlacementError naming the key,
    its labels and every live node's labels."""
    selectors = {key: sel for key, sel in selectors.items() if sel}
    deadline = time.monotonic() + timeout_s
    while selectors:
        nodes = [n.get("Labels") or {} for n in ray.nodes() if n.get("Alive")]
        missing = {key: sel for key, sel in selectors.items() if not any(node_matches(sel, n) for n in nodes)}
        if not missing:
            return
        if time.monotonic() > deadline:
            shown = [{k: v for k, v in n.items() if not k.startswith("ray.io/")} for n in nodes]
            raise PlacementError("; ".join(f"no live node carries ray.{key}={sel}" for key, sel in missing.items())
                                 + f" within {timeout_s:g}s (the live nodes' labels: {shown}); start a node with "
                                 "`ray start --labels=...`, or change the labels")
        time.sleep(poll_s)


def plan_placement(layout: GpuLayout, timeout_s: float, *, replica_labels: dict[str, str] | None = None,
                   learner_labels: dict[str, str] | None = None,
                   env_worker_labels: dict[str, str] | None = None) -> Placement:
    """Reserve the GPUs of `layout` (decided and checked by `placement_rules.gpu_layout`), waiting at
    most `timeout_s`, and return every role's actor options. `*_labels`: node labels each role's actors
    need (their `label_selector`; {} or None = any node).

    Raises PlacementError (leaving no placement group behind) when the cluster cannot provide the
    requested GPUs, or no node carries a role's labels, in time.
    """
    n_rep, n_learn = layout.num_replicas, layout.num_learners
    wait_for_labelled_nodes({"replica_node_labels": replica_labels, "learner_node_labels": learner_labels,
                             "env_worker_node_labels": env_worker_labels}, timeout_s)
    env_options = _with_labels({}, env_worker_labels)
    driver_node = {"scheduling_strategy": NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(),
                                                                         soft=False)}
    frozen = _with_labels({}, learner_labels) if learner_labels else driver_node  # the reference, the teacher
    others = {"env_worker_options": env_options, "driver_node_options": driver_node, "frozen_options": frozen}
    if not layout.uses_gpus:
        return Placement([_with_labels({"num_cpus": 0}, replica_labels) for _ in range(n_rep)],
                         [_with_labels({"num_cpus": 0}, learner_labels) for _ in range(n_learn)], **others)
    selectors = ([dict(replica_labels or {})] * n_rep
                 + ([] if layout.colocated else [dict(learner_labels or {})] * n_learn))
    pg = placement_group(layout.bundles(), strategy=STRATEGY,
                         bundle_label_selector=selectors if any(selectors) else None)
    try:
        ray.get(pg.ready(), timeout=timeout_s)
    except ray.exceptions.GetTimeoutError as exc:
        remove_placement_group(pg)
        requested = n_rep * layout.replica_gpus + n_learn * layout.learner_gpus
        where = (f", replicas on nodes labelled {replica_labels or {}}, learners on {learner_labels or {}}"
                 if any(selectors) else "")
        raise PlacementError(
            f"could not reserve {requested:g} GPUs within ray.sync_timeout_s={timeout_s:g}s "
            f"({n_rep} replicas x ray.gpus_per_replica={layout.replica_gpus:g} + "
            f"{n_learn} learners x ray.gpus_per_learner={layout.learner_gpus:g}{where}); "
            f"cluster has GPU={ray.cluster_resources().get('GPU', 0):g} in total, "
            f"GPU={ray.available_resources().get('GPU', 0):g} free") from exc
    except BaseException:
        remove_placement_group(pg)
        raise
    if layout.frozen_bundle() is not None:
        others["frozen_options"] = _actor_options(pg, layout.frozen_bundle(), layout.frozen_asks)
    return Placement([_actor_options(pg, i, layout.replica_asks) for i in range(n_rep)],
                     [_actor_options(pg, layout.learner_bundle(r), layout.learner_asks) for r in range(n_learn)],
                     pg, **others)


def _bundle_index(pg_id: str) -> int | None:
    """Bundle index of the calling actor in placement group `pg_id`, from its assigned resources.

    Every actor placed in bundle i holds a share of Ray's implicit `bundle_group_<i>_<pg id>`
    resource. Ray has no public API for the index, so this reads the core worker's resource ids
    (what `get_assigned_resources()` uses before it strips the group names); None if that changes.
    """
    try:
        resource_ids = ray._private.worker.global_worker.core_worker.resource_ids()
    except AttributeError:
        return None
    pattern = re.compile(rf"^bundle_group_(\d+)_{re.escape(pg_id)}$")
    indices = {int(m.group(1)) for name in resource_ids if (m := pattern.match(name))}
    return indices.pop() if len(indices) == 1 else None


def visible_devices() -> dict[str, Any]:
    """Call INSIDE an actor: the GPUs Ray gave it, CUDA_VISIBLE_DEVICES, its placement group and bundle."""
    pg_id = ray.get_runtime_context().get_placement_group_id()
    return {
        "gpu_ids": ray.get_gpu_ids(),
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "placement_group_id": pg_id,
        "bundle_index": _bundle_index(pg_id) if pg_id is not None else None,
    }
