"""Learner checkpoints: an HF model directory plus `learner_state.pt`, resumable bit for bit.

Layout of `path/`:
  config.json, model.safetensors, ...   full weights, `AutoModelForCausalLM.from_pretrained(path)`
  tokenizer files                        when a tokenizer is given
  learner_state.pt                       {"format", "optimizer" (full, keyed by parameter name),
                                          "optim_steps", "generator" (minibatch
                                          permutation RNG), "rng" (torch RNG state per rank),
                                          "world_size", "extra" (the driver's: data loader state,
                                          the policy version it owns, ...)}

A LoRA learner (`model.lora.rank > 0`) saves its adapter in PEFT format instead of the full weights:
  adapter_model.safetensors, adapter_config.json   `PeftModel.from_pretrained(base, path)`; vLLM's LoRARequest
and `rayllm_rl.lora.export_merged` (`python -m rayllm_rl.export_lora path out`) merges it into a full
HF model. The optimizer state covers the adapter only.

Under FSDP both functions are collectives: every rank calls them; full weights and optimizer
state are gathered to rank 0 (CPU) and only rank 0 writes; on load only rank 0 reads the files
and broadcasts to the others. The optimizer state is stored unsharded and keyed by parameter
name, so a checkpoint saved with W ranks loads with any W (exact continuation needs the same W:
the summation order of the gradients depends on it).
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from rayllm_rl.learner.distributed import all_gather_objects, barrier, broadcast_object

FORMAT = 1
STATE_FILE = "learner_state.pt"


def _options(**kw):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, **kw)


def _rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def save_checkpoint(learner, path: str | os.PathLike, tokenizer=None, extra: dict | None = None) -> str:
    """Write `learner`'s weights (HF format), optimizer, counters and RNG to `path`; returns `path`.

    Collective under FSDP (all ranks gather, rank 0 writes, then all ranks sync on a barrier);
    `tokenizer` and `extra` are only used on rank 0.
    """
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    path = Path(path)
    sharded = learner.world_size > 1
    lora = getattr(learner, "lora", None)
    if lora is not None:  # the adapter by PEFT name: every rank joins each gather, rank 0 keeps a host copy
        adapter = {n: t.detach().cpu().clone() for n, t in learner.iter_named_tensors() if learner.rank == 0}
    # Gathers: every rank must run them (cpu_offload keeps the full copy on rank 0 only).
    model_sd = get_model_state_dict(learner.model, options=_options(cpu_offload=True)) \
        if sharded and lora is None else None
    optim_sd = get_optimizer_state_dict(learner.model, learner.optimizer, options=_options(cpu_offload=sharded))
    rng = all_gather_objects(_rng_state())
    if learner.rank == 0:
        path.mkdir(parents=True, exist_ok=True)
        if lora is not None:
            from rayllm_rl.lora import write_adapter

            write_adapter(path, adapter, lora, getattr(learner, "model_path", ""))
        elif sharded:
            learner.model.save_pretrained(path, state_dict=model_sd)
        else:
            learner.model.save_pretrained(path)
        if tokenizer is not None:
            tokenizer.save_pretrained(path)
        state = {
            "format": FORMAT, "optimizer": optim_sd, "optim_steps": learner.optim_steps,
            "generator": learner.generator.get_state(), "rng": rng,
            "world_size": learner.world_size, "extra": dict(extra or {}),
        }
        tmp = path / (STATE_FILE + ".tmp")
        torch.save(state, tmp)
        os.replace(tmp, path / STATE_FILE)  # its presence marks a complete checkpoint
    barrier()
    return str(path)


def load_checkpoint(learner, path: str | os.PathLike) -> dict:
    """Restore weights, optimizer state, counters and RNG saved by `save_checkpoint`; returns `extra`.

    Collective under FSDP: rank 0 reads `path` and broadcasts. With the same world size, data and
    config, training afterwards is identical to an uninterrupted run. The learner's current
    `OptimConfig` (lr schedule, betas, weight decay) stays in force.
    """
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict
    from transformers import AutoModelForCausalLM

    path = Path(path)
    sharded = learner.world_size > 1
    lora = getattr(learner, "lora", None)
    model_sd: dict[str, Any] = {}
    state: dict[str, Any] = {}
    if learner.rank == 0:
        if not (path / STATE_FILE).exists():
            raise FileNotFoundError(f"{path} is not a learner checkpoint (no {STATE_FILE})")
        _check_lora_match(path, lora)
        state = torch.load(path / STATE_FILE, map_location="cpu", weights_only=False)
        if state.get("format") != FORMAT:
            raise ValueError(f"unsupported learner checkpoint format {state.get('format')!r} in {path}")
        if lora is None:
            dtype = next(learner.model.parameters()).dtype
            model_sd = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).state_dict()
    optim_sd = state.pop("optimizer", {})
    opts = _options(broadcast_from_rank0=True) if sharded else _options()
    if lora is not None:  # the adapter only (small): every rank gets it whole and loads its shard
        from rayllm_rl.lora import model_key, read_adapter

        adapter = broadcast_object({model_key(n): t for n, t in read_adapter(path).items()}
                                   if learner.rank == 0 else None)
        set_model_state_dict(learner.model, adapter, options=_options(strict=False))
    else:
        set_model_state_dict(learner.model, model_sd, options=opts)
    set_optimizer_state_dict(learner.model, learner.optimizer, optim_sd, options=opts)
    del model_sd, optim_sd
    state = broadcast_object(state)
    for g in learner.optimizer.param_groups:  # the current config wins over the saved hyperparameters
        g["betas"] = (learner.cfg.beta1, learner.cfg.beta2)
        g["weight_decay"] = learner.cfg.weight_decay
    learner.optim_steps = int(state["optim_steps"])
    learner.generator.set_state(state["generator"])
    rng = state["rng"]
    _set_rng_state(rng[learner.rank] if len(rng) == learner.world_size else rng[0])
    return state["extra"]


def _check_lora_match(path: Path, lora) -> None:
    """A checkpoint of a LoRA policy loads only into a learner with the same adapter, and vice versa."""
    from rayllm_rl.lora import CONFIG_FILE, LoraOptions

    if (path / CONFIG_FILE).exists():
        saved = LoraOptions.from_adapter_config(path)
        if lora is None:
            raise ValueError(f"{path} holds a LoRA adapter (rank {saved.rank}): resume it with model.lora.rank="
                             f"{saved.rank}, or export a full model with `python -m rayllm_rl.export_lora`")
        if (saved.rank, sorted(saved.target_modules)) != (lora.rank, sorted(lora.target_modules)):
            raise ValueError(f"{path} holds a LoRA adapter of rank {saved.rank} on {sorted(saved.target_modules)}; "
                             f"this job has model.lora.rank={lora.rank}, target_modules={sorted(lora.target_modules)}")
    elif lora is not None:
        raise ValueError(f"{path} holds full weights, not a LoRA adapter: resume it with model.lora.rank=0")


def prune_checkpoints(directory: str | os.PathLike, keep: int) -> list[str]:
    """Delete all but the newest `keep` complete `step_<n>` checkpoints under `directory` (0 keeps all);
    returns the deleted paths. Incomplete ones (no state file: a save cut short) are left alone."""
    import re
    import shutil

    if keep <= 0:
        return []
    steps = sorted((int(m.group(1)), p) for p in Path(directory).glob("step_*")
                   if (m := re.fullmatch(r"step_(\d+)", p.name)) and (p / STATE_FILE).exists())
    doomed = [p for _, p in steps[:-keep]]
    for p in doomed:
        shutil.rmtree(p, ignore_errors=True)
    return [str(p) for p in doomed]
