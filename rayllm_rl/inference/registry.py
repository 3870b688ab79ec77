"""The engine registry: one line per engine; the one place that knows engines by name.

An engine is a class with:

* ``Options``: a dataclass of its own options (docstring under each field), filled from
  `inference.options.*` in the job config and checked before any actor starts;
* ``requires``: the package it needs (None: always there), for a clear error when it is missing;
* ``build(model_path, *, seed, dtype, version, tensor_parallel_size, options, lora)``: the engine (`lora`:
  a `rayllm_rl.lora.LoraOptions` of a LoRA policy, or None);
* ``check_job(job: EngineJob)``: raises ValueError naming the key a job sets that the engine cannot serve;
* ``placement_defaults(colocated)``: options the placement sets unless the job does (vLLM's GPU share);
* ``kv_cache_plan(options, ...)``: the dry run's KV-cache budget;
* the runtime contract of `inference/protocol.py` (`start`, `aclose`, `agenerate`, the weight sink).

Adding an engine: one module with that class, and one line in `ENGINES` (docs/inference-engines.md).
"""
from __future__ import annotations

import dataclasses
import importlib
import importlib.util
from typing import Any, Mapping

ENGINES: dict[str, str] = {
    "transformers": "rayllm_rl.inference.transformers_engine:TransformersEngine",
    "vllm": "rayllm_rl.inference.vllm_engine:VLLMEngine",
}
"""Engine name (`inference.engine`) -> "module:class"."""


@dataclasses.dataclass(frozen=True)
class EngineJob:
    """What of a job an engine may refuse (a neutral view of the job config; which backend runs it is the
    job's own check, orchestration/job_checks.py)."""

    gpus_per_replica: float
    tensor_parallel_size: int
    dtype: str
    environment: bool
    """Whether to check this machine (installed packages); False for a dry run planning other machines."""
    options: Any = None
    """The engine's `Options`, as `engine_options` typed them (placement defaults included)."""
    colocated: bool = False
    """`ray.placement=colocated`: each replica shares its GPU with a learner rank and sleeps while it trains."""
    lora_rank: int = 0
    """`model.lora.rank`: > 0 serves a LoRA policy (the base model plus an adapter that every update replaces)."""


def engine_class(name: str) -> type:
    """The class registered as `name` (its module is imported; the engine's own package is not)."""
    if name not in ENGINES:
        raise ValueError(f"inference.engine must be one of {tuple(ENGINES)}, got {name!r}")
    module, cls = ENGINES[name].split(":")
    return getattr(importlib.import_module(module), cls)


def engine_installed(name: str) -> bool:
    """Whether the package the engine needs is importable on this machine."""
    requires = engine_class(name).requires
    return requires is None or importlib.util.find_spec(requires) is not None


def engine_options(name: str, values: Mapping[str, Any] | None = None):
    """`inference.options` checked and typed into the engine's `Options` (an unknown key names itself)."""
    from rayllm_rl.config import ConfigError, apply_dict

    cls = engine_class(name)
    try:
        return apply_dict(cls.Options(), dict(values or {}), prefix="inference.options.")
    except ConfigError as exc:
        raise ValueError(f"{exc} (the options of inference.engine={name})") from None


def placed_options(name: str, values: Mapping[str, Any] | None, *, colocated: bool) -> dict[str, Any]:
    """`inference.options` over the engine's defaults for the placement (`placement_defaults`): the
    placement decides a replica's GPU share and sleep mode, a value the job sets wins."""
    return {**engine_class(name).placement_defaults(colocated), **dict(values or {})}


def build_engine(name: str, model_path: str, *, seed: int = 0, dtype: str = "float32", version: int = 0,
                 tensor_parallel_size: int = 1, options: Mapping[str, Any] | None = None, revision: str = "",
                 lora=None):
    """The engine `name` over `model_path` (call `await engine.start()` on the loop that serves it).

    `model_path` (a local directory, a hub id, or the driver's snapshot directory) is resolved on this
    node first (`resolve_model_path`), so every engine gets a local directory. `lora`: the policy's
    `LoraOptions` (rank > 0: updates carry the adapter only), or None."""
    from rayllm_rl.hub import resolve_model_path

    cls = engine_class(name)
    if not engine_installed(name):
        raise ImportError(f"inference.engine={name} needs the {cls.requires} package: {cls.install_hint}")
    return cls.build(resolve_model_path(model_path, revision), seed=seed, dtype=dtype, version=version,
                     tensor_parallel_size=tensor_parallel_size, options=engine_options(name, options),
                     lora=lora if lora is not None and lora.enabled else None)
