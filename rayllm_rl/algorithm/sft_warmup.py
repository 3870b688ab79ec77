"""The SFT warm start before RL, shared by both backends (they pass their own train/reset calls), and
the SFT-warmed demo model that a LoRA job on the tiny demo model adapts (`sft_warmed_demo_model`).

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
import logging
import os
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from rayllm_rl.envs.task import Task

if TYPE_CHECKING:  # the job's config is read, never built, here
    from rayllm_rl.job.config import GRPOJobConfig


def sft_chats(task: Task, rows: list[dict]) -> list[list[dict]]:
    """Demonstration chats for the SFT warm start."""
    return [r["messages"] + [{"role": "assistant", "content": task.sft_target(r)}] for r in rows]


def sft_batch(task: Task, tokenizer, rows: list[dict]):
    """The SFT batch of `rows`: the task's demonstrated episodes (`Task.demonstrate`, several turns each) when it has
    them, else one chat per row ending in `sft_target`'s reply."""
    from rayllm_rl.data.sft import make_sft_batch

    if task.demonstrate is not None:
        return task.demonstrate(tokenizer, rows)
    return make_sft_batch(tokenizer, sft_chats(task, rows))


def sft_warm_start(cfg: GRPOJobConfig, task: Task, tokenizer, reporter,
                   train_step: Callable[[Any, Any], dict], reset_optimizer: Callable[[Any], Any]) -> str | None:
    """Imitate the task's demonstrations for `sft.steps` steps (or until `sft.time_budget_s`), with the
    SFT learning rate, then give the learner(s) back the RL optimizer. Presets: 250 steps for the
    arithmetic demo, none for the other tasks. Both backends: `train_step(batch, loss) -> metrics`
    and `reset_optimizer(optim_cfg)` reach the local learner or the learner actors."""
    from rayllm_rl.data.loader import PromptLoader
    from rayllm_rl.objectives import SFTLoss

    if cfg.sft.steps <= 0:  # the default outside the arithmetic demo (its preset asks for 250 steps)
        return None
    if task.sft_target is None and task.demonstrate is None:  # nothing to imitate: say so
        note = f"sft.steps={cfg.sft.steps} but task={task.name} has no demonstrations: no SFT warm start"
        reporter.log({"phase": "sft", "skipped": note})
        logging.getLogger(__name__).warning(note)
        return None
    reset_optimizer(dataclasses.replace(cfg.optim, lr=cfg.sft.lr, warmup_steps=cfg.sft.warmup_steps,
                                        lr_schedule="constant"))
    loader, loss, t0 = PromptLoader(task.train, seed=cfg.trainer.seed + 1), SFTLoss(), time.perf_counter()
    cut = None
    with reporter.task_progress(cfg.sft.steps, "sft warm start") as tick:
        for step in range(1, cfg.sft.steps + 1):
            metrics = train_step(sft_batch(task, tokenizer, loader.next_rows(cfg.sft.batch_size)), loss)
            metrics.pop("trace", None)  # the RL steps' token trace (traces.jsonl), not a metric
            reporter.log({"phase": "sft", "sft_step": step, **metrics}, show=step % 50 == 0)
            tick(1)
            if cfg.sft.time_budget_s and time.perf_counter() - t0 > cfg.sft.time_budget_s:
                cut = (f"sft.time_budget_s={cfg.sft.time_budget_s:g} cut the SFT warm start at step {step} "
                       f"of {cfg.sft.steps}")
                reporter.log({"phase": "sft", "sft_step": step, "stopped": cut}, show=True)
                break
    reset_optimizer(cfg.optim)
    return cut


def sft_warmed_demo_model(cfg, model_path: str, task, tokenizer, reporter, threads: int = 0) -> str:
    """`model_path` itself, except for a LoRA job on the tiny demo model (`model.path` empty): that model
    after the task's full-weight SFT warm start, built once and cached, with `threads` torch threads (0 =
    as they are; `JobPlan.learner_threads`). Returns a local HF directory."""
    if cfg.model.lora.rank <= 0 or cfg.model.path:
        return model_path
    from rayllm_rl.envs.task_registry import task_entry

    preset = task_entry(cfg.task).presets
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
    _warm_up_demo(cfg, sft, model_path, task, tokenizer, reporter, out, threads)
    return str(out)


def _warm_up_demo(cfg, sft, model_path: str, task, tokenizer, reporter, out: Path, threads: int) -> None:
    """The full-weight SFT warm start of the demo, on a Learner in this process; saved atomically."""
    import torch

    from rayllm_rl.learner.learner import Learner

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
