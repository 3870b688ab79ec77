"""The ``gloo`` and ``nccl`` transports: full weights from learner rank 0 to K replicas over a broadcast group.

Wire protocol of one sync (every step is a collective of the whole group, each bounded by
the phase timeout of the group, and each failure names its phase):

1. ``header``: rank 0 broadcasts int64 ``[MAGIC, status, version, n_buckets, total_numel,
   plan_fingerprint]``. ``status != 0`` means the sender aborted before sending anything
   (e.g. a missing tensor); receivers then raise at once instead of timing out.
2. ``vote``: an element-wise MAX all-reduce of one int64 slot per rank, where a receiver
   writes a non-zero code if the header disagrees with its own plan or its destination
   does not fit the plan. Any non-zero slot makes *every* rank raise WeightSyncError,
   naming the rejecting ranks, before any payload moves.
3. ``bucket i/n``: for each bucket of :func:`plan_buckets` rank 0 packs the bucket into a
   flat buffer and broadcasts it; receivers unpack into their destination. A bucket holding
   a single contiguous tensor is broadcast from / received into that tensor directly.
4. ``ack``: a final MAX all-reduce, so the sender knows that every receiver got and
   unpacked every bucket (a gloo broadcast can complete on the root before the peers read).

The group is anything with ``rank``, ``world_size``, ``device`` and
``broadcast(tensor, src, timeout_s, phase=)`` / ``allreduce_max(tensor, timeout_s, phase=)``:
:class:`~rayllm_rl.weight_sync.gloo_group.StatelessGlooGroup` (CPU) or
:class:`~rayllm_rl.weight_sync.gloo_group.StatelessNcclGroup` (GPU). Control tensors (header,
votes, acks) live on the group's device: NCCL rejects CPU tensors.

If the sender fails in the middle of the payload (its lazy tensor source raised), the
receivers cannot be told in-band: they raise WeightSyncTimeout at the pending bucket, the
sender raises at once, and both must build a new group before the next sync. A sender that
fails for any other reason still drains its lazy source (FSDP peers gather in step with it).
A failure at the header or vote leaves the group usable; any later failure breaks it.

:class:`BroadcastScheme` builds both ends on a private group (`weight_sync.scheme.GroupScheme`); each
receiver lands the buckets in a back buffer (:class:`DoubleBufferReceiver`) and swaps it in.
"""
from __future__ import annotations

import time
from typing import Any, Iterable, Mapping, Sequence

import torch

from rayllm_rl.weight_sync.buckets import (
    TensorMeta, bucket_numel, metas_from_spec, pack, plan_buckets, plan_fingerprint, unpack_into,
)
from rayllm_rl.weight_sync.common import WeightSyncError
from rayllm_rl.weight_sync.ends import EndpointView, ReceiverEnd, SyncStats, TensorSource, Wrapping
from rayllm_rl.weight_sync.scheme import GroupScheme, Spec

__all__ = ["WeightSender", "WeightReceiver", "DoubleBufferReceiver", "BroadcastScheme", "DEFAULT_BUCKET_BYTES"]

DEFAULT_BUCKET_BYTES = 64 << 20
_MAGIC = 0x5753594E43  # "WSYNC"
_HEADER_LEN = 6
_OK, _PLAN_MISMATCH, _BAD_DESTINATION, _BAD_MAGIC, _RECEIVE_FAILED = 0, 1, 2, 3, 4
_CODE_TEXT = {_PLAN_MISMATCH: "header disagrees with its plan", _BAD_DESTINATION: "destination does not fit the plan",
              _BAD_MAGIC: "bad header magic", _RECEIVE_FAILED: "unpacking a bucket failed"}


def _describe_votes(votes: torch.Tensor) -> str:
    return ", ".join(f"rank {r}: {_CODE_TEXT.get(int(c), f'code {int(c)}')}"
                     for r, c in enumerate(votes.tolist()) if c)


class _Endpoint:
    """State shared by sender and receiver: the plan and its fingerprint."""

    def __init__(self, group, metas: Sequence[TensorMeta], bucket_bytes: int, timeout_s: float | None):
        self.group = group
        self.metas = list(metas)
        if not self.metas:
            raise ValueError("weight sync: empty list of tensor metadata")
        self.bucket_bytes = int(bucket_bytes)
        self.buckets = plan_buckets(self.metas, self.bucket_bytes)
        self.fingerprint = plan_fingerprint(self.buckets)
        self.total_numel = sum(m.numel for m in self.metas)
        self.total_bytes = sum(m.nbytes for m in self.metas)
        self.timeout_s = timeout_s
        self.device = torch.device(getattr(group, "device", "cpu"))
        self._staging: dict[torch.dtype, torch.Tensor] = {}
        self.last_stats: SyncStats | None = None

    def _stage(self, dtype: torch.dtype, numel: int) -> torch.Tensor:
        """A reusable 1-D staging buffer per dtype (allocated on first use).

        Sized for the biggest multi-tensor bucket of that dtype (at most `bucket_bytes`):
        single-tensor buckets normally travel in the tensor itself, so an oversize tensor
        does not inflate the buffer unless it has to be staged (e.g. non-contiguous).
        """
        buf = self._staging.get(dtype)
        if buf is None or buf.numel() < numel:
            need = max((bucket_numel(b) for b in self.buckets if b[0].dtype == dtype and len(b) > 1), default=0)
            buf = self._staging[dtype] = torch.empty(max(need, numel), dtype=dtype, device=self.device)
        return buf[:numel]

    def _error(self, phase: str, message: str) -> WeightSyncError:
        return WeightSyncError(
            f"weight sync phase '{phase}' failed on rank {self.group.rank} of world size {self.group.world_size}"
            f" (timeout {self._phase_timeout():g}s): {message}",
            phase=phase, rank=self.group.rank, world_size=self.group.world_size, timeout_s=self._phase_timeout())

    def _phase_timeout(self) -> float:
        return float(self.timeout_s if self.timeout_s is not None else getattr(self.group, "timeout_s", 0.0))

    def _direct(self, bucket: Sequence[TensorMeta], t: torch.Tensor | None) -> bool:
        """Whether a single-tensor bucket can travel in `t` itself (no pack / unpack copy)."""
        return (len(bucket) == 1 and t is not None and t.dtype == bucket[0].dtype and t.device == self.device
                and t.is_contiguous() and tuple(t.shape) == bucket[0].shape)

    def _vote(self, code: int) -> torch.Tensor:
        """MAX all-reduce of one slot per rank, on the group's device; returned on the CPU."""
        votes = torch.zeros(self.group.world_size, dtype=torch.int64, device=self.device)
        votes[self.group.rank] = code
        self._allreduce_max(votes, "vote")
        return votes.cpu()

    def _allreduce_max(self, t: torch.Tensor, phase: str) -> None:
        self.group.allreduce_max(t, self.timeout_s, phase=phase)

    def _broadcast(self, t: torch.Tensor, phase: str, timeout_s: float | None = None) -> None:
        self.group.broadcast(t, 0, self.timeout_s if timeout_s is None else timeout_s, phase=phase)


class WeightSender(EndpointView):
    """Rank 0 of the group: streams named tensors to every other rank.

    Args:
        group: the broadcast group (this process must be its rank 0).
        metas: the tensors of every update, in the order the source produces them
            (:func:`~rayllm_rl.weight_sync.buckets.metadata_of`); receivers get the same list.
        bucket_bytes: upper bound of a bucket (a larger tensor travels alone).
        timeout_s: deadline of each phase (default: the group's timeout).
        drain_on_error: when a send fails, still consume the rest of a lazy source (unless
            the source itself raised), so that FSDP ranks gathering full tensors in step with
            rank 0 are not left waiting in their collectives.
    """

    def __init__(self, group, metas: Sequence[TensorMeta], bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                 timeout_s: float | None = None, *, drain_on_error: bool = True):
        if group.rank != 0:
            raise ValueError(f"WeightSender must be rank 0 of its group, this process is rank {group.rank}")
        self._ep = _Endpoint(group, metas, bucket_bytes, timeout_s)
        self._broken: str | None = None
        self.drain_on_error = drain_on_error

    def send(self, named: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]], version: int, *,
             header_timeout_s: float | None = None) -> SyncStats:
        """Broadcast every tensor of the plan, stamped `version`, and wait for every receiver's ack.

        `named` is a Mapping, or an iterable of (name, tensor) pairs consumed lazily one bucket
        at a time (e.g. an FSDP learner gathering one parameter after the other); items may
        come in any order (out-of-order ones are held until their bucket is sent).
        `header_timeout_s`: how long to wait for the receivers to join this sync (default: the
        phase timeout); every later phase uses the phase timeout.
        """
        source = TensorSource(named, {m.name for m in self._ep.metas})
        try:
            return self._send(source, named, int(version), header_timeout_s)
        except Exception:
            if self.drain_on_error:
                try:
                    source.drain()
                except Exception:  # the original failure is the one to report
                    pass
            raise

    def _send(self, source: TensorSource, named, version: int, header_timeout_s: float | None) -> SyncStats:
        ep = self._ep
        if self._broken is not None:
            raise ep._error("header", f"this sender is broken by an earlier failure ({self._broken}); "
                                      "build a new group and sender")
        t0 = time.perf_counter()
        n = len(ep.buckets)
        # A Mapping can be validated before anything is sent: on failure the receivers are
        # told through the header instead of waiting for buckets that never come.
        problem = None
        if isinstance(named, Mapping):
            problem = self._check_mapping(named)
        header = torch.tensor([_MAGIC, 1 if problem else 0, int(version), n, ep.total_numel, ep.fingerprint],
                              dtype=torch.int64)
        ep._broadcast(header.to(ep.device), "header", header_timeout_s)
        if problem:
            raise ep._error("header", f"sender aborted the sync of version {version}: {problem}")
        votes = ep._vote(_OK)
        if votes.any():
            raise ep._error("vote", f"receivers rejected the sync of version {version}: {_describe_votes(votes)}")
        for i, bucket in enumerate(ep.buckets):
            phase = f"bucket {i + 1}/{n}"
            try:
                tensors = {m.name: source.take(m.name) for m in bucket}
                only = tensors[bucket[0].name].detach() if len(bucket) == 1 else None
                if ep._direct(bucket, only):
                    flat = only.view(-1)
                else:
                    flat = pack(bucket, tensors, out=ep._stage(bucket[0].dtype, bucket_numel(bucket)))
            except Exception as exc:
                self._broken = f"{phase}: {exc}"
                raise ep._error(phase, f"could not produce the bucket ({type(exc).__name__}: {exc}); the receivers "
                                       "will time out waiting for it and the group must be rebuilt") from exc
            ep._broadcast(flat, phase)
            del tensors, flat
        acks = torch.zeros(ep.group.world_size, dtype=torch.int64, device=ep.device)
        ep._allreduce_max(acks, "ack")
        acks = acks.cpu()
        if acks.any():
            raise ep._error("ack", f"receivers failed version {version}: {_describe_votes(acks)}")
        stats = SyncStats(bytes=ep.total_bytes, seconds=time.perf_counter() - t0, buckets=n, version=int(version))
        ep.last_stats = stats
        return stats

    def close(self) -> None:
        """Nothing to release here: the group is closed by its owner."""

    def _check_mapping(self, named: Mapping[str, torch.Tensor]) -> str | None:
        for m in self._ep.metas:
            if m.name not in named:
                return f"tensor {m.name!r} is missing from the source"
            t = named[m.name]
            if tuple(t.shape) != m.shape or t.dtype != m.dtype:
                return f"{m.name} is {tuple(t.shape)}/{t.dtype}, planned {m.shape}/{m.dtype}"
        return None


class WeightReceiver(EndpointView):
    """A rank > 0 of the group: receives every update into a destination Mapping.

    Args:
        group: the broadcast group (this process is one of its ranks 1..K).
        metas: the sender's tensor metadata (same list, same order, same `bucket_bytes`).
        bucket_bytes: must equal the sender's (checked through the header's plan fingerprint).
        timeout_s: deadline of each phase (default: the group's timeout); the first phase
            (waiting for the header) is as long as the sender may take to start the sync.
    """

    def __init__(self, group, metas: Sequence[TensorMeta], bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                 timeout_s: float | None = None):
        if group.rank == 0:
            raise ValueError("WeightReceiver cannot be rank 0 of its group (rank 0 is the sender)")
        self._ep = _Endpoint(group, metas, bucket_bytes, timeout_s)

    def _check_destination(self, dst: Mapping[str, torch.Tensor]) -> str | None:
        for m in self._ep.metas:
            if m.name not in dst:
                return f"destination lacks {m.name!r}"
            if tuple(dst[m.name].shape) != m.shape:
                return f"destination {m.name} has shape {tuple(dst[m.name].shape)}, the plan has {m.shape}"
        return None

    def receive_into(self, dst: Mapping[str, torch.Tensor], *, header_timeout_s: float | None = None) -> int:
        """Receive one update into `dst` (written in place, may differ in dtype); returns its version.

        `header_timeout_s`: how long to wait for the sender to start (default: the phase
        timeout), so a replica can wait long for the next version while every phase of the
        transfer itself keeps a short deadline.

        Raises WeightSyncError if the header disagrees with this receiver's plan (every rank
        then raises, before any payload moves) and WeightSyncTimeout if a phase times out.
        On failure `dst` may be partly written.
        """
        ep = self._ep
        t_wait = time.perf_counter()
        header = torch.zeros(_HEADER_LEN, dtype=torch.int64, device=ep.device)
        ep._broadcast(header, "header", header_timeout_s)
        t0 = time.perf_counter()
        magic, status, version, n, total_numel, fingerprint = header.cpu().tolist()
        if magic != _MAGIC:
            raise ep._error("header", f"bad magic {magic:#x} (is the peer a WeightSender of the same version?)")
        if status != 0:
            raise ep._error("header", f"the sender aborted the sync of version {version} (see the sender's log)")
        mismatch = []
        if n != len(ep.buckets):
            mismatch.append(f"n_buckets {n} != {len(ep.buckets)}")
        if total_numel != ep.total_numel:
            mismatch.append(f"total_numel {total_numel} != {ep.total_numel}")
        if fingerprint != ep.fingerprint:
            mismatch.append(f"plan fingerprint {fingerprint:#x} != {ep.fingerprint:#x}")
        bad_dst = None if mismatch else self._check_destination(dst)
        code = _PLAN_MISMATCH if mismatch else (_BAD_DESTINATION if bad_dst else _OK)
        votes = ep._vote(code)
        if mismatch:
            raise ep._error("header", f"the header of version {version} disagrees with this receiver's plan ("
                                      f"{'; '.join(mismatch)}): sender and receiver must use the same metas "
                                      "and bucket_bytes")
        if bad_dst:
            raise ep._error("vote", bad_dst)
        if votes.any():
            raise ep._error("vote", f"the sync of version {version} was rejected: {_describe_votes(votes)}")
        failure = None
        for i, bucket in enumerate(ep.buckets):
            phase = f"bucket {i + 1}/{n}"
            target = dst[bucket[0].name] if len(bucket) == 1 else None
            if ep._direct(bucket, target):
                ep._broadcast(target.view(-1), phase)
                continue
            flat = ep._stage(bucket[0].dtype, bucket_numel(bucket))
            ep._broadcast(flat, phase)
            if failure is None:
                try:
                    unpack_into(flat, bucket, dst)
                except Exception as exc:  # keep receiving so the group stays in step, then report
                    failure = f"{phase}: {type(exc).__name__}: {exc}"
        acks = torch.zeros(ep.group.world_size, dtype=torch.int64, device=ep.device)
        acks[ep.group.rank] = _RECEIVE_FAILED if failure else _OK
        ep._allreduce_max(acks, "ack")
        acks = acks.cpu()
        if failure:
            raise ep._error("ack", f"unpacking failed at {failure}")
        if acks.any():
            raise ep._error("ack", f"the sync of version {version} failed elsewhere: {_describe_votes(acks)}")
        ep.last_stats = SyncStats(bytes=ep.total_bytes, seconds=time.perf_counter() - t0, buckets=n,
                                  version=int(version), wait_seconds=t0 - t_wait)
        return int(version)


class DoubleBufferReceiver(Wrapping, ReceiverEnd):
    """Receive into a back buffer while the engine keeps generating, then hand it over in one swap.

    `target` is whatever owns the weights (an engine's weight sink): it offers
    ``named_parameters()`` (the tensors an update may carry) and ``swap_weights(back, version)
    -> stall_s``, applied between two decode steps. This class only moves bytes into `back`.
    Only the tensors named in the receiver's metas are received. `back` defaults to empty
    tensors shaped like the target's; pass one to receive into memory of your choice (e.g. a
    target that copies on swap and has no tensors of its own to mirror). If a receive fails,
    the target's weights are untouched (only the back buffer is dirty).
    """

    def __init__(self, target: Any, receiver: WeightReceiver, back: dict[str, torch.Tensor] | None = None):
        self.target = target
        self.inner = receiver
        if back is None:
            params = target.named_parameters()
            unknown = [m.name for m in receiver.metas if m.name not in params]
            if unknown:
                raise KeyError(f"DoubleBufferReceiver: the target has no tensors named {unknown[:5]} "
                               f"(it has e.g. {list(params)[:3]})")
            back = {m.name: torch.empty_like(params[m.name]) for m in receiver.metas}
        missing = [m.name for m in receiver.metas if m.name not in back]
        if missing:
            raise KeyError(f"DoubleBufferReceiver: the back buffer lacks {missing[:5]}")
        self.back: dict[str, torch.Tensor] = back
        self._own = {t.data_ptr() for t in back.values()}  # storage this receiver may write
        self._received: int | None = None

    def receive(self, handoff: Any = None, *, header_timeout_s: float | None = None) -> int:
        """Fill the back buffer with the next update (generation continues); returns its version.
        `handoff` is unused: the bytes arrive through the group."""
        self._received = None
        version = self.inner.receive_into(self.back, header_timeout_s=header_timeout_s)
        self._received = version
        return version

    def swap(self, version: int | None = None) -> float:
        """Swap the received weights in between two decode steps; returns the stall in seconds."""
        if version is None:
            if self._received is None:
                raise RuntimeError("DoubleBufferReceiver.swap: nothing received since the last swap")
            version = self._received
        stall = self.target.swap_weights(self.back, int(version))
        self._received = None
        for name, t in self.back.items():  # never receive into storage another transport handed the target
            if t.data_ptr() not in self._own:  # (e.g. read-only views of the object store or a shm segment)
                self.back[name] = torch.empty_like(t)
                self._own.add(self.back[name].data_ptr())
        return stall

    def close(self) -> None:
        """Forget a received update that was not swapped in (the group is closed by its owner)."""
        self._received = None


class BroadcastScheme(GroupScheme):
    """gloo and nccl: buckets broadcast over a private group; each receiver lands them in a back buffer
    on the group's device, then swaps it in."""

    def sender_in(self, group, spec: Spec, metas: Sequence[TensorMeta]) -> WeightSender:
        return WeightSender(group, metas, spec.bucket_bytes)

    def receiver_in(self, group, spec: Spec, target: Any) -> DoubleBufferReceiver:
        metas = metas_from_spec(spec.metas)
        params = target.named_parameters()
        back = {m.name: torch.empty(m.shape, dtype=params[m.name].dtype, device=group.device) for m in metas}
        return DoubleBufferReceiver(target, WeightReceiver(group, metas, spec.bucket_bytes), back)
