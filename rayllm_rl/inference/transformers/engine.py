"""A Transformers inference engine that batches concurrent `agenerate` calls, on CUDA or the CPU.

Requests arriving together are decoded as one left-padded batch with a KV cache: one forward
pass per decode step for the whole batch, finished rows pruned from the cache. Each output
token carries the sampled token's logprob and the engine version of the weights that
produced it. Weight updates are applied under a lock taken once per decode step, so a swap
lands between two decode steps and never inside one; after a swap the KV cache is rebuilt
with the new weights, so a token stamped version v was sampled from exactly policy v.

The engine runs on the GPU its process sees (Ray gives a replica its GPUs through
CUDA_VISIBLE_DEVICES), else on the CPU, with SDPA attention in the job's dtype. For the
colocated placement its turns can `sleep` (generation held, weights to pinned host memory or
dropped, GPU memory freed) while a learner trains on the same GPU, and `wake_up` after.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from typing import Any

import torch

from rayllm_rl.inference.protocol import LLMRequest, LLMResponse, PromptTooLongError, check_request
from rayllm_rl.inference.decoding import DecodeBatch, EngineStats, RowSampler
from rayllm_rl.inference.transformers.job import DEVICES, TransformersOptions, pick_device
from rayllm_rl.inference.transformers.turns import SLEEP_TAGS, TransformersTurns
from rayllm_rl.inference.transformers.weights import TransformersWeights

__all__ = ["TransformersEngine", "TransformersOptions", "PromptTooLongError", "EngineStats", "SLEEP_TAGS", "DEVICES",
           "pick_device", "TransformersWeights", "TransformersTurns"]



class TransformersEngine:
    """Batched KV-cache decoding over any local HF causal LM (loaded with from_pretrained). It holds its parts:
    `weights`, the weight sink (transformers/weights.py), and `turns`, its pause and sleep
    (transformers/turns.py); serving is here. What a job may ask of it is `TransformersJobSide`
    (transformers/job.py)."""

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
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        """Every sampled token's random draws (seeded: the same requests in the same batches sample alike)."""
        self.stats = EngineStats()
        self.weights = TransformersWeights(self.model, self.device, version, lora, model_path)
        """The weight sink: what transports write, its version, and its lock taken by every decode step."""
        self.turns = TransformersTurns(self.weights, self.stats, lambda: self._running)
        """Pause and sleep: the holds the decode loop reads once per step."""
        self._running: asyncio.Future | None = None  # the batch worker's decode thread, while it runs
        self._pending: list[tuple[LLMRequest, asyncio.Future]] = []
        self._wakeup: asyncio.Event | None = None
        self._worker: asyncio.Task | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def version(self) -> int:
        """Policy version of the weights that generate the next token (the weight sink's)."""
        return self.weights.version

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
                await self.turns.gate().wait()  # paused or asleep: requests wait here
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
                await self.turns.gate().wait()
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
            with self.weights.lock.decode_step():
                if self.turns.held():
                    if self.turns.sleeping:
                        b.cache = None
                    return False
                stale = self.weights.stale
                if stale:
                    raise RuntimeError(f"generate: sleep(level=2) dropped the weights and no weight update has "
                                       f"resent {len(stale)} of them (e.g. {sorted(stale)[:3]})")
                version = self.weights.version
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
                    tokens, logps = b.sampler(logits, self.generator)
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
            asleep = self.turns.sleeping
            raise RuntimeError(f"generate_batch: the engine is {'asleep' if asleep else 'paused'}: "
                               f"{'turns.wake_up()' if asleep else 'turns.resume()'} first, "
                               "or use agenerate, which waits")
        return self._finish_batch(state)

    def generate(self, requests: list[LLMRequest]) -> list[LLMResponse]:
        """Synchronous convenience wrapper, chunked by max_batch_size."""
        out: list[LLMResponse] = []
        for i in range(0, len(requests), self.max_batch_size):
            out += self.generate_batch(requests[i:i + self.max_batch_size])
        return out

    def info(self) -> dict[str, Any]:
        return {"model_path": self.model_path, "version": self.weights.version, "device": str(self.device),
                "dtype": str(self.dtype).removeprefix("torch."), "asleep": sorted(self.turns.asleep),
                **dataclasses.asdict(self.stats)}
