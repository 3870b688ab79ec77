"""LocalBackend: every role of a job in this process, driven by the same driver as the Ray backend.

The plain classes the Ray actors wrap run here directly, built by the same `build()` of the plan's role
specs (`JobPlan.engine_spec`, ...): the engine (Transformers, on the CPU), the `LLMCollector`, the
awaitable replay buffer and the `Learner`. Generation, the collector and
the buffer live on one asyncio loop in a background thread; learner steps run in the
driver's thread, so with `max_staleness >= 1` the next batch is generated while the learner
trains (the engine takes new weights between two decode steps, under its lock).
"""
from __future__ import annotations

import contextlib
import dataclasses
import random
import time
from typing import Any

import torch

from rayllm_rl.hub import resolve_model_path
from rayllm_rl.inference.protocol import weights_checksum
from rayllm_rl.loop_thread import EventLoopThread
from rayllm_rl.algorithm.batch_prep import prepare_batch
from rayllm_rl.orchestration.backend import ROLE_KINDS, backend_summary
from rayllm_rl.rollout.collector import run_and_store
from rayllm_rl.orchestration.fault_ledger import FaultLedger
from rayllm_rl.orchestration.factories import (build_episode_filter, build_evaluation, build_workflow,
                                               local_python_tools)
from rayllm_rl.orchestration.local.reward_scorers import local_reward_scorers
from rayllm_rl.job.plan import JobPlan
from rayllm_rl.workflows.rewards import workflow_reward_counters


def run_now(coro):
    """The result of a coroutine that never suspends (the local frozen models score in this thread), run to its end
    without an event loop: so it runs in any thread, one whose loop is running (a notebook's) too."""
    try:
        coro.send(None)
    except StopIteration as done:
        return done.value
    coro.close()
    raise RuntimeError("a local batch preparation awaited something: the local backend scores in this thread")


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
        self.evaluation = build_evaluation(cfg, task, tokenizer)
        self.timeout_s = cfg.trainer.call_timeout_s
        self.reward_scorers: dict[str, Any] = {}
        self.loop: EventLoopThread | None = None
        self.collector = None
        try:  # a failed start closes what it started (scorer threads, judge engines, the loop), then raises
            self.engine = plan.engine_spec(model_path).build()  # the plan placed it on the CPU
            self.learner = plan.learner_spec(model_path).build()
            self.loss = plan.loss
            self.reward_scorers = local_reward_scorers(plan)  # {} unless reward.model / reward.judge is on
            self.workflow = build_workflow(cfg, task, tokenizer, make_tools=local_python_tools,
                                           reward_scorers=self.reward_scorers, custom=workflow)
            self.episode_filter = build_episode_filter(cfg)
            self.failures = plan.failure_policy()
            self.frozen: dict[str, Any] = {}
            """The frozen models started so far (`start_frozen`), by name."""
            self.faults = FaultLedger(ROLE_KINDS)
            """Always zero here (one process: a crashed role is a crashed run), kept so both backends report alike."""
            self.versions_held = [self.engine.version]
            self.loop = EventLoopThread("rayllm-local-loop")
            self.loop.run(self._build_on_loop)
        except BaseException:
            self.shutdown()
            raise

    def _build_on_loop(self) -> None:
        self.buffer = self.plan.buffer_spec().build(on_dropped=lambda n: self.collector.on_dropped(n))
        self.collector = self.plan.collector_spec().build(self.task.train, self._run_episode)

    async def _run_episode(self, row: dict):
        put = lambda td: self.buffer.put(td, self.timeout_s)  # noqa: E731
        return await run_and_store(self.workflow, self.engine, row, put, self.episode_filter, self.failures)

    # ---------------------------------------------------------------- learner
    def train_step(self, batch, loss=None) -> dict[str, float]:
        metrics = self.learner.train_step(batch, loss if loss is not None else self.loss)
        return {**metrics, "trace": self.learner.trace} if self.learner.trace else metrics

    def reset_optimizer(self, optim_cfg) -> None:
        self.learner.reset_optimizer(optim_cfg)

    def sync_weights(self, version: int) -> dict[str, float]:
        """Copy the learner's weights into the engine between two decode steps (the engine's lock), then
        tell the collector the version."""
        t0 = time.perf_counter()
        self.engine.weights.load_weights_sync(self.learner.named_tensors(), version=version)
        self.versions_held.append(int(version))
        dt = time.perf_counter() - t0
        self.loop.run(self.collector.set_version, version)
        return {"sync_s": dt, "stall_s": dt}

    # ---------------------------------------------------------------- collector and buffer
    def start_collector(self) -> None:
        self.loop.run(self.collector.start, self.buffer.fail)

    def next_batch(self, n_episodes: int, version: int):
        """(training batch, its metadata): the batch stays in this process, prepared here."""
        batch, depth = self.loop.call(self.buffer.get_batch(n_episodes, version, self.timeout_s), self.timeout_s + 30,
                                      f"a batch of {n_episodes} episodes at version {version}")
        async def score(name, td):  # in this thread: a crashed model is a crashed run, nothing is scored again
            return self.frozen[name].compute_logprobs(td), 0

        batch, meta = run_now(prepare_batch(self.plan.batch_pipeline, batch, version, score))
        return batch, {**meta, "buffer_depth": depth}

    def driver_bytes(self) -> None:
        """Nothing crosses a process boundary here."""
        return None

    def drain(self) -> None:
        self.loop.call(self.collector.drain(self.timeout_s), self.timeout_s + 30, "draining the collector")

    def collector_stats(self) -> dict[str, Any]:
        self.loop.run(self.collector.raise_if_dead)
        return self.loop.run(self.collector.stats)

    # ---------------------------------------------------------------- frozen models, eval, checkpoints
    def start_frozen(self, checkpoint: str | None) -> None:
        for spec in self.plan.frozen:
            weights = (checkpoint or self.learner.named_tensors()) if spec.saved else None
            self.frozen[spec.name] = spec.build(policy_path=self.model_path, weights=weights)

    def evaluate(self, progress=None) -> dict[str, Any]:
        return self.loop.call(self.evaluation(self.engine, progress=progress), self.timeout_s, "greedy evaluation")

    def role_states(self) -> dict[str, Any]:
        return {"collector": self.loop.run(self.collector.state_dict),
                "buffer": self.loop.run(self.buffer.buffer.state_dict)}

    def load_role_states(self, states: dict[str, Any]) -> None:
        self.loop.run(self.collector.load_state_dict, states["collector"])
        self.loop.run(self.buffer.buffer.load_state_dict, states["buffer"])

    def save_models(self, path: str, extra: dict[str, Any]) -> None:
        from rayllm_rl.learner.checkpoint import save_checkpoint

        save_checkpoint(self.learner, path, tokenizer=self.tokenizer, extra=extra)
        for spec in self.plan.frozen:
            if spec.saved and spec.name in self.frozen:
                self.frozen[spec.name].save(path, spec.name)

    def load_models(self, path: str) -> dict[str, Any]:
        from rayllm_rl.learner.checkpoint import load_checkpoint

        return load_checkpoint(self.learner, path)

    def summary_stats(self) -> dict[str, Any]:
        engine_sum = self.loop.call(self.engine.weights.weights_checksum(), 60, "engine checksum")
        model = self.reward_scorers.get("model")
        return backend_summary(collector=self.collector_stats(), faults=self.faults,
                               buffer=self.loop.run(self.buffer.buffer.stats),
                               reward_failures=workflow_reward_counters(self.workflow),
                               versions_held=[list(self.versions_held)], transport=self.plan.transport.setting,
                               checksums_equal=weights_checksum(self.learner.named_tensors()) == engine_sum,
                               reward_services={"reward-model": dataclasses.asdict(model.stats)} if model else {})

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
