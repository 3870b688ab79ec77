"""The base model a LoRA job adapts.

A LoRA adapter adapts a pretrained model: it cannot change the embeddings, the LM head or the norms.
The offline tiny demo model (`model.path` empty) is random until its SFT warm start, and with its
embeddings, tied head and final norm frozen at their random initialisation its logits stay within about
+-3, so an adapter alone cannot make it answer (measured: greedy answers improve, yet sampled rollouts at
temperature 1 stay near uniform and the RL reward stays 0). So for the demo the base of a LoRA job is
the tiny model after the demo's own full-weight SFT warm start (`TASK_PRESETS`' sft.* of the task,
logged as phase "sft" like the full-weight demo's), built once, in this process, and cached on disk
beside the tiny model; the learner and every replica load it with `from_pretrained` like any model.
A job that names `model.path` adapts that model as it is.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
from pathlib import Path


def lora_base_model(cfg, model_path: str, task, tokenizer, reporter, threads: int = 0) -> str:
    """`model_path` itself, except for a LoRA job on the tiny demo model (`model.path` empty): that model
    after the task's full-weight SFT warm start, built once and cached, with `threads` torch threads (0 =
    as they are; `JobPlan.learner_threads`). Returns a local HF directory."""
    if cfg.model.lora.rank <= 0 or cfg.model.path:
        return model_path
    from rayllm_rl.orchestration.presets import TASK_PRESETS

    preset = TASK_PRESETS[cfg.task]
    # no time budget: the cached base must not depend on how busy the machine was
    sft = dataclasses.replace(cfg.sft, steps=preset["sft.steps"], lr=preset["sft.lr"], time_budget_s=0.0)
    if sft.steps <= 0 or task.sft_target is None:
        return model_path
    key = hashlib.sha256(json.dumps([os.path.realpath(model_path), cfg.task, dataclasses.asdict(sft),
                                     cfg.trainer.seed, dataclasses.asdict(cfg.data)], sort_keys=True,
                                    default=str).encode()).hexdigest()[:12]
    out = Path(model_path).parent / f"{Path(model_path).name}-sft-{key}"
    if (out / "config.json").exists():
        reporter.log({"phase": "sft", "skipped": f"LoRA base: the SFT-warmed tiny model is cached at {out}"}, show=True)
        return str(out)
    _warm_up(cfg, sft, model_path, task, tokenizer, reporter, out, threads)
    return str(out)


def _warm_up(cfg, sft, model_path: str, task, tokenizer, reporter, out: Path, threads: int) -> None:
    """The full-weight SFT warm start of the demo, on a Learner in this process; saved atomically."""
    import torch

    from rayllm_rl.learner.learner import Learner
    from rayllm_rl.orchestration.sft_warmup import sft_warm_start

    base_cfg = dataclasses.replace(cfg, sft=sft, model=dataclasses.replace(cfg.model, lora=dataclasses.replace(
        cfg.model.lora, rank=0)))
    learner = Learner(model_path, base_cfg.optim, temperature=cfg.rollout.temperature, seed=cfg.trainer.seed)
    reporter.log({"phase": "sft", "note": f"LoRA base: full-weight SFT warm start of the tiny model ({sft.steps} "
                                          f"steps, lr {sft.lr:g}), cached at {out}"}, show=True)
    before = torch.get_num_threads()
    torch.set_num_threads(threads or before)  # as the learner would (faster on a busy box)
    try:
        sft_warm_start(base_cfg, task, tokenizer, reporter, learner.train_step, learner.reset_optimizer)
    finally:
        torch.set_num_threads(before)
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    learner.model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)
