"""ReplicaRouter: the `InferenceEngine` a workflow sees inside an EnvWorker, backed by Ray replicas.

New conversations go to the least-loaded replica; a request whose `rid` was seen before goes
back to the same replica (KV/prefix reuse). A replica whose process died, is restarting or has
not received the current weights yet is skipped: the request goes to another replica, or waits
for this one, within the same timeout. Every call has a timeout.
"""
from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from typing import Any, Mapping

from rayllm_rl.inference.protocol import LLMRequest, LLMResponse


class ReplicaTimeout(TimeoutError):
    """A replica did not answer within the router's timeout."""


class ReplicaNotReady(RuntimeError):
    """A restarted replica refuses requests until the current weights reach it."""


def _replica_unavailable(exc: BaseException) -> bool:
    """The replica's process is gone or restarting, or it has no current weights yet: try again."""
    import ray

    if isinstance(exc, ray.exceptions.RayActorError):  # includes ActorUnavailableError (restarting)
        return True
    return isinstance(exc, ray.exceptions.RayTaskError) and isinstance(exc.cause, ReplicaNotReady)


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
        self.unavailable_retries = 0
        """Requests sent again because their replica was unavailable (dead, restarting, no weights yet)."""

    @property
    def version(self) -> int:
        """Highest policy version seen on a generated token (replicas may briefly differ)."""
        return self._version

    def _pick(self, rid: str, avoid: set[int] = frozenset()) -> int:
        idx = self._sticky.get(rid)
        if idx is None or idx in avoid:
            usable = [i for i in range(len(self.replicas)) if i not in avoid] or list(range(len(self.replicas)))
            idx = min(usable, key=lambda i: self.in_flight[i])
            self._sticky[rid] = idx
            if len(self._sticky) > self._max_sticky:
                self._sticky.popitem(last=False)
        else:
            self._sticky.move_to_end(rid)
        return idx

    async def agenerate(self, request: LLMRequest) -> LLMResponse:
        deadline = time.monotonic() + self.timeout_s
        avoid: set[int] = set()
        while True:
            idx = self._pick(request.rid, avoid)
            self.in_flight[idx] += 1
            left = deadline - time.monotonic()
            try:
                resp = await asyncio.wait_for(self.replicas[idx].agenerate.remote(request), max(left, 0.0))
                break
            except asyncio.TimeoutError:
                raise ReplicaTimeout(f"inference replica {idx} gave no answer to request {request.rid} "
                                     f"within {self.timeout_s:.0f}s") from None
            except Exception as exc:  # noqa: BLE001 - only an unavailable replica is retried
                if not _replica_unavailable(exc) or time.monotonic() > deadline:
                    raise
                self.unavailable_retries += 1
                avoid = {idx} if len(avoid) + 1 >= len(self.replicas) else avoid | {idx}
                await asyncio.sleep(0.5)
            finally:
                self.in_flight[idx] -= 1
        if resp.output_versions:
            self._version = max(self._version, max(resp.output_versions))
        return resp

    async def load_weights(self, named_tensors: Mapping[str, Any], version: int) -> int:
        """Refused: an EnvWorker's router is no weight sink."""
        raise TypeError("weights reach replicas through the weight-sync transport, not through an EnvWorker")
