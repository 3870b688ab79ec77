"""The job's plan: every choice of a job made once, from its config, and handed down.

`make_plan(cfg)` is the job's validation: it fills the presets, checks the rules no decision covers
(`job_checks`), then decides the backend, the loss, the GPU layout and bundles, the engine and its options
(placed, checked), the frozen models (a KL reference, a distillation teacher), every actor (name, role, GPUs, torch
threads, bundle, restarts), the replay buffer's capacity and its batch pipeline, and the weight transport, each
once, raising ValueError naming the key. The dry run prints it (`job/describe.py`); both backends
build from it; the driver takes it alone; nothing below it decides these again.
Ray-free: a plan can be made for machines this one is not.
"""
from __future__ import annotations

import dataclasses
import importlib
import os
from typing import TYPE_CHECKING, Any

from rayllm_rl.algorithm.batch_prep import BatchPipeline, make_batch_pipeline
from rayllm_rl.job.placement_rules import GpuLayout, gpu_layout
from rayllm_rl.sampling_mask import SamplingMask

if TYPE_CHECKING:  # the plan reads the config; `GRPOJobConfig.validate()` calls `make_plan`
    from rayllm_rl.job.config import GRPOJobConfig

BACKENDS = {"local": "rayllm_rl.orchestration.local.backend:LocalBackend",
            "ray": "rayllm_rl.orchestration.ray.backend:RayBackend"}
"""`trainer.backend` -> the class that runs the roles (imported only when the job starts)."""
PRIMITIVE_HOSTS = {"local": "rayllm_rl.orchestration.local.primitives:LocalRoles",
                   "ray": "rayllm_rl.orchestration.ray.primitives:RayRoles"}
"""`trainer.backend` -> the class that runs a plan of learners and replicas for a loop of the user's own
(`rayllm_rl.tinker`): blocking calls on the same role specs."""

REPLICA, LEARNER, ENV_WORKER = "inference-{}", "learner-{}", "env-{}"
BUFFER, COLLECTOR, REFERENCE, TEACHER = "replay-buffer", "collector", "reference", "teacher"
"""The dashboard names of the job's actors (`{}`: the replica, rank or worker index)."""


KINDS = ("reward-model", "judge", "replica", "buffer", "env", "learner", "collector", "frozen", "tool")
"""The kinds of role, in the order a job starts them (`JobPlan.roles`): the reward services first (env workers look
them up by name when they start), the frozen models once the learners hold the policy (`PHASES`)."""
PHASES = {"reward-model": "services", "judge": "services", "frozen": "frozen", "tool": "on demand"}
"""When a kind starts: "services" (before the rest, each waited for), "roles" (every kind not named here), "frozen"
(`Backend.start_frozen`: from the learners' weights or a checkpoint), "on demand" (by the first env worker that
needs it)."""


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
    kind: str = ""
    """One of `KINDS`: what builds it."""
    index: int = 0
    """Its place among the actors of its kind (the replica's index, the learner's rank)."""

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "role": self.role, "num_cpus": 0, "num_gpus": self.num_gpus,
                "torch_threads": self.threads, "bundle": self.bundle, "max_restarts": self.restarts,
                **({"note": self.note} if self.note else {})}


@dataclasses.dataclass(frozen=True)
class Role:
    """One entry of a job's role list (`JobPlan.roles`): what is built, from what, where and when."""

    name: str
    """Its dashboard name (the Ray actor's name)."""
    kind: str
    """One of `KINDS`."""
    spec: Any
    """What it is built from (`EngineSpec`, `LearnerSpec`, `BufferSpec`, `CollectorSpec`, `FrozenSpec`,
    `RewardModelSpec`), or None where the backend brings it (an env worker's workflow, the tool service)."""
    actor: ActorPlan
    """Its placement: GPUs, torch threads, bundle, restarts."""
    phase: str
    """When it starts (`PHASES`)."""

    @property
    def index(self) -> int:
        return self.actor.index


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
    """The config the plan was made from, presets filled and checked: what every role reads."""
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
    actors: tuple[ActorPlan, ...]
    buffer_capacity: int
    """Replay buffer capacity in episodes."""
    batch_pipeline: BatchPipeline
    """The stages that make a rollout batch a training batch, run where the batch is (the buffer)."""
    transport: TransportChoice
    sampling_mask: SamplingMask = SamplingMask()
    """What the learner replays when it scores tokens: the rollout's top-k / top-p, or nothing when
    `rollout.replay_sampling_mask` is off (`rayllm_rl.sampling_mask`)."""
    frozen: tuple = ()
    """The frozen models (`learner.frozen.FrozenSpec`), in the order they start: the KL reference (KL in the loss
    or the reward; a LoRA policy is its own reference, so none), the distillation teacher (`teacher.path`)."""
    learner_threads: int = 0
    """torch threads of a learner: `ray.threads_per_actor` in an actor, `trainer.num_threads` in this process
    (0 = torch's default); the LoRA demo's base warm-up runs with it too."""

    @property
    def colocated(self) -> bool:
        return self.layout.colocated

    @property
    def in_process(self) -> bool:
        """Every role runs in this process on the CPU (`trainer.backend=local`): no actors, no transport."""
        return _in_process(self.config)

    def backend_class(self) -> type:
        module, name = BACKENDS[self.backend].split(":")
        return getattr(importlib.import_module(module), name)

    def primitives_class(self) -> type:
        """What runs this plan's learners and replicas for Tinker's primitives (`PRIMITIVE_HOSTS`)."""
        module, name = PRIMITIVE_HOSTS[self.backend].split(":")
        return getattr(importlib.import_module(module), name)

    def roles(self, model_path: str = "", phase: str | None = None) -> tuple[Role, ...]:
        """The job's roles in the order they start (`KINDS`), each with its spec (`model_path`: the policy's,
        resolved where the job runs); with `phase`, those of that phase only. Empty in process (`in_process`:
        the local backend builds the same specs itself)."""
        specs = {"replica": lambda a: self.engine_spec(model_path, a.index), "learner": lambda a: self.learner_spec(
            model_path), "buffer": lambda a: self.buffer_spec(), "collector": lambda a: self.collector_spec(),
            "frozen": lambda a: self.frozen_spec(a.name), "reward-model": lambda a: self.reward_model_spec(),
            "judge": lambda a: self.judge_spec(a.index)}
        ordered = sorted(self.actors, key=lambda a: KINDS.index(a.kind))
        roles = (Role(a.name, a.kind, specs[a.kind](a) if a.kind in specs else None, a, PHASES.get(a.kind, "roles"))
                 for a in ordered)
        return tuple(r for r in roles if phase is None or r.phase == phase)

    def names(self, kind: str) -> list[str]:
        """The names of the roles of `kind`, in index order (the env workers find the replicas and the buffer by
        them)."""
        return [a.name for a in sorted(self.actors, key=lambda a: a.index) if a.kind == kind]

    def only(self, *kinds: str) -> "JobPlan":
        """This plan with the roles of `kinds` alone: a job of learners and replicas (`only("learner", "replica")`)
        that a user's own loop drives from Python, with nothing collecting rollouts."""
        if unknown := set(kinds) - set(KINDS):
            raise ValueError(f"unknown role kinds {sorted(unknown)}; the kinds are {list(KINDS)}")
        return dataclasses.replace(self, actors=tuple(a for a in self.actors if a.kind in kinds))

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

    def frozen_names(self) -> tuple[str, ...]:
        return tuple(spec.name for spec in self.frozen)

    def frozen_spec(self, name: str):
        """The frozen model `name`'s spec, or None when the job has none of that name."""
        return next((spec for spec in self.frozen if spec.name == name), None)

    def reward_model_spec(self):
        """The reward model of `reward.model` (`rewards.reward_model.RewardModelSpec`), the same for every actor."""
        from rayllm_rl.rewards.reward_model import RewardModelSpec

        m = self.config.reward.model
        return RewardModelSpec(m.path, m.batch_size, m.batch_wait_s, m.max_length, m.activation, m.dtype)

    def judge_spec(self, replica: int = 0):
        """Judge replica `replica`'s engine (`inference.registry.EngineSpec`), placed as the policy's engines are
        (`_placed_options`: in this process on the CPU for the local backend); its seed is the job's + `replica`."""
        from rayllm_rl.inference.registry import EngineSpec

        j, cfg = self.config.reward.judge, self.config
        return EngineSpec(j.engine, j.path, seed=cfg.trainer.seed + replica, dtype=j.dtype,
                          options=_placed_options(j.engine, j.options, colocated=False, in_process=self.in_process))

    def buffer_spec(self):
        """The replay buffer (`rollout.replay_buffer.BufferSpec`)."""
        from rayllm_rl.rollout.replay_buffer import BufferSpec

        return BufferSpec(self.buffer_capacity, self.config.rollout.max_staleness)

    def collector_spec(self):
        """The collector (`rollout.collector.CollectorSpec`): a batch of prompts per step, the staleness bound."""
        from rayllm_rl.rollout.collector import CollectorSpec

        r = self.config.rollout
        return CollectorSpec(r.prompts_per_step, r.max_staleness, self.config.trainer.seed, r.group_size)

    def failure_policy(self):
        """What a failed sample does (`rollout.failures.FailurePolicy`, from `rollout.on_failure` and its numbers,
        their None defaults resolved here): the env workers (or the local backend) run every prompt under it."""
        from rayllm_rl.rollout.failures import FailurePolicy

        r = self.config.rollout
        return FailurePolicy(r.on_failure, r.group_size,
                             r.min_finished if r.min_finished is not None else min(2, r.group_size),
                             r.resample_budget if r.resample_budget is not None else 2,
                             r.episode_timeout_s or self.config.trainer.call_timeout_s)

    def pick_transport(self, learner_node: str, replica_nodes: list[str]) -> str:
        """The transport for the nodes the actors landed on (known only once they run)."""
        return _resolve_transport(self.config.ray.sync_transport, self.layout, learner_node, replica_nodes)


def _needs_reference(cfg: GRPOJobConfig, loss) -> bool:
    if cfg.model.lora.rank > 0:  # the learner serves it: the base model, adapter off
        return False
    return cfg.algo.kl_reward_coef > 0 or bool(getattr(loss, "needs_ref_logp", False))


def _frozen(cfg: GRPOJobConfig, loss) -> tuple:
    """The job's frozen models (`learner.frozen.FrozenSpec`), scoring as the learner scores (temperature, dtype,
    batching; on the CPU until the layout places them): the KL reference from the policy's weights; the teacher
    from `teacher.path`, its prompts shared and the sampling mask always replayed (the student's logprob in its KL
    is the sampler's)."""
    from rayllm_rl.learner.frozen import FrozenSpec

    scoring = dict(temperature=cfg.rollout.temperature, dtype=cfg.model.dtype,
                   max_tokens_per_micro_batch=cfg.optim.max_tokens_per_micro_batch,
                   logprob_chunk_size=cfg.optim.logprob_chunk_size)
    out = []
    if _needs_reference(cfg, loss):
        out.append(FrozenSpec(REFERENCE, "policy", role="frozen reference model (KL)", **scoring))
    if cfg.teacher.path:
        path = cfg.teacher.path  # a local directory or file as an absolute path: the actors' working directory differs
        out.append(FrozenSpec(TEACHER, "path", os.path.abspath(path) if os.path.exists(path) else path,
                              sampling_mask=SamplingMask(cfg.rollout.top_k, cfg.rollout.top_p),
                              share_prompts=cfg.optim.share_prompts, restarts=cfg.ray.teacher_restarts,
                              role="distillation teacher (frozen, scores sampled tokens)", **scoring))
    return tuple(out)


def _actors(cfg: GRPOJobConfig, layout: GpuLayout, frozen: tuple) -> tuple[ActorPlan, ...]:
    """Every actor of the Ray backend, as the dry run lists them: replicas, learner ranks, env workers, buffer,
    collector, and the frozen models, tool and reward services the config asks for."""
    rc, t, pg = cfg.ray, cfg.ray.threads_per_actor, layout.uses_gpus
    tp = f"tensor_parallel_size={rc.tensor_parallel_size}" if rc.tensor_parallel_size > 1 else ""
    actors = [ActorPlan(REPLICA.format(i), f"inference replica ({cfg.inference.engine})", layout.replica_asks, t,
                        i if pg else None, rc.replica_restarts, tp, kind="replica", index=i)
              for i in range(layout.num_replicas)]
    actors += [ActorPlan(LEARNER.format(r), "FSDP learner rank", layout.learner_asks, t,
                         layout.learner_bundle(r) if pg else None, 0,
                         f"shares its GPU with {REPLICA.format(r)}; offloaded while it generates"
                         if layout.colocated else "", kind="learner", index=r)
               for r in range(layout.num_learners)]
    actors += [ActorPlan(ENV_WORKER.format(i), "env worker (rollout workflows, rewards)", 0.0, 1, None,
                         rc.env_worker_restarts, kind="env", index=i) for i in range(rc.num_env_workers)]
    actors += [ActorPlan(BUFFER, "replay buffer", 0.0, 1, kind="buffer"),
               ActorPlan(COLLECTOR, "collector", 0.0, 1, kind="collector")]
    for i, spec in enumerate(frozen):
        where = f"on {LEARNER.format(0)}'s GPU, {spec.dtype}" if spec.gpu_share else f"CPU, {spec.dtype}"
        actors.append(ActorPlan(spec.name, spec.role, spec.gpu_share, t, layout.frozen_bundle(), spec.restarts,
                                f"{spec.model_path}; {where}" if spec.model_path else where, kind="frozen", index=i))
    if cfg.rollout.workflow == "python_tool":
        actors.append(ActorPlan("python-executor", "sandboxed code execution service", 0.0, 1, kind="tool"))
    m, j = cfg.reward.model, cfg.reward.judge
    actors += [ActorPlan(f"reward-model-{i}", "reward model (sequence classification)", m.gpus_per_actor, t, None,
                         rc.replica_restarts, f"weight {m.weight:g}, batches of <= {m.batch_size}",
                         kind="reward-model", index=i) for i in range(m.num_actors if m.path else 0)]
    actors += [ActorPlan(f"judge-{i}", f"judge replica ({j.engine})", j.gpus_per_replica, t, None,
                         rc.replica_restarts, f"weight {j.weight:g}", kind="judge", index=i)
               for i in range(j.num_replicas if j.path else 0)]
    return tuple(actors)


def _resolve_transport(setting: str, layout: GpuLayout, learner_node: str, replica_nodes) -> str:
    """`ray.sync_transport` resolved for the layout and the nodes (`weight_sync.registry.plan_transport`)."""
    from rayllm_rl.weight_sync.registry import plan_transport

    return plan_transport(setting, learner_gpus=layout.learner_gpus > 0, learner_ranks=layout.num_learners,
                          replica_gpus=layout.replica_gpus > 0, learner_node=learner_node,
                          replica_nodes=replica_nodes, colocated=layout.colocated)


def _transport(cfg: GRPOJobConfig, layout: GpuLayout) -> TransportChoice:
    """`ray.sync_transport` for the layout: refused here when it cannot run even with every actor on one node
    (what can be known before the actors run); across nodes the refusal is shown, and raised at the start
    only if the actors do land on several nodes (`JobPlan.pick_transport`)."""
    from rayllm_rl.weight_sync.registry import TRANSPORTS

    rc = cfg.ray
    same = _resolve_transport(rc.sync_transport, layout, "node-a", {"node-a"})
    try:
        across = _resolve_transport(rc.sync_transport, layout, "node-a", {"node-a", "node-b"})
    except ValueError as exc:
        across = f"refused: {exc}"
    return TransportChoice(rc.sync_transport, same, across,
                           rc.sync_bucket_mb or (TRANSPORTS[same].default_bucket_mb if same in TRANSPORTS else None))


def _in_process(cfg: GRPOJobConfig) -> bool:
    """Whether every role runs in this process, on the CPU: the one place `trainer.backend=local` is read."""
    return cfg.trainer.backend == "local"


def _placed_options(engine: str, options, *, colocated: bool, in_process: bool) -> dict[str, Any]:
    """An engine's options over its defaults for the placement (`inference.registry.placed_options`), on the
    CPU when it runs in this process (`job.checks.check_local_backend` refused any other device there)."""
    from rayllm_rl.inference.registry import placed_options

    placed = placed_options(engine, options, colocated=colocated)
    return {**placed, "device": "cpu"} if in_process else placed


def _engine_options(cfg: GRPOJobConfig, layout: GpuLayout, environment: bool) -> dict[str, Any]:
    """`inference.options` placed (`_placed_options`), each checked (an unknown key fails, naming itself), and the
    job checked against what the engine can serve (its `check_job`): what every replica is built with."""
    from rayllm_rl.inference.registry import EngineJob, engine_options, job_side

    rc, engine = cfg.ray, cfg.inference.engine
    options = _placed_options(engine, cfg.inference.options, colocated=layout.colocated, in_process=_in_process(cfg))
    job_side(engine).check_job(EngineJob(
        gpus_per_replica=rc.gpus_per_replica, tensor_parallel_size=rc.tensor_parallel_size, dtype=cfg.model.dtype,
        environment=environment, options=engine_options(engine, options), colocated=layout.colocated,
        lora_rank=cfg.model.lora.rank))
    return options


def make_plan(cfg: GRPOJobConfig, inputs: Any = None, *, environment: bool = True) -> JobPlan:
    """The plan of a job config, resolved or not (`presets.resolve_presets` fills it; `cfg` is left as it
    was), every decision made once here, raising ValueError naming the key. `inputs`: the job's objects
    (`job.inputs.JobInputs`; None = those the config's import paths name, imported here). `environment=False`
    skips the checks of this machine (the engine's package installed), for a dry run that plans other machines."""
    from rayllm_rl.job.checks import check_job
    from rayllm_rl.job.inputs import JobInputs
    from rayllm_rl.job.presets import resolve_presets

    inputs = inputs if inputs is not None else JobInputs.of(cfg)
    cfg = resolve_presets(cfg, inputs)
    check_job(cfg, environment, inputs)  # the rules no decision below covers
    rc = cfg.ray
    loss = cfg.algo.build_loss(cfg.rollout.max_new_tokens)  # and its own checks (e.g. GRPO's clip_eps_low < 1)
    frozen = _frozen(cfg, loss)
    capacity = cfg.rollout.buffer_episodes or 2 * (cfg.rollout.max_staleness + 1) * cfg.rollout.prompts_per_step
    if _in_process(cfg):  # every role in this process, on CPU: no actors, no transport
        layout = GpuLayout(1, 1, 0.0, 0.0, False, len(frozen))
        actors: tuple[ActorPlan, ...] = ()
        transport = TransportChoice("in-process", "in-process", "in-process")
    else:
        layout = gpu_layout(rc.num_replicas, rc.num_learners, rc.gpus_per_replica, rc.gpus_per_learner,
                            rc.tensor_parallel_size, rc.sync_timeout_s, colocated=rc.placement == "colocated",
                            frozen=len(frozen))
        frozen = tuple(dataclasses.replace(spec, gpu_share=layout.frozen_asks) for spec in frozen)
        actors, transport = _actors(cfg, layout, frozen), _transport(cfg, layout)
    return JobPlan(config=cfg, backend=cfg.trainer.backend, engine=cfg.inference.engine,
                   engine_options=_engine_options(cfg, layout, environment),
                   replicas=layout.num_replicas, learner_ranks=layout.num_learners, layout=layout, loss=loss,
                   frozen=frozen, actors=actors, buffer_capacity=capacity,
                   batch_pipeline=make_batch_pipeline(cfg, [spec.name for spec in frozen]), transport=transport,
                   sampling_mask=SamplingMask(cfg.rollout.top_k, cfg.rollout.top_p) if cfg.rollout.replay_sampling_mask
                   else SamplingMask(),
                   learner_threads=cfg.trainer.num_threads if _in_process(cfg) else rc.threads_per_actor)
