"""The Transformers engine's weight sink: the model's tensors, the version they are, and every way they change.

Updates land under the decode lock (`lock`), so they fall between two decode steps: a double-buffered
swap (`swap_weights`, O(1) per tensor), a copy (`load_weights`), or, for the colocated placement, a move to
pinned host memory and back (`offload` / `restore`, which the engine's turns call while holding the lock).
Transports are handed this object (`named_parameters`, `swap_weights`), never the engine.
"""
from __future__ import annotations

import asyncio
import time
from typing import Any, Mapping

import torch

from rayllm_rl.inference.decoding import DecodeLock
from rayllm_rl.inference.protocol import weights_checksum
from rayllm_rl.weight_sync.registry import SyncSpec


class TransformersWeights:
    """`WeightSink` of a `TransformersEngine` over `model`'s parameters on `device` (a LoRA policy: the
    adapter's, by PEFT name; the frozen base weights then move with the buffers at sleep)."""

    def __init__(self, model: torch.nn.Module, device: torch.device, version: int = 0, lora=None,
                 model_path: str = ""):
        self.device = device
        self.lock = DecodeLock()
        """Taken by every decode step, and as a writer by every change to the weights or the holds."""
        self.version = int(version)
        """Policy version of the weights (changed only under `lock`)."""
        self.params = dict(model.named_parameters())  # what weight sync carries
        self.buffers = dict(model.named_buffers())
        if lora is not None and lora.enabled:
            from rayllm_rl.lora import engine_tensors
            self.params, frozen = engine_tensors(model, lora, model_path)
            self.buffers.update(frozen)
        self.offload_level = 0
        """0: the weights are on the device; 1: in pinned host memory; 2: dropped (`offload`)."""
        self.stale: frozenset[str] = frozenset()
        """Parameters `offload(2)` dropped and no update has refilled: generating or a checksum is an error."""
        self._borrowed: set[str] = set()  # parameters whose storage came from a transport: never written in place
        self._receiver = None  # this engine's end of the weight sync, once built

    def _check_writable(self, what: str) -> None:
        """A weight update needs the weights on the device (called under the lock)."""
        if self.offload_level:
            raise RuntimeError(f"{what}: the engine's weights are asleep (sleep(level={self.offload_level})): "
                               "call turns.wake_up(['weights']) before a weight sync (colocated order: sleep -> train "
                               "-> wake_up(['weights']) -> hand-over -> wake_up(['kv_cache']))")

    # ---------------------------------------------------------------- direct updates
    def load_weights_sync(self, named_tensors: Mapping[str, torch.Tensor], version: int | None = None) -> int:
        """`load_weights`, blocking (the local backend calls it from its own thread): copy new weights in
        between two decode steps (host tensors: one copy each, to the device and dtype); returns the version.

        A parameter whose storage a transport handed over (`swap_weights`, e.g. a read-only view
        of a shared-memory segment) is given fresh storage instead of being written in place."""
        targets = {**self.params, **self.buffers}
        unknown = [k for k in named_tensors if k not in targets]
        if unknown:
            raise KeyError(f"load_weights: unknown parameter names {unknown[:5]} "
                           f"(model has e.g. {list(self.params)[:3]})")
        with self.lock.writer(), torch.no_grad():
            self._check_writable("load_weights")
            for name, tensor in named_tensors.items():
                dst = targets[name]
                if dst.shape != tensor.shape:
                    raise ValueError(f"load_weights: {name} has shape {tuple(tensor.shape)}, "
                                     f"expected {tuple(dst.shape)}")
                if name in self._borrowed:
                    dst.data = tensor.detach().to(device=dst.device, dtype=dst.dtype, copy=True)
                    self._borrowed.discard(name)
                else:
                    dst.copy_(tensor)
            self.stale = self.stale.difference(named_tensors)
            self.version = self.version + 1 if version is None else int(version)
        return self.version

    async def load_weights(self, named_tensors: Mapping[str, torch.Tensor], version: int) -> int:
        return await asyncio.to_thread(self.load_weights_sync, named_tensors, version)

    def swap_weights(self, back: dict[str, torch.Tensor], version: int) -> float:
        """Double-buffer swap: exchange storage with `back` between two decode steps.

        Tensors on the engine's device: O(1) per tensor (no copy), so generation stalls only for the
        swap, and `back` then holds the previous weights and can receive the next update. Tensors
        elsewhere (a CUDA engine handed host tensors, e.g. the object store's read-only views) are
        first copied once each to fresh device storage while decoding goes on, and that is swapped in;
        `back` keeps its own storage then. Returns the stall in seconds: the time the swap holds the
        decode lock (generation cannot run then).
        """
        for name, t in back.items():
            if name not in self.params:
                raise KeyError(f"swap_weights: unknown parameter {name!r}")
            if t.shape != self.params[name].shape or t.dtype != self.params[name].dtype:
                raise ValueError(f"swap_weights: {name} is {tuple(t.shape)}/{t.dtype}, expected "
                                 f"{tuple(self.params[name].shape)}/{self.params[name].dtype}")
        self._check_writable("swap_weights")  # before allocating device memory (the learner may be training)
        staged = {name: torch.empty(t.shape, dtype=t.dtype, device=self.device).copy_(t, non_blocking=t.is_pinned())
                  for name, t in back.items() if t.device != self.device}
        if staged and self.device.type == "cuda":  # copies done before the pointers move (any stream may read)
            torch.cuda.current_stream(self.device).synchronize()
        with self.lock.writer():  # waiting for the running decode step is not a stall: it is generating
            self._check_writable("swap_weights")
            t0 = time.perf_counter()
            for name, t in back.items():
                p = self.params[name]
                if name in staged:
                    p.data = staged[name]  # the previous device storage is freed
                else:
                    p.data, t.data = t.data, p.data
            self._borrowed.update(n for n in back if n not in staged)  # storage the transport owns: never write it
            self._borrowed.difference_update(staged)
            self.stale = self.stale.difference(back)
            self.version = int(version)
            return time.perf_counter() - t0

    def set_version(self, version: int) -> None:
        """Set the version without changing weights (e.g. after a checkpoint restore)."""
        with self.lock.writer():
            self.version = int(version)

    def named_parameters(self) -> dict[str, torch.Tensor]:
        """What a weight update carries, by HF (or PEFT) name: the engine's own tensors."""
        return dict(self.params)

    def borrowed(self) -> frozenset[str]:
        """Parameters whose storage a transport owns now (a swap handed it over; a load gives them their own)."""
        return frozenset(self._borrowed)

    # ---------------------------------------------------------------- the double-buffered sync
    def weight_metadata(self) -> list[tuple[str, tuple[int, ...], str]]:
        return [(k, tuple(v.shape), str(v.dtype).removeprefix("torch.")) for k, v in self.params.items()]

    def receiving_processes(self, transport: str) -> int:
        """This engine receives in its own process: one rank whatever the transport."""
        return 1

    async def init_update_group(self, spec: SyncSpec) -> None:
        """Build this engine's end of the weight sync (the registry picks how bytes arrive)."""
        from rayllm_rl.weight_sync.registry import build_receiver

        mine = {m[0]: m for m in self.weight_metadata()}
        for name, shape, _ in spec.metas:
            if name not in mine or tuple(mine[name][1]) != tuple(shape):
                raise KeyError(f"init_update_group: the learner sends {name} {tuple(shape)}, this engine has "
                               f"{mine.get(name, 'no such weight')}")
        await self.close_update_group()
        self._receiver = await asyncio.to_thread(build_receiver, spec, self)

    async def receive_weights(self, handoff: Any = None) -> dict[str, float]:
        """Receive into the back buffer in a thread while decoding goes on, then swap in O(1).
        `handoff`: what the sender published (the object store's references), if the transport pulls."""
        if self._receiver is None:
            raise RuntimeError("receive_weights: init_update_group was not called on this engine")
        out = await asyncio.to_thread(self._receiver.receive_and_swap, handoff)
        return {"version": out["version"], "receive_s": out["receive_s"], "stall_s": out["stall_s"]}

    async def weights_checksum(self) -> float:
        """`protocol.weights_checksum` of the weights, in float64 on the CPU one tensor at a time (the
        same terms added in the same order: equal bit for bit to it over CPU copies of the weights)."""
        if self.stale:
            raise RuntimeError(f"weights_checksum: sleep(level=2) dropped the weights and no update has resent "
                               f"{len(self.stale)} of them (e.g. {sorted(self.stale)[:3]})")

        def total() -> float:
            return float(sum(weights_checksum({k: v.detach().cpu()}) for k, v in self.params.items()))

        return await asyncio.to_thread(total)

    async def close_update_group(self) -> None:
        receiver, self._receiver = self._receiver, None
        if receiver is not None:
            receiver.close()

    # ---------------------------------------------------------------- colocated: off the device and back
    def offload(self, level: int) -> None:
        """Under `lock`: level 1 moves the weights to pinned host memory, level 2 drops them (one-element
        placeholders keep each shape and dtype; the next update refills them). Buffers go to host memory at
        both levels. On the CPU nothing moves; level 2 still marks the weights as to be resent. A deeper
        level over a shallower one drops them; the same or a shallower one does nothing."""
        if self.offload_level and level <= self.offload_level:
            return
        if self.device.type == "cuda":
            if not self.offload_level:
                self._to_host(self.buffers if level == 2 else {**self.params, **self.buffers})
            if level == 2:
                for p in self.params.values():
                    p.data = torch.empty((), dtype=p.dtype).expand(p.shape)
            self._borrowed.clear()  # no parameter holds transport storage now
        if level == 2:
            self.stale = frozenset(self.params)
        self.offload_level = level

    def _to_host(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Move `tensors` (device parameters or buffers) to pinned host memory, in place."""
        host = {k: torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t.data, non_blocking=True)
                for k, t in tensors.items()}
        torch.cuda.synchronize(self.device)
        for k, t in tensors.items():
            t.data = host[k]

    def restore(self) -> None:
        """Under `lock`: the weights back on the device (level 1's host copies, or level 2's empty storage of
        the right shapes for the weight sync to fill). Idempotent."""
        if not self.offload_level:
            return
        if self.device.type == "cuda":
            targets = {k: t for k, t in {**self.params, **self.buffers}.items() if t.device != self.device}
            moved = {k: torch.empty(t.shape, dtype=t.dtype, device=self.device) for k, t in targets.items()}
            for k, t in targets.items():
                if k not in self.stale:  # level 2's placeholders: empty storage for the weight sync
                    moved[k].copy_(t, non_blocking=True)
            torch.cuda.synchronize(self.device)
            for k, t in targets.items():
                t.data = moved[k]
        self.offload_level = 0
