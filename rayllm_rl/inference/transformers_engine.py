"""A Transformers inference engine that batches concurrent `agenerate` calls, on CUDA or the CPU.

Requests arriving together are decoded as one left-padded batch with a KV cache: one forward
pass per decode step for the whole batch, finished rows pruned from the cache. Each output
token carries the sampled token's logprob and the engine version of the weights that
produced it. Weight updates are applied under a lock taken once per decode step, so a swap
lands between two decode steps and never inside one; after a swap the KV cache is rebuilt
with the new weights, so a token stamped version v was sampled from exactly policy v.

The engine runs on the GPU its process sees (Ray gives a replica its GPUs through
CUDA_VISIBLE_DEVICES), else on the CPU, with SDPA attention in the job's dtype. For the
colocated placement it can `sleep` (generation held, weights to pinned host memory or
dropped, GPU memory freed) while a learner trains on the same GPU, and `wake_up` after.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from typing import Any, Mapping

import torch

from rayllm_rl.inference.protocol import (
    LLMRequest, LLMResponse, PromptTooLongError, check_request, weights_checksum,
)
from rayllm_rl.inference.decoding import DecodeBatch, DecodeLock, EngineStats, RowSampler
from rayllm_rl.inference.transformers_job import DEVICES, TransformersOptions, pick_device
from rayllm_rl.inference.transformers_offload import SLEEP_TAGS, HostOffload
from rayllm_rl.weight_sync.registry import SyncSpec

__all__ = ["TransformersEngine", "TransformersOptions", "PromptTooLongError", "EngineStats", "SLEEP_TAGS", "DEVICES",
           "pick_device"]



class TransformersEngine(HostOffload):
    """Batched KV-cache decoding over any local HF causal LM (loaded with from_pretrained). What a job may
    ask of it is in `TransformersJobSide` (transformers_job.py), its sleep and wake-up in `HostOffload`
    (transformers_offload.py); serving and the weight updates are here."""

    def __init__(
        self,
        model_path: str,
        *,
        max_batch_size: int = 512,
        dtype: torch.dtype = torch.float32,
        seed: int = 0,
        version: int = 0,
        batch_wait_s: float = 0.0,
        model: torch.nn.Module | None = None,
        device: str | torch.device | None = "auto",
        lora=None,  # a LoRA policy's rayllm_rl.lora.LoraOptions: updates carry and swap the adapter alone
    ):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.model_path = model_path
        self.device = pick_device(device)
        """Where the model, its inputs and the sampling generator live (picked once)."""
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        if model is None:
            model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype, attn_implementation="sdpa")
        self.model = model.to(self.device)
        self.model.eval().requires_grad_(False)
        self.dtype = next(self.model.parameters()).dtype
        self.max_batch_size = max_batch_size
        self.batch_wait_s = batch_wait_s
        self.max_positions = int(getattr(self.model.config, "max_position_embeddings", 1 << 30))
        eos = self.model.generation_config.eos_token_id
        eos = [eos] if isinstance(eos, int) else list(eos or [])
        if self.tokenizer.eos_token_id is not None:
            eos.append(self.tokenizer.eos_token_id)
        self.eos_token_ids = frozenset(eos)
        self.pad_token_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else min(eos)
        self._generator = torch.Generator(device=self.device).manual_seed(seed)
        self._version = version
        self._weights_lock = DecodeLock()
        self._params = dict(self.model.named_parameters())  # what weight sync carries
        self._buffers = dict(self.model.named_buffers())
        if lora is not None and lora.enabled:  # adapter by PEFT name; base weights move with the buffers at sleep
            from rayllm_rl.lora import engine_tensors
            self._params, frozen = engine_tensors(self.model, lora, model_path)
            self._buffers.update(frozen)
        self._receiver = None  # this engine's end of the weight sync, once built
        self._borrowed: set[str] = set()  # parameters whose storage came from a transport
        # Holds on generation, changed under the decode lock and read by every decode step in it.
        self._paused = False
        self._asleep: frozenset[str] = frozenset()  # SLEEP_TAGS that `sleep` put down and are not back
        self._sleep_level = 0  # of the weights while "weights" is asleep
        self._stale: frozenset[str] = frozenset()  # parameters sleep(2) dropped and no update has refilled
        self._gate: asyncio.Event | None = None  # set while generation may run (the serving loop's)
        self._gate_loop: asyncio.AbstractEventLoop | None = None
        self._running: asyncio.Future | None = None  # the batch worker's decode thread, while it runs
        self._pending: list[tuple[LLMRequest, asyncio.Future]] = []
        self._wakeup: asyncio.Event | None = None
        self._worker: asyncio.Task | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.stats = EngineStats()

    # ---------------------------------------------------------------- versioning
    @property
    def version(self) -> int:
        return self._version

    def _check_writable(self, what: str) -> None:
        """A weight update needs the weights on the device (called under the decode lock)."""
        if "weights" in self._asleep:
            raise RuntimeError(f"{what}: the engine's weights are asleep (sleep(level={self._sleep_level})): call "
                               "wake_up(['weights']) before a weight sync (colocated order: sleep -> train -> "
                               "wake_up(['weights']) -> hand-over -> wake_up(['kv_cache']))")

    def load_weights_sync(self, named_tensors: Mapping[str, torch.Tensor], version: int | None = None) -> int:
        """`load_weights`, blocking (the local backend calls it from its own thread): copy new weights in
        between two decode steps (host tensors: one copy each, to the device and dtype); returns the version.

        A parameter whose storage a transport handed over (`swap_weights`, e.g. a read-only view
        of a shared-memory segment) is given fresh storage instead of being written in place."""
        targets = {**self._params, **self._buffers}
        unknown = [k for k in named_tensors if k not in targets]
        if unknown:
            raise KeyError(f"load_weights: unknown parameter names {unknown[:5]} (model has e.g. {list(self._params)[:3]})")
        with self._weights_lock.writer(), torch.no_grad():
            self._check_writable("load_weights")
            for name, tensor in named_tensors.items():
                dst = targets[name]
                if dst.shape != tensor.shape:
                    raise ValueError(f"load_weights: {name} has shape {tuple(tensor.shape)}, expected {tuple(dst.shape)}")
                if name in self._borrowed:
                    dst.data = tensor.detach().to(device=dst.device, dtype=dst.dtype, copy=True)
                    self._borrowed.discard(name)
                else:
                    dst.copy_(tensor)
            self._stale = self._stale.difference(named_tensors)
            self._version = self._version + 1 if version is None else int(version)
        return self._version

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
            if name not in self._params:
                raise KeyError(f"swap_weights: unknown parameter {name!r}")
            if t.shape != self._params[name].shape or t.dtype != self._params[name].dtype:
                raise ValueError(f"swap_weights: {name} is {tuple(t.shape)}/{t.dtype}, expected "
                                 f"{tuple(self._params[name].shape)}/{self._params[name].dtype}")
        self._check_writable("swap_weights")  # before allocating device memory (the learner may be training)
        staged = {name: torch.empty(t.shape, dtype=t.dtype, device=self.device).copy_(t, non_blocking=t.is_pinned())
                  for name, t in back.items() if t.device != self.device}
        if staged and self.device.type == "cuda":  # copies done before the pointers move (any stream may read)
            torch.cuda.current_stream(self.device).synchronize()
        with self._weights_lock.writer():  # waiting for the running decode step is not a stall: it is generating
            self._check_writable("swap_weights")
            t0 = time.perf_counter()
            for name, t in back.items():
                p = self._params[name]
                if name in staged:
                    p.data = staged[name]  # the previous device storage is freed
                else:
                    p.data, t.data = t.data, p.data
            self._borrowed.update(n for n in back if n not in staged)  # storage the transport owns: never write it
            self._borrowed.difference_update(staged)
            self._stale = self._stale.difference(back)
            self._version = int(version)
            return time.perf_counter() - t0

    def set_version(self, version: int) -> None:
        """Set the version without changing weights (e.g. after a checkpoint restore)."""
        with self._weights_lock.writer():
            self._version = int(version)

    def named_parameters(self) -> dict[str, torch.Tensor]:
        return dict(self._params)

    # ---------------------------------------------------------------- weight sink
    def weight_metadata(self) -> list[tuple[str, tuple[int, ...], str]]:
        return [(k, tuple(v.shape), str(v.dtype).removeprefix("torch.")) for k, v in self._params.items()]

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

    async def load_weights(self, named_tensors: Mapping[str, torch.Tensor], version: int) -> int:
        return await asyncio.to_thread(self.load_weights_sync, named_tensors, version)

    async def weights_checksum(self) -> float:
        """`protocol.weights_checksum` of the weights, in float64 on the CPU one tensor at a time (the
        same terms added in the same order: equal bit for bit to it over CPU copies of the weights)."""
        if self._stale:
            raise RuntimeError(f"weights_checksum: sleep(level=2) dropped the weights and no update has resent "
                               f"{len(self._stale)} of them (e.g. {sorted(self._stale)[:3]})")

        def total() -> float:
            return float(sum(weights_checksum({k: v.detach().cpu()}) for k, v in self._params.items()))

        return await asyncio.to_thread(total)

    async def close_update_group(self) -> None:
        receiver, self._receiver = self._receiver, None
        if receiver is not None:
            receiver.close()

    # ---------------------------------------------------------------- holding generation
    def _held(self) -> bool:
        return self._paused or bool(self._asleep)

    def _hold_gate(self) -> asyncio.Event:
        """The serving loop's event, set while generation may run (brought in line with the holds)."""
        loop = asyncio.get_running_loop()
        if self._gate is None or self._gate_loop is not loop:
            self._gate, self._gate_loop = asyncio.Event(), loop
        (self._gate.clear if self._held() else self._gate.set)()
        return self._gate

    def _open_gate_if_free(self) -> None:
        """After a hold is lifted: let the serving loop's waiting batches go on (from any thread or loop)."""
        gate, loop = self._gate, self._gate_loop
        if gate is None or self._held():
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
        with self._weights_lock.writer():  # the running decode step ends first, later ones see the hold
            self._paused = True

    async def pause(self) -> None:
        """Hold decoding after the running step (requests and their KV caches are kept) until `resume`."""
        if not self._paused:
            await asyncio.to_thread(self._pause)

    async def resume(self) -> None:
        if self._paused:
            self._paused = False
            self._open_gate_if_free()

    # ---------------------------------------------------------------- lifecycle
    async def start(self) -> "TransformersEngine":
        """Nothing to start: the model is loaded and the batching worker starts with the first request."""
        return self

    async def aclose(self) -> None:
        """Stop the batching worker (requests still queued fail with CancelledError); idempotent."""
        worker, self._worker = self._worker, None
        if worker is not None and not worker.done():
            worker.cancel()
            await asyncio.gather(worker, return_exceptions=True)
        for _, fut in self._pending:
            if not fut.done():
                fut.cancel()
        self._pending.clear()

    # ---------------------------------------------------------------- serving
    async def agenerate(self, request: LLMRequest) -> LLMResponse:
        """Queue a request; it joins the next batch decoded by the background worker (which waits
        while the engine is paused or asleep)."""
        self._check_request(request)
        loop = asyncio.get_running_loop()
        if self._worker is None or self._loop is not loop or self._worker.done():
            self._loop = loop
            self._wakeup = asyncio.Event()
            self._worker = loop.create_task(self._serve())
        fut = loop.create_future()
        self._pending.append((request, fut))
        self._wakeup.set()
        return await fut

    def _check_request(self, req: LLMRequest) -> None:
        check_request(req, self.max_positions)

    async def _serve(self) -> None:
        while True:
            await self._wakeup.wait()
            self._wakeup.clear()
            # Let callers scheduled in the same tick enqueue too, so they share the batch.
            for _ in range(4):
                await asyncio.sleep(0)
            if self.batch_wait_s > 0:
                await asyncio.sleep(self.batch_wait_s)
            while self._pending:
                await self._hold_gate().wait()  # paused or asleep: requests wait here
                batch = self._pending[: self.max_batch_size]
                del self._pending[: self.max_batch_size]
                live = [(r, f) for r, f in batch if not f.cancelled()]
                if live:
                    await self._serve_batch(live)

    async def _serve_batch(self, live: list[tuple[LLMRequest, asyncio.Future]]) -> None:
        """Decode one batch to the end, waiting out every pause or sleep that stops it on the way."""
        try:
            state = await asyncio.to_thread(self._start_batch, [r for r, _ in live])
            while True:
                self._running = asyncio.ensure_future(asyncio.to_thread(self._run_batch, state))
                if await self._running:
                    break
                await self._hold_gate().wait()
            results = self._finish_batch(state)
        except asyncio.CancelledError:
            for _, f in live:
                f.cancel()
            raise
        except Exception as exc:  # one bad batch fails its callers, not the engine
            for _, f in live:
                if not f.done():
                    f.set_exception(exc)
            return
        finally:
            self._running = None
        for (_, f), res in zip(live, results):
            if not f.done():
                f.set_result(res)

    def _on_device(self):
        """Factory calls (the sampler's tensors, its uniform draws) default to the engine's GPU."""
        return self.device if self.device.type == "cuda" else contextlib.nullcontext()

    def _start_batch(self, requests: list[LLMRequest]) -> DecodeBatch:
        """Left-pad `requests` into one batch on the device (nothing decoded yet)."""
        t0 = time.perf_counter()
        n = len(requests)
        for r in requests:
            self._check_request(r)
        lens = [len(r.input_ids) for r in requests]
        width = max(lens)
        ids = torch.full((n, width), self.pad_token_id, dtype=torch.long)
        attn = torch.zeros((n, width), dtype=torch.long)
        for i, r in enumerate(requests):
            ids[i, width - lens[i]:] = torch.tensor(r.input_ids, dtype=torch.long)
            attn[i, width - lens[i]:] = 1
        with self._on_device():
            sampler = RowSampler(
                [r.sampling.temperature for r in requests], [r.sampling.top_k for r in requests],
                [r.sampling.top_p for r in requests], [r.sampling.greedy for r in requests],
            )
        stops = [(frozenset() if r.sampling.ignore_eos else self.eos_token_ids) | frozenset(r.sampling.stop_token_ids)
                 for r in requests]
        return DecodeBatch(requests, sampler, stops, [r.sampling.max_new_tokens for r in requests],
                      attn.to(self.device), ids.to(self.device), t0, active=list(range(n)),
                      out_tok=[[] for _ in range(n)], out_lp=[[] for _ in range(n)], out_ver=[[] for _ in range(n)],
                      reason=["length"] * n)

    @torch.no_grad()
    def _run_batch(self, b: DecodeBatch) -> bool:
        """Decode `b` until every row ends (True) or the engine is paused or asleep (False: call again
        once it is not; asleep, the KV cache is dropped now and rebuilt from `b.full_ids` then)."""
        from transformers import DynamicCache

        while b.active:
            with self._weights_lock.decode_step():
                if self._held():
                    if self._asleep:
                        b.cache = None
                    return False
                if self._stale:
                    raise RuntimeError(f"generate: sleep(level=2) dropped the weights and no weight update has "
                                       f"resent {len(self._stale)} of them (e.g. {sorted(self._stale)[:3]})")
                version = self._version
                if b.cache is not None and b.cache_version != version:
                    # Weights changed since the KV cache was built: re-prefill the whole sequence
                    # so every later token is sampled from exactly policy `version` (AReaL-style).
                    b.cache = None
                    self.stats.cache_rebuilds += 1
                if b.cache is None:
                    b.step_ids, b.step_pos = b.full_ids, (b.attn.cumsum(-1) - 1).clamp_(min=0)
                    b.cache, b.cache_version = DynamicCache(config=self.model.config), version
                logits = self.model(
                    input_ids=b.step_ids, attention_mask=b.attn, position_ids=b.step_pos,
                    past_key_values=b.cache, use_cache=True, logits_to_keep=1,
                ).logits[:, -1, :]
                with self._on_device():
                    tokens, logps = b.sampler(logits, self._generator)
            self.stats.decode_steps += 1
            tok_list, lp_list = tokens.tolist(), logps.tolist()
            keep = []
            for j, row in enumerate(b.active):
                t = tok_list[j]
                b.out_tok[row].append(t)
                b.out_lp[row].append(lp_list[j])
                b.out_ver[row].append(version)
                if t in b.stops[row]:
                    b.reason[row] = "stop"
                elif len(b.out_tok[row]) < b.budget[row]:
                    keep.append(j)
            if len(keep) < len(b.active):
                if not keep:
                    b.active = []
                    break
                idx = torch.tensor(keep, dtype=torch.long, device=self.device)
                b.cache.batch_select_indices(idx)
                b.attn, tokens = b.attn[idx], tokens[idx]
                with self._on_device():
                    b.sampler = b.sampler.select(idx)
                b.step_pos, b.full_ids = b.step_pos[idx], b.full_ids[idx]
                b.active = [b.active[j] for j in keep]
            b.attn = torch.cat([b.attn, b.attn.new_ones((len(b.active), 1))], dim=-1)
            b.step_pos = b.step_pos[:, -1:] + 1
            b.step_ids = tokens.unsqueeze(-1)
            b.full_ids = torch.cat([b.full_ids, b.step_ids], dim=-1)
        b.cache = None
        return True

    def _finish_batch(self, b: DecodeBatch) -> list[LLMResponse]:
        elapsed = time.perf_counter() - b.t0
        self.stats.requests += len(b.requests)
        self.stats.batches += 1
        self.stats.generated_tokens += sum(len(t) for t in b.out_tok)
        self.stats.busy_seconds += elapsed
        return [
            LLMResponse(
                input_tokens=list(r.input_ids), output_tokens=b.out_tok[i], output_logprobs=b.out_lp[i],
                output_versions=b.out_ver[i], stop_reason=b.reason[i], rid=r.rid, latency_s=elapsed,
            )
            for i, r in enumerate(b.requests)
        ]

    def generate_batch(self, requests: list[LLMRequest]) -> list[LLMResponse]:
        """Decode a list of requests together (synchronous; also usable without asyncio). A pause or
        sleep that stops it raises (only `agenerate`'s requests wait for `resume`/`wake_up`)."""
        state = self._start_batch(requests)
        if not self._run_batch(state):
            raise RuntimeError(f"generate_batch: the engine is {'asleep' if self._asleep else 'paused'}: "
                               f"{'wake_up()' if self._asleep else 'resume()'} first, or use agenerate, which waits")
        return self._finish_batch(state)

    def generate(self, requests: list[LLMRequest]) -> list[LLMResponse]:
        """Synchronous convenience wrapper, chunked by max_batch_size."""
        out: list[LLMResponse] = []
        for i in range(0, len(requests), self.max_batch_size):
            out += self.generate_batch(requests[i:i + self.max_batch_size])
        return out

    def info(self) -> dict[str, Any]:
        return {"model_path": self.model_path, "version": self._version, "device": str(self.device),
                "dtype": str(self.dtype).removeprefix("torch."), "asleep": sorted(self._asleep),
                **dataclasses.asdict(self.stats)}
