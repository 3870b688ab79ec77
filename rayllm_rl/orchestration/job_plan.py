"""The job's plan: every choice of a job made once, from its validated config, and handed down.

`make_plan(cfg)` decides the backend, the engine and its options (placed), the GPU layout and bundles,
whether a reference model is needed (and the loss that says so), every actor (name, role, GPUs, torch
threads, bundle, restarts), the replay buffer's capacity and its batch pipeline, and the weight transport. The dry run prints
it (`orchestration/plan.py`); both backends build from it; nothing below it decides these again.
Ray-free: a plan can be made for machines this one is not.
"""
from __future__ import annotations

import dataclasses
import importlib
from typing import Any

from rayllm_rl.orchestration.batch_prep import BatchPipeline, make_batch_pipeline
from rayllm_rl.orchestration.job_config import GRPOJobConfig
from rayllm_rl.orchestration.placement_rules import GpuLayout, gpu_layout
from rayllm_rl.sampling_mask import SamplingMask

BACKENDS = {"local": "rayllm_rl.orchestration.local.backend:LocalBackend",
            "ray": "rayllm_rl.orchestration.ray.backend:RayBackend"}
"""`trainer.backend` -> the class that runs the roles (imported only when the job starts)."""

REPLICA, LEARNER, ENV_WORKER = "inference-{}", "learner-{}", "env-{}"
BUFFER, COLLECTOR, REFERENCE = "replay-buffer", "collector", "reference"
"""The dashboard names of the job's actors (`{}`: the replica, rank or worker index)."""


@dataclasses.dataclass(frozen=True)
class ActorPlan:
    """One actor the Ray backend creates."""

    name: str
    role: str
    num_gpus: float
    threads: int
    bundle: int | None = None
    """Its placement-group bundle (None: not in the group)."""
    restarts: int = 0
    """Ray's `max_restarts` for it."""
    note: str = ""

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "role": self.role, "num_cpus": 0, "num_gpus": self.num_gpus,
                "torch_threads": self.threads, "bundle": self.bundle, "max_restarts": self.restarts,
                **({"note": self.note} if self.note else {})}


@dataclasses.dataclass(frozen=True)
class TransportChoice:
    """The weight transport: the setting, and what it resolves to on one node and across nodes
    (`weight_sync.registry.plan_transport`; a refusal reads "refused: <why>")."""

    setting: str
    same_node: str
    across_nodes: str
    bucket_mb: float | None = None

    def describe(self) -> dict[str, Any]:
        out = {"setting": self.setting, "same_node": self.same_node, "across_nodes": self.across_nodes}
        return out if self.setting == "in-process" else {**out, "bucket_mb": self.bucket_mb}


@dataclasses.dataclass(frozen=True)
class JobPlan:
    """What a job runs, decided once (`make_plan`)."""

    config: GRPOJobConfig
    """The validated config the plan was made from (presets filled)."""
    backend: str
    engine: str
    engine_options: dict[str, Any]
    """`inference.options` over the engine's defaults for the placement (`inference.registry.placed_options`):
    what every replica is built with."""
    replicas: int
    learner_ranks: int
    layout: GpuLayout
    loss: Any
    """The loss `algo.*` builds (`objectives`): one instance per learner is built from the same config."""
    needs_reference: bool
    """A frozen reference model serves KL (in the loss or the reward); a LoRA policy is its own reference."""
    actors: tuple[ActorPlan, ...]
    buffer_capacity: int
    """Replay buffer capacity in episodes."""
    batch_pipeline: BatchPipeline
    """The stages that make a rollout batch a training batch, run where the batch is (the buffer)."""
    transport: TransportChoice
    sampling_mask: SamplingMask = SamplingMask()
    """What the learner replays when it scores tokens: the rollout's top-k / top-p, or nothing when
    `rollout.replay_sampling_mask` is off (`rayllm_rl.sampling_mask`)."""
    learner_threads: int = 0
    """torch threads of a learner: `ray.threads_per_actor` in an actor, `trainer.num_threads` in this process
    (0 = torch's default); the LoRA demo's base warm-up runs with it too."""

    @property
    def colocated(self) -> bool:
        return self.layout.colocated

    def backend_class(self) -> type:
        module, name = BACKENDS[self.backend].split(":")
        return getattr(importlib.import_module(module), name)

    def actor(self, name: str) -> ActorPlan:
        found = [a for a in self.actors if a.name == name]
        if not found:
            raise KeyError(f"the plan has no actor {name!r} (it has {[a.name for a in self.actors]})")
        return found[0]

    # ---------------------------------------------------------------- role specs: what both backends build
    def engine_spec(self, model_path: str, replica: int = 0):
        """Inference replica `replica`'s engine (`inference.registry.EngineSpec`; its seed is the job's + `replica`)."""
        from rayllm_rl.inference.registry import EngineSpec

        cfg = self.config
        return EngineSpec(self.engine, model_path, seed=cfg.trainer.seed + replica, dtype=cfg.model.dtype,
                          tensor_parallel_size=cfg.ray.tensor_parallel_size, options=dict(self.engine_options),
                          lora=cfg.model.lora if cfg.model.lora.enabled else None)

    def learner_spec(self, model_path: str):
        """What every learner rank is built from (`learner.LearnerSpec`)."""
        from rayllm_rl.learner.learner import LearnerSpec

        cfg = self.config
        return LearnerSpec(model_path, cfg.optim, cfg.rollout.temperature, self.sampling_mask, cfg.trainer.seed,
                           cfg.model.dtype, self.layout.learner_gpus > 0, cfg.model.lora)

    def reference_spec(self, model_path: str):
        """The frozen reference (`learner.reference.ReferenceSpec`): the learner's temperature, dtype and batching."""
        from rayllm_rl.learner.reference import ReferenceSpec

        cfg = self.config
        return ReferenceSpec(model_path, cfg.rollout.temperature, cfg.model.dtype,
                             cfg.optim.max_tokens_per_micro_batch, cfg.optim.logprob_chunk_size)

    def buffer_spec(self):
        """The replay buffer (`rollout.replay_buffer.BufferSpec`)."""
        from rayllm_rl.rollout.replay_buffer import BufferSpec

        return BufferSpec(self.buffer_capacity, self.config.rollout.max_staleness)

    def collector_spec(self):
        """The collector (`rollout.collector.CollectorSpec`): a batch of prompts per step, the staleness bound."""
        from rayllm_rl.rollout.collector import CollectorSpec

        r = self.config.rollout
        return CollectorSpec(r.prompts_per_step, r.max_staleness, self.config.trainer.seed)

    def pick_transport(self, learner_node: str, replica_nodes: list[str]) -> str:
        """The transport for the nodes the actors landed on (known only once they run)."""
        return _resolve_transport(self.config.ray.sync_transport, self.layout, learner_node, replica_nodes)


def _needs_reference(cfg: GRPOJobConfig, loss) -> bool:
    if cfg.model.lora.rank > 0:  # the learner serves it: the base model, adapter off
        return False
    return cfg.algo.kl_reward_coef > 0 or bool(getattr(loss, "needs_ref_logp", False))


def _actors(cfg: GRPOJobConfig, layout: GpuLayout, reference: bool) -> tuple[ActorPlan, ...]:
    """Every actor of the Ray backend: replicas, learner ranks, env workers, buffer, collector, and the
    reference, tool and reward services the config asks for."""
    rc, t, pg = cfg.ray, cfg.ray.threads_per_actor, layout.uses_gpus
    tp = f"tensor_parallel_size={rc.tensor_parallel_size}" if rc.tensor_parallel_size > 1 else ""
    actors = [ActorPlan(REPLICA.format(i), f"inference replica ({cfg.inference.engine})", layout.replica_asks, t,
                        i if pg else None, rc.replica_restarts, tp) for i in range(layout.num_replicas)]
    actors += [ActorPlan(LEARNER.format(r), "FSDP learner rank", layout.learner_asks, t,
                         layout.learner_bundle(r) if pg else None, 0,
                         f"shares its GPU with {REPLICA.format(r)}; offloaded while it generates"
                         if layout.colocated else "")
               for r in range(layout.num_learners)]
    actors += [ActorPlan(ENV_WORKER.format(i), "env worker (rollout workflows, rewards)", 0.0, 1, None,
                         rc.env_worker_restarts) for i in range(rc.num_env_workers)]
    actors += [ActorPlan(BUFFER, "replay buffer", 0.0, 1), ActorPlan(COLLECTOR, "collector", 0.0, 1)]
    if reference:
        gpus = layout.reference_asks
        actors.append(ActorPlan(REFERENCE, "frozen reference model (KL)", gpus, t, layout.reference_bundle(), 0,
                                f"on {LEARNER.format(0)}'s GPU, {cfg.model.dtype}" if gpus else f"CPU, {cfg.model.dtype}"))
    if cfg.rollout.workflow == "python_tool":
        actors.append(ActorPlan("python-executor", "sandboxed code execution service", 0.0, 1))
    m, j = cfg.reward.model, cfg.reward.judge
    actors += [ActorPlan(f"reward-model-{i}", "reward model (sequence classification)", m.gpus_per_actor, t, None, 0,
                         f"weight {m.weight:g}, batches of <= {m.batch_size}") for i in range(m.num_actors if m.path else 0)]
    actors += [ActorPlan(f"judge-{i}", f"judge replica ({j.engine})", j.gpus_per_replica, t, None, 0,
                         f"weight {j.weight:g}") for i in range(j.num_replicas if j.path else 0)]
    return tuple(actors)


def _resolve_transport(setting: str, layout: GpuLayout, learner_node: str, replica_nodes) -> str:
    """`ray.sync_transport` resolved for the layout and the nodes (`weight_sync.registry.plan_transport`)."""
    from rayllm_rl.weight_sync.registry import plan_transport

    return plan_transport(setting, learner_gpus=layout.learner_gpus > 0, learner_ranks=layout.num_learners,
                          replica_gpus=layout.replica_gpus > 0, learner_node=learner_node,
                          replica_nodes=replica_nodes, colocated=layout.colocated)


def _transport(cfg: GRPOJobConfig, layout: GpuLayout) -> TransportChoice:
    from rayllm_rl.weight_sync.registry import TRANSPORTS

    rc = cfg.ray

    def pick(nodes: set[str]) -> str:
        try:
            return _resolve_transport(rc.sync_transport, layout, "node-a", nodes)
        except ValueError as exc:
            return f"refused: {exc}"

    same, across = pick({"node-a"}), pick({"node-a", "node-b"})
    chosen = same if same in TRANSPORTS else None
    return TransportChoice(rc.sync_transport, same, across,
                           rc.sync_bucket_mb or (TRANSPORTS[chosen].default_bucket_mb if chosen else None))


def make_plan(cfg: GRPOJobConfig) -> JobPlan:
    """The plan of a validated config (`cfg.validate()`: presets filled, cross-field checks passed)."""
    from rayllm_rl.inference.registry import placed_options

    if any(v is None for v in (cfg.rollout.max_new_tokens, cfg.data.eval_size)) or cfg.model.dtype == "auto":
        raise ValueError("make_plan needs a validated config (cfg.validate() fills the task presets and dtype)")
    rc, inf = cfg.ray, cfg.inference
    loss = cfg.algo.build_loss(cfg.rollout.max_new_tokens)
    reference = _needs_reference(cfg, loss)
    capacity = cfg.rollout.buffer_episodes or 2 * (cfg.rollout.max_staleness + 1) * cfg.rollout.prompts_per_step
    if cfg.trainer.backend == "local":  # every role in this process, on CPU: no actors, no transport
        layout = GpuLayout(1, 1, 0.0, 0.0, False, reference)
        actors: tuple[ActorPlan, ...] = ()
        transport = TransportChoice("in-process", "in-process", "in-process")
    else:
        layout = gpu_layout(rc.num_replicas, rc.num_learners, rc.gpus_per_replica, rc.gpus_per_learner,
                            rc.tensor_parallel_size, rc.sync_timeout_s, colocated=rc.placement == "colocated",
                            reference=reference)
        actors, transport = _actors(cfg, layout, reference), _transport(cfg, layout)
    options = placed_options(inf.engine, inf.options, colocated=layout.colocated)
    if cfg.trainer.backend == "local":  # the engine runs in this process, on the CPU (job_checks refuses cuda)
        options = {**options, "device": "cpu"}
    return JobPlan(config=cfg, backend=cfg.trainer.backend, engine=inf.engine, engine_options=options,
                   replicas=layout.num_replicas, learner_ranks=layout.num_learners, layout=layout, loss=loss,
                   needs_reference=reference, actors=actors, buffer_capacity=capacity,
                   batch_pipeline=make_batch_pipeline(cfg, reference), transport=transport,
                   sampling_mask=SamplingMask(cfg.rollout.top_k, cfg.rollout.top_p) if cfg.rollout.replay_sampling_mask
                   else SamplingMask(),
                   learner_threads=cfg.trainer.num_threads if cfg.trainer.backend == "local" else rc.threads_per_actor)
