"""The public shape of a weight transport's two ends, and the pieces the transports build them from.

Every transport module (broadcast, shm, object_store, ray_channel, ray_direct, cuda_ipc) exposes a
sender and a receiver of this shape behind its scheme (`weight_sync.scheme`), so engines and actors
use any transport the same way and never look at its name:

* :class:`SenderEnd` (learner rank 0): ``send(named, version) -> (SyncStats, handoff)``, ``close()``.
  The handoff is the update info the driver passes to the receivers: ``ObjectRef``s for the object store,
  CUDA IPC handles as plain data, the tensors Ray moves, or ``None`` where the bytes travel in-band.
* :class:`ReceiverEnd` (each receiving process): ``receive(handoff, header_timeout_s=None) -> version``
  (bytes land in a back buffer while the engine generates), ``swap(version) -> stall_s`` (the target's
  ``swap_weights`` between two decode steps), ``receive_and_swap``, ``close()``, ``last_stats``.
"""
from __future__ import annotations

import abc
import contextlib
import dataclasses
import time
from typing import Any, Iterable, Iterator, Mapping, Sequence

import torch

from rayllm_rl.weight_sync.buckets import TensorMeta, plan_buckets, plan_fingerprint
from rayllm_rl.weight_sync.common import WeightSyncError, WeightSyncTimeout

__all__ = ["SyncStats", "SenderEnd", "ReceiverEnd", "GroupSender", "GroupReceiver", "TensorSource", "EndpointView",
           "HandoffPlan", "HeldReceiver", "Wrapping", "target_dtypes", "Named"]

Named = Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]
"""What a sender sends: tensors by name, or (name, tensor) pairs pulled lazily (an FSDP learner gathers)."""


@dataclasses.dataclass
class SyncStats:
    """What one sync moved and how long it took (payload bytes, not counting control messages)."""

    bytes: int
    seconds: float
    buckets: int
    version: int
    wait_seconds: float = 0.0
    """Receivers only: time spent waiting for the sender's header before the transfer began."""

    @property
    def bytes_per_s(self) -> float:
        return self.bytes / self.seconds if self.seconds > 0 else float("inf")


class SenderEnd(abc.ABC):
    """Learner rank 0's end of a transport (see the module docstring)."""

    metas: list[TensorMeta]

    @abc.abstractmethod
    def send(self, named: Named, version: int) -> tuple[SyncStats, Any]:
        """Send every tensor of the plan stamped `version`; returns (stats, the handoff for the receivers)."""

    def close(self) -> None:
        """Release what the end holds (groups, segments, channels, the last handoff)."""


class ReceiverEnd(abc.ABC):
    """A receiving process's end of a transport (see the module docstring)."""

    metas: list[TensorMeta]
    last_stats: SyncStats | None

    @abc.abstractmethod
    def receive(self, handoff: Any = None, *, header_timeout_s: float | None = None) -> int:
        """Land the next version in the back buffer while the engine generates; returns the version."""

    @abc.abstractmethod
    def swap(self, version: int | None = None) -> float:
        """Hand the received version to the target between two decode steps; returns the stall (s)."""

    def close(self) -> None:
        """Forget what was received and not swapped in (the target keeps its weights)."""

    def receive_and_swap(self, handoff: Any = None, *, header_timeout_s: float | None = None) -> dict[str, float | int]:
        """receive() then swap(); returns version, receive_s, stall_s, transfer_s, bytes, bytes_per_s."""
        t0 = time.perf_counter()
        version = self.receive(handoff, header_timeout_s=header_timeout_s)
        receive_s = time.perf_counter() - t0
        stall = self.swap(version)
        st = self.last_stats
        return {"version": version, "receive_s": receive_s, "stall_s": stall,
                "transfer_s": st.seconds if st else receive_s, "bytes": st.bytes if st else 0,
                "bytes_per_s": st.bytes_per_s if st else 0.0}


class Wrapping:
    """An end built around another (`inner`): it shows the inner end's plan and last stats."""

    inner: Any

    @property
    def metas(self) -> list[TensorMeta]:
        return self.inner.metas

    @property
    def last_stats(self) -> SyncStats | None:
        return self.inner.last_stats


class GroupSender(Wrapping, SenderEnd):
    """A group protocol's sender (whose `send` returns stats only) as a SenderEnd that owns its group:
    the handoff is None (the bytes went through the group), and closing closes the group."""

    def __init__(self, inner: Any, group: Any):
        self.inner, self.group = inner, group

    def send(self, named: Named, version: int) -> tuple[SyncStats, None]:
        return self.inner.send(named, version), None

    def close(self) -> None:
        self.inner.close()
        self.group.close()


class GroupReceiver(Wrapping, ReceiverEnd):
    """A group protocol's receiver as a ReceiverEnd that owns its group (closed with it)."""

    def __init__(self, inner: ReceiverEnd, group: Any):
        self.inner, self.group = inner, group

    def receive(self, handoff: Any = None, *, header_timeout_s: float | None = None) -> int:
        return self.inner.receive(handoff, header_timeout_s=header_timeout_s)

    def swap(self, version: int | None = None) -> float:
        return self.inner.swap(version)

    def receive_and_swap(self, handoff: Any = None, *, header_timeout_s: float | None = None) -> dict[str, float | int]:
        return self.inner.receive_and_swap(handoff, header_timeout_s=header_timeout_s)

    def close(self) -> None:
        self.inner.close()
        self.group.close()


class TensorSource:
    """Tensors by name from a Mapping, or pulled lazily from an iterator of (name, tensor)."""

    def __init__(self, named: Named, known: set[str]):
        self.mapping = named if isinstance(named, Mapping) else None
        self.iter: Iterator[tuple[str, torch.Tensor]] | None = None if self.mapping is not None else iter(named)
        self.pending: dict[str, torch.Tensor] = {}
        self.known = known
        self.failed = False  # the iterator itself raised

    def _next(self) -> tuple[str, torch.Tensor] | None:
        try:
            return next(self.iter)
        except StopIteration:
            return None
        except BaseException:
            self.failed = True
            raise

    def drain(self) -> int:
        """Consume what is left of a lazy source (keeps FSDP ranks that gather in step unblocked)."""
        self.pending.clear()
        if self.iter is None or self.failed:
            return 0
        n = 0
        while self._next() is not None:
            n += 1
        return n

    def take(self, name: str) -> torch.Tensor:
        if self.mapping is not None:
            if name not in self.mapping:
                raise KeyError(f"tensor {name!r} is missing from the source")
            return self.mapping[name]
        if name in self.pending:
            return self.pending.pop(name)
        while (item := self._next()) is not None:  # out-of-order items wait in `pending`
            n, t = item
            if n not in self.known:
                raise KeyError(f"the source yielded {n!r}, which is not in the plan")
            if n == name:
                return t
            self.pending[n] = t
        raise KeyError(f"the source ended before yielding {name!r}")


class EndpointView:
    """What sender and receiver show of their endpoint: the plan and the last sync's stats."""

    _ep: Any  # a HandoffPlan, or the broadcast protocol's endpoint: the same fields

    @property
    def metas(self) -> list[TensorMeta]:
        return self._ep.metas

    @property
    def buckets(self) -> list[list[TensorMeta]]:
        return self._ep.buckets

    @property
    def last_stats(self) -> SyncStats | None:
        return self._ep.last_stats


class HandoffPlan:
    """The plan of a transport whose sender returns a handoff (the object store, Ray Direct
    Transport): tensors, buckets, fingerprint, last stats, and errors naming the transport."""

    def __init__(self, metas: Sequence[TensorMeta], bucket_bytes: int, timeout_s: float, rank: int, what: str):
        self.metas = list(metas)
        if not self.metas:
            raise ValueError("weight sync: empty list of tensor metadata")
        if not timeout_s > 0:
            raise ValueError(f"weight sync: timeout_s must be > 0, got {timeout_s}")
        self.buckets = plan_buckets(self.metas, int(bucket_bytes))
        self.fingerprint = plan_fingerprint(self.buckets)
        self.total_bytes = sum(m.nbytes for m in self.metas)
        self.timeout_s, self.rank, self.what = float(timeout_s), rank, what
        self.last_stats: SyncStats | None = None

    def error(self, phase: str, message: str, timed_out: bool = False) -> WeightSyncError:
        cls = WeightSyncTimeout if timed_out else WeightSyncError
        return cls(f"weight sync phase '{phase}' {'timed out' if timed_out else 'failed'} on rank {self.rank} "
                   f"({self.what}, timeout {self.timeout_s:g}s): {message}",
                   phase=phase, rank=self.rank, world_size=None, timeout_s=self.timeout_s)

    def take(self, source: "TensorSource", m: TensorMeta, phase: str) -> torch.Tensor:
        """The source's tensor for `m`, checked against the plan."""
        t = source.take(m.name)
        if tuple(t.shape) != m.shape or t.dtype != m.dtype:
            raise self.error(phase, f"{m.name} is {tuple(t.shape)}/{t.dtype}, planned {m.shape}/{m.dtype}")
        return t

    @contextlib.contextmanager
    def publishing(self, source: "TensorSource"):
        """A failed publish drains a lazy source (FSDP peers gather in step) and names its phase."""
        try:
            yield
        except KeyError as exc:
            source.drain()
            raise self.error("publish", str(exc)) from exc
        except WeightSyncError:
            source.drain()
            raise

    def sent(self, t0: float, buckets: int, version: int) -> SyncStats:
        self.last_stats = SyncStats(bytes=self.total_bytes, seconds=time.perf_counter() - t0, buckets=buckets,
                                    version=int(version))
        return self.last_stats


def target_dtypes(target: Any, metas, who: str) -> dict[str, torch.dtype]:
    """Check that `target.named_parameters()` has every planned tensor with its shape (a KeyError or
    ValueError naming `who` and the first mismatches); returns the target's dtype per name."""
    params = target.named_parameters()
    unknown = [m.name for m in metas if m.name not in params]
    if unknown:
        raise KeyError(f"{who}: the target has no tensors named {unknown[:5]} (it has e.g. {list(params)[:3]})")
    bad = [(m.name, m.shape, tuple(params[m.name].shape)) for m in metas if tuple(params[m.name].shape) != m.shape]
    if bad:
        raise ValueError(f"{who}: shapes differ (name, sent, target): {bad[:5]}")
    return {m.name: params[m.name].dtype for m in metas}


class HeldReceiver(EndpointView, ReceiverEnd):
    """A receiver whose bytes arrive as whole tensors (fetched, or delivered by Ray): it holds them
    until `swap` hands them to its target between two decode steps."""

    target: Any
    _received: tuple[int, dict[str, torch.Tensor]] | None = None

    def _hold(self, version: int, named: dict[str, torch.Tensor], t0: float, buckets: int) -> int:
        self._received = (int(version), named)
        self._ep.sent(t0, buckets, version)
        return int(version)

    def swap(self, version: int | None = None) -> float:
        """Hand the received tensors to the target; returns the stall (s). The dict comes back
        holding the target's previous storage and is dropped here."""
        if self._received is None:
            raise RuntimeError(f"{type(self).__name__}.swap: nothing received since the last swap")
        received, named = self._received
        self._received = None
        try:
            return float(self.target.swap_weights(named, received if version is None else int(version)))
        except Exception as exc:
            raise self._ep.error("swap", f"{type(exc).__name__}: {exc}") from exc

    def close(self) -> None:
        """Drop what was received and not swapped in (the target keeps its current weights)."""
        self._received = None
