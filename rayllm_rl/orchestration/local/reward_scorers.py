"""The `reward.*` scorers of the single-process backend: the reward model and the judge in this process.

The reward model is the same `RewardModelScorer` the `reward-model-<i>` actors wrap (its batching
thread takes requests from any thread or loop); the judge's engine runs on an event loop thread of its
own (`LoopThreadEngine`), so the judge can be asked from the collector's loop and from env steps run
in worker threads alike. Both on the CPU (validation refuses GPUs and several actors here).
"""
from __future__ import annotations

import asyncio
from typing import Any

from rayllm_rl.hub import resolve_model_path
from rayllm_rl.loop_thread import EventLoopThread


class LoopThreadEngine:
    """An engine served on its own event loop thread; `agenerate` may be awaited on any loop."""

    def __init__(self, engine: Any, name: str, start_timeout_s: float = 600.0):
        self.engine = engine
        self.loop = EventLoopThread(name)
        self.loop.call(engine.start(), start_timeout_s, f"starting {name}")

    async def agenerate(self, request):
        return await asyncio.wrap_future(
            asyncio.run_coroutine_threadsafe(self.engine.agenerate(request), self.loop.loop))

    def close(self) -> None:
        self.loop.close(self.engine.aclose())


def local_reward_scorers(plan: Any) -> dict[str, Any]:
    """{"model": RewardModelScorer, "judge": Judge} for the parts the job's `reward.*` turns on, built from the
    plan's specs (`JobPlan.reward_model_spec`, `judge_spec`: in this process, on the CPU); each has `close()`."""
    r = plan.config.reward
    scorers: dict[str, Any] = {}
    if r.model.path:
        scorers["model"] = plan.reward_model_spec().build("cpu")
    if r.judge.path:
        from transformers import AutoTokenizer

        from rayllm_rl.rewards.judge import Judge

        engine = plan.judge_spec().build()
        scorers["judge"] = Judge.from_config(r.judge, LoopThreadEngine(engine, "rayllm-local-judge"),
                                             AutoTokenizer.from_pretrained(resolve_model_path(r.judge.path)))
    return scorers
