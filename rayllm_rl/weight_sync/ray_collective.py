"""Weight-sync groups over ``ray.util.collective`` (NCCL via cupy on GPU).

:class:`RayCollectiveGroup` has the interface of
:class:`~rayllm_rl.weight_sync.gloo_group.StatelessGlooGroup` (``rank``, ``world_size``,
``device``, ``broadcast(tensor, src, timeout_s)``, ``allreduce_max``, ``barrier``,
``close``), so :class:`~rayllm_rl.weight_sync.transport.WeightSender` /
``WeightReceiver`` run over it unchanged. Every member must be a Ray actor (or task) and
call the constructor with the same `group_name` (``ray.util.collective.init_collective_group``).

Backends (Ray 2.60, see ``ray/util/collective/collective.py``):

* ``"nccl"``: GPU tensors, NCCL through cupy; coexists with an FSDP/NCCL group in the same
  process (it owns its own communicator). **Untested on the development machine (no GPU, no
  cupy)**; only its CPU siblings below are exercised by ``tests/test_weight_sync.py``.
* ``"gloo"`` (also ``"torch_gloo"``): Ray's ``TorchGLOOGroup``, which calls
  ``torch.distributed.init_process_group`` on the *global* group, so it must not be used in
  a process that runs FSDP; fine between plain actors (tested).
* ``"stateless_gloo"``: ``StatelessGlooBackend`` (a ``BaseGroup``), registered with
  ``ray.util.collective.register_collective_backend`` by :func:`register_stateless_gloo_backend`
  (called by the constructor when this backend is asked for): a
  :class:`StatelessGlooGroup` behind the Ray collective API, rendezvous through Ray's
  internal KV, global ``torch.distributed`` state untouched, so it can live beside FSDP (tested).

How the timeout is enforced. Ray's collective API has no per-call deadline: its option
``timeout_ms`` fields are ignored by the NCCL and GLOO groups, ``init_collective_group`` only
bounds the GLOO rendezvous (``gloo_timeout``) and ``torch.distributed``'s default gloo
timeout is 30 minutes; an NCCL op returns once *enqueued* and its communicator is created
lazily (``ncclCommInitRank`` waits for every rank) on the first collective. Therefore each
call runs in a watchdog: the Ray call is issued on a daemon thread joined with the remaining
deadline, and for NCCL a CUDA event recorded on the group's NCCL streams is then polled
(``event.query()``) until the same deadline. When the deadline passes
:class:`WeightSyncTimeout` is raised naming the phase; the stuck thread cannot be cancelled,
so the group is marked broken (later calls raise at once), the NCCL communicators are aborted
(best effort) and a new group (new name) must be built. The constructor forces the connection
with a barrier so that "connect" is bounded too.

NCCL caveats (from reading Ray's ``NCCLGroup``, not from a run): the collective is issued from
the watchdog thread, whose cupy current stream is the legacy default stream, so Ray orders
the NCCL stream after *default-stream* work only: produce the tensors on the default stream
(or synchronise first). Ray picks the GPU from the tensor's device, so one GPU per actor (the
usual Ray setup) is assumed.
"""
from __future__ import annotations

import threading
import time
from typing import Any, Callable

import torch

from rayllm_rl.weight_sync.gloo_group import (
    StatelessGlooGroup, WeightSyncError, find_free_port, sync_error,
)

__all__ = ["RayCollectiveGroup", "register_stateless_gloo_backend", "STATELESS_GLOO"]

STATELESS_GLOO = "STATELESS_GLOO"
_KV_PREFIX = "rayllm_rl_weight_sync_rendezvous_"


def _call_with_deadline(fn: Callable[[], Any], timeout_s: float) -> tuple[bool, Any, BaseException | None]:
    """Run `fn` on a daemon thread; (finished, result, exception) after at most `timeout_s`."""
    box: dict[str, Any] = {}

    def target():
        try:
            box["result"] = fn()
        except BaseException as exc:  # noqa: BLE001 - handed back to the caller
            box["error"] = exc

    th = threading.Thread(target=target, name="weight-sync-watchdog", daemon=True)
    th.start()
    th.join(timeout_s)
    if th.is_alive():
        return False, None, None
    return True, box.get("result"), box.get("error")


class RayCollectiveGroup:
    """A weight-sync group over ``ray.util.collective`` with a deadline on every call.

    Args:
        group_name: name of the collective group, the same in every member.
        world_size: number of members (rank 0 sends the weights).
        rank: this actor's rank.
        backend: "nccl" (GPU), "gloo"/"torch_gloo" (CPU, global torch.distributed group) or
            "stateless_gloo" (CPU, private group; see the module docstring).
        timeout_s: default deadline of every phase (connect included).
        device: where transfer buffers live (default: the current CUDA device for NCCL, CPU otherwise).
    """

    def __init__(self, group_name: str, world_size: int, rank: int, backend: str = "nccl",
                 timeout_s: float = 60.0, *, device: torch.device | str | None = None):
        import ray.util.collective as col

        if not 0 <= rank < world_size:
            raise ValueError(f"RayCollectiveGroup: rank {rank} is outside [0, {world_size})")
        if not timeout_s > 0:
            raise ValueError(f"RayCollectiveGroup: timeout_s must be > 0, got {timeout_s}")
        self.group_name = group_name
        self.world_size, self.rank = int(world_size), int(rank)
        self.backend = backend.lower()
        if self.backend == "torch_gloo":
            self.backend = "gloo"
        self.timeout_s = float(timeout_s)
        self._col = col
        self._broken: WeightSyncError | None = None
        self._closed = False
        self._initialized = False
        if self.backend == "nccl":
            self.device = torch.device(device) if device is not None else torch.device(
                "cuda", torch.cuda.current_device())
        else:
            self.device = torch.device(device or "cpu")
        if self.backend == STATELESS_GLOO.lower():
            register_stateless_gloo_backend(timeout_s=self.timeout_s)
        self._run(lambda: col.init_collective_group(self.world_size, self.rank, backend=self.backend,
                                                    group_name=group_name, gloo_timeout=int(self.timeout_s * 1000)),
                  "connect", self.timeout_s)
        self._initialized = True
        # NCCL creates its communicator on the first collective: force it now, bounded.
        self.barrier(phase="connect")

    # ------------------------------------------------------------------ watchdog
    def _fail(self, exc: BaseException | None, phase: str, timeout_s: float) -> WeightSyncError:
        err = sync_error(exc, phase=phase, rank=self.rank, world_size=self.world_size, timeout_s=timeout_s,
                         where=f"ray collective group {self.group_name!r}, backend {self.backend}")
        self._broken = err
        if self.backend == "nccl":
            self._abort_nccl()
        return err

    def _run(self, fn: Callable[[], Any], phase: str, timeout_s: float) -> Any:
        if self._closed:
            raise WeightSyncError(f"weight sync phase '{phase}' on rank {self.rank}: group {self.group_name!r} "
                                  "is closed", phase=phase, rank=self.rank, world_size=self.world_size)
        if self._broken is not None:
            raise WeightSyncError(f"weight sync phase '{phase}' on rank {self.rank}: group {self.group_name!r} is "
                                  f"broken by an earlier failure ({self._broken}); build a new group",
                                  phase=phase, rank=self.rank, world_size=self.world_size, timeout_s=timeout_s)
        deadline = time.monotonic() + timeout_s
        done, result, exc = _call_with_deadline(fn, timeout_s)
        if not done:
            raise self._fail(None, phase, timeout_s)
        if exc is not None:
            raise self._fail(exc, phase, timeout_s) from exc
        if self.backend == "nccl":
            self._wait_nccl(deadline, phase, timeout_s)
        return result

    def _nccl_streams(self) -> list:
        g = self._col.get_group_handle(self.group_name)
        return [s for streams in (getattr(g, "_dev_streams_map", None) or {}).values() for s in (streams or [])]

    def _wait_nccl(self, deadline: float, phase: str, timeout_s: float) -> None:
        """Poll a CUDA event recorded on the NCCL streams until `deadline` (ops are asynchronous)."""
        events = []
        for s in self._nccl_streams():
            ev = torch.cuda.Event()
            ev.record(torch.cuda.ExternalStream(s.ptr, device=self.device))
            events.append(ev)
        sleep = 1e-5
        while not all(ev.query() for ev in events):
            if time.monotonic() > deadline:
                raise self._fail(None, phase, timeout_s)
            time.sleep(sleep)
            sleep = min(sleep * 2, 2e-3)
        for ev in events:  # order later work on the caller's stream after the collective
            torch.cuda.current_stream(self.device).wait_event(ev)

    def _abort_nccl(self) -> None:
        try:
            g = self._col.get_group_handle(self.group_name)
            for comms in (getattr(g, "_dev_comm_map", None) or {}).values():
                for c in comms or []:
                    c.abort()
        except Exception:  # best effort
            pass

    def _timeout(self, timeout_s: float | None) -> float:
        t = self.timeout_s if timeout_s is None else float(timeout_s)
        if not t > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        return t

    # ------------------------------------------------------------------ collectives
    def broadcast(self, tensor: torch.Tensor, src: int = 0, timeout_s: float | None = None, *,
                  phase: str = "broadcast") -> None:
        """Broadcast `tensor` in place from rank `src` (on `self.device`, contiguous)."""
        t = self._timeout(timeout_s)
        if tensor.device != self.device or not tensor.is_contiguous():
            raise ValueError(f"broadcast ({phase}): need a contiguous tensor on {self.device}, got "
                             f"device={tensor.device} contiguous={tensor.is_contiguous()}")
        from ray.util.collective import types

        def op():
            g = self._col.get_group_handle(self.group_name)
            opts = types.BroadcastOptions()
            opts.root_rank, opts.root_tensor = int(src), 0
            opts.timeout_ms = int(t * 1000)
            g.broadcast([tensor], opts)

        self._run(op, phase, t)

    def allreduce_max(self, tensor: torch.Tensor, timeout_s: float | None = None, *,
                      phase: str = "allreduce") -> None:
        """Element-wise MAX over every member, in place (small control tensors; any device)."""
        t = self._timeout(timeout_s)
        from ray.util.collective import types

        work = tensor if tensor.device == self.device else tensor.to(self.device)

        def op():
            g = self._col.get_group_handle(self.group_name)
            opts = types.AllReduceOptions()  # an instance: ray's allreduce() mutates the class
            opts.reduceOp = types.ReduceOp.MAX
            opts.timeout_ms = int(t * 1000)
            g.allreduce([work], opts)

        self._run(op, phase, t)
        if work is not tensor:
            tensor.copy_(work)

    def barrier(self, timeout_s: float | None = None, *, phase: str = "barrier") -> None:
        self.allreduce_max(torch.zeros(1, dtype=torch.int64), timeout_s, phase=phase)

    @property
    def broken(self) -> bool:
        return self._broken is not None

    def close(self) -> None:
        """Destroy the Ray collective group (bounded by the timeout; idempotent)."""
        if self._closed:
            return
        self._closed = True
        if self._initialized and self._broken is None:
            _call_with_deadline(lambda: self._col.destroy_collective_group(self.group_name), self.timeout_s)
        elif self._initialized:  # a thread may hold the group: do not wait on it for long
            _call_with_deadline(lambda: self._col.destroy_collective_group(self.group_name), 1.0)

    def __enter__(self) -> "RayCollectiveGroup":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else ("broken" if self._broken else "ok")
        return (f"RayCollectiveGroup({self.group_name!r}, rank={self.rank}, world_size={self.world_size}, "
                f"backend={self.backend}, timeout_s={self.timeout_s:g}, {state})")


# ---------------------------------------------------------------------- custom backend
_backend_lock = threading.Lock()
_backend_timeout_s = 60.0


def _make_backend_class():
    from ray.util.collective.collective_group.base_collective_group import BaseGroup

    class StatelessGlooBackend(BaseGroup):
        """``ray.util.collective`` backend around :class:`StatelessGlooGroup` (broadcast, allreduce, barrier).

        Rendezvous: rank 0 picks a free port on its node IP and publishes ``host:port`` in
        Ray's internal KV under the group name; the other ranks poll it (bounded by the
        backend timeout) and connect. The global torch.distributed group is never touched.
        Honours the ``timeout_ms`` field of Ray's option objects when it is set.
        """

        def __init__(self, world_size: int, rank: int, group_name: str):
            import ray
            import ray.experimental.internal_kv as kv

            super().__init__(world_size, rank, group_name)
            timeout_s = _backend_timeout_s
            key = _KV_PREFIX + group_name
            if rank == 0:
                host = ray.util.get_node_ip_address()
                port = find_free_port(host)
                kv._internal_kv_put(key, f"{host}:{port}", overwrite=True)
            else:
                deadline = time.monotonic() + timeout_s
                while True:
                    val = kv._internal_kv_get(key)
                    if val is not None:
                        host, port = val.decode().rsplit(":", 1)
                        break
                    if time.monotonic() > deadline:
                        raise sync_error(None, phase="connect", rank=rank, world_size=world_size,
                                         timeout_s=timeout_s, where=f"rendezvous key {key!r}",
                                         detail="rank 0 never published its address")
                    time.sleep(0.02)
            try:
                self._group = StatelessGlooGroup(host, int(port), rank, world_size, timeout_s)
            finally:
                if rank == 0:  # every rank has connected (or given up): drop the address
                    try:
                        kv._internal_kv_del(key)
                    except Exception:
                        pass

        @classmethod
        def backend(cls):
            return STATELESS_GLOO

        @classmethod
        def check_backend_availability(cls) -> bool:
            return True

        @staticmethod
        def _tensor(tensors) -> torch.Tensor:
            if not (isinstance(tensors, list) and len(tensors) == 1 and isinstance(tensors[0], torch.Tensor)):
                raise ValueError(f"{STATELESS_GLOO} takes a list holding one torch.Tensor, got {type(tensors)}")
            return tensors[0]

        @staticmethod
        def _t(options) -> float | None:
            ms = getattr(options, "timeout_ms", None)
            if ms is None:
                return None
            ms = ms.total_seconds() * 1000 if hasattr(ms, "total_seconds") else ms
            return ms / 1000.0 if ms > 0 else None

        def broadcast(self, tensor, broadcast_options=None):
            self._group.broadcast(self._tensor(tensor), getattr(broadcast_options, "root_rank", 0),
                                  self._t(broadcast_options))

        def allreduce(self, tensor, allreduce_options=None):
            from ray.util.collective.types import ReduceOp

            op = getattr(allreduce_options, "reduceOp", ReduceOp.SUM)
            if op != ReduceOp.MAX:
                raise NotImplementedError(f"{STATELESS_GLOO} implements allreduce with MAX only, got {op}")
            self._group.allreduce_max(self._tensor(tensor), self._t(allreduce_options))

        def barrier(self, barrier_options=None):
            self._group.barrier(self._t(barrier_options))

        def destroy_group(self):
            self._group.close()

        def _unsupported(self, *args, **kwargs):
            raise NotImplementedError(f"{STATELESS_GLOO} implements broadcast, allreduce(MAX) and barrier only")

        reduce = allgather = reducescatter = send = recv = _unsupported

    return StatelessGlooBackend


_backend_cls = None  # built on first registration (ray is imported lazily)


def register_stateless_gloo_backend(timeout_s: float | None = None):
    """Register the ``STATELESS_GLOO`` backend in this process (idempotent); returns its class.

    Must run in every process that uses the backend (the RayCollectiveGroup constructor does
    it). `timeout_s` sets the rendezvous / default op timeout of groups created afterwards.
    """
    global _backend_cls, _backend_timeout_s
    from ray.util.collective.backend_registry import _global_registry, register_collective_backend

    with _backend_lock:
        if timeout_s is not None:
            _backend_timeout_s = float(timeout_s)
        if _backend_cls is None:
            _backend_cls = _make_backend_class()
        if not _global_registry.is_registered(STATELESS_GLOO):
            register_collective_backend(STATELESS_GLOO, _backend_cls)
    return _backend_cls
