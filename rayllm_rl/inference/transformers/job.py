"""What a job may ask of the Transformers engine, decided before any replica starts: its options
(`inference.options.*`), the device it picks, and the registry's hooks (`build`, `placement_defaults`,
`check_job`, `kv_cache_plan`): the registry's entry, apart from the engine it builds (`TransformersEngine`)."""
from __future__ import annotations

import dataclasses
from typing import Any

import torch

DEVICES = ("auto", "cpu", "cuda")


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


class TransformersJobSide:
    """The engine registry's entry for `inference.engine=transformers` (the engine: `TransformersEngine`)."""

    Options = TransformersOptions
    requires = None
    install_hint = ""

    @staticmethod
    def engine_class() -> type:
        """The engine these rules build (its module imported here)."""
        from rayllm_rl.inference.transformers.engine import TransformersEngine

        return TransformersEngine

    @classmethod
    def build(cls, model_path: str, *, seed: int, dtype: str, version: int, tensor_parallel_size: int,
              options: TransformersOptions, lora=None):
        return cls.engine_class()(model_path, seed=seed, version=version, dtype=getattr(torch, dtype), lora=lora,
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
