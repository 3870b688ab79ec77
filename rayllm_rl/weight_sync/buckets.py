"""Bucketing of named tensors into flat, single-dtype buffers for broadcasting.

The sender and every receiver compute the same plan independently from the same list of
:class:`TensorMeta` (names, shapes, dtypes in the sender's iteration order), so only the
flat buffers travel; :func:`plan_fingerprint` lets them check that they agree.
"""
from __future__ import annotations

import dataclasses
import hashlib
import math
from typing import Iterable, Mapping, Sequence

import torch

__all__ = ["TensorMeta", "metadata_of", "metas_to_spec", "metas_from_spec", "plan_buckets", "plan_fingerprint",
           "bucket_numel", "pack", "unpack_into"]


@dataclasses.dataclass(frozen=True)
class TensorMeta:
    """Name, shape and dtype of one tensor of a weight update."""

    name: str
    shape: tuple
    dtype: torch.dtype

    def __post_init__(self):
        object.__setattr__(self, "shape", tuple(int(s) for s in self.shape))
        if not isinstance(self.dtype, torch.dtype):
            raise TypeError(f"TensorMeta {self.name!r}: dtype must be a torch.dtype, got {self.dtype!r}")

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def element_size(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    @property
    def nbytes(self) -> int:
        return self.numel * self.element_size


def metadata_of(named: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]) -> list[TensorMeta]:
    """The TensorMeta of every tensor, in iteration order (a Mapping or (name, tensor) pairs)."""
    items = named.items() if isinstance(named, Mapping) else named
    metas, seen = [], set()
    for name, t in items:
        if name in seen:
            raise ValueError(f"metadata_of: duplicate tensor name {name!r}")
        seen.add(name)
        metas.append(TensorMeta(name, tuple(t.shape), t.dtype))
    return metas


def metas_to_spec(metas: Sequence[TensorMeta]) -> tuple[tuple[str, tuple[int, ...], str], ...]:
    """Plain `(name, shape, dtype name)` tuples: what crosses a process boundary (e.g. into vLLM's worker)."""
    return tuple((m.name, tuple(m.shape), str(m.dtype).removeprefix("torch.")) for m in metas)


def metas_from_spec(spec: Iterable[Sequence]) -> list[TensorMeta]:
    """Inverse of :func:`metas_to_spec`; an unknown dtype name raises naming the tensor."""
    out = []
    for name, shape, dtype in spec:
        dt = getattr(torch, str(dtype), None)
        if not isinstance(dt, torch.dtype):
            raise TypeError(f"tensor {name!r}: unknown dtype {dtype!r}")
        out.append(TensorMeta(name, tuple(shape), dt))
    return out


def plan_buckets(metas: Sequence[TensorMeta], bucket_bytes: int) -> list[list[TensorMeta]]:
    """Group consecutive same-dtype tensors into buckets of at most `bucket_bytes`.

    Order is preserved (concatenating the buckets gives `metas` back); a dtype change
    starts a new bucket; a tensor larger than `bucket_bytes` gets a bucket of its own.
    Pure function of its inputs, so every rank computes the same plan.
    """
    if bucket_bytes <= 0:
        raise ValueError(f"plan_buckets: bucket_bytes must be > 0, got {bucket_bytes}")
    names = [m.name for m in metas]
    if len(set(names)) != len(names):
        dup = next(n for n in names if names.count(n) > 1)
        raise ValueError(f"plan_buckets: duplicate tensor name {dup!r}")
    buckets: list[list[TensorMeta]] = []
    cur: list[TensorMeta] = []
    cur_bytes = 0
    for m in metas:
        nb = m.nbytes
        if cur and (m.dtype != cur[0].dtype or cur_bytes + nb > bucket_bytes):
            buckets.append(cur)
            cur, cur_bytes = [], 0
        cur.append(m)
        cur_bytes += nb
    if cur:
        buckets.append(cur)
    return buckets


def plan_fingerprint(buckets: Sequence[Sequence[TensorMeta]]) -> int:
    """A signed 63-bit hash of a plan (names, shapes, dtypes and bucket boundaries)."""
    h = hashlib.blake2b(digest_size=8)
    for b in buckets:
        h.update(b"|bucket|")
        for m in b:
            h.update(f"{m.name}:{m.shape}:{m.dtype};".encode())
    return int.from_bytes(h.digest(), "little") & ((1 << 62) - 1)


def bucket_numel(bucket: Sequence[TensorMeta]) -> int:
    return sum(m.numel for m in bucket)


def _bucket_dtype(bucket: Sequence[TensorMeta]) -> torch.dtype:
    if not bucket:
        raise ValueError("empty bucket")
    dtype = bucket[0].dtype
    if any(m.dtype != dtype for m in bucket):
        raise ValueError(f"bucket mixes dtypes: {sorted({str(m.dtype) for m in bucket})}")
    return dtype


def pack(bucket: Sequence[TensorMeta], tensors: Mapping[str, torch.Tensor], *, out: torch.Tensor | None = None,
         device: torch.device | str | None = None) -> torch.Tensor:
    """Concatenate the bucket's tensors (flattened, in bucket order) into one 1-D tensor.

    `out`: optional preallocated 1-D buffer of the bucket's dtype with at least the bucket's
    numel (the packed prefix view is returned). Each source must match its meta's shape and
    dtype exactly; it may live on another device (copied over).
    """
    dtype = _bucket_dtype(bucket)
    n = bucket_numel(bucket)
    if out is None:
        dev = device if device is not None else next(
            (tensors[m.name].device for m in bucket if m.name in tensors), torch.device("cpu"))
        flat = torch.empty(n, dtype=dtype, device=dev)
    else:
        if out.dim() != 1 or out.dtype != dtype or out.numel() < n:
            raise ValueError(f"pack: out buffer is {tuple(out.shape)}/{out.dtype}, "
                             f"need 1-D {dtype} with >= {n} elements")
        flat = out[:n]
    off = 0
    with torch.no_grad():
        for m in bucket:
            if m.name not in tensors:
                raise KeyError(f"pack: tensor {m.name!r} is missing from the source")
            src = tensors[m.name]
            if tuple(src.shape) != m.shape or src.dtype != m.dtype:
                raise ValueError(f"pack: {m.name} is {tuple(src.shape)}/{src.dtype}, planned {m.shape}/{m.dtype}")
            k = m.numel
            flat[off:off + k].view(m.shape).copy_(src.detach())
            off += k
    return flat


def unpack_into(flat: torch.Tensor, bucket: Sequence[TensorMeta], dst: Mapping[str, torch.Tensor]) -> None:
    """Copy the slices of a packed bucket into the destination tensors (shapes checked).

    A destination may have another dtype or device than the bucket (copy_ converts).
    """
    dtype = _bucket_dtype(bucket)
    n = bucket_numel(bucket)
    if flat.dim() != 1 or flat.numel() != n or flat.dtype != dtype:
        raise ValueError(f"unpack_into: flat buffer is {tuple(flat.shape)}/{flat.dtype}, "
                         f"bucket needs 1-D {dtype} with {n} elements")
    missing = [m.name for m in bucket if m.name not in dst]
    if missing:
        raise KeyError(f"unpack_into: destination lacks {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    for m in bucket:
        if tuple(dst[m.name].shape) != m.shape:
            raise ValueError(f"unpack_into: destination {m.name} has shape {tuple(dst[m.name].shape)}, "
                             f"the update has {m.shape}")
    off = 0
    with torch.no_grad():
        for m in bucket:
            k = m.numel
            dst[m.name].copy_(flat[off:off + k].view(m.shape))
            off += k
