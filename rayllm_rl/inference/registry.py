"""The engine registry: one line per engine; the one place that knows engines by name.

Each line names an engine's job side (`transformers.job.TransformersJobSide`, `vllm.job.VLLMJobSide`): what a
job may ask of the engine, apart from the engine class, which it builds. A job side has:

* ``Options``: a dataclass of its own options (docstring under each field), filled from
  `inference.options.*` in the job config and checked before any actor starts;
* ``requires``: the package it needs (None: always there), for a clear error when it is missing;
* ``engine_class()``: the engine class (the runtime contract of `inference/protocol.py`);
* ``build(model_path, *, seed, dtype, version, tensor_parallel_size, options, lora)``: the engine (`lora`:
  a `rayllm_rl.lora.LoraOptions` of a LoRA policy, or None);
* ``check_job(job: EngineJob)``: raises ValueError naming the key a job sets that the engine cannot serve;
* ``placement_defaults(colocated)``: options the placement sets unless the job does (vLLM's GPU share);
* ``kv_cache_plan(options, ...)``: the dry run's KV-cache budget.

The engine class holds the runtime contract of `inference/protocol.py` (`start`, `aclose`, `agenerate`, the
weight sink). Adding an engine: its module, its job side, and one line in `ENGINES` (docs/inference-engines.md).
"""
from __future__ import annotations

import dataclasses
import importlib
import importlib.util
from typing import Any, Mapping

ENGINES: dict[str, str] = {
    "transformers": "rayllm_rl.inference.transformers.job:TransformersJobSide",
    "vllm": "rayllm_rl.inference.vllm.job:VLLMJobSide",
}
"""Engine name (`inference.engine`) -> "module:class" of its job side."""


@dataclasses.dataclass(frozen=True)
class EngineJob:
    """What of a job an engine may refuse (a neutral view of the job config; which backend runs it is the
    job's own check, job/checks.py)."""

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


def job_side(name: str) -> type:
    """The job side registered as `name` (its module is imported; neither the engine's module nor its package
    is: `job_side(name).engine_class()` is the engine)."""
    if name not in ENGINES:
        raise ValueError(f"inference.engine must be one of {tuple(ENGINES)}, got {name!r}")
    module, cls = ENGINES[name].split(":")
    return getattr(importlib.import_module(module), cls)


def engine_installed(name: str) -> bool:
    """Whether the package the engine needs is importable on this machine."""
    requires = job_side(name).requires
    return requires is None or importlib.util.find_spec(requires) is not None


def engine_options(name: str, values: Mapping[str, Any] | None = None):
    """`inference.options` checked and typed into the engine's `Options` (an unknown key names itself)."""
    from rayllm_rl.config import ConfigError, apply_dict

    cls = job_side(name)
    try:
        return apply_dict(cls.Options(), dict(values or {}), prefix="inference.options.")
    except ConfigError as exc:
        raise ValueError(f"{exc} (the options of inference.engine={name})") from None


def placed_options(name: str, values: Mapping[str, Any] | None, *, colocated: bool) -> dict[str, Any]:
    """`inference.options` over the engine's defaults for the placement (`placement_defaults`): the
    placement decides a replica's GPU share and sleep mode, a value the job sets wins."""
    return {**job_side(name).placement_defaults(colocated), **dict(values or {})}


@dataclasses.dataclass(frozen=True)
class EngineSpec:
    """What one engine is built from, the same in every backend: the job plan makes it (`JobPlan.engine_spec`),
    a replica actor or the local backend calls `build()`. Picklable: Ray hands it to the actor whole."""

    engine: str
    """A name of `ENGINES` (`inference.engine`, `reward.judge.engine`)."""
    model_path: str
    """A local directory, a hub id, or the driver's snapshot (resolved on the node that builds)."""
    seed: int = 0
    dtype: str = "float32"
    tensor_parallel_size: int = 1
    options: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    """`inference.options` as the plan placed them (`placed_options`); typed by `build_engine`."""
    revision: str = ""
    lora: Any = None
    """The policy's `LoraOptions` (rank > 0: updates carry the adapter only), or None."""

    def build(self):
        """The engine (call `await engine.start()` on the loop that serves it)."""
        return build_engine(self.engine, self.model_path, seed=self.seed, dtype=self.dtype,
                            tensor_parallel_size=self.tensor_parallel_size, options=self.options,
                            revision=self.revision, lora=self.lora)


def build_engine(name: str, model_path: str, *, seed: int = 0, dtype: str = "float32", version: int = 0,
                 tensor_parallel_size: int = 1, options: Mapping[str, Any] | None = None, revision: str = "",
                 lora=None):
    """The engine `name` over `model_path` (call `await engine.start()` on the loop that serves it).

    `model_path` (a local directory, a hub id, or the driver's snapshot directory) is resolved on this
    node first (`resolve_model_path`), so every engine gets a local directory. `lora`: the policy's
    `LoraOptions` (rank > 0: updates carry the adapter only), or None."""
    from rayllm_rl.hub import resolve_model_path

    cls = job_side(name)
    if not engine_installed(name):
        raise ImportError(f"inference.engine={name} needs the {cls.requires} package: {cls.install_hint}")
    return cls.build(resolve_model_path(model_path, revision), seed=seed, dtype=dtype, version=version,
                     tensor_parallel_size=tensor_parallel_size, options=engine_options(name, options),
                     lora=lora if lora is not None and lora.enabled else None)
