"""`VLLMEngine`: vLLM's `AsyncLLM` behind our engine contract; its parts are the weight sink (`weights`,
vllm/weights.py) and its turns (`turns`: pause and sleep, here).

Token ids in (`TokensPrompt`), token ids out with the sampled token's logprob and the policy
version of the weights that produced each token (vLLM's per-token `weight_versions` spans).
Logprobs are vLLM's `processed_logprobs`: log-softmax of `logits / temperature` (of the raw
logits for greedy), over the kept tokens under top-k / top-p: the learner rebuilds that kept set when it
scores the token (sampling-mask replay, `rayllm_rl.sampling_mask`, docs/algorithms.md).

Weights live in vLLM's worker process (vllm/worker.py), and a LoRA policy's adapter in vLLM's one LoRA
slot (vllm/lora.py): how an update gets there is the weight sink's (vllm/weights.py).

Only this module, `vllm/weights.py`, `vllm/worker.py` and `vllm/lora.py` import vllm, and only when a vLLM engine
is built.
"""
from __future__ import annotations

import asyncio
import os
import time
import uuid
from typing import Any, Sequence

import torch

from rayllm_rl.inference.protocol import LLMRequest, LLMResponse, check_request
from rayllm_rl.inference.vllm.job import (VLLMJobSide, VLLMOptions, cpu_thread_binding, fitting_length,
                                          separate_inductor_cache)
from rayllm_rl.inference.vllm.shutdown import (engine_ipc_dir, engine_processes, process_trees, remove_ipc_dir,
                                               stop_async_llm, unlink_orphaned_segments)
from rayllm_rl.inference.vllm.weights import VLLMWeights
from rayllm_rl.lora import LoraOptions

WORKER_EXTENSION = "rayllm_rl.inference.vllm.worker.RayllmWorkerExtension"


def _torch_dtype_name(dtype: str) -> str:
    return {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16",
            "float16": "float16", "fp16": "float16"}[dtype]


class VLLMEngine:
    """vLLM `AsyncLLM` (engine core in its own process) as an `InferenceEngine`, holding its `WeightSink` (`weights`)
    and `GenerationTurns` (`turns`).
    What a job may ask of it (its options, `check_job`, the dry run's KV plan) is `VLLMJobSide` (vllm/job.py).

    Construction is cheap; :meth:`start` (awaited from the event loop that will serve requests)
    starts vLLM. `agenerate` starts it on first use too.
    """

    def _executor(self, on_cpu: bool):
        """The engine core's executor: one worker inside the engine-core process when there is one rank; vLLM's
        own choice across ranks. On CPU the class, not "uni": vLLM-CPU swaps the name "uni" for its
        multiprocessing executor, which spawns a second process importing vLLM (about 6 s idle on 2 cores)."""
        if self.tensor_parallel_size > 1:
            return None
        if on_cpu:
            from vllm.v1.executor.uniproc_executor import UniProcExecutor

            return UniProcExecutor
        return "uni"

    def __init__(self, model_path: str, *, seed: int = 0, version: int = 0, dtype: str = "float32",
                 tensor_parallel_size: int = 1, options: VLLMOptions | None = None, lora: LoraOptions | None = None):
        from transformers import AutoConfig, AutoTokenizer

        # vLLM logs every request and cache reset at INFO; keep warnings unless the user asked for more.
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
        os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")  # stdout ends with the job's JSON
        self.model_path = model_path
        self.options = options or VLLMOptions()
        self.dtype = _torch_dtype_name(dtype)
        """Weights and activations: float32 (CPU, exact logprobs) or bfloat16 (GPU)."""
        self.tensor_parallel_size = int(tensor_parallel_size)
        self.seed = seed
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        config = AutoConfig.from_pretrained(model_path)
        self.max_positions = self.options.max_model_len or fitting_length(config, self.options, self.dtype)
        self.llm = None
        """vLLM's `AsyncLLM`, once `start` built it (None before and after)."""
        self._segments_before: set[str] = set()
        self._ipc_dir: str | None = None  # vLLM's zmq sockets for this engine (removed when it stops)
        self._processes: list = []  # vLLM's engine processes and their workers (psutil), from the start on
        self.eager = True
        """No CUDA graphs or torch.compile (set when vLLM is built; always on the CPU)."""
        self._start_lock: asyncio.Lock | None = None
        self.sleep_mode = bool(self.options.enable_sleep_mode) and torch.cuda.is_available()
        """vLLM's sleep mode frees GPU memory at `sleep` (CUDA only; else sleep only holds scheduling)."""
        self.stats = {"requests": 0, "generated_tokens": 0, "updates": 0, "last_stall_s": 0.0, "last_receive_s": 0.0}
        self.lora = lora if lora is not None and lora.enabled else None
        """A LoRA policy: the adapter is what updates carry (vllm/lora.py); None = full weights."""
        self.weights = VLLMWeights(self, version)
        """The weight sink (vllm/weights.py): the version served, and how a new one reaches vLLM's worker."""
        self.turns = VLLMTurns(self)
        """Pause and sleep: vLLM's scheduler held, or its memory freed for a colocated learner."""

    # ---------------------------------------------------------------- lifecycle
    async def start(self) -> "VLLMEngine":
        """Start vLLM (spawns the engine core; tens of seconds on CPU) and label its weights."""
        if self.llm is not None:
            return self
        if self._start_lock is None:
            self._start_lock = asyncio.Lock()
        async with self._start_lock:
            if self.llm is None:
                await asyncio.to_thread(self._build)
                await self.weights.on_start()
        return self

    def _build(self) -> None:
        """Build the AsyncLLM into `self.llm` on a worker thread. It is stored here, not returned:
        vLLM imported on this thread keeps an import error's traceback (torchcodec's, in
        `vllm.multimodal.media.audio`) whose frames reach this thread's frames for the process's
        life, so a returned AsyncLLM (a local and a future's result there) would outlive `aclose`
        and its `__del__` would run at interpreter exit, when vLLM's globals are gone
        ("Exception ignored in AsyncLLM.__del__ ... 'NoneType' object is not callable")."""
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        from rayllm_rl.inference.vllm.lora import engine_args
        from rayllm_rl.inference.vllm.shutdown import shm_segments

        self._segments_before = shm_segments()  # what exists before vLLM makes its queues (aclose sweeps the rest)

        o = self.options
        on_cpu = not torch.cuda.is_available()
        self.eager = on_cpu if o.enforce_eager is None else bool(o.enforce_eager)
        if on_cpu:
            separate_inductor_cache(os.environ)  # vLLM's compiled helpers, when ATEN_CPU_CAPABILITY picks the kernels
        if on_cpu and self.tensor_parallel_size > 1:
            os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", cpu_thread_binding(self.tensor_parallel_size))
        args = AsyncEngineArgs(
            model=self.model_path, tokenizer=self.model_path, dtype=self.dtype, seed=self.seed,
            max_model_len=self.max_positions, enable_prefix_caching=o.enable_prefix_caching,
            enforce_eager=self.eager, max_num_seqs=o.max_num_seqs, logprobs_mode="processed_logprobs",
            tensor_parallel_size=self.tensor_parallel_size, worker_extension_cls=WORKER_EXTENSION,
            weight_transfer_config={"backend": "rayllm"}, disable_log_stats=True,
            use_tqdm_on_load=False,  # no loading bar: Ray forwards it to the driver's console
            distributed_executor_backend=self._executor(on_cpu),
            **({"kv_cache_memory_bytes": int(o.kv_cache_mb) << 20} if on_cpu
               else {"gpu_memory_utilization": o.gpu_memory_utilization or VLLMJobSide.placement_defaults(False)[
                   "gpu_memory_utilization"], "enable_sleep_mode": o.enable_sleep_mode}),
            **(engine_args(self.lora, o.max_lora_rank) if self.lora is not None else {}),
        )
        with engine_ipc_dir() as self._ipc_dir:  # a failed start removes it (vLLM stops what it started)
            self.llm = AsyncLLM.from_engine_args(args)
        self._processes = process_trees(engine_processes(self.llm))  # its workers, while they are its children

    async def aclose(self) -> None:
        """Stop vLLM from the loop that serves it: the output handler first, then the engine core
        (the other order makes the handler see a dead engine and log an error). Idempotent; the
        AsyncLLM is shut down even if cancelling its handler fails, and no reference to it is kept."""
        llm, self.llm = self.llm, None
        self.weights.close_adapters()
        if llm is None:
            return
        try:
            handler = getattr(llm, "output_handler", None)
            if handler is not None and not handler.done():
                handler.cancel()
                await asyncio.gather(handler, return_exceptions=True)
        finally:
            self._stop(llm)

    def shutdown(self) -> None:
        """Stop vLLM from outside its loop (prefer `aclose`); idempotent."""
        llm, self.llm = self.llm, None
        if llm is not None:
            self._stop(llm)

    def _stop(self, llm) -> None:
        """Stop `llm`'s processes, then remove what they leave: shared-memory segments and the socket directory."""
        stop_async_llm(llm, started=self._processes)
        self._processes = []
        unlink_orphaned_segments(self._segments_before)
        remove_ipc_dir(self._ipc_dir)

    # ---------------------------------------------------------------- generation
    @property
    def version(self) -> int:
        """Policy version of the weights that generate the next token (the weight sink's)."""
        return self.weights.version

    def _sampling(self, req: LLMRequest):
        from vllm import SamplingParams as VSamplingParams

        s = req.sampling
        return VSamplingParams(
            max_tokens=s.max_new_tokens, temperature=0.0 if s.greedy else s.temperature,
            top_p=1.0 if s.greedy else s.top_p, top_k=0 if s.greedy else s.top_k,
            stop_token_ids=list(s.stop_token_ids), ignore_eos=s.ignore_eos, logprobs=0, detokenize=False,
            skip_special_tokens=False,
        )

    async def agenerate(self, request: LLMRequest) -> LLMResponse:
        from vllm.inputs import TokensPrompt

        check_request(request, self.max_positions)
        await self.start()
        t0 = time.perf_counter()
        final = None
        # vLLM's renderer turns the token ids into its engine input (a raw prompt is deprecated and warned about)
        (prompt,) = await self.llm.renderer.render_cmpl_async([TokensPrompt(prompt_token_ids=list(request.input_ids))])
        async for out in self.llm.generate(prompt, self._sampling(request), lora_request=self.weights.lora_request,
                                            request_id=f"{request.rid}-{uuid.uuid4().hex[:8]}"):
            final = out
        comp = final.outputs[0]
        tokens = list(comp.token_ids)
        logprobs = [float(lp[t].logprob) for lp, t in zip(comp.logprobs or [], tokens)]
        if len(logprobs) != len(tokens):
            raise RuntimeError(f"vLLM returned {len(logprobs)} logprobs for {len(tokens)} tokens "
                               f"(request {request.rid})")
        versions = _expand_versions(comp.weight_versions, len(tokens))
        reason = comp.finish_reason if comp.finish_reason in ("stop", "length") else "abort"
        self.stats["requests"] += 1
        self.stats["generated_tokens"] += len(tokens)
        return LLMResponse(input_tokens=list(request.input_ids), output_tokens=tokens, output_logprobs=logprobs,
                           output_versions=versions, stop_reason=reason, rid=request.rid,
                           latency_s=time.perf_counter() - t0)

    def info(self) -> dict[str, Any]:
        return {"model_path": self.model_path, "version": self.weights.version, "engine": "vllm", **self.stats}


class VLLMTurns:
    """`GenerationTurns` of a `VLLMEngine`: vLLM's scheduler paused for a moment, or the engine put to sleep
    for the colocated placement (vLLM's sleep mode on a GPU; on the CPU only scheduling is held)."""

    def __init__(self, engine: VLLMEngine):
        self.engine = engine
        self.asleep: set[str] = set()
        """What `sleep` put down and `wake_up` has not brought back ("weights", "kv_cache"; or "scheduling")."""

    @property
    def sleeping(self) -> bool:
        return bool(self.asleep)

    async def sleep(self, level: int = 1) -> None:
        """Colocated: hold generation (running requests kept) and, on a GPU with sleep mode, free vLLM's
        memory at `inference.options.sleep_level`; `level` is the protocol's and is overridden by that
        option. Without sleep mode (CPU) vLLM's level 0: scheduling paused, no memory freed."""
        e = self.engine
        await e.start()
        if self.asleep:
            return
        lvl = e.options.sleep_level if e.sleep_mode else 0
        await e.llm.sleep(lvl, mode="keep")
        self.asleep = {"weights", "kv_cache"} if lvl else {"scheduling"}

    async def wake_up(self, tags: Sequence[str] | None = None) -> None:
        """Bring back `tags` ("weights", "kv_cache"; None = both); vLLM resumes scheduling once all is back."""
        bad = [t for t in (tags or []) if t not in ("weights", "kv_cache")]
        if bad:
            raise ValueError(f"wake_up: unknown tags {bad}; use 'weights' and/or 'kv_cache'")
        if not self.asleep:
            return
        if "scheduling" in self.asleep:  # level 0: nothing was freed; scheduling resumes with the last tag
            if tags is None or "kv_cache" in tags:
                await self.engine.llm.wake_up(["scheduling"])
                self.asleep = set()
            return
        want = [t for t in (tags or ["weights", "kv_cache"]) if t in self.asleep]
        if want:
            await self.engine.llm.wake_up(want)
            self.asleep -= set(want)

    async def pause(self) -> None:
        await self.engine.start()
        # the engine core's pause, as a weight update's (vllm/weights.py, `VLLMWeights.apply`), keeping the KV cache
        await self.engine.llm.engine_core.pause_scheduler_async(mode="keep", clear_cache=False)

    async def resume(self) -> None:
        await self.engine.llm.resume_generation()


def _expand_versions(spans, n: int) -> list[int]:
    """vLLM's `[WeightVersionSpan(version, start, end)]` → one int version per output token."""
    out: list[int | None] = [None] * n
    for span in spans or []:
        try:
            v = int(span.version)
        except (TypeError, ValueError):
            raise ValueError(f"vLLM weight version {span.version!r} is not an integer policy version") from None
        for i in range(max(span.start, 0), min(span.end, n)):
            out[i] = v
    if any(v is None for v in out):
        raise RuntimeError(f"vLLM returned weight-version spans {spans} that do not cover all {n} tokens")
    return out
