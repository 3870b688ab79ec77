"""When the Transformers engine generates: held for a moment (`pause`/`resume`), or put to sleep for the
colocated placement (generation held, weights to pinned host memory or dropped, GPU memory freed while a
learner trains on the same GPU) and woken after. The decode loop reads the holds once per step, under the
weight sink's lock, so a hold takes effect between two decode steps."""
from __future__ import annotations

import asyncio
import time
from typing import Callable, Sequence

import torch

from rayllm_rl.inference.decoding import EngineStats
from rayllm_rl.inference.transformers.weights import TransformersWeights

SLEEP_TAGS = ("weights", "kv_cache")
"""What `sleep` puts down and `wake_up(tags)` brings back; the engine generates once both are up."""


class TransformersTurns:
    """`GenerationTurns` of a `TransformersEngine`: the holds on its decode loop, and the serving loop's gate
    that waiting batches pass once no hold is left. `in_flight()`: the batch decoding now (a future), if any."""

    def __init__(self, weights: TransformersWeights, stats: EngineStats,
                 in_flight: Callable[[], "asyncio.Future | None"]):
        self.weights = weights
        self.stats = stats
        self._in_flight = in_flight
        # Changed under the weights' lock and read by every decode step in it.
        self.paused = False
        self._kv_cache_down = False  # "kv_cache" is asleep; "weights" is the weight sink's offload level
        self._gate: asyncio.Event | None = None  # set while generation may run (the serving loop's)
        self._gate_loop: asyncio.AbstractEventLoop | None = None

    @property
    def asleep(self) -> frozenset[str]:
        """The SLEEP_TAGS that `sleep` put down and `wake_up` has not brought back ("weights": the sink's
        weights are off the device, `weights.offload_level`)."""
        down = {"weights": self.weights.offload_level > 0, "kv_cache": self._kv_cache_down}
        return frozenset(tag for tag in SLEEP_TAGS if down[tag])

    @property
    def sleeping(self) -> bool:
        """Whether `sleep` put anything down that `wake_up` has not brought back (no generation then)."""
        return self._kv_cache_down or self.weights.offload_level > 0

    def held(self) -> bool:
        """Whether generation must wait (read by the decode loop under the weights' lock)."""
        return self.paused or self.sleeping

    def gate(self) -> asyncio.Event:
        """The serving loop's event, set while generation may run (brought in line with the holds)."""
        loop = asyncio.get_running_loop()
        if self._gate is None or self._gate_loop is not loop:
            self._gate, self._gate_loop = asyncio.Event(), loop
        (self._gate.clear if self.held() else self._gate.set)()
        return self._gate

    def _open_gate_if_free(self) -> None:
        """After a hold is lifted: let the serving loop's waiting batches go on (from any thread or loop)."""
        gate, loop = self._gate, self._gate_loop
        if gate is None or self.held():
            return
        try:
            here = asyncio.get_running_loop()
        except RuntimeError:
            here = None
        if loop is here or loop.is_closed() or not loop.is_running():
            gate.set()
        else:
            loop.call_soon_threadsafe(gate.set)

    def _pause(self) -> None:
        with self.weights.lock.writer():  # the running decode step ends first, later ones see the hold
            self.paused = True

    async def pause(self) -> None:
        """Hold decoding after the running step (requests and their KV caches are kept) until `resume`."""
        if not self.paused:
            await asyncio.to_thread(self._pause)

    async def resume(self) -> None:
        if self.paused:
            self.paused = False
            self._open_gate_if_free()

    async def sleep(self, level: int = 1) -> None:
        """Hold generation and free the GPU memory while a colocated learner trains.

        Waits for the running decode step; a batch in flight drops its KV cache and re-prefills after
        `wake_up`; requests that arrive wait. Level 1: weights to pinned host memory (back with
        `wake_up(["weights"])`); level 2: weights dropped (the weight sync after `wake_up(["weights"])`
        refills them; generating before that is an error). Buffers go to host memory at both levels.
        On the CPU nothing moves: sleep only holds generation, and level 2 keeps the weights but marks
        them as to be resent, like on a GPU. Idempotent (a level-2 sleep over a level-1 one drops them)."""
        if level not in (1, 2):
            raise ValueError(f"sleep: level must be 1 (weights to host memory) or 2 (weights dropped), got {level!r}")
        t0 = time.perf_counter()
        await asyncio.to_thread(self._sleep, int(level))
        run = self._in_flight()
        if run is not None and not run.done() and run.get_loop() is asyncio.get_running_loop():
            await asyncio.wait([run])  # the batch in flight stops at its next step and drops its KV cache
        if self.weights.device.type == "cuda":
            torch.cuda.empty_cache()
        self.stats.sleeps += 1
        self.stats.last_sleep_s = time.perf_counter() - t0

    def _sleep(self, level: int) -> None:
        with self.weights.lock.writer(), torch.no_grad():
            self._kv_cache_down = True
            self.weights.offload(level)

    async def wake_up(self, tags: Sequence[str] | None = None) -> None:
        """Bring back `tags`: "weights" (to the device: level 1's host copies, or level 2's empty storage
        of the right shapes for the weight sync to fill), "kv_cache" (nothing to allocate: the cache
        is per batch); None = both. Generation resumes once both are up. Idempotent."""
        if isinstance(tags, str):
            raise ValueError(f"wake_up: tags is a list of tag names such as ['weights'], got the string {tags!r}")
        want = frozenset(SLEEP_TAGS if tags is None else tags)
        bad = sorted(want.difference(SLEEP_TAGS))
        if bad:
            raise ValueError(f"wake_up: unknown tags {bad}; the tags are {list(SLEEP_TAGS)}")
        if "weights" in want and "weights" in self.asleep:
            t0 = time.perf_counter()
            await asyncio.to_thread(self._wake_weights)
            self.stats.last_wake_s = time.perf_counter() - t0
        if "kv_cache" in want:
            self._kv_cache_down = False
        self._open_gate_if_free()

    def _wake_weights(self) -> None:
        with self.weights.lock.writer(), torch.no_grad():
            self.weights.restore()
