"""Weights through Ray's object store: learner rank 0 publishes buckets, replicas fetch them by reference.

Sender (:class:`ObjectStoreSender`, learner rank 0): ``send(named, v)`` puts every bucket of the
plan as one object, a list of flat ``uint8`` numpy views (pickle-5 out-of-band buffers, so each byte
is copied once, into the object store, with no packing; a tensor of a few MiB goes in pieces of at
most :data:`PIECE_BYTES`, which Ray copies faster, and arrives as one view again), and returns a
:class:`Handoff` of ``ObjectRef``s stamped ``v``. It keeps the last handoff alive, so a receiver
built later can still fetch the current weights from it.

The driver passes the handoff (references only, never bytes) to every receiver.

Receiver (:class:`ObjectStoreReceiver`): ``receive(handoff)`` checks the plan's fingerprint and
fetches the buckets with a deadline per bucket: on the learner's node ``ray.get`` returns
read-only views of the shared store (zero-copy), on another node Ray pulls each object over once
per node. ``swap(v)`` hands the views to the target's ``swap_weights`` (a pointer exchange for
Transformers, a copy into a staging segment for vLLM's worker). The object store is the back
buffer: version v+1 is fetched while the engine still generates with v's views, and v's objects
are freed when the last view of them goes.

Phases and their timeouts: ``publish`` (put, on the sender), ``fetch bucket i/n`` (each bounded by
``timeout_s``), ``swap``. Every failure names its phase, rank and timeout.
"""
from __future__ import annotations

import dataclasses
import time
import warnings
from typing import Any, Iterable, Mapping, Sequence

import numpy as np
import ray
import torch

from rayllm_rl.weight_sync.buckets import TensorMeta, metas_from_spec
from rayllm_rl.weight_sync.ends import (
    EndpointView, HandoffPlan, HeldReceiver, SenderEnd, SyncStats, TensorSource, target_dtypes,
)
from rayllm_rl.weight_sync.scheme import TransportScheme

__all__ = ["Handoff", "ObjectStoreSender", "ObjectStoreReceiver", "ObjectStoreScheme", "flat_pieces",
           "tensors_of_buffers"]


@dataclasses.dataclass(frozen=True)
class Handoff:
    """One published version: a reference per bucket, in plan order (small: Ray inlines it)."""

    version: int
    fingerprint: int
    refs: tuple
    nbytes: int


PIECE_BYTES = (1 << 20) - 64
"""Largest piece of a tensor put as one out-of-band buffer. Ray copies a buffer over 1 MiB into the store
with a fan of threads it starts for that buffer alone (`parallel_memcopy`): for tensors of a few MiB that
start-up costs more than the copy (80 buffers of 1.27 MB: 32 ms against 13 ms in pieces, here). Pieces
of at most this size are plain memcpys; a multiple of 64 bytes, Ray's alignment of large buffers, so a
tensor's pieces lie back to back in the object and the receiver views them as one tensor."""
WHOLE_BYTES = 64 << 20
"""A tensor at least this large goes as one buffer: the threads' start-up is small beside its copy."""


def _flat_bytes(t: torch.Tensor) -> np.ndarray:
    """A tensor's bytes as a 1-D uint8 numpy view (a copy only if it is on a GPU or not contiguous)."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    return t.contiguous().reshape(-1).view(torch.uint8).numpy()


def pieces_of(nbytes: int) -> int:
    """How many out-of-band buffers a tensor of `nbytes` travels as."""
    return 1 if nbytes <= PIECE_BYTES or nbytes >= WHOLE_BYTES else -(-nbytes // PIECE_BYTES)


def _pieces(buf: np.ndarray) -> list[np.ndarray]:
    """`buf` cut into the views that travel as its out-of-band buffers (no copy)."""
    if pieces_of(buf.nbytes) == 1:
        return [buf]
    return [buf[i:i + PIECE_BYTES] for i in range(0, buf.nbytes, PIECE_BYTES)]


def _joined(parts: Sequence[np.ndarray]) -> np.ndarray:
    """One read-only 1-D view over a tensor's pieces where they lie back to back in the fetched object
    (no copy: the span is exactly the pieces' own bytes, and the first piece keeps the whole object
    alive, as every piece holds the store buffer they were cut from), else a copy (writable, so the
    receiver counts it)."""
    if len(parts) == 1:
        return parts[0]
    if all(b.ctypes.data == a.ctypes.data + a.nbytes for a, b in zip(parts, parts[1:])):
        nbytes = sum(p.nbytes for p in parts)
        return np.lib.stride_tricks.as_strided(parts[0], shape=(nbytes,), strides=(1,), writeable=False)
    return np.concatenate(parts)


_NUMPY_DTYPES = {torch.float32: np.float32, torch.float16: np.float16, torch.float64: np.float64,
                 torch.int64: np.int64, torch.int32: np.int32, torch.int8: np.int8, torch.uint8: np.uint8,
                 torch.bool: np.bool_}
"""Dtypes numpy has: their views are made in numpy (a quarter of torch's per-tensor cost); bf16 in torch."""


def _tensor_of(buf: np.ndarray, meta: TensorMeta) -> torch.Tensor:
    """The tensor `meta` describes over `buf` (a read-only store view: no copy). torch warns once per
    process that the memory is not writable (it is the store's, on purpose): call it under
    `warnings.catch_warnings()`, as `tensors_of_buffers` does for all of a version's tensors at once."""
    if buf.nbytes != meta.nbytes:
        raise ValueError(f"{meta.name}: {buf.nbytes} bytes fetched, {meta.nbytes} planned")
    if meta.numel == 0:
        return torch.empty(meta.shape, dtype=meta.dtype)
    np_dtype = _NUMPY_DTYPES.get(meta.dtype)
    if np_dtype is not None:
        return torch.from_numpy(buf.view(np_dtype).reshape(meta.shape))
    return torch.from_numpy(buf).view(meta.dtype).view(meta.shape)


def flat_pieces(tensors: Iterable[torch.Tensor]) -> list[np.ndarray]:
    """The out-of-band buffers tensors travel as: each one's bytes, cut as `_pieces` cuts them (no copy
    for contiguous CPU tensors)."""
    return [p for t in tensors for p in _pieces(_flat_bytes(t))]


def tensors_of_buffers(arrays: Sequence[np.ndarray], metas: Sequence[TensorMeta], pieces: Sequence[int],
                       dtypes: Mapping[str, torch.dtype], out: dict[str, torch.Tensor]) -> int:
    """Put into `out` the tensor of each of `metas` over its `pieces[i]` buffers of `arrays` (a fetched
    object's read-only views: no copy), converted to `dtypes[name]` where that differs; returns the bytes
    that are private copies (a conversion, or a buffer Ray handed back writable) rather than the store's."""
    copied, at = 0, 0
    with warnings.catch_warnings():  # "non-writable NumPy array": read-only store memory, on purpose
        warnings.simplefilter("ignore", UserWarning)
        for m, k in zip(metas, pieces):
            buf, at = _joined(arrays[at:at + k]), at + k
            t = _tensor_of(buf, m)
            if buf.flags.writeable or t.dtype != dtypes[m.name]:
                copied += m.nbytes
            out[m.name] = t if t.dtype == dtypes[m.name] else t.to(dtypes[m.name])
    return copied


class ObjectStoreSender(EndpointView, SenderEnd):
    """Learner rank 0: puts each bucket of a version into the object store; returns the references."""

    def __init__(self, metas: Sequence[TensorMeta], bucket_bytes: int, timeout_s: float):
        self._ep = HandoffPlan(metas, bucket_bytes, timeout_s, 0, "object store")
        self.handoff: Handoff | None = None
        """The last published version (kept alive for receivers built later)."""

    def send(self, named: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
             version: int) -> tuple[SyncStats, Handoff]:
        """Publish every tensor of the plan as version `version`; returns (stats, handoff).

        `named` is a Mapping or (name, tensor) pairs in any order, consumed lazily (an FSDP learner
        gathers one parameter after the other, so at most a bucket is held outside the store)."""
        plan = self._ep
        t0 = time.perf_counter()
        source = TensorSource(named, {m.name for m in plan.metas})
        refs = []
        with plan.publishing(source):
            for i, bucket in enumerate(plan.buckets):
                phase = f"publish bucket {i + 1}/{len(plan.buckets)}"
                refs.append(ray.put(flat_pieces(plan.take(source, m, phase) for m in bucket)))
        self.handoff = Handoff(int(version), plan.fingerprint, tuple(refs), plan.total_bytes)
        return plan.sent(t0, len(refs), version), self.handoff

    def close(self) -> None:
        """Drop the last handoff (its objects are freed once no replica views them)."""
        self.handoff = None


class ObjectStoreReceiver(HeldReceiver):
    """A replica: fetches a handoff's buckets and hands them, as tensors, to its target's sink.

    `target` offers ``named_parameters()`` (names, shapes, dtypes it takes) and
    ``swap_weights(dict, version) -> stall_s``. A tensor whose dtype differs from the target's is
    converted (a copy); the others are zero-copy views of the store."""

    def __init__(self, target: Any, metas: Sequence[TensorMeta], bucket_bytes: int, timeout_s: float,
                 rank: int = 1):
        self._ep = HandoffPlan(metas, bucket_bytes, timeout_s, rank, "object store")
        self._dtypes = target_dtypes(target, self._ep.metas, "ObjectStoreReceiver")
        self._pieces = [[pieces_of(m.nbytes) for m in bucket] for bucket in self._ep.buckets]
        """Per bucket, the buffers each tensor arrives as (from the plan, as the sender cut them)."""
        self.target = target
        self.copied_bytes = 0
        """Bytes of the last receive that are not read-only views of the node's store (a dtype
        conversion, or a writable copy Ray handed back): 0 is the zero-copy path."""

    def receive(self, handoff: Handoff, *, header_timeout_s: float | None = None) -> int:
        """Fetch every bucket of `handoff` (generation goes on); returns its version.

        `header_timeout_s` is unused: the handoff arrives with the call, nothing is waited for."""
        plan = self._ep
        if not isinstance(handoff, Handoff):
            raise plan.error("handoff", f"expected a Handoff from the learner, got {type(handoff).__name__}")
        if handoff.fingerprint != plan.fingerprint or len(handoff.refs) != len(plan.buckets):
            raise plan.error("handoff", f"version {handoff.version} was published with plan {handoff.fingerprint:#x} "
                                        f"({len(handoff.refs)} buckets), this receiver's is {plan.fingerprint:#x} "
                                        f"({len(plan.buckets)} buckets): sender and receiver must use the same "
                                        "metas and bucket_bytes")
        t0 = time.perf_counter()
        named: dict[str, torch.Tensor] = {}
        n, copied = len(plan.buckets), 0
        for i, (ref, bucket) in enumerate(zip(handoff.refs, plan.buckets)):
            phase = f"fetch bucket {i + 1}/{n}"
            try:
                arrays = ray.get(ref, timeout=plan.timeout_s)
            except ray.exceptions.GetTimeoutError as exc:
                raise plan.error(phase, f"version {handoff.version}: the object did not arrive", True) from exc
            except ray.exceptions.RayError as exc:  # owner (learner) died, object lost, ...
                raise plan.error(phase, f"version {handoff.version}: {type(exc).__name__}: {exc}") from exc
            pieces = self._pieces[i]
            if len(arrays) != sum(pieces):
                raise plan.error(phase, f"{len(arrays)} buffers fetched for {len(bucket)} tensors, "
                                        f"{sum(pieces)} planned")
            copied += tensors_of_buffers(arrays, bucket, pieces, self._dtypes, named)
        self.copied_bytes = copied
        return self._hold(handoff.version, named, t0, n)


class ObjectStoreScheme(TransportScheme):
    """object_store: nothing to agree on beforehand; each version's handoff is a :class:`Handoff`."""

    def sender(self, spec, metas: Sequence[TensorMeta]) -> ObjectStoreSender:
        return ObjectStoreSender(metas, spec.bucket_bytes, spec.timeout_s)

    def receiver(self, spec, target: Any) -> ObjectStoreReceiver:
        return ObjectStoreReceiver(target, metas_from_spec(spec.metas), spec.bucket_bytes, spec.timeout_s, spec.rank)
