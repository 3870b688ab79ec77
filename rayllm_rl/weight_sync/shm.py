"""Same-node weight transport through POSIX shared memory: a double buffer across processes.

The learner (`ShmWeightSender`, rank 0 of a `StatelessGlooGroup`) writes every weight into one of two
shared-memory segments (`shm_segments.plan_layout`), broadcasts a small header, and each receiver swaps its
engine onto zero-copy read-only views of that segment (the engine's sink: `engine.weights.swap_weights`) and
acknowledges; the next sync writes the other segment, which no replica reads by then. The protocol, why the sender
never writes memory a replica is reading, and what a failed sync leaves are in docs/weight-sync.md ("The `shm`
double buffer"). POSIX only: `/dev/shm` must hold two copies of the weights (the sender reserves both at once).
"""
from __future__ import annotations

import errno
import mmap
import os
import secrets
import threading
import time
import warnings
from multiprocessing import shared_memory
from typing import Any, Iterable, Mapping, Sequence

import torch

from rayllm_rl.weight_sync.buckets import TensorMeta, metas_from_spec
from rayllm_rl.weight_sync.common import Closing, WeightSyncError
from rayllm_rl.weight_sync.ends import ReceiverEnd, SyncStats
from rayllm_rl.weight_sync.scheme import GroupScheme, ShmInit
from rayllm_rl.weight_sync.shm_segments import attach_readonly, plan_layout, segment_size, tensor_at

__all__ = ["ShmWeightSender", "ShmWeightReceiver", "ShmScheme"]
_MAGIC = 0x53484D5753  # "SHMWS"
_HEADER_LEN = 7
_OK, _ABORTED = 0, 1
# Receiver codes in the ack all-reduce (0: swapped onto the announced segment).
_BAD_MAGIC, _LAYOUT_MISMATCH, _BAD_SEGMENT, _SWAP_FAILED, _SENDER_ABORTED = 1, 2, 3, 4, 5
_CODE_TEXT = {_BAD_MAGIC: "bad header magic", _LAYOUT_MISMATCH: "layout disagrees with the header",
              _BAD_SEGMENT: "announced segment is the one its engine reads", _SWAP_FAILED: "swap_weights failed",
              _SENDER_ABORTED: "saw an aborted header"}


def _describe(codes: torch.Tensor) -> str:
    return ", ".join(f"rank {r}: {_CODE_TEXT.get(int(c), f'code {int(c)}')}"
                     for r, c in enumerate(codes.tolist()) if c)


class _Base:
    def __init__(self, group, metas: Sequence[TensorMeta], timeout_s: float):
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.group = group
        self.metas = list(metas)
        self.layout = plan_layout(self.metas)
        self.timeout_s = float(timeout_s)
        self.total_bytes = self.layout.payload_bytes
        self.last_stats: SyncStats | None = None

    def _error(self, phase: str, message: str) -> WeightSyncError:
        return WeightSyncError(f"shm weight sync phase '{phase}' failed on rank {self.group.rank} of world size "
                   f"{self.group.world_size} (timeout {self.timeout_s:g}s): {message}",
                   phase=phase, rank=self.group.rank, world_size=self.group.world_size, timeout_s=self.timeout_s)


# ---------------------------------------------------------------------------- sender
class ShmWeightSender(Closing, _Base):
    """Learner side (rank 0 of `group`): owns the two segments and writes one per sync.

    Args:
        group: the control group (a :class:`StatelessGlooGroup` with the node's receivers;
            only the header and the acks travel through it).
        metas: every tensor of an update (names, shapes, dtypes; the receivers get the same
            list, e.g. :func:`~rayllm_rl.weight_sync.buckets.metadata_of`).
        name_prefix: segment names are ``f"{name_prefix}_0"`` and ``f"{name_prefix}_1"``
            (default: a random per-process prefix); pass :attr:`segment_names` to receivers.
        timeout_s: deadline of the header broadcast and of the wait for every ack.
        drain_on_error: when a send fails, still consume the rest of a lazy source (unless
            it raised), so FSDP ranks gathering in step with rank 0 are not left waiting.
    """

    def __init__(self, group, metas: Sequence[TensorMeta], *, name_prefix: str | None = None,
                 timeout_s: float = 60.0, drain_on_error: bool = True):
        if group.rank != 0:
            raise ValueError(f"ShmWeightSender must be rank 0 of its group, this process is rank {group.rank}")
        super().__init__(group, metas, timeout_s)
        self.drain_on_error = drain_on_error
        self.last_write_seconds = 0.0
        prefix = name_prefix if name_prefix is not None else f"rlws_{os.getpid()}_{secrets.token_hex(4)}"
        size = segment_size(self.layout)
        self._shms: list[shared_memory.SharedMemory] = []
        try:
            for i in range(2):
                name = f"{prefix}_{i}"
                try:
                    # The creator registers the segment with multiprocessing's resource tracker:
                    # if this process dies without close(), the tracker unlinks it.
                    shm = shared_memory.SharedMemory(name=name, create=True, size=size)
                except FileExistsError as exc:
                    raise WeightSyncError(f"ShmWeightSender: a shared memory segment named {name!r} already "
                                          "exists (another sender with the same name_prefix?)", phase="create") from exc
                self._shms.append(shm)
                self._reserve(shm, size)
        except BaseException:
            self._release()
            raise
        self.segment_names: tuple[str, str] = tuple(s.name for s in self._shms)
        # Writable views of every tensor in each segment (the sender's only references).
        self._dst: list[dict[str, torch.Tensor]] = [
            {s.meta.name: tensor_at(shm.buf, s.meta, s.offset) for s in self.layout.slots} for shm in self._shms]
        self._lock = threading.Lock()
        self._seq = 0  # successful syncs so far; the next one writes segment _seq % 2
        self._in_use: int | None = None  # the segment every replica reads (None: their own weights)
        self._pending: tuple[int, int, int] | None = None  # (seq, segment, version) announced, not acked
        self._broken: str | None = None
        self._closed = False

    @staticmethod
    def _reserve(shm: shared_memory.SharedMemory, size: int) -> None:
        """Allocate and map the segment's pages now, not during the first syncs.

        tmpfs accepts any ftruncate, and a write past a full /dev/shm would kill the learner
        with SIGBUS in the middle of a sync: fallocate fails cleanly instead. Then every page
        is touched once, because first-touch page faults cost several times the copy itself
        (about 10x in a VM), which would otherwise land in the first sync of each segment.
        """
        fd = getattr(shm, "_fd", -1)
        if fd >= 0 and hasattr(os, "posix_fallocate"):
            try:
                os.posix_fallocate(fd, 0, size)
            except OSError as exc:
                if exc.errno in (errno.ENOSPC, errno.ENOMEM, errno.EFBIG):
                    raise WeightSyncError(
                        f"ShmWeightSender: /dev/shm cannot hold segment {shm.name!r} of {size} bytes ({exc}); two "
                        f"segments of the weights are needed (raise the shared-memory size, e.g. docker --shm-size)",
                        phase="create") from exc
                if exc.errno not in (errno.EINVAL, errno.EOPNOTSUPP, errno.ENOSYS):  # unsupported: skip
                    raise
        whole = torch.frombuffer(shm.buf, dtype=torch.uint8, count=size)
        whole.zero_()
        del whole  # (a view of shm.buf: must not outlive the mapping)

    @property
    def next_segment(self) -> int:
        """The segment the next send writes."""
        return self._seq % 2

    @property
    def broken(self) -> bool:
        return self._broken is not None

    def send(self, named: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]], version: int, *,
             header_timeout_s: float | None = None) -> SyncStats:
        """Write every tensor into the free segment, announce it as `version`, wait for every ack.

        `named`: a Mapping or an iterable of (name, tensor) pairs consumed lazily in any order
        (each tensor is copied into its slot as it arrives; shapes and dtypes must match).
        `header_timeout_s`: how long the receivers may take to join this sync (default
        `timeout_s`). Returns SyncStats(bytes, seconds, buckets=1, version).

        Raises WeightSyncError (phase 'write') without writing anything if the previous sync
        was not acknowledged by every receiver, or if the sender is broken or closed;
        WeightSyncTimeout if the header or the acks time out (the sender is then broken).
        """
        if not self._lock.acquire(blocking=False):
            raise self._error("write", "another send is in progress on this sender")
        try:
            refusal = self._refusal(int(version))
            if refusal is not None:
                self._drain(named)
                raise refusal
            return self._send(named, int(version), header_timeout_s)
        finally:
            self._lock.release()

    def _refusal(self, version: int) -> WeightSyncError | None:
        if self._closed:
            return self._error("write", "the sender is closed")
        if self._pending is not None:
            seq, seg, ver = self._pending
            return self._error(
                "write", f"refusing to write version {version}: sync #{seq} (version {ver}, segment {seg}) was "
                         "never acknowledged by every receiver, so a replica may still read either segment"
                         f"{f' ({self._broken})' if self._broken else ''}; close this sender and build a new one")
        if self._broken is not None:
            return self._error("write", f"the sender is broken by an earlier failure ({self._broken})")
        return None

    def _drain(self, named) -> None:
        if self.drain_on_error and not isinstance(named, Mapping):
            try:
                for _ in named:
                    pass
            except Exception:  # the original failure is the one to report
                pass

    def _send(self, named, version: int, header_timeout_s: float | None) -> SyncStats:
        seg = self._seq % 2
        if seg == self._in_use:  # cannot happen: the acks advance _seq and _in_use together
            raise self._error("write", f"internal error: segment {seg} is the one the replicas read")
        t0 = time.perf_counter()
        try:
            problem = self._write(seg, named)
        except Exception as exc:  # the lazy source raised: tell the receivers, stay usable
            self._announce_abort(version, seg, header_timeout_s)
            raise self._error("write", f"the tensor source raised while writing version {version} "
                                       f"({type(exc).__name__}: {exc}); nothing was swapped") from exc
        if problem is not None:
            self._announce_abort(version, seg, header_timeout_s)
            raise self._error("write", f"sender aborted version {version}: {problem}; nothing was swapped")
        write_s = time.perf_counter() - t0
        header = torch.tensor([_MAGIC, _OK, version, seg, self.layout.fingerprint, self.layout.nbytes, self._seq],
                              dtype=torch.int64)
        # From here on a receiver may swap onto `seg`: until every ack is in, neither segment is free.
        self._pending = (self._seq, seg, version)
        try:
            codes = self._announce(header, header_timeout_s)
        except WeightSyncError as exc:
            self._broken = f"sync #{self._seq} failed in phase '{exc.phase}'"
            raise
        rejected = codes[1:] != 0
        if bool(rejected.any()):
            if bool(rejected.all()):  # nobody swapped: the replicas still read what they read before
                self._pending = None
                raise self._error("ack", f"every receiver rejected version {version}: {_describe(codes)}")
            self._broken = f"sync #{self._seq}: some receivers swapped, some rejected ({_describe(codes)})"
            raise self._error("ack", f"receivers rejected version {version}: {_describe(codes)}; the others "
                                     "swapped, so this sender is broken")
        self._in_use, self._pending = seg, None
        self._seq += 1
        stats = SyncStats(bytes=self.total_bytes, seconds=time.perf_counter() - t0, buckets=1, version=version)
        self.last_stats, self.last_write_seconds = stats, write_s  # the memcpy part of `seconds`
        return stats

    def _write(self, seg: int, named) -> str | None:
        """Copy the source into segment `seg`; returns a problem (after draining) or None."""
        dst = self._dst[seg]
        problem = None
        with torch.no_grad():
            if isinstance(named, Mapping):
                for m in self.metas:
                    if m.name not in named:
                        return f"tensor {m.name!r} is missing from the source"
                    t = named[m.name]
                    if tuple(t.shape) != m.shape or t.dtype != m.dtype:
                        return f"{m.name} is {tuple(t.shape)}/{t.dtype}, planned {m.shape}/{m.dtype}"
                for m in self.metas:
                    dst[m.name].copy_(named[m.name].detach())
                return None
            seen: set[str] = set()
            for name, t in named:
                if problem is not None:
                    if not self.drain_on_error:
                        break
                    continue  # keep consuming: FSDP peers gather in step
                if name not in dst:
                    problem = f"the source yielded {name!r}, which is not in the layout"
                elif name in seen:
                    problem = f"the source yielded {name!r} twice"
                elif tuple(t.shape) != dst[name].shape or t.dtype != dst[name].dtype:
                    want = dst[name]
                    problem = f"{name} is {tuple(t.shape)}/{t.dtype}, planned {tuple(want.shape)}/{want.dtype}"
                else:
                    dst[name].copy_(t.detach())
                    seen.add(name)
            if problem is None and len(seen) != len(self.metas):
                missing = [m.name for m in self.metas if m.name not in seen]
                problem = f"the source ended without {missing[:5]}{' ...' if len(missing) > 5 else ''}"
        return problem

    def _announce_abort(self, version: int, seg: int, header_timeout_s: float | None) -> None:
        header = torch.tensor([_MAGIC, _ABORTED, version, seg, self.layout.fingerprint, self.layout.nbytes,
                               self._seq], dtype=torch.int64)
        try:
            self._announce(header, header_timeout_s)
        except WeightSyncError as exc:
            self._broken = f"announcing an aborted sync failed in phase '{exc.phase}'"

    def _announce(self, header: torch.Tensor, header_timeout_s: float | None) -> torch.Tensor:
        """Broadcast the header, then collect every receiver's code in the ack all-reduce."""
        self.group.broadcast(header, 0, self.timeout_s if header_timeout_s is None else header_timeout_s,
                             phase="header")
        codes = torch.zeros(self.group.world_size, dtype=torch.int64)
        self.group.allreduce_max(codes, self.timeout_s, phase="ack")
        return codes

    def _release(self) -> None:
        self._dst = []
        for shm in self._shms:
            for op in (shm.close, shm.unlink):
                try:
                    op()
                except (FileNotFoundError, BufferError):
                    pass
        self._shms = []

    def close(self) -> None:
        """Unlink both segments (idempotent). Replicas keep their mappings (and weights)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._release()

    def __repr__(self) -> str:
        state = "closed" if self._closed else ("broken" if self._broken else "ok")
        return (f"ShmWeightSender(segments={getattr(self, 'segment_names', ())}, bytes={self.total_bytes}, "
                f"syncs={getattr(self, '_seq', 0)}, {state})")


# ---------------------------------------------------------------------------- receiver
class ShmWeightReceiver(_Base, ReceiverEnd):
    """Replica side: hands each sync's segment, as zero-copy views, to the engine's weight sink.

    Args:
        engine: the sink: anything with ``named_parameters()`` (names, shapes, dtypes it takes)
            and ``swap_weights(dict, version) -> stall_s`` (TransformersEngine adopts the views
            as its parameters; vLLM's worker copies them in with ``model.load_weights``).
        group: the control group (this process is one of ranks 1..K).
        metas: the sender's metas (same names, shapes, dtypes, order).
        segment_names: the sender's :attr:`ShmWeightSender.segment_names`.
        timeout_s: deadline of the wait for the header (see `header_timeout_s`) and of the ack.

    Both segments are mapped once, read-only. Use :meth:`receive` on a background thread
    while the engine generates (it only waits for the header), then :meth:`swap` (or
    :meth:`receive_and_swap`). The sender waits for :meth:`swap`'s ack, so call it promptly.
    """

    def __init__(self, engine: Any, group, metas: Sequence[TensorMeta], segment_names: Sequence[str],
                 timeout_s: float = 60.0):
        if group.rank == 0:
            raise ValueError("ShmWeightReceiver cannot be rank 0 of its group (rank 0 is the sender)")
        super().__init__(group, metas, timeout_s)
        names = list(segment_names)
        if len(names) != 2:
            raise ValueError(f"ShmWeightReceiver: expected the 2 segment names of the sender, got {names}")
        params = engine.named_parameters()
        for m in self.metas:
            if m.name not in params:
                raise KeyError(f"ShmWeightReceiver: the engine has no parameter {m.name!r} "
                               f"(it has e.g. {list(params)[:3]})")
            p = params[m.name]
            if tuple(p.shape) != m.shape or p.dtype != m.dtype:
                raise ValueError(f"ShmWeightReceiver: engine parameter {m.name} is {tuple(p.shape)}/{p.dtype}, "
                                 f"the sender's is {m.shape}/{m.dtype}")
        del params
        self.engine = engine
        self.segment_names = tuple(names)
        self._maps: list[mmap.mmap | None] = []
        self._ranges: list[tuple[int, int]] = []
        for name in names:
            mm, size = attach_readonly(name, self.layout.nbytes)
            self._maps.append(mm)
            with warnings.catch_warnings():  # "buffer is not writable": read-only on purpose
                warnings.simplefilter("ignore", UserWarning)
                start = torch.frombuffer(mm, dtype=torch.uint8, count=1).data_ptr()
            self._ranges.append((start, start + size))
        self.current_segment: int | None = None  # the segment the engine's parameters live in
        self._received: tuple[int, int, dict[str, torch.Tensor]] | None = None  # (version, segment, views)
        self._closed = False

    def segment_of(self, tensor: torch.Tensor) -> int | None:
        """Which segment (0 or 1) a tensor's memory lies in, or None (e.g. the loaded weights)."""
        ptr = tensor.data_ptr()
        return next((i for i, (a, b) in enumerate(self._ranges) if a <= ptr < b), None)

    def _views(self, seg: int) -> dict[str, torch.Tensor]:
        mm = self._maps[seg]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            return {s.meta.name: tensor_at(mm, s.meta, s.offset) for s in self.layout.slots}

    def _ack(self, code: int) -> torch.Tensor:
        codes = torch.zeros(self.group.world_size, dtype=torch.int64)
        codes[self.group.rank] = code
        self.group.allreduce_max(codes, self.timeout_s, phase="ack")
        return codes

    def receive(self, handoff: Any = None, *, header_timeout_s: float | None = None) -> int:
        """Wait for the next sync's header (generation continues) and validate it; returns its version.
        `handoff` is unused: the header arrives through the group.

        Raises WeightSyncError naming the mismatch (bad magic, layout fingerprint or size,
        segment index, aborted sync) after telling the sender through the ack; the engine's
        weights are untouched then.
        """
        if self._closed:
            raise self._error("header", "the receiver is closed")
        if self._received is not None:
            raise self._error("header", f"version {self._received[0]} was received but not swapped in yet")
        header = torch.zeros(_HEADER_LEN, dtype=torch.int64)
        self.group.broadcast(header, 0, self.timeout_s if header_timeout_s is None else header_timeout_s,
                             phase="header")
        magic, status, version, seg, fingerprint, nbytes, seq = header.tolist()
        problem, code = None, _OK
        if magic != _MAGIC:
            problem, code = f"bad magic {magic:#x} (is the peer a ShmWeightSender of the same version?)", _BAD_MAGIC
        elif status != _OK:
            problem, code = f"the sender aborted the sync of version {version} (see the sender's log)", _SENDER_ABORTED
        elif fingerprint != self.layout.fingerprint or nbytes != self.layout.nbytes:
            problem, code = (f"layout mismatch for version {version}: the sender's layout fingerprint {fingerprint:#x} "
                             f"/ {nbytes} bytes, this receiver's {self.layout.fingerprint:#x} / {self.layout.nbytes} "
                             "bytes (sender and receiver must use the same metas)"), _LAYOUT_MISMATCH
        elif seg not in (0, 1) or seg == self.current_segment:
            problem, code = (f"the header of sync #{seq} announces segment {seg}, but this engine reads segment "
                             f"{self.current_segment}"), _BAD_SEGMENT
        if problem is not None:
            # Answer in the ack all-reduce, so the sender learns of the rejection at once (an
            # aborted sync is awaited there by the sender too) and the group stays in step.
            self._ack(code)
            raise self._error("header", problem)
        self._received = (int(version), int(seg), self._views(int(seg)))
        return int(version)

    def swap(self, version: int | None = None) -> float:
        """Swap the received segment in (between two decode steps), then ack; returns the stall (s).

        The dict handed to ``swap_weights`` comes back holding the engine's previous storage
        and is dropped here, so the old weights are freed and no view of the segment the
        sender writes next is kept. `version` defaults to the received one.
        """
        if self._received is None:
            raise RuntimeError("ShmWeightReceiver.swap: nothing received since the last swap")
        received_version, seg, views = self._received
        self._received = None
        try:
            stall = self.engine.swap_weights(views, received_version if version is None else int(version))
        except Exception as exc:
            del views
            self._ack(_SWAP_FAILED)
            raise self._error("swap", f"engine.swap_weights raised {type(exc).__name__}: {exc}") from exc
        del views  # now the previous storage (loaded weights or the other segment's views)
        self.current_segment = seg
        codes = self._ack(_OK)
        if bool(codes.any()):
            raise self._error("ack", f"the sync was rejected elsewhere ({_describe(codes)}); this replica swapped")
        return float(stall)

    def receive_and_swap(self, handoff: Any = None, *, header_timeout_s: float | None = None) -> dict[str, float | int]:
        """receive() then swap(); returns version, receive_s, stall_s, ack_s and bytes."""
        t0 = time.perf_counter()
        version = self.receive(handoff, header_timeout_s=header_timeout_s)
        t1 = time.perf_counter()
        stall = self.swap(version)
        t2 = time.perf_counter()
        self.last_stats = SyncStats(bytes=self.total_bytes, seconds=t2 - t1, buckets=1, version=version,
                                    wait_seconds=t1 - t0)
        return {"version": version, "receive_s": t1 - t0, "stall_s": stall, "ack_s": t2 - t1 - stall,
                "bytes": self.total_bytes}

    def close(self) -> None:
        """Detach (idempotent): drop this receiver's references; never unlinks the segments.

        A mapping is released when the last tensor viewing it goes, so the engine keeps its
        current weights (a segment's memory then lives until the engine drops them).
        """
        self._closed = True
        self._received = None
        self._maps = []  # never mmap.close(): the engine's parameters may still view it

    def __repr__(self) -> str:
        return (f"ShmWeightReceiver(rank={self.group.rank}, segments={self.segment_names}, "
                f"current_segment={self.current_segment}{', closed' if self._closed else ''})")


class ShmScheme(GroupScheme):
    """shm: the learner's two segments, named in the init info; a gloo group carries headers and acks."""

    def init_info(self, *, receivers: int, host: str = "", port: int = 0, readers=()) -> ShmInit:
        group = super().init_info(receivers=receivers, host=host, port=port)
        prefix = f"rayllm_{secrets.token_hex(6)}"
        return ShmInit(group.host, group.port, (f"{prefix}_0", f"{prefix}_1"))

    def sender_in(self, group, spec, metas: Sequence[TensorMeta]) -> ShmWeightSender:
        prefix = spec.init.segments[0].rsplit("_", 1)[0]
        sender = ShmWeightSender(group, metas, name_prefix=prefix, timeout_s=spec.timeout_s)
        try:
            group.barrier(phase="segments created")  # receivers attach only after this
        except BaseException:
            sender.close()
            raise
        return sender

    def receiver_in(self, group, spec, target: Any) -> ShmWeightReceiver:
        group.barrier(phase="segments created")
        return ShmWeightReceiver(target, group, metas_from_spec(spec.metas), spec.init.segments, spec.timeout_s)
