"""The vLLM engine's weight sink: how a version reaches vLLM's worker and becomes the served weights.

Weights live in vLLM's worker process; this part drives the backend in :mod:`rayllm_rl.inference.vllm.worker`
through vLLM's weight-transfer API and `collective_rpc`. The receive overlaps generation (on CPU so does
the load, into a shadow copy of the model: vllm/shadow.py); the stall is the paused update (a swap on CPU,
`load_weights` on GPUs) up to the resume, with running requests kept and re-prefilled under the new weights.

LoRA policies: vLLM serves the base model with one LoRA slot; the adapter arrives through the same weight
sync, is written in PEFT format and loaded in place in the same pause (`vllm/lora.py`).
"""
from __future__ import annotations

import asyncio
import os
import time
from typing import TYPE_CHECKING, Any, Mapping

import torch

from rayllm_rl.inference.protocol import weights_checksum
from rayllm_rl.weight_sync.registry import SyncSpec

if TYPE_CHECKING:
    from rayllm_rl.inference.vllm.engine import VLLMEngine


class VLLMWeights:
    """`WeightSink` of a `VLLMEngine` (`engine`: whose AsyncLLM it updates, started on demand). Owns the
    version the engine serves, its receiving end and staging segment, and a LoRA policy's adapter files."""

    def __init__(self, engine: "VLLMEngine", version: int = 0):
        self.engine = engine
        self.version = int(version)
        """Policy version of the weights vLLM serves (set at the end of each update's pause)."""
        self.last_stall_parts: dict[str, float] = {}
        """The last update's stall in parts: `stall_pause_s`, `stall_load_s`, `stall_finish_s` (re-processing)."""
        self.lora_request = None
        """A LoRA policy: what every request carries (the current version's adapter directory); else None."""
        self.adapters = None
        """A LoRA policy: `vllm.lora.AdapterDirWriter`, the adapter versions on disk (from `on_start`)."""
        self._sync_timeout_s: float | None = None  # set when the update group is joined
        self._receiver = self._staging = None  # this actor's receiving end and staging segment, if any
        self._pulls = False  # the transport's receivers are handed what the sender published

    async def on_start(self) -> None:
        """Once vLLM runs: label its weights with the version (a LoRA policy: load an all-zero adapter first,
        the base model's output until the first update)."""
        e = self.engine
        if e.lora is not None:
            from rayllm_rl.inference.vllm.lora import AdapterDirWriter

            self.adapters = AdapterDirWriter(e.model_path, e.lora, e.dtype)
            await self._load_adapter(self.adapters.zeros(self.version))
        await e.llm.update_weight_version(str(self.version))

    def close_adapters(self) -> None:
        """Remove a LoRA policy's adapter directories (the engine is stopping)."""
        if self.adapters is not None:
            self.adapters.close()

    def weight_metadata(self) -> list[tuple[str, tuple[int, ...], str]]:
        """HF names and shapes from the checkpoint's safetensors headers, in the engine's dtype (a LoRA
        policy: the adapter's PEFT names and shapes)."""
        from safetensors import safe_open

        e = self.engine
        if e.lora is not None:
            from rayllm_rl.lora import adapter_metas

            return adapter_metas(e.model_path, e.lora, e.dtype)
        files = sorted(f for f in os.listdir(e.model_path) if f.endswith(".safetensors"))
        if not files:
            raise FileNotFoundError(f"no .safetensors weights in {e.model_path}")
        out = []
        for f in files:
            with safe_open(os.path.join(e.model_path, f), framework="pt") as st:
                for name in st.keys():
                    out.append((name, tuple(st.get_slice(name).get_shape()), e.dtype))
        return out

    def receiving_processes(self, transport: str) -> int:
        """Ranks this replica takes: one per worker (tensor parallelism) where the workers receive
        themselves, one where this actor receives for them."""
        from rayllm_rl.weight_sync.registry import transport_info

        if self.engine.lora is not None:  # this actor receives the adapter and writes it for vLLM to load
            return 1
        return 1 if transport_info(transport).receiver_needs_ray else self.engine.tensor_parallel_size

    async def init_update_group(self, spec: SyncSpec) -> None:
        """Where the transport's receiver can run in vLLM's worker, every worker builds its own end
        (rank: the replica's first rank plus its tensor-parallel rank) and, for a pull transport (CUDA
        IPC), is handed the sender's plain-data handoff through `collective_rpc`; where it needs Ray
        (the object store), this actor receives and stages the bytes for the workers (staging.py)."""
        mine = {m[0]: tuple(m[1]) for m in self.weight_metadata()}
        bad = [(n, tuple(s), mine.get(n)) for n, s, _ in spec.metas if mine.get(n) != tuple(s)]
        if bad:
            raise KeyError(f"init_update_group: the learner sends weights this model does not have or with other "
                           f"shapes (name, sent, checkpoint): {bad[:5]}")
        from vllm.distributed.weight_transfer.base import WeightTransferInitRequest

        from rayllm_rl.weight_sync.buckets import metas_from_spec, metas_to_spec
        from rayllm_rl.weight_sync.registry import build_receiver

        e = self.engine
        await e.start()
        await self.close_update_group()
        self._sync_timeout_s = spec.timeout_s
        self._pulls = spec.info.pulls
        if e.lora is not None:  # the adapter: received here over any transport, written to disk (vllm/lora.py)
            self._receiver = await asyncio.to_thread(build_receiver, spec, self.adapters)
            return
        if spec.info.receiver_needs_ray:
            from rayllm_rl.inference.vllm.staging import StagingWriter

            # The worker loads in the engine's dtype: stage in that dtype (the receiver converts).
            metas = metas_from_spec([(n, s, e.dtype) for n, s, _ in spec.metas])
            self._staging = StagingWriter(metas)
            self._receiver = build_receiver(spec, self._staging)
            info = {"staging": {"segment": self._staging.name, "metas": [list(m) for m in metas_to_spec(metas)],
                                "timeout_s": spec.timeout_s}}
        else:
            info = {"spec": spec.as_dict()}
        # The shadow's swap moves parameters to other storage: only where nothing compiled holds them.
        info["double_buffer"] = bool(e.options.double_buffer_weights) and e.eager
        await asyncio.wait_for(e.llm.init_weight_transfer_engine(WeightTransferInitRequest(init_info=info)),
                               spec.timeout_s + 30)

    async def receive_weights(self, handoff: Any = None, header_timeout_s: float | None = None) -> dict[str, float]:
        """Bytes arrive while decoding goes on (on vLLM's worker thread, or fetched and staged by
        this actor); then a short paused load. What the workers' ends get: the staged version where
        this actor received, else the sender's `handoff` itself (plain data for a pull transport whose
        receiver runs in the worker, e.g. CUDA IPC handles; None where the bytes travel in a group)."""
        timeout = self._sync_timeout_s
        if timeout is None:
            raise RuntimeError("receive_weights: init_update_group was not called on this engine")
        t0 = time.perf_counter()
        if self.engine.lora is not None:
            return await self._receive_adapter(handoff, t0)
        for_workers = handoff if self._pulls else None
        if self._receiver is not None:  # fetch here, then stage for the worker (vLLM keeps generating)
            for_workers = await asyncio.to_thread(self._receiver.receive, handoff)
            await asyncio.to_thread(self._receiver.swap, for_workers)
        await self.rpc("rayllm_begin_receive", header_timeout_s or timeout, for_workers)
        deadline = time.monotonic() + (header_timeout_s or timeout) + timeout
        while True:  # a short RPC between engine steps, not a wait inside one
            state = await self.rpc("rayllm_receive_state")
            if state["done"]:
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"vLLM replica: the weight receive did not finish within {timeout:g}s")
            await asyncio.sleep(0.005)
        if state["error"]:
            raise RuntimeError(f"vLLM replica: receiving weights failed: {state['error']}")
        version = int(state["version"])
        receive_s = self.engine.stats["last_receive_s"] = time.perf_counter() - t0
        if state.get("shadow_loaded"):  # loaded and processed in the worker's shadow model: only a swap is left
            stall = await self.apply(version, lambda: self.rpc("rayllm_swap_shadow", version), reload=False)
        else:
            stall = await self.apply(version, lambda: self.update_request(version))
        return {"version": version, "receive_s": receive_s, "stall_s": stall, **self.last_stall_parts}

    async def update_request(self, version: int) -> None:
        """vLLM's weight-transfer update: its workers load what their ends received as `version`."""
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

        await self.engine.llm.update_weights(WeightTransferUpdateRequest(update_info={"version": version}))

    async def apply(self, version: int, load, reload: bool = True) -> float:
        """pause(keep, clear KV) → load → finish(version) → resume; returns the stall in seconds: from the
        pause taking effect to the resume. The pause itself (`stall_pause_s`, reported apart) mostly waits
        for the running engine step to end, which keeps generating, as the Transformers engine's decode lock
        does; idle it takes about a millisecond. `reload`: vLLM's update lifecycle around `load` (for a
        LoRA adapter, only its version)."""
        llm, stats = self.engine.llm, self.engine.stats
        t0 = time.perf_counter()
        # The engine core's pause, not `AsyncLLM.pause_generation`: that adds a fixed 20 ms sleep
        # (for the order of in-flight outputs, "not required for correctness") and clears the
        # multimodal cache, which a text-only policy does not have. The sleep was ~20% of the stall.
        await llm.engine_core.pause_scheduler_async(mode="keep", clear_cache=True)
        paused = time.perf_counter()
        parts = {"stall_pause_s": paused - t0}
        try:
            t = time.perf_counter()
            if reload:
                await llm.start_weight_update()
            await load()
            parts["stall_load_s"] = time.perf_counter() - t
            t = time.perf_counter()
            if reload:
                await llm.finish_weight_update(weight_version=str(version))  # re-process (CPU: repack)
            else:
                await llm.update_weight_version(str(version))
            parts["stall_finish_s"] = time.perf_counter() - t
            self.version = int(version)
        finally:
            if not self.engine.turns.sleeping:  # asleep (colocated hand-over): wake_up resumes with the KV cache
                await llm.resume_generation()
        stall = time.perf_counter() - paused
        stats["updates"] += 1
        stats["last_stall_s"] = stall
        self.last_stall_parts = parts
        return stall

    async def load_weights(self, named_tensors: Mapping[str, torch.Tensor], version: int) -> int:
        """Direct load (no group): tensors cross into vLLM's worker by collective_rpc pickling."""
        from safetensors.torch import save

        await self.engine.start()
        if self.engine.lora is not None:
            directory = await asyncio.to_thread(self.adapters.write, named_tensors, int(version))
            await self.apply(int(version), lambda: self._load_adapter(directory), reload=False)
            return self.version
        blob = save({k: v.detach().cpu().contiguous() for k, v in named_tensors.items()})

        async def load():
            await self.rpc("rayllm_load_named", blob)

        await self.apply(int(version), load)
        return self.version

    async def weights_checksum(self) -> float:
        """Checksum of the weights vLLM last loaded (the checkpoint's until the first update)."""
        e = self.engine
        await e.start()
        if e.lora is not None:
            return float(self.adapters.checksum)
        loaded = await self.rpc("rayllm_loaded_checksum")
        if loaded is not None:
            return float(loaded)
        from safetensors.torch import load_file

        dtype = getattr(torch, e.dtype)
        named = {}
        for f in sorted(f for f in os.listdir(e.model_path) if f.endswith(".safetensors")):
            named.update({k: v.to(dtype) for k, v in load_file(os.path.join(e.model_path, f)).items()})
        return weights_checksum(named)

    async def close_update_group(self) -> None:
        """Leave the group: vLLM's workers drop their ends (bounded by ray.sync_timeout_s), then this actor's
        receiving end and staging segment go whatever the workers did."""
        receiver, staging, self._receiver, self._staging = self._receiver, self._staging, None, None
        try:
            if self.engine.llm is not None:
                await asyncio.wait_for(self.engine.llm.shutdown_weight_transfer_engine(), self._sync_timeout_s or 120.0)
        finally:
            if receiver is not None:
                receiver.close()
            if staging is not None:
                staging.close()

    async def _load_adapter(self, directory: str) -> None:
        """Load the adapter in `directory` into the policy's slot (in place) and make later requests carry it."""
        from rayllm_rl.inference.vllm.lora import lora_request

        timeout = self._sync_timeout_s or 120.0
        if not await asyncio.wait_for(self.engine.llm.add_lora(lora_request(directory, in_place=True)), timeout):
            raise RuntimeError(f"vLLM did not load the LoRA adapter in {directory}")
        self.lora_request = lora_request(directory)
        self.adapters.prune()

    async def _receive_adapter(self, handoff: Any, t0: float) -> dict[str, float]:
        """Receive the adapter here and write it (vLLM generates meanwhile), then load it in the update pause."""
        version = await asyncio.to_thread(self._receiver.receive, handoff)
        await asyncio.to_thread(self._receiver.swap, version)  # AdapterDirWriter: one PEFT directory per version
        receive_s = self.engine.stats["last_receive_s"] = time.perf_counter() - t0
        _, directory = self.adapters.latest()
        stall = await self.apply(int(version), lambda: self._load_adapter(directory), reload=False)
        return {"version": int(version), "receive_s": receive_s, "stall_s": stall, **self.last_stall_parts}

    async def rpc(self, method: str, *args):
        """`method` of our worker extension (vllm/worker.py) on vLLM's workers; the first worker's result."""
        results = await self.engine.llm.collective_rpc(method, timeout=self._sync_timeout_s or 120.0, args=args)
        return results[0]
