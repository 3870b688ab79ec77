"""Weights through two of Ray's mutable shared-memory objects, written in turn: a double buffer in Ray's store.

Ray's Compiled Graphs move values between actors through `Channel`s: one mutable object in the node's
object store that the writer overwrites in place and every registered reader reads in place. Two of
them make the double buffer, and Ray enforces it: a write waits until every reader has dropped its views
of what that channel held before (a read counts as held until its buffers are freed).

* Sender (:class:`ChannelSender`, learner rank 0): when the group forms it makes both channels, with the
  replicas as readers; its k-th ``send(named, v)`` writes version v into channel ``k % 2``: the tensors'
  bytes as the object store cuts them (`object_store.flat_pieces`), copied once, into the store. The
  write waits (≤ timeout) until every replica has swapped in version v-1, which drops its views of v-2,
  the channel's previous content; so an engine never decodes from memory being overwritten.
* Receiver (:class:`ChannelReceiver`, a replica's actor): its k-th ``receive()`` reads channel ``k % 2``
  (≤ timeout): read-only views of the store, no copy; ``swap`` hands them to the engine between two
  decode steps, and the dropped previous views free the other channel for the next write.

The driver hands the channels over once, when the group forms (learner rank 0 makes them and returns
them; they are references to store objects), then passes only versions: its sync call to learner rank 0
and each replica's receive call run at the same time, as for a group transport (no handoff to wait for).
Against the object store this saves, per version, creating and sealing an object and the hop that hands
its reference from learner rank 0 through the driver to the replicas (benchmarks/weight_sync.py).

One node: a reader on another node would need Ray to push every version to a buffer there, which this
transport does not set up; across nodes the object store carries the weights. Ray frees a channel's
memory only with its writer's process (measured: 2 objects still held after close and release), so a
group formed again after a replica restart leaves the last two buffers until learner rank 0 exits.

Phases and their timeouts: ``open``, ``publish``, ``write channel i`` (every replica released it),
``read channel i`` (learner rank 0 wrote), ``swap``. Every failure names its phase, rank and timeout.
"""
from __future__ import annotations

import time
from typing import Any, Iterable, Mapping, Sequence

import ray
import torch
from ray.exceptions import RayChannelError, RayChannelTimeoutError

from rayllm_rl.weight_sync.buckets import TensorMeta, metas_from_spec
from rayllm_rl.weight_sync.ends import (
    EndpointView, HandoffPlan, HeldReceiver, SenderEnd, SyncStats, TensorSource, target_dtypes,
)
from rayllm_rl.weight_sync.object_store import pieces_of, flat_pieces, tensors_of_buffers
from rayllm_rl.weight_sync.scheme import ChannelAttach, ChannelInit, TransportScheme

__all__ = ["ChannelSender", "ChannelReceiver", "ChannelScheme", "channel_capacity"]

WHOLE_MODEL = 1 << 62
"""Bucket bound of the plan: one write carries every tensor (buckets then only split dtypes)."""


def channel_capacity(total_bytes: int, buffers: int) -> int:
    """Bytes each channel is made with: the tensors, plus pickle's header per buffer and Ray's alignment
    (64 bytes) of each, with room to spare: a value larger than the channel makes Ray allocate a new one."""
    return int(total_bytes) + 256 * int(buffers) + (1 << 20)


def _self_actor():
    """This process's actor handle, or None in the driver (a channel's writer must be the process making it)."""
    from ray.experimental.channel.utils import get_self_actor

    return get_self_actor()


class _ChannelPlan(HandoffPlan):
    """The plan (every tensor in one write) and the buffers each tensor travels as."""

    def __init__(self, metas: Sequence[TensorMeta], timeout_s: float, rank: int):
        super().__init__(metas, WHOLE_MODEL, timeout_s, rank, "ray channel")
        self.order = [m for bucket in self.buckets for m in bucket]
        self.pieces = [pieces_of(m.nbytes) for m in self.order]


class ChannelSender(EndpointView, SenderEnd):
    """Learner rank 0: makes the two channels (replicas as readers) and writes each version into one."""

    def __init__(self, metas: Sequence[TensorMeta], timeout_s: float, readers: Sequence[tuple[Any, str]]):
        """`readers`: (actor handle, node id) of every receiving process, all on this node."""
        from ray.experimental.channel.shared_memory_channel import Channel

        self._ep = _ChannelPlan(metas, timeout_s, 0)
        readers = [(h, str(n)) for h, n in readers]
        if not readers:
            raise ValueError("weight sync over ray channels: no readers (replica actors) given")
        here = ray.get_runtime_context().get_node_id()
        away = sorted({n for _, n in readers if n != here})
        if away:
            raise ValueError(f"weight sync over ray channels: readers on nodes {away}, learner rank 0 is on {here}: "
                             "a channel carries weights within one node (use object_store across nodes)")
        capacity = channel_capacity(self._ep.total_bytes, sum(self._ep.pieces))
        try:
            self.channels = [Channel(_self_actor(), readers, capacity) for _ in range(2)]
        except Exception as exc:  # noqa: BLE001 - e.g. the store is full: named, with what was asked
            raise self._ep.error("open", f"two channels of {capacity} bytes: {type(exc).__name__}: {exc}") from exc
        self._writes = 0
        self._broken: str | None = None

    def send(self, named: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
             version: int) -> tuple[SyncStats, None]:
        """Write every tensor of the plan as version `version` into the next channel; returns (stats, None).

        A failed write leaves the pair out of step with the replicas: later sends refuse, naming it, until
        the group forms again."""
        plan = self._ep
        k = self._writes % 2
        if self._broken:
            raise plan.error(f"write channel {k}", f"an earlier write failed ({self._broken}); form the group again")
        t0 = time.perf_counter()
        source = TensorSource(named, {m.name for m in plan.metas})
        with plan.publishing(source):
            pieces = flat_pieces(plan.take(source, m, "publish") for m in plan.order)
        try:
            self.channels[k].write((int(version), plan.fingerprint, pieces), timeout=plan.timeout_s)
        except RayChannelTimeoutError as exc:
            self._broken = f"version {version} timed out"
            raise plan.error(f"write channel {k}", f"version {version}: a replica still holds what this channel "
                                                   "carried two versions ago (it did not swap in the last version, "
                                                   "or it died)", True) from exc
        except RayChannelError as exc:
            self._broken = f"version {version}: {type(exc).__name__}"
            raise plan.error(f"write channel {k}", f"version {version}: {type(exc).__name__}: {exc}") from exc
        self._writes += 1
        return plan.sent(t0, 1, version), None

    def close(self) -> None:
        """Close both channels: a replica waiting in a read gets an error at once, not at its timeout."""
        channels, self.channels = self.channels, []
        for ch in channels:
            try:
                ch.close()
            except Exception:  # noqa: BLE001 - closing anyway (a reader may be gone)
                pass


class ChannelReceiver(HeldReceiver):
    """A replica's actor: reads each version in place from the channel whose turn it is.

    `target` offers ``named_parameters()`` and ``swap_weights(dict, version) -> stall_s``. A tensor whose
    dtype differs from the target's is converted (a copy); the others are read-only views of the store."""

    def __init__(self, target: Any, metas: Sequence[TensorMeta], timeout_s: float, rank: int, channels: Sequence):
        self._ep = _ChannelPlan(metas, timeout_s, rank)
        if len(channels) != 2:
            raise ValueError("weight sync over ray channels: expected learner rank 0's 2 channels, "
                             f"got {len(channels)}")
        self._dtypes = target_dtypes(target, self._ep.metas, "ChannelReceiver")
        self.target = target
        self.channels = list(channels)
        for ch in self.channels:
            ch.ensure_registered_as_reader()
        self._reads = 0
        self.copied_bytes = 0
        """Bytes of the last receive that are not views of the store (dtype conversions)."""

    def receive(self, handoff: None = None, *, header_timeout_s: float | None = None) -> int:
        """Read the next version (generation goes on); returns it. `header_timeout_s`: how long to wait
        for learner rank 0's write (default: the phase timeout)."""
        plan = self._ep
        k = self._reads % 2
        phase = f"read channel {k}"
        if handoff is not None:
            raise plan.error(phase, f"got a handoff ({type(handoff).__name__}): the driver passes none, the "
                                    "bytes are in the channel")
        t0 = time.perf_counter()
        timeout = plan.timeout_s if header_timeout_s is None else float(header_timeout_s)
        try:
            value = self.channels[k].read(timeout=timeout)
        except RayChannelTimeoutError as exc:
            raise plan.error(phase, f"learner rank 0 wrote no version within {timeout:g}s", True) from exc
        except RayChannelError as exc:
            raise plan.error(phase, f"{type(exc).__name__}: {exc} (learner rank 0 closed the channel?)") from exc
        if isinstance(value, BaseException):  # Ray hands a closed channel's error back as the value
            raise plan.error(phase, f"{type(value).__name__}: {value} (learner rank 0 closed the channel?)")
        self._reads += 1
        version, fingerprint, arrays = value
        if fingerprint != plan.fingerprint or len(arrays) != sum(plan.pieces):
            raise plan.error(phase, f"version {version} was written with plan {fingerprint:#x} "
                                    f"({len(arrays)} buffers), this receiver's is {plan.fingerprint:#x} "
                                    f"({sum(plan.pieces)} buffers): sender and receiver must use the same metas")
        named: dict[str, torch.Tensor] = {}
        self.copied_bytes = tensors_of_buffers(arrays, plan.order, plan.pieces, self._dtypes, named)
        return self._hold(version, named, t0, 1)

    def close(self) -> None:
        """Drop what was read and not swapped in; the engine keeps the views it holds (Ray keeps their memory)."""
        super().close()
        self.channels = []


class ChannelScheme(TransportScheme):
    """ray_channel, sender first: learner rank 0 is given the readers (:class:`ChannelInit`) and makes the
    two channels, which the driver hands to the receivers (:class:`ChannelAttach`)."""

    def init_info(self, *, receivers: int, host: str = "", port: int = 0,
                  readers: Sequence[tuple[Any, str]] = ()) -> ChannelInit:
        if len(readers) != int(receivers):
            raise ValueError(f"weight sync over {self.info.name}: {int(receivers)} receiving processes but "
                             f"{len(readers)} readers (actor handle, node id) given")
        return ChannelInit(tuple((h, str(n)) for h, n in readers))

    def sender(self, spec, metas: Sequence[TensorMeta]) -> ChannelSender:
        return ChannelSender(metas, spec.timeout_s, spec.init.readers)

    def receivers_init(self, spec, sender: ChannelSender) -> ChannelAttach:
        return ChannelAttach(tuple(sender.channels))

    def receiver(self, spec, target: Any) -> ChannelReceiver:
        if not isinstance(spec.init, ChannelAttach):
            raise ValueError("weight sync over ray_channel: the spec has no channels; build learner rank 0's end "
                             "first and hand the receivers spec.with_init(registry.open_sender(spec, metas).init)")
        return ChannelReceiver(target, metas_from_spec(spec.metas), spec.timeout_s, spec.rank, spec.init.channels)
