"""A Transformers inference engine that batches concurrent `agenerate` calls.

Requests arriving together are decoded as one left-padded batch with a KV cache: one forward
pass per decode step for the whole batch, finished rows pruned from the cache. Each output
token carries the sampled token's logprob and the engine version of the weights that
produced it. Weight updates are applied under a lock taken once per decode step, so a swap
lands between two decode steps and never inside one; after a swap the KV cache is rebuilt
with the new weights, so a token stamped version v was sampled from exactly policy v.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time
from contextlib import contextmanager
from typing import Any, Iterator, Mapping

import torch

from rayllm_rl.inference.protocol import (
    LLMRequest, LLMResponse, PromptTooLongError, check_request, weights_checksum,
)
from rayllm_rl.inference.sampling import RowSampler
from rayllm_rl.weight_sync.registry import SyncSpec

log = logging.getLogger(__name__)

__all__ = ["TransformersEngine", "PromptTooLongError", "EngineStats"]

@dataclasses.dataclass
class EngineStats:
    """Counters for throughput reporting."""

    requests: int = 0
    batches: int = 0
    generated_tokens: int = 0
    decode_steps: int = 0
    busy_seconds: float = 0.0
    cache_rebuilds: int = 0


class DecodeLock:
    """The lock between decode steps and weight writers, fair to the writers.

    The decode loop takes the lock again microseconds after releasing it, and a plain Lock
    is not fair, so a writer could wait out a whole generation. Here a waiting writer holds
    the gate, and the next decode step waits at the gate until the writer is done."""

    def __init__(self):
        self._lock = threading.Lock()
        self._gate = threading.Lock()

    @contextmanager
    def decode_step(self) -> Iterator[None]:
        with self._gate:  # a writer holding the gate goes first
            pass
        with self._lock:
            yield

    def acquire_for_writer(self) -> None:
        """Block until the running decode step ends; the next one waits for `release`."""
        with self._gate:
            self._lock.acquire()

    def release(self) -> None:
        self._lock.release()

    @contextmanager
    def writer(self) -> Iterator[None]:
        self.acquire_for_writer()
        try:
            yield
        finally:
            self.release()


@dataclasses.dataclass
class TransformersOptions:
    """The Transformers engine's options: `inference.options.*` with `inference.engine=transformers`."""

    max_batch_size: int = 512
    """Requests decoded together in one batch (more wait for the next batch)."""
    batch_wait_s: float = 0.0
    """Seconds the batching worker waits for more requests before it starts a batch."""


class TransformersEngine:
    """Batched KV-cache decoding over any local HF causal LM (loaded with from_pretrained)."""

    Options = TransformersOptions
    requires = None
    install_hint = ""

    @classmethod
    def build(cls, model_path: str, *, seed: int, dtype: str, version: int, tensor_parallel_size: int,
              options: TransformersOptions) -> "TransformersEngine":
        return cls(model_path, seed=seed, version=version, dtype=getattr(torch, dtype),
                   max_batch_size=options.max_batch_size, batch_wait_s=options.batch_wait_s)

    @classmethod
    def placement_defaults(cls, colocated: bool) -> dict[str, Any]:
        """No option depends on the placement: the engine takes no fixed GPU share (its KV cache grows
        with the batch) and `sleep`/`wake_up` work without being switched on."""
        return {}

    @classmethod
    def check_job(cls, job) -> None:
        """What a job may not ask of this engine (`registry.EngineJob`): it runs on the CPU, in float32."""
        if job.gpus_per_replica > 0:
            raise ValueError("ray.gpus_per_replica > 0 needs an engine that runs on GPUs (inference.engine=vllm); "
                             "the Transformers engine runs on CPU")
        if job.tensor_parallel_size > 1:
            raise ValueError("ray.tensor_parallel_size > 1 needs inference.engine=vllm (the Transformers engine "
                             "holds the whole model in one process)")
        if job.dtype == "bfloat16":
            raise ValueError("model.dtype=bfloat16 is for GPUs (inference.engine=vllm); the CPU TransformersEngine "
                             "and learner run float32")

    @classmethod
    def kv_cache_plan(cls, options: TransformersOptions, *, gpus_per_replica: float, weights_bytes: float,
                      per_token: int, sequence_tokens: int, in_flight: int) -> dict[str, Any]:
        """The dry run's KV budget of one replica: every request it holds decodes in one batch."""
        return {"concurrent_sequences": min(options.max_batch_size, in_flight),
                "budget": "no fixed budget: the Transformers engine grows its cache with the batch (host RAM)"}

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
    ):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.model_path = model_path
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.model = model if model is not None else AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype)
        self.model.eval().requires_grad_(False)
        self.max_batch_size = max_batch_size
        self.batch_wait_s = batch_wait_s
        self.max_positions = int(getattr(self.model.config, "max_position_embeddings", 1 << 30))
        eos = self.model.generation_config.eos_token_id
        eos = [eos] if isinstance(eos, int) else list(eos or [])
        if self.tokenizer.eos_token_id is not None:
            eos.append(self.tokenizer.eos_token_id)
        self.eos_token_ids = frozenset(eos)
        self.pad_token_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else min(eos)
        self._generator = torch.Generator().manual_seed(seed)
        self._version = version
        self._weights_lock = DecodeLock()
        self._params = dict(self.model.named_parameters())  # what weight sync carries
        self._buffers = dict(self.model.named_buffers())
        self._receiver = None  # this engine's end of the weight sync, once built
        self._borrowed: set[str] = set()  # parameters whose storage came from a transport
        self._paused = False
        self._pending: list[tuple[LLMRequest, asyncio.Future]] = []
        self._wakeup: asyncio.Event | None = None
        self._worker: asyncio.Task | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.stats = EngineStats()

    # ---------------------------------------------------------------- versioning
    @property
    def version(self) -> int:
        return self._version

    def update_weights(self, named_tensors: Mapping[str, torch.Tensor], version: int | None = None) -> int:
        """Copy new weights in between two decode steps; returns the new version.

        A parameter whose storage a transport handed over (`swap_weights`, e.g. a read-only view
        of a shared-memory segment) is given fresh storage instead of being written in place."""
        targets = {**self._params, **self._buffers}
        unknown = [k for k in named_tensors if k not in targets]
        if unknown:
            raise KeyError(f"update_weights: unknown parameter names {unknown[:5]} (model has e.g. {list(self._params)[:3]})")
        with self._weights_lock.writer(), torch.no_grad():
            for name, tensor in named_tensors.items():
                dst = targets[name]
                if dst.shape != tensor.shape:
                    raise ValueError(f"update_weights: {name} has shape {tuple(tensor.shape)}, expected {tuple(dst.shape)}")
                if name in self._borrowed:
                    dst.data = tensor.detach().to(device=dst.device, dtype=dst.dtype).clone()
                    self._borrowed.discard(name)
                else:
                    dst.copy_(tensor)
            self._version = self._version + 1 if version is None else int(version)
        return self._version

    def swap_weights(self, back: dict[str, torch.Tensor], version: int) -> float:
        """Double-buffer swap: exchange storage with `back` between two decode steps.

        O(1) per tensor (no copy), so generation stalls only for the swap; `back` then holds
        the previous weights and can receive the next update. Returns the stall in seconds:
        the time the swap holds the decode lock (generation cannot run then).
        """
        for name, t in back.items():
            if name not in self._params:
                raise KeyError(f"swap_weights: unknown parameter {name!r}")
            if t.shape != self._params[name].shape or t.dtype != self._params[name].dtype:
                raise ValueError(f"swap_weights: {name} is {tuple(t.shape)}/{t.dtype}, expected "
                                 f"{tuple(self._params[name].shape)}/{self._params[name].dtype}")
        with self._weights_lock.writer():  # waiting for the running decode step is not a stall: it is generating
            t0 = time.perf_counter()
            for name, t in back.items():
                p = self._params[name]
                p.data, t.data = t.data, p.data
            self._borrowed.update(back)  # storage the transport owns (maybe read-only): never write it
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

    async def receive_update(self, handoff: Any = None) -> dict[str, float]:
        """Receive into the back buffer in a thread while decoding goes on, then swap in O(1).
        `handoff`: what the sender published (the object store's references), if the transport pulls."""
        if self._receiver is None:
            raise RuntimeError("receive_update: init_update_group was not called on this engine")
        out = await asyncio.to_thread(self._receiver.receive_and_swap, handoff)
        return {"version": out["version"], "receive_s": out["receive_s"], "stall_s": out["stall_s"]}

    async def load_weights(self, named_tensors: Mapping[str, torch.Tensor], version: int) -> int:
        return await asyncio.to_thread(self.update_weights, named_tensors, version)

    async def pause(self) -> None:
        """Hold decoding: the next decode step waits until `resume` (requests are kept)."""
        if not self._paused:
            await asyncio.to_thread(self._weights_lock.acquire_for_writer)
            self._paused = True

    async def resume(self) -> None:
        if self._paused:
            self._paused = False
            self._weights_lock.release()

    async def weights_checksum(self) -> float:
        return weights_checksum(self._params)

    async def close_update_group(self) -> None:
        receiver, self._receiver = self._receiver, None
        if receiver is not None:
            receiver.close()

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
        """Queue a request; it joins the next batch decoded by the background worker."""
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
                batch = self._pending[: self.max_batch_size]
                del self._pending[: self.max_batch_size]
                live = [(r, f) for r, f in batch if not f.cancelled()]
                if not live:
                    continue
                try:
                    results = await asyncio.to_thread(self.generate_batch, [r for r, _ in live])
                except Exception as exc:  # one bad batch fails its callers, not the engine
                    for _, f in live:
                        if not f.done():
                            f.set_exception(exc)
                    continue
                for (_, f), res in zip(live, results):
                    if not f.done():
                        f.set_result(res)

    @torch.no_grad()
    def generate_batch(self, requests: list[LLMRequest]) -> list[LLMResponse]:
        """Decode a list of requests together (synchronous; also usable without asyncio)."""
        from transformers import DynamicCache

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
        positions = (attn.cumsum(-1) - 1).clamp_(min=0)
        sampler = RowSampler(
            [r.sampling.temperature for r in requests], [r.sampling.top_k for r in requests],
            [r.sampling.top_p for r in requests], [r.sampling.greedy for r in requests],
        )
        stops = [(frozenset() if r.sampling.ignore_eos else self.eos_token_ids) | frozenset(r.sampling.stop_token_ids)
                 for r in requests]
        budget = [r.sampling.max_new_tokens for r in requests]
        out_tok: list[list[int]] = [[] for _ in range(n)]
        out_lp: list[list[float]] = [[] for _ in range(n)]
        out_ver: list[list[int]] = [[] for _ in range(n)]
        reason = ["length"] * n
        active = list(range(n))  # original row index of each row still in the batch
        full_ids = ids  # every token fed so far plus the one about to be fed, per active row
        cache, cache_version = None, None
        step_ids, step_pos = ids, positions
        while active:
            with self._weights_lock.decode_step():
                version = self._version
                if cache is not None and cache_version != version:
                    # Weights changed since the KV cache was built: re-prefill the whole sequence
                    # so every later token is sampled from exactly policy `version` (AReaL-style).
                    cache, step_ids = None, full_ids
                    step_pos = (attn.cumsum(-1) - 1).clamp_(min=0)
                    self.stats.cache_rebuilds += 1
                if cache is None:
                    cache, cache_version = DynamicCache(config=self.model.config), version
                logits = self.model(
                    input_ids=step_ids, attention_mask=attn, position_ids=step_pos,
                    past_key_values=cache, use_cache=True, logits_to_keep=1,
                ).logits[:, -1, :]
                tokens, logps = sampler(logits, self._generator)
            self.stats.decode_steps += 1
            tok_list, lp_list = tokens.tolist(), logps.tolist()
            keep = []
            for j, row in enumerate(active):
                t = tok_list[j]
                out_tok[row].append(t)
                out_lp[row].append(lp_list[j])
                out_ver[row].append(version)
                if t in stops[row]:
                    reason[row] = "stop"
                elif len(out_tok[row]) < budget[row]:
                    keep.append(j)
            if len(keep) < len(active):
                if not keep:
                    break
                idx = torch.tensor(keep, dtype=torch.long)
                cache.batch_select_indices(idx)
                attn, tokens, sampler = attn[idx], tokens[idx], sampler.select(idx)
                step_pos, full_ids = step_pos[idx], full_ids[idx]
                active = [active[j] for j in keep]
            attn = torch.cat([attn, torch.ones((len(active), 1), dtype=attn.dtype)], dim=-1)
            step_pos = step_pos[:, -1:] + 1
            step_ids = tokens.unsqueeze(-1)
            full_ids = torch.cat([full_ids, step_ids], dim=-1)
        elapsed = time.perf_counter() - t0
        self.stats.requests += n
        self.stats.batches += 1
        self.stats.generated_tokens += sum(len(t) for t in out_tok)
        self.stats.busy_seconds += elapsed
        return [
            LLMResponse(
                input_tokens=list(r.input_ids), output_tokens=out_tok[i], output_logprobs=out_lp[i],
                output_versions=out_ver[i], stop_reason=reason[i], rid=r.rid, latency_s=elapsed,
            )
            for i, r in enumerate(requests)
        ]

    def generate(self, requests: list[LLMRequest]) -> list[LLMResponse]:
        """Synchronous convenience wrapper, chunked by max_batch_size."""
        out: list[LLMResponse] = []
        for i in range(0, len(requests), self.max_batch_size):
            out += self.generate_batch(requests[i:i + self.max_batch_size])
        return out

    def info(self) -> dict[str, Any]:
        return {"model_path": self.model_path, "version": self._version, **dataclasses.asdict(self.stats)}
