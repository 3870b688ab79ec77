"""The one place that picks a weight transport and builds its two ends.

The driver plans a transport from the placement (:func:`plan_transport`) and a :class:`SyncSpec`
(:func:`make_spec`); learner rank 0 builds its end with :func:`build_sender`, every receiving
process its own with :func:`build_receiver`. Engines receive through these ends and never look at
the transport's name; what they may ask is a property of the transport (:class:`TransportInfo`).

Every end has the same shape:

* sender: ``send(named, version) -> (SyncStats, handoff)``, ``close()``. The handoff is what the
  driver passes to the receivers (``ObjectRef``s for the object store; CUDA IPC handles as plain data
  for ``cuda_ipc``; ``None`` where the bytes travel inside a group collective).
* receiver: ``receive(handoff, header_timeout_s=None) -> version`` (bytes land in a back buffer
  while the engine generates), ``swap(version) -> stall_s`` (between two decode steps), ``close()``,
  ``last_stats``.

Transports (see docs/ray-orchestration.md, "Weight sync"):

* ``object_store``: Ray's object store (the default on CPU and across nodes). Learner rank 0 puts
  buckets, the driver hands the references over, receivers fetch (zero-copy on the learner's node).
* ``ray_channel``: two of Ray's mutable shared-memory objects (Compiled Graphs' channels) on the learner's
  node, written in turn: learner rank 0 makes them when the group forms, the driver hands them to the
  replicas, then passes versions only; replicas read in place (weight_sync/ray_channel.py).
* ``shm``: two shared-memory segments per job on the learner's node, control over a gloo group.
* ``gloo``: buckets broadcast over a private gloo group (TCP).
* ``rdt_gloo`` / ``rdt_nccl``: Ray Direct Transport: the driver passes the reference to learner rank
  0's result and Ray sends its tensors to each replica over a Ray collective group (gloo on CPU,
  NCCL GPU to GPU).
* ``nccl``: buckets broadcast over a private NCCL group between GPUs.
* ``cuda_ipc``: colocated on one GPU: learner rank 0 exports CUDA IPC handles of its own tensors, the
  driver hands them over as plain data, the replica opens them on the same device and copies device to
  device (weight_sync/cuda_ipc.py).

Which of them have run on a GPU, and where: docs/weight-sync.md.
"""
from __future__ import annotations

import dataclasses
import time
import uuid
from typing import Any, Iterable, Mapping, Sequence

import torch

from rayllm_rl.weight_sync.buckets import TensorMeta, metas_from_spec
from rayllm_rl.weight_sync.gloo_group import StatelessGlooGroup, StatelessNcclGroup
from rayllm_rl.weight_sync.transport import SyncStats

__all__ = ["SyncSpec", "TransportInfo", "TRANSPORTS", "transport_info", "plan_transport", "make_spec",
           "build_sender", "build_receiver", "receiver_payload"]


@dataclasses.dataclass(frozen=True)
class TransportInfo:
    """What orchestration and engines may know of a transport (never its name)."""

    name: str
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
    sender_first: bool = False
    """The receivers' ends are built from what learner rank 0's end made (`receiver_payload`): the driver
    builds the sender first, then the receivers (Ray channels: the writer makes them, readers attach)."""
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
    TransportInfo("object_store", pulls=True, receiver_needs_ray=True, cross_node=True, gpu_only=False, group=False,
                  default_bucket_mb=256.0),
    TransportInfo("rdt_gloo", pulls=True, receiver_needs_ray=True, cross_node=True, gpu_only=False, group=False,
                  tensor_transport="gloo", single_learner_rank=True),
    TransportInfo("rdt_nccl", pulls=True, receiver_needs_ray=True, cross_node=True, gpu_only=True, group=False,
                  tensor_transport="nccl", shared_device=False),
    TransportInfo("ray_channel", pulls=False, receiver_needs_ray=True, cross_node=False, gpu_only=False, group=False,
                  sender_first=True),
    TransportInfo("shm", pulls=False, receiver_needs_ray=False, cross_node=False, gpu_only=False, group=True),
    TransportInfo("gloo", pulls=False, receiver_needs_ray=False, cross_node=True, gpu_only=False, group=True),
    TransportInfo("nccl", pulls=False, receiver_needs_ray=False, cross_node=True, gpu_only=True, group=True,
                  shared_device=False),
    TransportInfo("cuda_ipc", pulls=True, receiver_needs_ray=False, cross_node=False, gpu_only=True, group=False,
                  shared_device=True, device_local=True),
)}


def transport_info(name: str) -> TransportInfo:
    if name not in TRANSPORTS:
        raise ValueError(f"unknown weight-sync transport {name!r}; choose one of {tuple(TRANSPORTS)}")
    return TRANSPORTS[name]


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
    payload: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    """Per transport: `host`, `port` (group rendezvous), `segments` (shm), `readers` (ray_channel: the
    replicas' actor handles and node ids, for learner rank 0) and `channels` (ray_channel: what it made,
    for the replicas)."""
    rank: int = 0

    @property
    def info(self) -> TransportInfo:
        return transport_info(self.transport)

    def for_rank(self, rank: int) -> "SyncSpec":
        if not 0 < rank < self.world_size:
            raise ValueError(f"weight sync: receiver rank {rank} is outside [1, {self.world_size})")
        return dataclasses.replace(self, rank=int(rank))

    def with_payload(self, **more: Any) -> "SyncSpec":
        return dataclasses.replace(self, payload={**self.payload, **more})

    def as_dict(self) -> dict[str, Any]:
        """Plain fields (crosses into vLLM's worker, whose RPC carries dicts and lists)."""
        return {**dataclasses.asdict(self), "payload": dict(self.payload)}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "SyncSpec":
        metas = tuple((str(n), tuple(int(x) for x in s), str(dt)) for n, s, dt in d["metas"])
        return cls(**{**d, "metas": metas, "payload": dict(d.get("payload") or {})})


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
        raise ValueError(f"ray.sync_transport={requested} hands the weights over on the GPU the learner and the replica "
                         "share: it needs ray.placement=colocated (with GPUs of their own use nccl, or auto)")
    if info.device_local and learner_ranks > 1:
        raise ValueError(f"ray.sync_transport={requested} with ray.num_learners={learner_ranks}: replica i shares GPU i "
                         "with learner rank i, but only learner rank 0 sends, on GPU 0; use auto (object_store) "
                         "or ray.num_learners=1")
    if info.single_learner_rank and learner_ranks > 1:
        raise ValueError(f"ray.sync_transport={requested} initialises the learner's torch.distributed for Ray's "
                         f"collective group, which FSDP's ray.num_learners={learner_ranks} ranks already use: use "
                         "object_store, or ray.num_learners=1")
    return requested


def make_spec(transport: str, metas: Sequence, *, receivers: int, timeout_s: float, bucket_bytes: int = 0,
              host: str = "", port: int = 0, readers: Sequence[tuple[Any, str]] = ()) -> SyncSpec:
    """The spec of one setup with `receivers` receiving processes (ranks 1..receivers); `bucket_bytes`
    0 is the transport's own default (`TransportInfo.default_bucket_mb`). `readers`: (actor handle, node
    id) of each receiving process, for a transport whose sender makes what they read (ray_channel)."""
    info = transport_info(transport)
    if bucket_bytes < 0:
        raise ValueError(f"weight sync: bucket_bytes must be >= 0 (0 = the transport's default), got {bucket_bytes}")
    bucket_bytes = bucket_bytes or info.default_bucket_bytes
    metas = tuple(metas)
    payload: dict[str, Any] = {}
    if info.group:
        if not host or not port:
            raise ValueError(f"weight sync over {transport}: learner rank 0's host and port are needed")
        payload.update(host=host, port=int(port))
    if transport == "shm":
        prefix = f"rayllm_{uuid.uuid4().hex[:12]}"
        payload["segments"] = (f"{prefix}_0", f"{prefix}_1")
    if info.sender_first:
        if len(readers) != int(receivers):
            raise ValueError(f"weight sync over {transport}: {int(receivers)} receiving processes but {len(readers)} "
                             "readers (actor handle, node id) given")
        payload["readers"] = tuple((h, str(n)) for h, n in readers)
    return SyncSpec(transport, metas, 1 + int(receivers), float(timeout_s), int(bucket_bytes), payload)


# ---------------------------------------------------------------------------- ends
def _group(spec: SyncSpec, rank: int):
    cls = StatelessNcclGroup if spec.info.gpu_only else StatelessGlooGroup
    return cls(spec.payload["host"], spec.payload["port"], rank, spec.world_size, spec.timeout_s)


class _GroupSender:
    """A group transport's sender behind the common shape (the handoff is None: bytes went in-band)."""

    def __init__(self, inner, group):
        self.inner, self.group = inner, group

    @property
    def metas(self) -> list[TensorMeta]:
        return self.inner.metas

    def send(self, named, version: int) -> tuple[SyncStats, None]:
        return self.inner.send(named, version), None

    def close(self) -> None:
        self.inner.close()
        self.group.close()


def build_sender(spec: SyncSpec, metas: Sequence[TensorMeta]):
    """Learner rank 0's end. Group transports wait here for every receiver to join (≤ timeout)."""
    if tuple(spec.metas) != tuple((m.name, tuple(m.shape), str(m.dtype).removeprefix("torch.")) for m in metas):
        raise ValueError("weight sync: the learner's tensors differ from the spec's metas")
    if spec.transport == "object_store":
        from rayllm_rl.weight_sync.object_store import ObjectStoreSender

        return ObjectStoreSender(metas, spec.bucket_bytes, spec.timeout_s)  # already of the common shape
    if spec.transport == "ray_channel":
        from rayllm_rl.weight_sync.ray_channel import ChannelSender

        return ChannelSender(metas, spec.timeout_s, spec.payload["readers"])  # of the common shape
    if spec.transport == "cuda_ipc":
        from rayllm_rl.weight_sync.cuda_ipc import CudaIpcSender

        return CudaIpcSender(metas, spec.timeout_s, receivers=spec.world_size - 1)  # of the common shape
    if spec.info.tensor_transport is not None:
        from rayllm_rl.weight_sync.ray_direct import RDTSender

        return RDTSender(metas, spec.timeout_s, "cuda" if spec.info.gpu_only else "cpu")
    group = _group(spec, 0)
    try:
        if spec.transport == "shm":
            from rayllm_rl.weight_sync.shm import ShmWeightSender

            segments = spec.payload["segments"]
            sender = ShmWeightSender(group, metas, name_prefix=segments[0].rsplit("_", 1)[0], timeout_s=spec.timeout_s)
            group.barrier(phase="segments created")  # receivers attach only after this
            return _GroupSender(sender, group)
        from rayllm_rl.weight_sync.transport import WeightSender

        return _GroupSender(WeightSender(group, metas, spec.bucket_bytes), group)
    except BaseException:
        group.close()
        raise


def receiver_payload(spec: SyncSpec, sender) -> dict[str, Any]:
    """What learner rank 0's end made for the receivers (`TransportInfo.sender_first`): the driver adds it
    to the spec it hands them (`SyncSpec.with_payload`); empty for every other transport."""
    if spec.transport == "ray_channel":
        return {"channels": list(sender.channels)}
    return {}


class _Receiver:
    """A receiver behind the common shape, with `receive_and_swap`; `group` (if any) is closed with it."""

    def __init__(self, inner, group=None):
        self.inner, self.group = inner, group

    @property
    def metas(self) -> list[TensorMeta]:
        return self.inner.metas

    @property
    def last_stats(self) -> SyncStats | None:
        return self.inner.last_stats

    def receive(self, handoff=None, *, header_timeout_s: float | None = None) -> int:
        return self.inner.receive(handoff, header_timeout_s=header_timeout_s)

    def swap(self, version: int | None = None) -> float:
        return self.inner.swap(version)

    def receive_and_swap(self, handoff=None, *, header_timeout_s: float | None = None) -> dict[str, float | int]:
        """receive() then swap(); returns version, receive_s, stall_s, bytes, bytes_per_s."""
        t0 = time.perf_counter()
        version = self.receive(handoff, header_timeout_s=header_timeout_s)
        receive_s = time.perf_counter() - t0
        stall = self.swap(version)
        st = self.last_stats
        return {"version": version, "receive_s": receive_s, "stall_s": stall,
                "bytes": st.bytes if st else 0, "bytes_per_s": st.bytes_per_s if st else 0.0}

    def close(self) -> None:
        self.inner.close()
        if self.group is not None:
            self.group.close()


def build_receiver(spec: SyncSpec, target: Any):
    """A receiving process's end for `target` (``named_parameters()``, ``swap_weights(dict, v)``).

    `spec.rank` is this process's rank (a replica adds its worker index to its first rank).
    Group transports wait here for every member to join (≤ timeout)."""
    metas = metas_from_spec(spec.metas)
    params = target.named_parameters()
    unknown = [m.name for m in metas if m.name not in params]
    if unknown:
        raise KeyError(f"weight sync: the receiving engine has no weights named {unknown[:5]} (it has e.g. "
                       f"{list(params)[:3]})")
    if spec.transport == "object_store":
        from rayllm_rl.weight_sync.object_store import ObjectStoreReceiver

        return _Receiver(ObjectStoreReceiver(target, metas, spec.bucket_bytes, spec.timeout_s, spec.rank))
    if spec.transport == "ray_channel":
        from rayllm_rl.weight_sync.ray_channel import ChannelReceiver

        if "channels" not in spec.payload:
            raise ValueError("weight sync over ray_channel: the spec has no channels; build learner rank 0's end "
                             "first and hand its receiver_payload to the receivers (SyncSpec.with_payload)")
        return _Receiver(ChannelReceiver(target, metas, spec.timeout_s, spec.rank, spec.payload["channels"]))
    if spec.transport == "cuda_ipc":
        from rayllm_rl.weight_sync.cuda_ipc import CudaIpcReceiver

        return _Receiver(CudaIpcReceiver(target, metas, spec.timeout_s, spec.rank))
    if spec.info.tensor_transport is not None:
        from rayllm_rl.weight_sync.ray_direct import RDTReceiver

        return _Receiver(RDTReceiver(target, metas, spec.timeout_s, spec.rank))
    group = _group(spec, spec.rank)
    try:
        if spec.transport == "shm":
            from rayllm_rl.weight_sync.shm import ShmWeightReceiver

            group.barrier(phase="segments created")
            return _Receiver(ShmWeightReceiver(target, group, metas, spec.payload["segments"], spec.timeout_s), group)
        from rayllm_rl.weight_sync.transport import DoubleBufferReceiver, WeightReceiver

        back = {m.name: torch.empty(m.shape, dtype=params[m.name].dtype, device=group.device) for m in metas}
        return _Receiver(DoubleBufferReceiver(target, WeightReceiver(group, metas, spec.bucket_bytes), back), group)
    except BaseException:
        group.close()
        raise
