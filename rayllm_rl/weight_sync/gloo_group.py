"""A gloo process group that never touches the global ``torch.distributed`` state.

Learner rank 0 may itself be a rank of the FSDP group that lives in the *global*
``torch.distributed`` group, so the CPU weight-sync group between it and the inference
replicas must be built on the side: rank 0 hosts a private ``TCPStore`` and every member
builds a ``ProcessGroupGloo`` object on it directly. Rank 0 binds that store before the others
learn its port (:func:`rayllm_rl.rendezvous.listen_store`, passed as `store`): no port is picked
ahead. ``dist.is_initialized()`` is left as it was (``torch.distributed.init_process_group`` is never
called here).

Every operation is bounded in time: building the group waits at most ``timeout_s`` for the
peers, and each collective is waited on with ``Work.wait(timedelta)``, which in torch 2.13
raises ``RuntimeError("Operation timed out!")`` when the deadline passes (checked on this
machine, also when the peer is connected but idle). A timed-out gloo operation is *not*
cancelled (its background thread keeps running until gloo's own timeout), so after any
failure the group is marked broken and every later call raises at once; build a new group
to resume. c10d errors are converted into :class:`WeightSyncTimeout` (deadline passed) or
:class:`WeightSyncError` (e.g. a peer closed its connection), whose message names the
phase, the rank, the world size and the timeout.
"""
from __future__ import annotations

import time
from datetime import timedelta

import torch
import torch.distributed as dist

from rayllm_rl.rendezvous import join_store
from rayllm_rl.weight_sync.common import Closing, WeightSyncError, is_timeout_error, sync_error

__all__ = ["StatelessGlooGroup", "StatelessNcclGroup"]


class StatelessGlooGroup(Closing):
    """A private gloo group of `world_size` processes; rank 0 hosts its TCPStore at host:port.

    Args:
        host: address of rank 0 (reachable from every member).
        port: TCP port of rank 0's store (`store.port`; the other members are told it after rank 0 bound it).
        rank: this process's rank in the group (0 = the weight sender by convention).
        world_size: number of members (1 sender + K receivers).
        timeout_s: default deadline of every phase: building the group (waiting for the
            peers; c10d's connect retries can add up to ~1 s to it) and each collective
            unless the call passes its own `timeout_s` (which may be longer or shorter).
        device_host: optional local address gloo binds its sockets to (default: gloo's
            default device, i.e. the interface the hostname resolves to / GLOO_SOCKET_IFNAME).
        store: rank 0's store, already listening (:func:`rayllm_rl.rendezvous.listen_store`); rank 0 must
            pass it, the other ranks join `host:port` as clients.
    """

    def __init__(self, host: str, port: int, rank: int, world_size: int, timeout_s: float = 60.0, *,
                 device_host: str | None = None, store: dist.TCPStore | None = None):
        if world_size < 1:
            raise ValueError(f"StatelessGlooGroup: world_size must be >= 1, got {world_size}")
        if not 0 <= rank < world_size:
            raise ValueError(f"StatelessGlooGroup: rank {rank} is outside [0, {world_size})")
        if not timeout_s > 0:
            raise ValueError(f"StatelessGlooGroup: timeout_s must be > 0, got {timeout_s}")
        if (store is not None) != (rank == 0):
            raise ValueError(f"StatelessGlooGroup: rank 0 serves the store it bound (store=listen_store(...)), the "
                             f"other ranks join it; got rank {rank} with{'' if store is not None else 'out'} a store")
        self.host, self.port = host, int(store.port if store is not None else port)
        self.rank, self.world_size = int(rank), int(world_size)
        self.timeout_s = float(timeout_s)
        self.device = torch.device("cpu")
        self._broken: WeightSyncError | None = None
        self._closed = False
        self._store = None
        self._pg = None
        where = f"store {host}:{self.port}"
        deadline = time.monotonic() + self.timeout_s
        try:
            # Rank 0 serves the store it bound; clients retry connecting to it until the timeout, and
            # building the process group waits (<= timeout) for every member's keys.
            self._store = store if store is not None else join_store(host, self.port, self.world_size, self.timeout_s)
            left = max(deadline - time.monotonic(), 0.5)
            self._pg = self._make_process_group(timedelta(seconds=left), device_host)
            # gloo's own per-operation timeout: the group default (calls may lower it per op).
            self._pg._set_default_timeout(timedelta(seconds=self.timeout_s))
        except Exception as exc:  # DistStoreError / DistNetworkError / RuntimeError from gloo
            self._store = self._pg = None
            raise sync_error(exc, phase="connect", rank=self.rank, world_size=self.world_size,
                             timeout_s=self.timeout_s, where=where,
                             detail="not every peer joined the group" if is_timeout_error(exc) else "") from exc

    def _make_process_group(self, timeout: timedelta, device_host: str | None):
        if device_host is not None:
            opts = dist.ProcessGroupGloo._Options()
            opts._timeout = timeout
            opts._devices = [dist.ProcessGroupGloo.create_device(hostname=device_host)]
            return dist.ProcessGroupGloo(self._store, self.rank, self.world_size, opts)
        return dist.ProcessGroupGloo(self._store, self.rank, self.world_size, timeout)

    # ------------------------------------------------------------------ helpers
    def _check_usable(self, phase: str) -> None:
        if self._closed:
            raise WeightSyncError(f"weight sync phase '{phase}' on rank {self.rank}: the group is closed",
                                  phase=phase, rank=self.rank, world_size=self.world_size, timeout_s=self.timeout_s)
        if self._broken is not None:
            raise WeightSyncError(
                f"weight sync phase '{phase}' on rank {self.rank} of world size {self.world_size}: the group "
                f"is broken by an earlier failure ({self._broken}); build a new group",
                phase=phase, rank=self.rank, world_size=self.world_size, timeout_s=self.timeout_s)

    def _wait(self, work, timeout_s: float, phase: str) -> None:
        try:
            ok = work.wait(timedelta(seconds=timeout_s))
        except Exception as exc:
            err = sync_error(exc, phase=phase, rank=self.rank, world_size=self.world_size, timeout_s=timeout_s,
                             where=f"store {self.host}:{self.port}")
            self._broken = err
            raise err from exc
        if ok is False:  # defensive: the gloo Work raises instead of returning False
            err = sync_error(None, phase=phase, rank=self.rank, world_size=self.world_size, timeout_s=timeout_s,
                             where=f"store {self.host}:{self.port}")
            self._broken = err
            raise err

    def _issue(self, fn, phase: str, timeout_s: float):
        try:
            return fn()
        except Exception as exc:
            err = sync_error(exc, phase=phase, rank=self.rank, world_size=self.world_size, timeout_s=timeout_s,
                             where=f"store {self.host}:{self.port}")
            self._broken = err
            raise err from exc

    def _timeout(self, timeout_s: float | None) -> float:
        t = self.timeout_s if timeout_s is None else float(timeout_s)
        if not t > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        return t

    # ------------------------------------------------------------------ collectives
    def broadcast(self, tensor: torch.Tensor, src: int = 0, timeout_s: float | None = None, *,
                  phase: str = "broadcast") -> None:
        """Broadcast `tensor` in place from rank `src` to every member (CPU, contiguous)."""
        phase_t = self._timeout(timeout_s)
        self._check_usable(phase)
        if not 0 <= src < self.world_size:
            raise ValueError(f"broadcast: src {src} is outside [0, {self.world_size})")
        if tensor.device.type != self.device.type or not tensor.is_contiguous():
            raise ValueError(f"broadcast ({phase}): this group needs a contiguous {self.device.type} tensor, got "
                             f"device={tensor.device} contiguous={tensor.is_contiguous()}")
        opts = dist.BroadcastOptions()
        opts.rootRank = int(src)
        opts.rootTensor = 0
        opts.timeout = timedelta(seconds=phase_t)
        work = self._issue(lambda: self._pg.broadcast([tensor], opts), phase, phase_t)
        self._wait(work, phase_t, phase)

    def allreduce_max(self, tensor: torch.Tensor, timeout_s: float | None = None, *,
                      phase: str = "allreduce") -> None:
        """Element-wise MAX over every member, in place (used for votes and acknowledgements)."""
        phase_t = self._timeout(timeout_s)
        self._check_usable(phase)
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.MAX
        opts.timeout = timedelta(seconds=phase_t)
        work = self._issue(lambda: self._pg.allreduce([tensor], opts), phase, phase_t)
        self._wait(work, phase_t, phase)

    def barrier(self, timeout_s: float | None = None, *, phase: str = "barrier") -> None:
        """Return once every member reached the barrier (a 1-element allreduce)."""
        self.allreduce_max(torch.zeros(1, dtype=torch.int64), timeout_s, phase=phase)

    @property
    def broken(self) -> bool:
        return self._broken is not None

    def close(self) -> None:
        """Release the group (idempotent). Pending operations are abandoned, not awaited."""
        if self._closed:
            return
        self._closed = True
        pg, self._pg = self._pg, None
        if pg is not None:
            try:
                pg.shutdown() if self._broken is None else pg.abort()
            except Exception:  # best effort: the process may be tearing down anyway
                pass
        self._store = None

    def __repr__(self) -> str:
        state = "closed" if self._closed else ("broken" if self._broken else "ok")
        return (f"StatelessGlooGroup(rank={self.rank}, world_size={self.world_size}, "
                f"store={self.host}:{self.port}, timeout_s={self.timeout_s:g}, {state})")


class StatelessNcclGroup(StatelessGlooGroup):
    """The same private group over NCCL (GPU tensors), built from its own TCPStore.

    Usable where Ray's collective API is not: inside vLLM's worker process (a plain child
    process, not a Ray actor) and beside FSDP's NCCL group in a learner, because it never
    touches the global torch.distributed state. Each member uses its current CUDA device.
    Never run on a GPU in this repository's CI (no GPU there): see docs/ray-orchestration.md.
    """

    def _make_process_group(self, timeout: timedelta, device_host: str | None):
        if not torch.cuda.is_available():
            raise RuntimeError("StatelessNcclGroup needs a CUDA device; use the gloo or shm transport on CPU")
        self.device = torch.device("cuda", torch.cuda.current_device())
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return dist.ProcessGroupNCCL(self._store, self.rank, self.world_size, opts)
