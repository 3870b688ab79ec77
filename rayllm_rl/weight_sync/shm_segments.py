"""The memory side of the shm transport: where each tensor lies in a flat segment, and read-only attach.

A pure function of the metas (:func:`plan_layout`), so the learner's sender, every replica's receiver and
the vLLM staging segment (`inference/vllm/staging.py`) compute the same layout and check it by fingerprint.
"""
from __future__ import annotations

import dataclasses
import hashlib
import mmap
import os
from typing import Any, Sequence

import torch

from rayllm_rl.weight_sync.buckets import TensorMeta
from rayllm_rl.weight_sync.common import WeightSyncError

try:  # the C module behind multiprocessing.shared_memory on POSIX
    import _posixshmem
except ImportError:  # pragma: no cover - Windows
    _posixshmem = None

__all__ = ["SHM_ALIGNMENT", "ShmSlot", "ShmLayout", "plan_layout", "segment_size", "tensor_at", "attach_readonly"]

SHM_ALIGNMENT = 64


@dataclasses.dataclass(frozen=True)
class ShmSlot:
    """Where one tensor lives in a segment."""

    meta: TensorMeta
    offset: int


@dataclasses.dataclass(frozen=True)
class ShmLayout:
    """Every tensor of an update at an aligned offset of one flat segment."""

    slots: tuple[ShmSlot, ...]
    nbytes: int
    """Bytes the layout spans (aligned up); a segment must be at least this big."""
    alignment: int
    fingerprint: int
    """Signed-63-bit-safe hash of names, shapes, dtypes, offsets, size and alignment."""

    @property
    def payload_bytes(self) -> int:
        return sum(s.meta.nbytes for s in self.slots)

    def __len__(self) -> int:
        return len(self.slots)


def _align(n: int, a: int) -> int:
    return (n + a - 1) // a * a


def plan_layout(metas: Sequence[TensorMeta], alignment: int = SHM_ALIGNMENT) -> ShmLayout:
    """The flat layout of `metas` (in order, each at an offset aligned to `alignment` bytes).

    Pure function of its inputs, so the sender and every receiver compute the same layout.
    """
    if alignment <= 0 or alignment & (alignment - 1):
        raise ValueError(f"plan_layout: alignment must be a power of two, got {alignment}")
    metas = list(metas)
    if not metas:
        raise ValueError("plan_layout: empty list of tensor metadata")
    names = [m.name for m in metas]
    if len(set(names)) != len(names):
        dup = next(n for n in names if names.count(n) > 1)
        raise ValueError(f"plan_layout: duplicate tensor name {dup!r}")
    slots, off = [], 0
    h = hashlib.blake2b(digest_size=8)
    h.update(f"shm-layout-v1|align={alignment}|".encode())
    for m in metas:
        off = _align(off, alignment)
        slots.append(ShmSlot(m, off))
        h.update(f"{m.name}:{m.shape}:{m.dtype}@{off};".encode())
        off += m.nbytes
    total = _align(off, alignment)
    h.update(f"|total={total}".encode())
    return ShmLayout(tuple(slots), total, alignment, int.from_bytes(h.digest(), "little") & ((1 << 62) - 1))


def segment_size(layout: ShmLayout) -> int:
    return max(layout.nbytes, layout.alignment)  # a zero-byte segment cannot be created


def tensor_at(buf: Any, meta: TensorMeta, offset: int) -> torch.Tensor:
    """The tensor `meta` describes at byte `offset` of `buf` (a view: no copy)."""
    if meta.numel == 0:
        return torch.empty(meta.shape, dtype=meta.dtype)
    return torch.frombuffer(buf, dtype=meta.dtype, count=meta.numel, offset=offset).view(meta.shape)


def attach_readonly(name: str, min_size: int) -> tuple[mmap.mmap, int]:
    """Map an existing segment read-only, without registering it with the resource tracker.

    `SharedMemory(name)` would register the segment with multiprocessing's resource tracker
    (Python < 3.13 has no ``track=False``), and the tracker unlinks every segment still
    registered when the process that registered it exits: a replica restarting would destroy
    the learner's segments. Calling ``resource_tracker.unregister`` after attaching is not
    safe either: children started with fork/forkserver share their parent's tracker, whose
    registry is a set keyed by name, so the receiver's unregister would drop the *creator's*
    registration (and its crash cleanup). Opening the segment with ``shm_open`` (what
    SharedMemory does internally) never involves the tracker.
    """
    if _posixshmem is None:  # pragma: no cover
        raise WeightSyncError("ShmWeightReceiver needs POSIX shared memory", phase="attach")
    try:
        fd = _posixshmem.shm_open("/" + name.lstrip("/"), os.O_RDONLY, mode=0o600)
    except FileNotFoundError as exc:
        raise WeightSyncError(f"shared memory segment {name!r} does not exist: the sender closed it, died, or "
                              "runs on another node (segments are per node)", phase="attach") from exc
    try:
        size = os.fstat(fd).st_size
        if size < min_size:
            raise WeightSyncError(f"shared memory segment {name!r} has {size} bytes, the layout needs "
                                  f"{min_size} (sender and receiver metas differ?)", phase="attach")
        # MAP_POPULATE: map every (already allocated) page now, so the first decode steps after
        # a swap do not take one page fault per 4 KiB of weights.
        flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
        return mmap.mmap(fd, size, flags=flags, prot=mmap.PROT_READ), size
    finally:
        os.close(fd)  # the mapping keeps its own reference
