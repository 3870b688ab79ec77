"""The one place that knows weight transports by name: their properties, and a name -> scheme table.

The driver plans a transport from the placement (:func:`plan_transport`) and a :class:`SyncSpec`
(:func:`make_spec`); learner rank 0 opens its end with :func:`open_sender` (a group binds its store there)
and the receivers are built from `spec.with_init(opened.init)` with :func:`build_receiver` while rank 0
finishes its end (`opened.finish()`). Each transport is a scheme (`weight_sync.scheme`) in a
module of its own, with a sender and a receiver of the shape `weight_sync.ends` gives; engines receive
through these ends and never look at the transport's name: what they may ask is a property of the
transport (:class:`TransportInfo`). This module imports no transport (nor Ray) until one is built.

Transports (what each does: its module's docstring; measurements: docs/weight-sync.md):

* ``object_store``: Ray's object store; learner rank 0 puts buckets, replicas fetch them by reference.
* ``ray_channel``: two of Ray's mutable shared-memory objects on the learner's node, written in turn.
* ``shm``: two shared-memory segments per job on the learner's node, control over a gloo group.
* ``gloo`` / ``nccl``: buckets broadcast over a private gloo (TCP) or NCCL (GPU) group.
* ``rdt_gloo`` / ``rdt_nccl``: Ray Direct Transport: Ray sends learner rank 0's result tensors to each
  replica over a Ray collective group.
* ``cuda_ipc``: colocated on one GPU: the replica opens CUDA IPC handles of the learner's own tensors.
"""
from __future__ import annotations

import dataclasses
import importlib
from typing import Any, Iterable, Mapping, Sequence

from rayllm_rl.weight_sync.buckets import TensorMeta, metas_from_spec
from rayllm_rl.weight_sync.scheme import InitInfo, NoInit, OpenedSender, TransportScheme, init_from_dict

__all__ = ["SyncSpec", "TransportInfo", "TRANSPORTS", "transport_info", "scheme_of", "plan_transport",
           "make_spec", "open_sender", "build_receiver"]


@dataclasses.dataclass(frozen=True)
class TransportInfo:
    """What orchestration and engines may know of a transport (never its name)."""

    name: str
    scheme: str
    """"module:Class" of its `TransportScheme`, imported only when one of its ends is built."""
    pulls: bool
    """Receivers fetch what the sender published, given its handoff; else the sender pushes the
    bytes through a group collective that every receiver joins at the same time."""
    receiver_needs_ray: bool
    """Its receiver calls Ray, so it runs in a Ray worker process (vLLM's own worker is not one)."""
    cross_node: bool
    """Receivers may sit on another node than the sender."""
    gpu_only: bool
    """Sender and receivers hold GPU tensors (NCCL)."""
    group: bool
    """Sender and receivers form a group: rendezvous at learner rank 0's host and port, one rank
    per receiving process (a vLLM replica with tensor parallelism takes one per worker)."""
    tensor_transport: str | None = None
    """Ray Direct Transport backend of learner rank 0's sync call ('gloo', 'nccl'): the Ray layer makes
    a collective group of learner rank 0 and the replicas, and Ray moves the result's tensors."""
    single_learner_rank: bool = False
    """Needs the learner's torch.distributed to itself (Ray's gloo group initialises it), so FSDP
    with several learner ranks cannot share the process."""
    shared_device: bool = True
    """Works when sender and receiver share one GPU (colocated placement). NCCL does not: it refuses
    two ranks of one communicator on one device."""
    device_local: bool = False
    """Receivers open the sender's own GPU memory (CUDA IPC), so each must sit on learner rank 0's GPU:
    the colocated placement with one learner rank (replica i shares GPU i with learner rank i)."""
    needs_readers: bool = False
    """Learner rank 0's end is made for its readers: the driver's spec names (actor handle, node id) of every
    receiving process (Ray channels: the writer makes channels they read), and the receivers are built from
    what that end made (its opened `init`)."""
    default_bucket_mb: float = 16.0
    """Bucket size when `ray.sync_bucket_mb` is 0. Group transports pack a bucket into a flat buffer of
    this size on each end. The object store puts a bucket as one object, and every object costs Ray
    about a millisecond (create, seal, pin; measured: 101.5 MB as 4 MiB objects 59 ms end to end, as
    16 MiB 33 ms, as 64 or 256 MiB 25 ms), while nothing is packed: only an FSDP learner (several ranks)
    holds a bucket of gathered tensors outside the store."""

    @property
    def default_bucket_bytes(self) -> int:
        return int(self.default_bucket_mb * (1 << 20))


TRANSPORTS: dict[str, TransportInfo] = {t.name: t for t in (
    TransportInfo("object_store", "rayllm_rl.weight_sync.object_store:ObjectStoreScheme",
                  pulls=True, receiver_needs_ray=True, cross_node=True, gpu_only=False, group=False,
                  default_bucket_mb=256.0),
    TransportInfo("rdt_gloo", "rayllm_rl.weight_sync.ray_direct:RDTScheme",
                  pulls=True, receiver_needs_ray=True, cross_node=True, gpu_only=False, group=False,
                  tensor_transport="gloo", single_learner_rank=True),
    TransportInfo("rdt_nccl", "rayllm_rl.weight_sync.ray_direct:RDTScheme",
                  pulls=True, receiver_needs_ray=True, cross_node=True, gpu_only=True, group=False,
                  tensor_transport="nccl", shared_device=False),
    TransportInfo("ray_channel", "rayllm_rl.weight_sync.ray_channel:ChannelScheme",
                  pulls=False, receiver_needs_ray=True, cross_node=False, gpu_only=False, group=False,
                  needs_readers=True),
    TransportInfo("shm", "rayllm_rl.weight_sync.shm:ShmScheme",
                  pulls=False, receiver_needs_ray=False, cross_node=False, gpu_only=False, group=True),
    TransportInfo("gloo", "rayllm_rl.weight_sync.broadcast:BroadcastScheme",
                  pulls=False, receiver_needs_ray=False, cross_node=True, gpu_only=False, group=True),
    TransportInfo("nccl", "rayllm_rl.weight_sync.broadcast:BroadcastScheme",
                  pulls=False, receiver_needs_ray=False, cross_node=True, gpu_only=True, group=True,
                  shared_device=False),
    TransportInfo("cuda_ipc", "rayllm_rl.weight_sync.cuda_ipc:CudaIpcScheme",
                  pulls=True, receiver_needs_ray=False, cross_node=False, gpu_only=True, group=False,
                  shared_device=True, device_local=True),
)}


def transport_info(name: str) -> TransportInfo:
    if name not in TRANSPORTS:
        raise ValueError(f"unknown weight-sync transport {name!r}; choose one of {tuple(TRANSPORTS)}")
    return TRANSPORTS[name]


def scheme_of(name: str) -> TransportScheme:
    """The scheme of transport `name`, built with its properties (its module is imported here)."""
    info = transport_info(name)
    module, cls = info.scheme.split(":")
    return getattr(importlib.import_module(module), cls)(info)


@dataclasses.dataclass(frozen=True)
class SyncSpec:
    """How every end of one weight-sync setup is built (picklable: driver → learner and replicas).

    `metas` are the sender's tensors as `(name, shape, dtype name)` in send order: HF names of
    the unsharded model, whatever layout an engine keeps inside. `rank` is a receiving end's first
    rank: a replica whose `ranks` processes receive (vLLM workers under tensor parallelism) gives
    rank `rank + k` to its k-th process."""

    transport: str
    metas: tuple[tuple[str, tuple[int, ...], str], ...]
    world_size: int
    """1 sender + every receiving process."""
    timeout_s: float
    bucket_bytes: int
    init: InitInfo = NoInit()
    """What the transport's ends are built from (`weight_sync.scheme`): a group's rendezvous, shm segment
    names, the readers (for learner rank 0) or channels (for the replicas) of Ray channels."""
    rank: int = 0

    @property
    def info(self) -> TransportInfo:
        return transport_info(self.transport)

    def for_rank(self, rank: int) -> "SyncSpec":
        if not 0 < rank < self.world_size:
            raise ValueError(f"weight sync: receiver rank {rank} is outside [1, {self.world_size})")
        return dataclasses.replace(self, rank=int(rank))

    def with_init(self, init: InitInfo) -> "SyncSpec":
        """The spec with another init info (the receivers' one, made by a sender-first transport's sender)."""
        return dataclasses.replace(self, init=init)

    def as_dict(self) -> dict[str, Any]:
        """Plain fields (crosses into vLLM's worker, whose RPC carries dicts and lists); the init info
        records its class name (`InitInfo.as_dict`)."""
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return {**fields, "init": self.init.as_dict()}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "SyncSpec":
        metas = tuple((str(n), tuple(int(x) for x in s), str(dt)) for n, s, dt in d["metas"])
        return cls(**{**d, "metas": metas, "init": init_from_dict(d.get("init"))})


def plan_transport(requested: str, *, learner_gpus: bool, replica_gpus: bool, learner_node: str,
                   replica_nodes: Iterable[str], learner_ranks: int = 1, colocated: bool = False) -> str:
    """`ray.sync_transport` resolved against the placement. 'auto': NCCL between GPUs of their own,
    else Ray's object store (same node: zero-copy; across nodes: Ray's own transfer). Colocated on
    GPUs (learner rank i and replica i on one GPU): CUDA IPC on that GPU where every replica shares
    learner rank 0's (one learner rank), else the object store (NCCL cannot join two ranks on one
    device, and only learner rank 0 sends)."""
    same_node = set(replica_nodes) <= {learner_node}
    if requested == "auto":
        if not (learner_gpus and replica_gpus):
            return "object_store"
        if not colocated:
            return "nccl"
        return "cuda_ipc" if learner_ranks == 1 else "object_store"  # a colocated pair shares its node
    info = transport_info(requested)
    if colocated and learner_gpus and not info.shared_device:
        raise ValueError(f"ray.sync_transport={requested} cannot run with ray.placement=colocated: NCCL refuses two "
                         "ranks on one GPU; use auto or object_store")
    if not info.cross_node and not same_node:
        raise ValueError(f"ray.sync_transport={requested} needs every replica on the learner's node "
                         f"({learner_node}); replicas are on {sorted(set(replica_nodes))}: use object_store or gloo")
    if info.gpu_only and not (learner_gpus and replica_gpus):
        raise ValueError(f"ray.sync_transport={requested} needs GPUs on both sides: ray.gpus_per_learner > 0 and "
                         "ray.gpus_per_replica > 0")
    if info.device_local and not colocated:
        raise ValueError(f"ray.sync_transport={requested} hands the weights over on the GPU the learner and the "
                         "replica share: it needs ray.placement=colocated (with GPUs of their own use nccl, or auto)")
    if info.device_local and learner_ranks > 1:
        raise ValueError(f"ray.sync_transport={requested} with ray.num_learners={learner_ranks}: replica i shares "
                         "GPU i with learner rank i, but only learner rank 0 sends, on GPU 0; use auto (object_store) "
                         "or ray.num_learners=1")
    if info.single_learner_rank and learner_ranks > 1:
        raise ValueError(f"ray.sync_transport={requested} initialises the learner's torch.distributed for Ray's "
                         f"collective group, which FSDP's ray.num_learners={learner_ranks} ranks already use: use "
                         "object_store, or ray.num_learners=1")
    return requested


def make_spec(transport: str, metas: Sequence, *, receivers: int, timeout_s: float, bucket_bytes: int = 0,
              host: str = "", port: int = 0, readers: Sequence[tuple[Any, str]] = ()) -> SyncSpec:
    """The spec of one setup with `receivers` receiving processes (ranks 1..receivers); `bucket_bytes`
    0 is the transport's own default (`TransportInfo.default_bucket_mb`). `host`: learner rank 0's address,
    for a group transport; `port`: one its store tries first (0: the OS picks when rank 0 opens its end).
    `readers`: (actor handle, node id) of each receiving process, for a transport whose sender makes what they read
    (ray_channel)."""
    info = transport_info(transport)
    if bucket_bytes < 0:
        raise ValueError(f"weight sync: bucket_bytes must be >= 0 (0 = the transport's default), got {bucket_bytes}")
    init = scheme_of(transport).init_info(receivers=int(receivers), host=host, port=port, readers=readers)
    return SyncSpec(transport, tuple(metas), 1 + int(receivers), float(timeout_s),
                    int(bucket_bytes or info.default_bucket_bytes), init)


def open_sender(spec: SyncSpec, metas: Sequence[TensorMeta]) -> OpenedSender:
    """Learner rank 0's end, opened: what the receivers connect to is bound (a group's store, on a port
    the OS gives) or made (Ray channels) now. Hand the receivers `spec.with_init(opened.init)`; then
    `opened.finish()` (a group waits there, ≤ timeout, for every receiver to join) gives the `SenderEnd`."""
    if tuple(spec.metas) != tuple((m.name, tuple(m.shape), str(m.dtype).removeprefix("torch.")) for m in metas):
        raise ValueError("weight sync: the learner's tensors differ from the spec's metas")
    return scheme_of(spec.transport).open_sender(spec, metas)


def build_receiver(spec: SyncSpec, target: Any):
    """A receiving process's end (a `weight_sync.ends.ReceiverEnd`) for `target` (``named_parameters()``,
    ``swap_weights(dict, v)``).

    `spec.rank` is this process's rank (a replica adds its worker index to its first rank).
    Group transports wait here for every member to join (≤ timeout)."""
    params = target.named_parameters()
    unknown = [m.name for m in metas_from_spec(spec.metas) if m.name not in params]
    if unknown:
        raise KeyError(f"weight sync: the receiving engine has no weights named {unknown[:5]} (it has e.g. "
                       f"{list(params)[:3]})")
    return scheme_of(spec.transport).receiver(spec, target)
