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
from typing import Any, Iterable, Mapping, Sequence, TypedDict

import torch

from rayllm_rl.weight_sync.buckets import TensorMeta, metas_from_spec
from rayllm_rl.weight_sync.ends import EndpointView, HandoffPlan, HeldReceiver, SenderEnd, SyncStats, TensorSource
from rayllm_rl.weight_sync.scheme import TransportScheme

__all__ = ["RDTSender", "RDTReceiver", "RDTHandoff", "RDTScheme"]


class RDTHandoff(TypedDict):
    """What learner rank 0's result carries: Ray moves `tensors` to each replica over the collective group."""

    version: int
    fingerprint: int
    tensors: dict[str, torch.Tensor]


class RDTSender(EndpointView, SenderEnd):
    """Learner rank 0: returns every tensor of the plan, on the transport's device, in the handoff."""

    def __init__(self, metas: Sequence[TensorMeta], timeout_s: float, device: str):
        self._ep = HandoffPlan(metas, 1 << 62, timeout_s, 0, "Ray Direct Transport")  # buckets: dtype runs
        self.device = device

    def send(self, named: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
             version: int) -> tuple[SyncStats, RDTHandoff]:
        plan = self._ep
        t0 = time.perf_counter()
        source = TensorSource(named, {m.name for m in plan.metas})
        tensors: dict[str, torch.Tensor] = {}
        with plan.publishing(source):
            for m in plan.metas:
                t = plan.take(source, m, "publish").detach()
                tensors[m.name] = t if t.device.type == self.device else t.to(self.device)
        stats = plan.sent(t0, len(tensors), version)
        return stats, RDTHandoff(version=int(version), fingerprint=plan.fingerprint, tensors=tensors)

    def close(self) -> None:
        """Nothing is held here: Ray frees the sent tensors once no reference to the result is left."""


class RDTReceiver(HeldReceiver):
    """A replica: the handoff arrives holding the tensors (Ray moved them); swaps them into `target`."""

    def __init__(self, target: Any, metas: Sequence[TensorMeta], timeout_s: float, rank: int = 1):
        params = target.named_parameters()
        self._ep = HandoffPlan(metas, 1 << 62, timeout_s, rank, "Ray Direct Transport")
        self._dtypes = {m.name: params[m.name].dtype for m in self._ep.metas}
        # where the target keeps each tensor (a staging target's are "meta": it copies from the CPU)
        self._devices = {m.name: params[m.name].device if params[m.name].device.type != "meta"
                         else torch.device("cpu") for m in self._ep.metas}
        self.target = target

    def receive(self, handoff: RDTHandoff, *, header_timeout_s: float | None = None) -> int:
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
        return self._hold(handoff["version"], named, t0, len(named))


class RDTScheme(TransportScheme):
    """rdt_gloo / rdt_nccl: nothing to agree on beforehand (the Ray layer makes the collective group);
    the handoff is an :class:`RDTHandoff`, on the GPU for NCCL."""

    def sender(self, spec, metas: Sequence[TensorMeta]) -> RDTSender:
        return RDTSender(metas, spec.timeout_s, "cuda" if self.info.gpu_only else "cpu")

    def receiver(self, spec, target: Any) -> RDTReceiver:
        return RDTReceiver(target, metas_from_spec(spec.metas), spec.timeout_s, spec.rank)
