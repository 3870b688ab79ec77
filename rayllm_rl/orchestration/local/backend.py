"""LocalBackend: every role of a job in this process, driven by the same driver as the Ray backend.

The plain classes the Ray actors wrap run here directly: a TransformersEngine, the
`LLMCollector`, the awaitable replay buffer and the `Learner`. Generation, the collector and
the buffer live on one asyncio loop in a background thread; learner steps run in the
driver's thread, so with `max_staleness >= 1` the next batch is generated while the learner
trains (the engine takes new weights between two decode steps, under its lock).
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import random
import time
from typing import Any

import torch

from rayllm_rl.data.loader import PromptLoader
from rayllm_rl.rollout.replay_buffer import AwaitableEpisodeBuffer, ReplayBuffer
from rayllm_rl.hub import resolve_model_path
from rayllm_rl.inference.protocol import weights_checksum
from rayllm_rl.inference.transformers_engine import TransformersEngine
from rayllm_rl.learner.learner import Learner
from rayllm_rl.loop_thread import EventLoopThread
from rayllm_rl.orchestration.backend import ROLE_KINDS
from rayllm_rl.rollout.collector import LLMCollector, run_and_store
from rayllm_rl.orchestration.fault_ledger import FaultLedger
from rayllm_rl.orchestration.factories import build_episode_filter, build_workflow, local_python_tools
from rayllm_rl.orchestration.local.reward_scorers import local_reward_scorers
from rayllm_rl.orchestration.job_plan import JobPlan
from rayllm_rl.rollout.staleness import StalenessController
from rayllm_rl.workflows.evaluation import evaluate_greedy
from rayllm_rl.workflows.rewards import workflow_reward_counters


class LocalBackend:
    """The driver's calls (backend.Backend) on in-process objects."""

    session = staticmethod(contextlib.nullcontext)
    """Around a job run by `entry.train`: nothing to start or stop outside this process."""

    def __init__(self, plan: JobPlan, model_path: str, task, tokenizer, workflow=None):
        """`workflow`: the user's own rollout workflow (`JobInputs.workflow`), built here; None = the built-in one."""
        self.plan, cfg = plan, plan.config
        random.seed(cfg.trainer.seed)
        torch.manual_seed(cfg.trainer.seed)
        if cfg.trainer.num_threads > 0:
            torch.set_num_threads(cfg.trainer.num_threads)
        model_path = resolve_model_path(model_path, cfg.model.revision)  # a hub id -> its local snapshot
        self.cfg, self.model_path, self.task, self.tokenizer = cfg, model_path, task, tokenizer
        self.timeout_s = cfg.trainer.call_timeout_s
        lora = cfg.model.lora  # a LoRA policy: the learner trains the adapter, the engine swaps it in
        self.reward_scorers: dict[str, Any] = {}
        self.loop: EventLoopThread | None = None
        self.collector = None
        try:  # a failed start closes what it started (scorer threads, judge engines, the loop), then raises
            self.engine = TransformersEngine(model_path, seed=cfg.trainer.seed, device="cpu", lora=lora)  # on the CPU
            self.learner = Learner(model_path, cfg.optim, temperature=cfg.rollout.temperature,
                                   sampling_mask=plan.sampling_mask, seed=cfg.trainer.seed, lora=lora)
            self.loss = plan.loss
            self.reward_scorers = local_reward_scorers(cfg)  # {} unless reward.model / reward.judge is on
            self.workflow = build_workflow(cfg, task, tokenizer, make_tools=local_python_tools,
                                           reward_scorers=self.reward_scorers, custom=workflow)
            self.episode_filter = build_episode_filter(cfg)
            self.reference = None
            self.faults = FaultLedger(ROLE_KINDS)
            """Always zero here (one process: a crashed role is a crashed run), kept so both backends report alike."""
            self.versions_held = [self.engine.version]
            self.loop = EventLoopThread("rayllm-local-loop")
            self.loop.run(self._build_on_loop)
        except BaseException:
            self.shutdown()
            raise
        self._collector_task: asyncio.Task | None = None

    def _build_on_loop(self) -> None:
        cfg = self.cfg
        self.buffer = AwaitableEpisodeBuffer(ReplayBuffer(self.plan.buffer_capacity, cfg.rollout.max_staleness),
                                             on_dropped=lambda n: self.collector.on_dropped(n))
        self.collector = LLMCollector(PromptLoader(self.task.train, seed=cfg.trainer.seed), self._run_episode,
                                      StalenessController(cfg.rollout.prompts_per_step, cfg.rollout.max_staleness))

    async def _run_episode(self, row: dict):
        put = lambda td: self.buffer.put(td, self.timeout_s)  # noqa: E731
        return await run_and_store(self.workflow, self.engine, row, put, self.episode_filter)

    # ---------------------------------------------------------------- learner
    def train_step(self, batch, loss=None) -> dict[str, float]:
        metrics = self.learner.train_step(batch, loss if loss is not None else self.loss)
        return {**metrics, "trace": self.learner.trace} if self.learner.trace else metrics

    def reset_optimizer(self, optim_cfg) -> None:
        self.learner.reset_optimizer(optim_cfg)

    def sync_weights(self, version: int) -> dict[str, float]:
        """Copy the learner's weights into the engine between two decode steps (the engine's lock)."""
        t0 = time.perf_counter()
        self.engine.load_weights_sync(self.learner.named_tensors(), version=version)
        self.versions_held.append(int(version))
        dt = time.perf_counter() - t0
        return {"sync_s": dt, "stall_s": dt}

    # ---------------------------------------------------------------- collector and buffer
    def set_version(self, version: int) -> None:
        self.loop.run(self.collector.set_version, version)

    def _on_loop_end(self, task: asyncio.Task) -> None:
        if not task.cancelled() and task.exception() is not None:
            self.buffer.fail(f"collector loop died: {task.exception()}")

    def _start_on_loop(self) -> None:
        if self._collector_task is None or self._collector_task.done():
            self._collector_task = asyncio.ensure_future(self.collector.run())
            self._collector_task.add_done_callback(self._on_loop_end)
        self.collector.resume()

    def start_collector(self) -> None:
        self.loop.run(self._start_on_loop)

    def next_batch(self, n_episodes: int, version: int):
        """(training batch, its metadata): the batch stays in this process, prepared here."""
        batch, depth = self.loop.call(self.buffer.get_batch(n_episodes, version, self.timeout_s), self.timeout_s + 30,
                                      f"a batch of {n_episodes} episodes at version {version}")
        ref = None if self.reference is None else self.reference.compute_logprobs(batch)
        batch, meta = self.plan.batch_pipeline.prepare(batch, version, ref)
        return batch, {**meta, "buffer_depth": depth}

    def driver_bytes(self) -> None:
        """Nothing crosses a process boundary here."""
        return None

    def drain(self) -> None:
        self.loop.call(self.collector.drain(self.timeout_s), self.timeout_s + 30, "draining the collector")

    def collector_stats(self) -> dict[str, Any]:
        return self.loop.run(self.collector.stats)

    # ---------------------------------------------------------------- reference, eval, checkpoints
    def start_reference(self, checkpoint: str | None):
        from rayllm_rl.learner.reference import ReferenceModel, load_reference_weights

        weights = load_reference_weights(checkpoint) if checkpoint else self.learner.named_tensors()
        self.reference = ReferenceModel(self.model_path, temperature=self.cfg.rollout.temperature,
                                        named_tensors=weights,
                                        max_tokens_per_micro_batch=self.cfg.optim.max_tokens_per_micro_batch,
                                        logprob_chunk_size=self.cfg.optim.logprob_chunk_size)

    def evaluate(self, progress=None) -> dict[str, Any]:
        coro = evaluate_greedy(self.engine, self.tokenizer, self.task.eval, self.task.reward_fn,
                               self.cfg.rollout.max_new_tokens, progress=progress)
        return self.loop.call(coro, self.timeout_s, "greedy evaluation")

    def save_checkpoint(self, path: str, step: int, version: int) -> str:
        from rayllm_rl.learner.checkpoint import save_checkpoint

        self.drain()
        extra = {"step": step, "version": version, "collector": self.loop.run(self.collector.state_dict),
                 "buffer": self.loop.run(self.buffer.buffer.state_dict)}
        save_checkpoint(self.learner, path, tokenizer=self.tokenizer, extra=extra)
        if self.reference is not None:
            self.reference.save(path)
        self.start_collector()
        return str(path)

    def restore(self, path: str) -> tuple[int, int]:
        from rayllm_rl.learner.checkpoint import load_checkpoint

        extra = load_checkpoint(self.learner, path)
        self.loop.run(self.collector.load_state_dict, extra["collector"])
        self.loop.run(self.buffer.buffer.load_state_dict, extra["buffer"])
        return extra["step"], extra["version"]

    def summary_stats(self) -> dict[str, Any]:
        engine_sum = self.loop.call(self.engine.weights_checksum(), 60, "engine checksum")
        return {"failed_episodes": self.collector_stats()["failed_episodes"], **self.faults.summary(),
                "buffer": self.loop.run(self.buffer.buffer.stats),
                "reward_failures": workflow_reward_counters(self.workflow),
                "replica_versions_held": [list(self.versions_held)], "weight_transport": "in-process",
                "learner_checksums_equal_replicas": weights_checksum(self.learner.named_tensors()) == engine_sum,
                "reward_services": {"reward-model": dataclasses.asdict(self.reward_scorers["model"].stats)}
                if "model" in self.reward_scorers else {}}

    def recover(self, crash) -> None:
        """Nothing to restart: in one process a crashed role is a crashed run."""
        raise crash

    def publish(self, record: dict[str, Any]) -> None:
        """Nothing to export to: the run's metrics.jsonl is the record."""

    def shutdown(self) -> None:
        """Stop the collector and the loop, close the reward scorers (what exists of them: also after a
        failed start)."""
        if self.loop is not None:
            if self.collector is not None:
                self.loop.run(self.collector.stop)
            self.loop.close()
        for scorer in self.reward_scorers.values():
            scorer.close()
