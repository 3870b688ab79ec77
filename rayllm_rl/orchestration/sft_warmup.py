"""The SFT warm start before RL, shared by both backends (they pass their own train/reset calls)."""
from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any, Callable

from rayllm_rl.envs.task import Task
from rayllm_rl.orchestration.job_config import GRPOJobConfig


def sft_chats(task: Task, rows: list[dict]) -> list[list[dict]]:
    """Demonstration chats for the SFT warm start."""
    return [r["messages"] + [{"role": "assistant", "content": task.sft_target(r)}] for r in rows]


def sft_warm_start(cfg: GRPOJobConfig, task: Task, tokenizer, reporter,
                   train_step: Callable[[Any, Any], dict], reset_optimizer: Callable[[Any], Any]) -> str | None:
    """Imitate the task's demonstrations for `sft.steps` steps (or until `sft.time_budget_s`), with the
    SFT learning rate, then give the learner(s) back the RL optimizer. Presets: 250 steps for the
    arithmetic demo, none for the other tasks. Both backends: `train_step(batch, loss) -> metrics`
    and `reset_optimizer(optim_cfg)` reach the local learner or the learner actors."""
    from rayllm_rl.data.loader import PromptLoader
    from rayllm_rl.data.sft import make_sft_batch
    from rayllm_rl.objectives import SFTLoss

    if cfg.sft.steps <= 0:  # the default outside the arithmetic demo (its preset asks for 250 steps)
        return None
    if task.sft_target is None:  # asked for, but there is nothing to imitate: say so instead of a silent no-op
        note = f"sft.steps={cfg.sft.steps} but task={task.name} has no demonstrations: no SFT warm start"
        reporter.log({"phase": "sft", "skipped": note})
        logging.getLogger(__name__).warning(note)
        return None
    reset_optimizer(dataclasses.replace(cfg.optim, lr=cfg.sft.lr, warmup_steps=cfg.sft.warmup_steps))
    loader, loss, t0 = PromptLoader(task.train, seed=cfg.trainer.seed + 1), SFTLoss(), time.perf_counter()
    cut = None
    for step in range(1, cfg.sft.steps + 1):
        metrics = train_step(make_sft_batch(tokenizer, sft_chats(task, loader.next_rows(cfg.sft.batch_size))), loss)
        reporter.log({"phase": "sft", "sft_step": step, **metrics}, show=step % 50 == 0)
        if cfg.sft.time_budget_s and time.perf_counter() - t0 > cfg.sft.time_budget_s:
            cut = f"sft.time_budget_s={cfg.sft.time_budget_s:g} cut the SFT warm start at step {step} of {cfg.sft.steps}"
            reporter.log({"phase": "sft", "sft_step": step, "stopped": cut}, show=True)
            break
    reset_optimizer(cfg.optim)
    return cut
