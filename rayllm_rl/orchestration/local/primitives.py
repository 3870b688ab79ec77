"""A plan of a learner and a replica (`JobPlan.only("learner", "replica")`) in this process, for a loop of the
user's own (`rayllm_rl.tinker`): the same role specs the job builds, built the same way (`spec.build()`), driven by
blocking calls. The Ray twin is `orchestration/ray/primitives.py`; both offer the calls of `PrimitiveRoles`
(orchestration/backend.py) and nothing above them asks which one runs.
"""
from __future__ import annotations

import asyncio
import time
from typing import Any, Mapping

from rayllm_rl.hub import resolve_model_path
from rayllm_rl.inference.protocol import LLMRequest, LLMResponse
from rayllm_rl.job.plan import JobPlan
from rayllm_rl.learner import primitives
from rayllm_rl.loop_thread import EventLoopThread


class LocalRoles:
    """The learner in the calling thread, the engine on an event loop of its own (generation runs while the
    learner computes; a weight load lands between two decode steps, under the engine's lock)."""

    @staticmethod
    def prepare(config) -> bool:
        """Nothing to start before the roles (the Ray twin starts Ray here)."""
        return False

    def __init__(self, plan: JobPlan, model_path: str, owns_runtime: bool | None = None):
        self.plan, self.timeout_s = plan, plan.config.trainer.call_timeout_s
        self.model_path = resolve_model_path(model_path, plan.config.model.revision)
        self.loop, self.engine = None, None
        try:  # a failed start closes what it started
            self.learner = plan.learner_spec(self.model_path).build()
            self.engine = plan.engine_spec(self.model_path).build()
            self.loop = EventLoopThread("rayllm-primitives-engine")
            self.loop.call(self.engine.start(), self.timeout_s, "starting the inference engine")
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------ learner
    def forward_backward(self, batch, loss, backward: bool, sampling_mask) -> tuple[Any, dict[str, float]]:
        return primitives.forward_backward(self.learner, batch, loss, backward=backward, sampling_mask=sampling_mask)

    def optim_step(self, adam: Mapping[str, float]) -> dict[str, float]:
        return primitives.optim_step(self.learner, adam)

    def save_state(self, path: str, extra: dict[str, Any]) -> None:
        from rayllm_rl.learner.checkpoint import save_checkpoint

        save_checkpoint(self.learner, path, extra=extra)

    def load_state(self, path: str, with_optimizer: bool) -> dict[str, Any]:
        from rayllm_rl.learner.checkpoint import load_checkpoint

        extra = load_checkpoint(self.learner, path)
        if not with_optimizer:
            self.learner.reset_optimizer(self.learner.cfg)
        return extra

    def learner_checksum(self) -> float:
        from rayllm_rl.inference.protocol import weights_checksum

        return weights_checksum(self.learner.named_tensors())

    # ------------------------------------------------------------------ weights and generation
    def sync_weights(self, version: int) -> dict[str, float]:
        t0 = time.perf_counter()
        self.engine.weights.load_weights_sync(self.learner.named_tensors(), version=version)
        return {"sync_s": time.perf_counter() - t0}

    def generate(self, requests: list[LLMRequest]) -> list[LLMResponse]:
        async def all_of():
            return await asyncio.gather(*(self.engine.agenerate(r) for r in requests))

        return self.loop.call(all_of(), self.timeout_s, f"generating {len(requests)} samples")

    def replica_checksums(self) -> list[float]:
        return [self.loop.call(self.engine.weights.weights_checksum(), self.timeout_s, "the engine's checksum")]

    def recover(self, crash) -> None:
        """Nothing to rebuild: in one process a crashed role is a crashed run."""
        raise crash

    def close(self) -> None:
        if self.loop is not None:
            self.loop.close(self.engine.aclose() if self.engine is not None else None)
            self.loop = None
