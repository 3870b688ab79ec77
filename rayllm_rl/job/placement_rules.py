"""The placement group's shape, without Ray: the `ray.*` GPU settings checked, and the bundles;
and the node labels that pin roles to nodes (`ray.*_node_labels`), checked.

Config validation and the dry-run plan read this; `orchestration/ray/placement.py` reserves the
group these functions describe (its docstring gives the design: PACK, replicas first, whole GPUs).
"""
from __future__ import annotations

import dataclasses
import math
import re
from typing import Any

CPU_ONLY_BUNDLE_CPUS = 0.01
"""CPU of the bundle of a 0-GPU role inside a GPU placement group (Ray rejects all-zero bundles)."""


def _check_gpus(key: str, value: float) -> float:
    """Return `value` as a float after checking it is a valid GPU count for config key `key`."""
    gpus = float(value)
    if not math.isfinite(gpus) or gpus < 0:
        raise ValueError(f"ray.{key} must be >= 0 (got {value!r})")
    if not gpus.is_integer():
        raise ValueError(f"ray.{key} must be a whole number of GPUs: actors do not share a GPU "
                         f"(got {value!r})")
    return gpus


COLOCATED_SHARE = 0.5
"""Colocated: what each of the two actors of a pair asks of their one-GPU bundle (Ray then gives both
the same device, and CUDA_VISIBLE_DEVICES names it for both)."""


def validate(num_replicas: int, num_learners: int, gpus_per_replica: float, gpus_per_learner: float,
             tensor_parallel_size: int, timeout_s: float, colocated: bool = False) -> tuple[float, float]:
    """Check the placement settings; raise ValueError naming the `ray.*` key. Returns the GPU counts.

    `colocated` (`ray.placement=colocated`): learner rank i and replica i share one GPU (or, with no
    GPU, take turns on the CPU), so the counts must pair up: one learner rank per replica, the same
    0 or 1 GPU on both sides, and no tensor parallelism (a replica of several GPUs has no one GPU to share)."""
    for key, count in (("num_replicas", num_replicas), ("num_learners", num_learners)):
        if int(count) != count or count < 1:
            raise ValueError(f"ray.{key} must be an integer >= 1 (got {count!r})")
    if int(tensor_parallel_size) != tensor_parallel_size or tensor_parallel_size < 1:
        raise ValueError(f"ray.tensor_parallel_size must be an integer >= 1 (got {tensor_parallel_size!r})")
    replica_gpus = _check_gpus("gpus_per_replica", gpus_per_replica)
    learner_gpus = _check_gpus("gpus_per_learner", gpus_per_learner)
    if replica_gpus > 0 and replica_gpus < tensor_parallel_size:
        raise ValueError(f"ray.gpus_per_replica must be >= ray.tensor_parallel_size "
                         f"({gpus_per_replica!r} < {tensor_parallel_size!r}): each replica actor "
                         f"holds all the GPUs of its tensor-parallel group")
    if not timeout_s > 0:
        raise ValueError(f"placement timeout_s must be > 0 (got {timeout_s!r})")
    if colocated:
        if num_learners != num_replicas:
            raise ValueError(f"ray.placement=colocated pairs learner rank i with replica i on one GPU: "
                             f"ray.num_learners ({num_learners}) must equal ray.num_replicas ({num_replicas})")
        if replica_gpus != learner_gpus or replica_gpus not in (0.0, 1.0):
            raise ValueError(f"ray.placement=colocated shares one GPU per pair: set ray.gpus_per_replica and "
                             f"ray.gpus_per_learner both to 1 (or both to 0 on CPU); got {gpus_per_replica!r} and "
                             f"{gpus_per_learner!r}")
        if tensor_parallel_size != 1:
            raise ValueError(f"ray.placement=colocated needs ray.tensor_parallel_size=1 (got {tensor_parallel_size}): "
                             "a tensor-parallel replica spans several GPUs, so no single learner rank shares them; "
                             "use ray.placement=separate")
    return replica_gpus, learner_gpus


STRATEGY = "PACK"
"""The placement group's strategy (orchestration/ray/placement.py's docstring says why)."""


def _bundle(gpus: float) -> dict[str, float]:
    """The bundle of one actor asking for `gpus` GPUs."""
    return {"GPU": gpus} if gpus > 0 else {"CPU": CPU_ONLY_BUNDLE_CPUS}


def plan_bundles(num_replicas: int, num_learners: int, replica_gpus: float,
                 learner_gpus: float, colocated: bool = False) -> list[dict[str, float]]:
    """The group's bundles, without Ray: replica i is bundle i, learner rank r is `learner_bundle(r)`
    (colocated: bundle i holds replica i and learner rank i, one GPU)."""
    if colocated:
        return [_bundle(replica_gpus) for _ in range(num_replicas)]
    return [_bundle(replica_gpus) for _ in range(num_replicas)] + [_bundle(learner_gpus) for _ in range(num_learners)]


def learner_bundle(num_replicas: int, rank: int, colocated: bool = False) -> int:
    """The bundle index of learner rank `rank` (after the replicas'; colocated: its replica's)."""
    return rank if colocated else num_replicas + rank


def actor_gpus(gpus: float, colocated: bool = False) -> float:
    """What one actor asks of its bundle: the bundle's GPUs, or its half of a colocated pair's GPU."""
    return gpus * COLOCATED_SHARE if colocated else gpus


FROZEN_SHARE = 0.1
"""What a frozen model (the KL reference, the distillation teacher, any `JobPlan.frozen` entry) asks of learner
rank 0's one-GPU bundle, taken from the learner's share: Ray then gives it learner rank 0's device, where it runs
in the learner's dtype."""


def frozen_on_gpu(learner_gpus: float) -> bool:
    """A frozen model shares learner rank 0's GPU when the job has one (a learner rank of one GPU); with CPU
    learners, or several GPUs per rank (no fraction of a multi-GPU bundle), it runs on the CPU."""
    return learner_gpus == 1.0


@dataclasses.dataclass(frozen=True)
class GpuLayout:
    """The job's GPU shape, decided once (`gpu_layout`): what each actor asks of its bundle, and the
    placement group's bundles (none when no GPU is asked for). Replica i is bundle i; learner rank r is
    `learner_bundle(r)`; each frozen model shares learner rank 0's bundle when it runs on a GPU."""

    num_replicas: int
    num_learners: int
    replica_gpus: float
    """GPUs per replica (all of its tensor-parallel group's), a checked whole number."""
    learner_gpus: float
    colocated: bool = False
    frozen: int = 0
    """How many frozen models the job has (`JobPlan.frozen`), each placed as `frozen_asks` says."""

    @property
    def uses_gpus(self) -> bool:
        return self.replica_gpus > 0 or self.learner_gpus > 0

    @property
    def replica_asks(self) -> float:
        return actor_gpus(self.replica_gpus, self.colocated)

    @property
    def learner_asks(self) -> float:
        """Each learner rank's share of its bundle, less each frozen model's on a one-GPU rank."""
        return actor_gpus(self.learner_gpus, self.colocated) - self.frozen * self.frozen_asks

    @property
    def frozen_asks(self) -> float:
        """What one frozen model asks of learner rank 0's GPU (0: it runs on the CPU)."""
        return FROZEN_SHARE if frozen_on_gpu(self.learner_gpus) else 0.0

    def bundles(self) -> list[dict[str, float]]:
        if not self.uses_gpus:
            return []
        return plan_bundles(self.num_replicas, self.num_learners, self.replica_gpus, self.learner_gpus, self.colocated)

    def learner_bundle(self, rank: int) -> int:
        return learner_bundle(self.num_replicas, rank, self.colocated)

    def frozen_bundle(self) -> int | None:
        """Learner rank 0's bundle when a frozen model takes a share of its GPU, else None (CPU)."""
        return self.learner_bundle(0) if self.frozen_asks else None


def gpu_layout(num_replicas: int, num_learners: int, gpus_per_replica: float, gpus_per_learner: float,
               tensor_parallel_size: int, timeout_s: float, *, colocated: bool = False, frozen: int = 0) -> GpuLayout:
    """Check the placement settings (`validate`, ValueError naming the `ray.*` key) and decide the layout."""
    replica_gpus, learner_gpus = validate(num_replicas, num_learners, gpus_per_replica, gpus_per_learner,
                                          tensor_parallel_size, timeout_s, colocated)
    return GpuLayout(int(num_replicas), int(num_learners), replica_gpus, learner_gpus, colocated, frozen)


_LABEL = r"[a-zA-Z0-9]([a-zA-Z0-9_.-]{0,61}[a-zA-Z0-9])?"
_LABEL_PREFIX = re.compile(rf"^{_LABEL}(\.{_LABEL})*$")
_LABEL_NAME = re.compile(rf"^{_LABEL}$")
_SELECTOR_VALUE = re.compile(rf"^!?(in)?\({_LABEL}(, ?{_LABEL})*\)$|^!?{_LABEL}$")
"""Ray's label syntax (Kubernetes': ray/_private/label_utils.py), restated here so the config check
needs no Ray: a value is `v`, `!v`, `in(a, b)` or `!in(a, b)`."""

NODE_LABEL_KEYS = ("replica_node_labels", "learner_node_labels", "env_worker_node_labels")
"""The `ray.*` keys whose labels pin a role to the nodes that carry them."""


def check_node_labels(key: str, labels: Any) -> dict[str, str]:
    """Check `ray.<key>`, the labels a node must carry to host a role (Ray's `label_selector`);
    raise ValueError naming the key and the bad entry. Returns the labels as a plain dict."""
    if not isinstance(labels, dict):
        raise ValueError(f"ray.{key} must be a mapping of node label to value, e.g. "
                         f"{{rayllm-role: inference}} (got {labels!r})")
    for name, value in labels.items():
        if not isinstance(name, str) or not isinstance(value, str):
            raise ValueError(f"ray.{key}: label {name!r}: {value!r} must map a string to a string "
                             f"(quote a value YAML reads as a number or a bool: '1', 'true')")
        prefix, _, base = name.rpartition("/")
        if ("/" in name and (len(prefix) > 253 or not _LABEL_PREFIX.match(prefix))) \
                or len(base) > 63 or not _LABEL_NAME.match(base):
            raise ValueError(f"ray.{key}: {name!r} is not a valid node label name (an optional DNS prefix and '/', "
                             f"then at most 63 of [a-zA-Z0-9_.-], starting and ending alphanumeric)")
        if not _SELECTOR_VALUE.match(value):
            raise ValueError(f"ray.{key}: {name}={value!r} is not a label selector value: 'v', '!v', 'in(a, b)' or "
                             f"'!in(a, b)', each value at most 63 of [a-zA-Z0-9_.-], starting and ending alphanumeric")
    return dict(labels)


def node_matches(selector: dict[str, str], node_labels: dict[str, str]) -> bool:
    """Whether a node with `node_labels` satisfies `selector` (checked `check_node_labels` values):
    `v` equal, `!v` not equal (or absent), `in(a, b)` one of, `!in(a, b)` none of."""
    for name, value in selector.items():
        negate = value.startswith("!")
        body = value[1:] if negate else value
        choices = {v.strip() for v in body[body.index("(") + 1:-1].split(",")} if body.endswith(")") else {body}
        if (node_labels.get(name) in choices) == negate:
            return False
    return True
