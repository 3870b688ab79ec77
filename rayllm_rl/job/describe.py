"""The dry-run description of a job's plan: what `jobs/grpo.py ... --dry-run` prints, computed without starting
anything.

`describe_plan(make_plan(cfg))` (or `describe_job(cfg)`) returns a JSON-able dict: the plan's decisions
(`plan_decisions`: the engine, every actor with its Ray CPU/GPU request, torch threads, bundle and
restarts, the placement group, the weight transport, all from `job.plan.JobPlan`), the data sources (a
local path must exist; a hub dataset's config and split are looked up in the local datasets cache, rows
never loaded), and a memory estimate of each learner rank and of each replica's KV cache from the model's
config.json (read from the HF cache, never downloaded; no weights are loaded, no Ray is started).

Memory model (bytes, per learner rank, `b` = bytes of model.dtype, P = parameters, W = learner ranks):
params, grads and the two AdamW moments are each P*m/W with m = max(b, 4) (FSDP2 shards them; the
learner keeps float32 master weights, learner/precision.py); with W > 1 one decoder layer plus the root
(embeddings, lm_head) is gathered whole at a time, in model.dtype; with W = 1 and b < 4, autocast's
model.dtype copy of every weight (P*b) lives through the backward. Activations: tokens of one
micro-batch x layers x (8H + 3*kv_dim + 4I) elements saved for the backward (the two RMSNorms' inputs
and outputs, q/k/v before and after RoPE, the attention output, the gated MLP's gate, up, SiLU and
product), or one H per layer per token plus one layer's full set with activation checkpointing. A
micro-batch holds min(optim.max_tokens_per_micro_batch // sequence length, optim.micro_batch_size if
set) rows. Logits: with optim.logprob_chunk_size > 0, chunk x vocabulary x 12 bytes (a float32 block, a
second one for the entropy, one in backward); without, all the micro-batch's tokens x vocabulary x
(b+12): the logits, their float32 copy, log_softmax, gradient.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any

from rayllm_rl.job.config import GRPOJobConfig
from rayllm_rl.job.plan import REFERENCE, TEACHER, JobPlan, make_plan
from rayllm_rl.sampling_mask import SamplingMask

GiB = float(1 << 30)

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


class PlanError(ValueError):
    """The plan cannot be made (e.g. an offline hub id whose config.json is not in the cache)."""


# ---------------------------------------------------------------------------------------- model


def _prompt_tokens(cfg: GRPOJobConfig) -> int:
    """Typical prompt length of the task (its registry entry's estimate), for the memory estimate only."""
    from rayllm_rl.envs.task_registry import task_entry

    return task_entry(cfg.task).prompt_tokens


def read_model_config(cfg: GRPOJobConfig) -> tuple[dict | None, str]:
    """(config.json as a dict or None, where it came from or why it is unknown).

    Empty model.path: the offline tiny Qwen2 (its cached config.json, else its spec). A hub id not
    in the cache is "unknown", unless HF_HUB_OFFLINE is on: then the job could never start, and this
    raises PlanError naming the id."""
    from rayllm_rl.hub import cached_model_file, hub_cache_dir, hub_offline, is_hub_id

    path, revision = cfg.model.path, cfg.model.revision
    if not path:
        return _tiny_model_config()
    local = os.path.expanduser(path)
    if os.path.isdir(local):
        found = cached_model_file(path, "config.json", revision)
        if found is None:
            raise PlanError(f"model.path {path!r} is a directory without config.json: not a Hugging Face model")
    elif is_hub_id(path):
        found = cached_model_file(path, "config.json", revision)
        if found is None:
            if hub_offline():
                raise PlanError(f"model.path {path!r} (revision {revision or 'main'!r}): config.json is not in the HF "
                                f"cache {hub_cache_dir()!r} and HF_HUB_OFFLINE is on, so the job cannot fetch it")
            return None, "unknown: config.json not in the cache"
    else:
        raise PlanError(f"model.path {path!r} is neither an existing local directory nor a hub id 'org/name'")
    with open(found) as f:
        return json.load(f), found


def gguf_plan(cfg: GRPOJobConfig) -> dict[str, Any] | None:
    """What a GGUF `model.path` will load (None for an HF model): the file, its architecture and tensor
    types, and the converted directory every role loads, with whether it is already cached. Reads only the
    metadata; a file transformers cannot dequantize raises PlanError naming its architecture. A `pypi:` source
    is not fetched here: the plan says where it comes from, and reads the file only if this node has it."""
    from rayllm_rl.hub import gguf_source
    from rayllm_rl.models import pypi_wheel
    from rayllm_rl.models.gguf import GGUFError, converted_dir, inspect_gguf, is_converted

    wheel = None
    try:
        if pypi_wheel.is_wheel_source(cfg.model.path):
            wheel_file = pypi_wheel.parse(cfg.model.path)
            local = pypi_wheel.cached_file(wheel_file)
            wheel = {"requirement": wheel_file.requirement, "member": wheel_file.member, "pinned_sha256":
                     wheel_file.sha256 or None, "cache": str(wheel_file.cache_path), "fetched_here": local is not None}
            if local is None:
                return {"file": str(wheel_file.cache_path), "pypi": wheel, "config": None}
            source = str(local)
        else:
            source = gguf_source(cfg.model.path, cfg.model.gguf_file, cfg.model.revision)
        if source is None:
            return None
        info = inspect_gguf(source)
    except (GGUFError, pypi_wheel.WheelSourceError) as error:
        raise PlanError(str(error)) from error
    target = converted_dir(source)
    out = {"file": source, "architecture": info.architecture, "model_type": info.model_type, "name": info.name,
           "tensor_types": info.tensor_types, "size_bytes": info.size_bytes, "converted_dir": str(target),
           "cached": is_converted(target), "config": info.config}
    return {**out, "pypi": wheel} if wheel else out


def _source_plan(source: str, split: str, field: str, default_config: str | None) -> dict[str, Any]:
    """What the job will read for one data source, checked without loading rows: a local path must exist;
    a hub dataset's config and split are checked against the local `datasets` cache. Offline (where the
    job could never fetch it) a miss raises PlanError naming `field`; online it is "not cached"."""
    from rayllm_rl.data.sources import (
        _cache_folder, cached_configs, cached_splits, datasets_offline, parse_source, source_kind)

    kind = source_kind(source)
    if kind == "missing":
        raise PlanError(f"{field}={source!r}: no such file or folder")
    out: dict[str, Any] = {"source": source, "kind": kind}
    if kind == "file":
        return {**out, "status": "local file"}
    if kind in ("disk", "folder"):
        return {**out, "split": split, "status": "local dataset folder"}
    name, config, split = parse_source(source, split)
    offline, configs = datasets_offline(), cached_configs(name)
    where = f"{field}={source!r} (hub dataset {name!r}, datasets cache {_cache_folder(name)})"
    if config is None and len(configs) == 1:
        config = configs[0]
    elif config is None and configs:
        config = default_config if default_config in configs else None
        if config is None and offline:
            raise PlanError(f"{where}: the cached configs are {configs} and none was given; name one, e.g. "
                            f"{field}={name}:{configs[0]}")
    splits = cached_splits(name, config) if config else []
    out.update(name=name, config=config, split=split, cached_configs=configs)
    if config is not None and config in configs and split in splits:
        return {**out, "status": "cached"}
    missing = ("not cached" if not configs else
               f"config {config!r} is not cached (cached: {configs})" if config and config not in configs else
               f"split {split!r} of config {config!r} is not cached (cached: {splits})" if config else
               "not cached")
    if offline:
        raise PlanError(f"{where}: {missing}, and offline mode is on (HF_HUB_OFFLINE/HF_DATASETS_OFFLINE), so the "
                        "job cannot load it")
    return {**out, "status": f"{missing}: will download at start"}


def data_plan(cfg: GRPOJobConfig, inputs: Any = None) -> dict[str, Any] | None:
    """The data sources of the task (train, eval), each checked by `_source_plan`, plus what the task's registry
    entry adds (`plan_rows`: generated rows described, the prompt task's first row and reward checked); None
    for a task that generates its rows and says nothing (arithmetic). An eval source naming no split reads
    "test"; the same source for both is a PlanError, as is what `plan_rows` refuses."""
    from rayllm_rl.data.sources import EVAL_SPLIT
    from rayllm_rl.envs.task_registry import task_entry
    from rayllm_rl.job.inputs import JobInputs
    from rayllm_rl.object_path import import_object

    entry = task_entry(cfg.task)
    inputs = inputs if inputs is not None else JobInputs.of(cfg)

    def extra() -> dict[str, Any]:
        return import_object(entry.plan_rows)(cfg.data, inputs) if entry.plan_rows else {}

    if entry.rows == "generated":
        return extra() or None
    if entry.rows == "factory":
        return {"train": {"kind": "factory", "source": cfg.task, "status": "rows made by the factory at start"},
                "eval": None}
    if not cfg.data.path:
        raise PlanError(f"task={cfg.task} reads its prompts from data.path (e.g. data.path={entry.example_path}); "
                        "none was given")
    default = entry.default_config
    plan = {"train": _source_plan(cfg.data.path, cfg.data.split, "data.path", default), "eval": None}
    if cfg.data.eval_path:
        plan["eval"] = _source_plan(cfg.data.eval_path, EVAL_SPLIT, "data.eval_path", default)
        same = ("name", "config", "split") if plan["train"]["kind"] == "hub" else ("source",)
        a, b = plan["train"], plan["eval"]
        if a["kind"] == b["kind"] and all(a.get(k) is not None and a.get(k) == b.get(k) for k in same):
            raise PlanError(f"data.eval_path={cfg.data.eval_path!r} and data.path={cfg.data.path!r} are the same rows: "
                            "the evaluation would score the policy on its training rows")
    return {**plan, **extra()}


def _tiny_model_config() -> tuple[dict, str]:
    """The built-in tiny Qwen2's config: the cached build's config.json, else its TinyModelSpec."""
    import dataclasses

    from rayllm_rl.models.tiny import TinyModelSpec, default_cache_dir

    spec = TinyModelSpec()
    built = default_cache_dir() / f"tiny-qwen2-{spec.key()}" / "config.json"
    if built.is_file():
        return json.loads(built.read_text()), str(built)
    fields = {k: v for k, v in dataclasses.asdict(spec).items() if k != "seed"}
    return {"model_type": "qwen2", "tie_word_embeddings": True, **fields}, "TinyModelSpec (not built yet)"


def architecture(config: dict) -> dict[str, Any]:
    """Shape numbers and the exact parameter count of a dense decoder (LLaMA/Qwen2/Mistral family:
    GQA attention, gated MLP, RMSNorm) from its config.json."""
    c = config.get("text_config", config)
    H, I, L = int(c["hidden_size"]), int(c["intermediate_size"]), int(c["num_hidden_layers"])
    heads = int(c["num_attention_heads"])
    kv_heads = int(c.get("num_key_value_heads") or heads)
    head_dim = int(c.get("head_dim") or H // heads)
    V = int(c["vocab_size"])
    tied = bool(c.get("tie_word_embeddings", config.get("tie_word_embeddings", False)))
    bias = c.get("model_type") == "qwen2" or bool(c.get("attention_bias", False))
    q_dim, kv_dim = heads * head_dim, kv_heads * head_dim
    attn = H * q_dim + 2 * H * kv_dim + q_dim * H + ((q_dim + 2 * kv_dim) if bias else 0)
    layer = attn + 3 * H * I + 2 * H  # + gate/up/down, + the two RMSNorm weights
    embed = V * H
    params = embed + L * layer + H + (0 if tied else embed)
    return {"model_type": c.get("model_type", "?"), "hidden_size": H, "intermediate_size": I, "num_layers": L,
            "num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": head_dim, "vocab_size": V,
            "tie_word_embeddings": tied, "params": params, "layer_params": layer, "embedding_params": embed,
            "max_position_embeddings": c.get("max_position_embeddings")}


# ---------------------------------------------------------------------------------------- memory


def _optim(cfg: GRPOJobConfig, name: str, default: Any) -> Any:
    """An optim field that may not exist yet in this version of OptimConfig."""
    return getattr(cfg.optim, name, default)


def learner_memory(plan: JobPlan, arch: dict) -> dict[str, Any]:
    """Estimated bytes held by one learner rank during a train step (see the module docstring)."""
    cfg = plan.config
    b = DTYPE_BYTES[cfg.model.dtype]
    P, W = arch["params"], plan.learner_ranks
    H, I, L, V = arch["hidden_size"], arch["intermediate_size"], arch["num_layers"], arch["vocab_size"]
    kv_dim = arch["num_key_value_heads"] * arch["head_dim"]
    seq = _prompt_tokens(cfg) + cfg.rollout.max_new_tokens
    rows = math.ceil(cfg.rollout.prompts_per_step * cfg.rollout.group_size / max(1, cfg.optim.num_minibatches) / W)
    budget = int(_optim(cfg, "max_tokens_per_micro_batch", 0) or 0)  # padded tokens; a longer row goes alone
    row_cap = int(cfg.optim.micro_batch_size or 0)  # 0 = no row cap (with a token budget)
    mb_rows = min(rows, max(1, budget // seq) if budget > 0 else rows, row_cap if row_cap > 0 else rows)
    mb_tokens = mb_rows * seq
    checkpointing = bool(_optim(cfg, "activation_checkpointing", False))
    per_layer = 8 * H + 3 * kv_dim + 4 * I
    act_elems = mb_tokens * (L * H + per_layer) if checkpointing else mb_tokens * L * per_layer
    chunk = int(_optim(cfg, "logprob_chunk_size", 0) or 0)
    # chunked LM head: one [chunk, V] float32 block, two while the entropy is computed, one more in backward
    logit_bytes = min(mb_tokens, chunk) * V * 12 if chunk > 0 else mb_tokens * V * (b + 12)
    import torch

    from rayllm_rl.learner.precision import Precision

    precision = Precision.of(getattr(torch, cfg.model.dtype), sharded=W > 1)  # the learner's own decision
    shard = P * precision.master.itemsize / W  # master weights, their gradients and AdamW state
    gathered = (arch["layer_params"] + arch["embedding_params"] * (1 if arch["tie_word_embeddings"] else 2)) * b \
        if W > 1 else 0.0
    # one process under autocast: the compute-dtype casts of every weight are kept for backward
    casts = P * b if precision.uses_autocast else 0.0
    parts = {"params": shard, "grads": shard, "adamw_state": 2 * shard, "fsdp_gathered": gathered,
             "autocast_weight_copies": casts, "activations": act_elems * b, "logits": logit_bytes}
    return {"bytes": {k: int(v) for k, v in parts.items()}, "total_bytes": int(sum(parts.values())),
            "assumed": {"sequence_tokens": seq, "prompt_tokens": seq - cfg.rollout.max_new_tokens,
                        "rows_per_rank_per_optimizer_step": rows, "micro_batch_rows": mb_rows,
                        "micro_batch_tokens": mb_tokens,
                        "logits_tokens_at_once": min(mb_tokens, chunk) if chunk > 0 else mb_tokens,
                        "activation_checkpointing": checkpointing, "dtype": cfg.model.dtype, "learner_ranks": W}}


def kv_cache_memory(plan: JobPlan, arch: dict) -> dict[str, Any]:
    """Per replica: KV bytes per token, what the step's sequences need, and the engine's budget."""
    from rayllm_rl.inference.registry import job_side, engine_options

    cfg = plan.config
    b = DTYPE_BYTES[cfg.model.dtype]
    per_token = 2 * arch["num_layers"] * arch["num_key_value_heads"] * arch["head_dim"] * b
    seq = _prompt_tokens(cfg) + cfg.rollout.max_new_tokens
    in_flight = math.ceil(cfg.rollout.prompts_per_step * cfg.rollout.group_size * (cfg.rollout.max_staleness + 1)
                          / plan.replicas)
    rc = cfg.ray
    out: dict[str, Any] = {"bytes_per_token": per_token, "sequence_tokens": seq}
    weights = arch["params"] * b / rc.tensor_parallel_size
    out.update(job_side(plan.engine).kv_cache_plan(
        engine_options(plan.engine, plan.engine_options), gpus_per_replica=rc.gpus_per_replica, weights_bytes=weights,
        per_token=per_token, sequence_tokens=seq, in_flight=in_flight))
    concurrent = out["concurrent_sequences"]
    out["needed_bytes"] = int(concurrent * seq * per_token)
    return out


# ---------------------------------------------------------------------------------------- placement


def placement_plan(plan: JobPlan) -> dict[str, Any]:
    """The placement group the Ray backend reserves (`plan.layout`): bundles, replicas first, then learner
    ranks, and strategy; none when no GPU is asked for (and none at all in the local backend)."""
    from rayllm_rl.job.plan import LEARNER, REPLICA
    from rayllm_rl.job.placement_rules import STRATEGY

    layout, rc = plan.layout, plan.config.ray
    shared = {"replica_gpus": layout.replica_asks, "learner_gpus": layout.learner_asks,
              **{f"{name}_gpus": getattr(plan.frozen_spec(name), "gpu_share", 0.0) for name in (REFERENCE, TEACHER)},
              "colocated": layout.colocated}
    if plan.actors:  # the Ray backend's actors are placed; the local backend has none
        shared = {"placement": rc.placement, **shared}
    if not layout.uses_gpus:
        return {"placement_group": False, "strategy": None, "bundles": [], "total_gpus": 0.0, **shared}
    if layout.colocated:
        names = [f"{REPLICA.format(i)} + {LEARNER.format(i)} (sharing one GPU, taking turns)"
                 for i in range(layout.num_replicas)]
    else:
        names = [REPLICA.format(i) for i in range(layout.num_replicas)] + \
            [LEARNER.format(r) for r in range(layout.num_learners)]
    bundles = [{"for": name, **bundle} for name, bundle in zip(names, layout.bundles())]
    return {"placement_group": True, "strategy": STRATEGY, "bundles": bundles,
            "total_gpus": sum(b.get("GPU", 0.0) for b in bundles), **shared}


# ---------------------------------------------------------------------------------------- the plan


def lr_schedule_text(optim) -> str:
    """The learning rate over RL in words, e.g. 'warm-up 5 steps, then cosine to 0.1 x lr at optimizer step 150'."""
    warm = f"warm-up {optim.warmup_steps} steps, then " if optim.warmup_steps > 0 else ""
    if optim.lr_schedule == "constant":
        return warm + "constant"
    return f"{warm}{optim.lr_schedule} to {optim.min_lr_ratio:g} x lr at optimizer step {optim.decay_steps}"


def plan_decisions(plan: JobPlan) -> dict[str, Any]:
    """What the plan decided, as the dry run shows it (JSON-able): backend, engine, rollout and schedule,
    every actor, the placement group and the weight transport. Reads nothing from disk."""
    from rayllm_rl.inference.registry import engine_installed

    cfg = plan.config
    out: dict[str, Any] = {
        "task": cfg.task, "backend": plan.backend, "algo": cfg.algo.name,
        "engine": {"name": plan.engine, "replicas": plan.replicas, "tensor_parallel_size": cfg.ray.tensor_parallel_size,
                   "installed_here": engine_installed(plan.engine)},
        "rollout": {"prompts_per_step": cfg.rollout.prompts_per_step, "group_size": cfg.rollout.group_size,
                    "max_new_tokens": cfg.rollout.max_new_tokens, "max_staleness": cfg.rollout.max_staleness},
        "schedule": {"sft_steps": cfg.sft.steps, "rl_steps": cfg.trainer.steps, "optim_lr": cfg.optim.lr,
                     "optim_lr_schedule": lr_schedule_text(cfg.optim),
                     "trainer_time_budget_s": cfg.trainer.time_budget_s,
                     "eval": cfg.data.eval_path or f"{cfg.data.eval_size} prompts held out of the training rows"},
        "actors": [a.describe() for a in plan.actors], "placement": placement_plan(plan),
        "weight_transport": plan.transport.describe(), "needs_reference": REFERENCE in plan.frozen_names(),
        "buffer_capacity": plan.buffer_capacity, "batch_stages": plan.batch_pipeline.names,
        "results": results_plan(cfg),
    }
    teacher = plan.frozen_spec(TEACHER)
    if teacher is not None:  # on-policy distillation (docs/distillation.md)
        out["teacher"] = {"path": cfg.teacher.path, "coef": cfg.teacher.coef, "task_coef": cfg.teacher.task_coef,
                          "placement": (f"{teacher.gpu_share:g} GPU of learner-0's bundle" if teacher.gpu_share
                                        else "CPU, in this process" if plan.in_process else "CPU")}
    if SamplingMask(cfg.rollout.top_k, cfg.rollout.top_p).active:  # truncated sampling: does the learner replay it?
        out["rollout"]["truncation"] = {"top_p": cfg.rollout.top_p, "top_k": cfg.rollout.top_k,
                                        "learner_replays_mask": plan.sampling_mask.active}
    if not plan.actors:
        out["note"] = f"trainer.backend={plan.backend}: every role runs in this process on CPU; no Ray"
    out["total_gpus"] = out["placement"]["total_gpus"]
    return out


def describe_plan(plan: JobPlan) -> dict[str, Any]:
    """The whole dry-run description of a job's plan (JSON-able): its decisions (`plan_decisions`), the
    data sources, the model's architecture and the memory estimates; raises PlanError when a source or
    the model cannot be found."""
    cfg = plan.config
    out = plan_decisions(plan)
    out["model"] = {"path": cfg.model.path or "(built-in tiny Qwen2)", "revision": cfg.model.revision or "main",
                    "dtype": cfg.model.dtype}
    gguf = gguf_plan(cfg) if cfg.model.path else None
    if gguf is None:
        config, source = read_model_config(cfg)
    else:  # the config transformers derives from the file's metadata
        config, source = gguf.pop("config"), f"GGUF metadata of {gguf['file']}"
        if config is None:  # a pypi: source this machine has not fetched
            source = "unknown until the wheel is fetched (each node fetches it when the job starts)"
        out["model"]["gguf"] = gguf
    out["data"] = data_plan(cfg)
    out["model"]["config_source"] = source
    if config is None:
        out["memory"] = {"unknown": source}
    else:
        arch = architecture(config)
        out["model"]["architecture"] = arch
        out["memory"] = {"learner_per_rank": learner_memory(plan, arch),
                         "kv_cache_per_replica": kv_cache_memory(plan, arch)}
    if plan.frozen_spec(TEACHER) is not None:
        out["teacher"].update(teacher_cost(plan))
    return out


def teacher_cost(plan: JobPlan) -> dict[str, Any]:
    """The teacher's memory (its weights in the job's dtype, and the largest scoring micro-batch's activations and
    logits chunk) and its work per batch (one forward over every sampled row, each group's prompt once with
    optim.share_prompts: ~2 x params FLOPs a token, a third of the learner's forward + backward), from its
    config.json when this machine can read it."""
    cfg = plan.config
    teacher_cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, path=cfg.teacher.path, revision="",
                                                                     gguf_file=""))
    try:  # the model's own readers, on the teacher's path: their errors name the teacher's key
        gguf = gguf_plan(teacher_cfg)
        config, source = read_model_config(teacher_cfg) if gguf is None else (gguf["config"], gguf["file"])
    except PlanError as error:
        raise PlanError(str(error).replace("model.path", "teacher.path")) from error
    if config is None:
        return {"memory": source if gguf is None else "unknown: the wheel is not fetched on this machine"}
    arch, b = architecture(config), DTYPE_BYTES[cfg.model.dtype]
    seq = _prompt_tokens(cfg) + cfg.rollout.max_new_tokens
    rows = cfg.rollout.prompts_per_step * cfg.rollout.group_size
    padded = rows * seq
    # with optim.share_prompts each group's prompt runs once (learner.shared_prompt), as in the learner's forward
    tokens = (cfg.rollout.prompts_per_step * _prompt_tokens(cfg) + rows * cfg.rollout.max_new_tokens
              if cfg.optim.share_prompts else padded)
    mb_tokens = min(padded, max(seq, cfg.optim.max_tokens_per_micro_batch))
    chunk = cfg.optim.logprob_chunk_size or mb_tokens
    parts = {"weights": arch["params"] * b,
             "activations": mb_tokens * (4 * arch["hidden_size"] + 2 * arch["intermediate_size"]) * b,
             "logits": min(mb_tokens, chunk) * arch["vocab_size"] * 8}
    return {"config_source": source, "params": arch["params"], "memory_bytes": {k: int(v) for k, v in parts.items()},
            "memory_total_bytes": int(sum(parts.values())),
            "flops_per_batch": 2 * arch["params"] * tokens, "tokens_per_batch": tokens,
            "time_per_batch": "about a third of a learner step's compute at the same size (a forward, no backward)"}


def results_plan(cfg: GRPOJobConfig) -> dict[str, Any]:
    """Where the run's directory and a relative resume will be, resolved as the job resolves them here."""
    from rayllm_rl.storage import with_resolved_paths

    resolved, root = with_resolved_paths(cfg)
    return {"run_dir": f"{resolved.trainer.run_dir}/<stamp>", "storage_root": str(root.path), "source": root.source,
            "resume": resolved.resume or None}


def describe_job(cfg: GRPOJobConfig, inputs: Any = None, *, environment: bool = False) -> dict[str, Any]:
    """The dry-run description of a job config, resolved or not: `describe_plan(make_plan(cfg, ...))`, by default
    for other machines (`environment=False`: this one need not have their packages)."""
    return describe_plan(make_plan(cfg, inputs, environment=environment))
