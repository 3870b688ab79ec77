"""The Transformers engine's sleep and wake-up, for the colocated placement: generation held, weights to
pinned host memory (or dropped), GPU memory freed while a learner trains on the same GPU; mixed into
`TransformersEngine`, whose state (`_params`, `_buffers`, `_weights_lock`, `_asleep`, ...) it moves."""
from __future__ import annotations

import asyncio
import time
from typing import Mapping, Sequence

import torch

SLEEP_TAGS = ("weights", "kv_cache")
"""What `sleep` puts down and `wake_up(tags)` brings back; the engine generates once both are up."""


class HostOffload:
    """`sleep` / `wake_up` of the Transformers engine (see `TransformersEngine`)."""

    @property
    def sleeping(self) -> bool:
        """Whether `sleep` put anything down that `wake_up` has not brought back (no generation then)."""
        return bool(self._asleep)

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
        await asyncio.to_thread(self._sleep_weights, int(level))
        run = self._running
        if run is not None and not run.done() and run.get_loop() is asyncio.get_running_loop():
            await asyncio.wait([run])  # the batch in flight stops at its next step and drops its KV cache
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        self.stats.sleeps += 1
        self.stats.last_sleep_s = time.perf_counter() - t0

    def _sleep_weights(self, level: int) -> None:
        with self._weights_lock.writer(), torch.no_grad():
            asleep_before = "weights" in self._asleep
            self._asleep = frozenset(SLEEP_TAGS)
            if asleep_before and level <= self._sleep_level:
                return
            if self.device.type == "cuda":
                if not asleep_before:
                    self._to_host(self._buffers if level == 2 else {**self._params, **self._buffers})
                if level == 2:  # one-element placeholders keep each parameter's shape and dtype
                    for p in self._params.values():
                        p.data = torch.empty((), dtype=p.dtype).expand(p.shape)
                self._borrowed.clear()  # no parameter holds transport storage now
            if level == 2:
                self._stale = frozenset(self._params)
            self._sleep_level = level

    def _to_host(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Move `tensors` (device parameters or buffers) to pinned host memory, in place."""
        host = {k: torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t.data, non_blocking=True)
                for k, t in tensors.items()}
        torch.cuda.synchronize(self.device)
        for k, t in tensors.items():
            t.data = host[k]

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
        if "weights" in want and "weights" in self._asleep:
            t0 = time.perf_counter()
            await asyncio.to_thread(self._wake_weights)
            self.stats.last_wake_s = time.perf_counter() - t0
        self._asleep = self._asleep.difference(want)
        self._open_gate_if_free()

    def _wake_weights(self) -> None:
        with self._weights_lock.writer(), torch.no_grad():
            if "weights" not in self._asleep:
                return
            if self.device.type == "cuda":
                targets = {k: t for k, t in {**self._params, **self._buffers}.items() if t.device != self.device}
                moved = {k: torch.empty(t.shape, dtype=t.dtype, device=self.device) for k, t in targets.items()}
                for k, t in targets.items():
                    if k not in self._stale:  # sleep(2)'s placeholders: empty storage for the weight sync
                        moved[k].copy_(t, non_blocking=True)
                torch.cuda.synchronize(self.device)
                for k, t in targets.items():
                    t.data = moved[k]
            self._asleep = self._asleep.difference({"weights"})
            self._sleep_level = 0
