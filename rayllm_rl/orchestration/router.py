"""ReplicaRouter: the `InferenceEngine` a workflow sees inside an EnvWorker, backed by Ray replicas.

New conversations go to the least-loaded replica; a request whose `rid` was seen before goes
back to the same replica (KV/prefix reuse). Every call has a timeout.
"""
from __future__ import annotations

import asyncio
from collections import OrderedDict
from typing import Any, Mapping

from rayllm_rl.inference.protocol import LLMRequest, LLMResponse


class ReplicaTimeout(TimeoutError):
    """A replica did not answer within the router's timeout."""


class ReplicaRouter:
    """Routes `agenerate` calls over replica actor handles (load-balanced, sticky by rid)."""

    def __init__(self, replicas: list[Any], timeout_s: float = 300.0, max_sticky: int = 50_000):
        if not replicas:
            raise ValueError("ReplicaRouter needs at least one replica")
        self.replicas = list(replicas)
        self.timeout_s = timeout_s
        self.in_flight = [0] * len(replicas)
        self._sticky: OrderedDict[str, int] = OrderedDict()
        self._max_sticky = max_sticky
        self._version = 0

    @property
    def version(self) -> int:
        """Highest policy version seen on a generated token (replicas may briefly differ)."""
        return self._version

    def _pick(self, rid: str) -> int:
        idx = self._sticky.get(rid)
        if idx is None:
            idx = min(range(len(self.replicas)), key=lambda i: self.in_flight[i])
            self._sticky[rid] = idx
            if len(self._sticky) > self._max_sticky:
                self._sticky.popitem(last=False)
        else:
            self._sticky.move_to_end(rid)
        return idx

    async def agenerate(self, request: LLMRequest) -> LLMResponse:
        idx = self._pick(request.rid)
        self.in_flight[idx] += 1
        try:
            resp = await asyncio.wait_for(self.replicas[idx].agenerate.remote(request), self.timeout_s)
        except asyncio.TimeoutError:
            raise ReplicaTimeout(f"inference replica {idx} gave no answer to request {request.rid} "
                                 f"within {self.timeout_s:.0f}s") from None
        finally:
            self.in_flight[idx] -= 1
        if resp.output_versions:
            self._version = max(self._version, max(resp.output_versions))
        return resp

    def update_weights(self, named_tensors: Mapping[str, Any], version: int | None = None) -> int:
        raise TypeError("weights reach replicas through the weight-sync transport, not through an EnvWorker")
