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
import threading
import time
from contextlib import contextmanager
from typing import Any, Iterator, Mapping, Sequence

import torch

from rayllm_rl.inference.protocol import (
    LLMRequest, LLMResponse, PromptTooLongError, check_request, weights_checksum,
)
from rayllm_rl.inference.sampling import RowSampler
from rayllm_rl.weight_sync.registry import SyncSpec

__all__ = ["TransformersEngine", "PromptTooLongError", "EngineStats", "SLEEP_TAGS"]

SLEEP_TAGS = ("weights", "kv_cache")
"""What `sleep` puts down and `wake_up(tags)` brings back; the engine generates once both are up."""
DEVICES = ("auto", "cpu", "cuda")


@dataclasses.dataclass
class EngineStats:
    """Counters for throughput reporting."""

    requests: int = 0
    batches: int = 0
    generated_tokens: int = 0
    decode_steps: int = 0
    busy_seconds: float = 0.0
    cache_rebuilds: int = 0
    sleeps: int = 0
    last_sleep_s: float = 0.0
    """Seconds the last `sleep` took (waiting for the running step, weights off the GPU, cache freed)."""
    last_wake_s: float = 0.0
    """Seconds the last `wake_up` that brought weights back took."""


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
    device: str = "auto"
    """Where the model runs: "auto" (the replica's GPU when its process sees one, else the CPU), "cpu", "cuda"."""


def pick_device(device: str | torch.device | None = "auto") -> torch.device:
    """The engine's device: "auto" is CUDA's current device when torch sees a GPU, else the CPU."""
    if device is None or device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(device)
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"inference.options.device must be one of {DEVICES}, got {device!r}")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"inference.options.device={device}: torch sees no GPU in this process "
                             f"(torch {torch.__version__}, CUDA_VISIBLE_DEVICES as Ray set it)")
        if dev.index is None:  # an explicit index, so tensor.device == engine.device compares true
            dev = torch.device("cuda", torch.cuda.current_device())
    return dev


@dataclasses.dataclass
class _Batch:
    """One batch's decoding state; it outlives a sleep (the KV cache is dropped, then re-prefilled)."""

    requests: list[LLMRequest]
    sampler: RowSampler
    stops: list[frozenset]
    budget: list[int]
    attn: torch.Tensor
    """`[rows, T]` 1 at real tokens (0 at left padding), T = tokens fed so far + the one about to be fed."""
    full_ids: torch.Tensor
    """`[rows, T]` every token fed so far plus the one about to be fed."""
    t0: float
    active: list[int] = dataclasses.field(default_factory=list)
    """Original row index of each row still in the batch."""
    out_tok: list[list[int]] = dataclasses.field(default_factory=list)
    out_lp: list[list[float]] = dataclasses.field(default_factory=list)
    out_ver: list[list[int]] = dataclasses.field(default_factory=list)
    reason: list[str] = dataclasses.field(default_factory=list)
    cache: Any = None
    """The KV cache, or None: the next step prefills `full_ids` into a new one."""
    cache_version: int | None = None
    step_ids: torch.Tensor | None = None
    step_pos: torch.Tensor | None = None


class TransformersEngine:
    """Batched KV-cache decoding over any local HF causal LM (loaded with from_pretrained)."""

    Options = TransformersOptions
    requires = None
    install_hint = ""

    @classmethod
    def build(cls, model_path: str, *, seed: int, dtype: str, version: int, tensor_parallel_size: int,
              options: TransformersOptions, lora=None) -> "TransformersEngine":
        return cls(model_path, seed=seed, version=version, dtype=getattr(torch, dtype), lora=lora,
                   max_batch_size=options.max_batch_size, batch_wait_s=options.batch_wait_s, device=options.device)

    @classmethod
    def placement_defaults(cls, colocated: bool) -> dict[str, Any]:
        """No option depends on the placement: the engine takes no fixed GPU share (its KV cache grows
        with the batch) and `sleep`/`wake_up` work without being switched on."""
        return {}

    @classmethod
    def check_job(cls, job) -> None:
        """What a job may not ask of this engine (`registry.EngineJob`): one process per replica, and
        bfloat16 only on GPU replicas."""
        if job.tensor_parallel_size > 1:
            raise ValueError("ray.tensor_parallel_size > 1 needs inference.engine=vllm (the Transformers engine "
                             "holds the whole model in one process)")
        device = getattr(getattr(job, "options", None), "device", "auto")
        if device not in DEVICES:
            raise ValueError(f"inference.options.device must be one of {DEVICES}, got {device!r}")
        if device == "cuda" and job.gpus_per_replica <= 0:
            raise ValueError("inference.options.device=cuda needs ray.gpus_per_replica > 0 (a replica without "
                             "a GPU of its own sees none)")
        if job.dtype == "bfloat16" and (job.gpus_per_replica <= 0 or device == "cpu"):
            raise ValueError(f"model.dtype=bfloat16 with inference.engine=transformers needs GPU replicas: "
                             f"ray.gpus_per_replica={job.gpus_per_replica}"
                             f"{', inference.options.device=cpu' if device == 'cpu' else ''} decodes on the CPU, "
                             "where bfloat16 is slow and the logprob checks are float32; set model.dtype=float32, "
                             "or ray.gpus_per_replica > 0")

    @classmethod
    def kv_cache_plan(cls, options: TransformersOptions, *, gpus_per_replica: float, weights_bytes: float,
                      per_token: int, sequence_tokens: int, in_flight: int) -> dict[str, Any]:
        """The dry run's KV budget of one replica: every request it holds decodes in one batch."""
        where = "GPU memory" if gpus_per_replica > 0 and options.device != "cpu" else "host RAM"
        return {"concurrent_sequences": min(options.max_batch_size, in_flight),
                "budget": f"no fixed budget: the Transformers engine grows its cache with the batch ({where})"}

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

    def update_weights(self, named_tensors: Mapping[str, torch.Tensor], version: int | None = None) -> int:
        """Copy new weights in between two decode steps (host tensors: one copy each, to the device and
        dtype); returns the new version.

        A parameter whose storage a transport handed over (`swap_weights`, e.g. a read-only view
        of a shared-memory segment) is given fresh storage instead of being written in place."""
        targets = {**self._params, **self._buffers}
        unknown = [k for k in named_tensors if k not in targets]
        if unknown:
            raise KeyError(f"update_weights: unknown parameter names {unknown[:5]} (model has e.g. {list(self._params)[:3]})")
        with self._weights_lock.writer(), torch.no_grad():
            self._check_writable("update_weights")
            for name, tensor in named_tensors.items():
                dst = targets[name]
                if dst.shape != tensor.shape:
                    raise ValueError(f"update_weights: {name} has shape {tuple(tensor.shape)}, expected {tuple(dst.shape)}")
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

    async def receive_update(self, handoff: Any = None) -> dict[str, float]:
        """Receive into the back buffer in a thread while decoding goes on, then swap in O(1).
        `handoff`: what the sender published (the object store's references), if the transport pulls."""
        if self._receiver is None:
            raise RuntimeError("receive_update: init_update_group was not called on this engine")
        out = await asyncio.to_thread(self._receiver.receive_and_swap, handoff)
        return {"version": out["version"], "receive_s": out["receive_s"], "stall_s": out["stall_s"]}

    async def load_weights(self, named_tensors: Mapping[str, torch.Tensor], version: int) -> int:
        return await asyncio.to_thread(self.update_weights, named_tensors, version)

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

    def _start_batch(self, requests: list[LLMRequest]) -> _Batch:
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
        return _Batch(requests, sampler, stops, [r.sampling.max_new_tokens for r in requests],
                      attn.to(self.device), ids.to(self.device), t0, active=list(range(n)),
                      out_tok=[[] for _ in range(n)], out_lp=[[] for _ in range(n)], out_ver=[[] for _ in range(n)],
                      reason=["length"] * n)

    @torch.no_grad()
    def _run_batch(self, b: _Batch) -> bool:
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

    def _finish_batch(self, b: _Batch) -> list[LLMResponse]:
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
