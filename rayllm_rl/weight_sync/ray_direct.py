"""Weights over Ray Direct Transport (RDT): Ray moves the tensors actor to actor, over a collective group.

Learner rank 0's sync call is made with ``tensor_transport="gloo"`` (CPU) or ``"nccl"`` (GPU): the
tensors of its result stay in the learner's RDT store and only their metadata travels. The driver
passes the reference to that result to every replica, so Ray sends each tensor straight from the
learner to the replica over the collective group (`ray.experimental.collective`) that the Ray layer
made of learner rank 0 and the replicas. With NCCL the bytes go GPU to GPU, never through host memory.

Neither end calls Ray: the sender hands its tensors back in the result (:class:`RDTSender`), and
the receiver gets them already in its process, as the resolved argument of its call
(:class:`RDTReceiver`). The sender does not copy: it returns the gathered full tensors (views of the
parameters when the learner is one rank), which the learner does not change before every replica has
received them (the driver awaits the sync before the next train step).
"""
from __future__ import annotations

import time
from typing import Any, Iterable, Mapping, Sequence

import torch

from rayllm_rl.weight_sync.buckets import TensorMeta, plan_buckets, plan_fingerprint
from rayllm_rl.weight_sync.gloo_group import WeightSyncError
from rayllm_rl.weight_sync.transport import SyncStats, _EndpointView, _Source

__all__ = ["RDTSender", "RDTReceiver"]


class _Plan:
    """The tensors both ends expect, and the last sync's stats."""

    def __init__(self, metas: Sequence[TensorMeta], timeout_s: float, rank: int, device: str):
        self.metas = list(metas)
        if not self.metas:
            raise ValueError("weight sync: empty list of tensor metadata")
        self.buckets = plan_buckets(self.metas, 1 << 62)  # one per dtype run: only for the fingerprint
        self.fingerprint = plan_fingerprint(self.buckets)
        self.total_bytes = sum(m.nbytes for m in self.metas)
        self.timeout_s, self.rank, self.device = float(timeout_s), rank, device
        self.last_stats: SyncStats | None = None

    def error(self, phase: str, message: str) -> WeightSyncError:
        return WeightSyncError(f"weight sync phase '{phase}' failed on rank {self.rank} (Ray Direct Transport, "
                               f"timeout {self.timeout_s:g}s): {message}", phase=phase, rank=self.rank,
                               world_size=None, timeout_s=self.timeout_s)


class RDTSender(_EndpointView):
    """Learner rank 0: returns every tensor of the plan, on the transport's device, in the handoff."""

    def __init__(self, metas: Sequence[TensorMeta], timeout_s: float, device: str):
        self._ep = _Plan(metas, timeout_s, 0, device)

    def send(self, named: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
             version: int) -> tuple[SyncStats, dict[str, Any]]:
        plan = self._ep
        t0 = time.perf_counter()
        source = _Source(named, {m.name for m in plan.metas})
        tensors: dict[str, torch.Tensor] = {}
        try:
            for m in plan.metas:
                t = source.take(m.name).detach()
                if tuple(t.shape) != m.shape or t.dtype != m.dtype:
                    raise plan.error("publish", f"{m.name} is {tuple(t.shape)}/{t.dtype}, planned {m.shape}/{m.dtype}")
                tensors[m.name] = t if t.device.type == plan.device else t.to(plan.device)
        except KeyError as exc:
            source.drain()  # FSDP peers gather in step with this rank
            raise plan.error("publish", str(exc)) from exc
        except WeightSyncError:
            source.drain()
            raise
        stats = SyncStats(bytes=plan.total_bytes, seconds=time.perf_counter() - t0, buckets=len(tensors),
                          version=int(version))
        plan.last_stats = stats
        return stats, {"version": int(version), "fingerprint": plan.fingerprint, "tensors": tensors}

    def close(self) -> None:
        """Nothing is held here: Ray frees the sent tensors once no reference to the result is left."""


class RDTReceiver(_EndpointView):
    """A replica: the handoff arrives holding the tensors (Ray moved them); swaps them into `target`."""

    def __init__(self, target: Any, metas: Sequence[TensorMeta], timeout_s: float, rank: int = 1):
        params = target.named_parameters()
        self._ep = _Plan(metas, timeout_s, rank, "cpu")
        self._dtypes = {m.name: params[m.name].dtype for m in self._ep.metas}
        # where the target keeps each tensor (a staging target's are "meta": it copies from the CPU)
        self._devices = {m.name: params[m.name].device if params[m.name].device.type != "meta"
                         else torch.device("cpu") for m in self._ep.metas}
        self.target = target
        self._received: tuple[int, dict[str, torch.Tensor]] | None = None

    def receive(self, handoff: Mapping[str, Any], *, header_timeout_s: float | None = None) -> int:
        """Check what Ray delivered against the plan; returns its version (nothing is waited for:
        Ray moved the tensors before this call began)."""
        plan = self._ep
        t0 = time.perf_counter()
        if not isinstance(handoff, Mapping) or "tensors" not in handoff:
            raise plan.error("handoff", f"expected the learner's tensors, got {type(handoff).__name__}")
        if handoff.get("fingerprint") != plan.fingerprint:
            raise plan.error("handoff", f"version {handoff.get('version')} was sent with plan "
                                        f"{handoff.get('fingerprint')}, this receiver's is {plan.fingerprint}: "
                                        "sender and receiver must use the same metas")
        named = {}
        for m in plan.metas:
            t = handoff["tensors"].get(m.name)
            if t is None or tuple(t.shape) != m.shape:
                raise plan.error("handoff", f"{m.name}: got {None if t is None else tuple(t.shape)}, planned {m.shape}")
            named[m.name] = t.to(device=self._devices[m.name], dtype=self._dtypes[m.name])  # no copy if they match
        self._received = (int(handoff["version"]), named)
        plan.last_stats = SyncStats(bytes=plan.total_bytes, seconds=time.perf_counter() - t0, buckets=len(named),
                                    version=int(handoff["version"]))
        return int(handoff["version"])

    def swap(self, version: int | None = None) -> float:
        if self._received is None:
            raise RuntimeError("RDTReceiver.swap: nothing received since the last swap")
        received, named = self._received
        self._received = None
        try:
            return float(self.target.swap_weights(named, received if version is None else int(version)))
        except Exception as exc:
            raise self._ep.error("swap", f"{type(exc).__name__}: {exc}") from exc

    def close(self) -> None:
        self._received = None
