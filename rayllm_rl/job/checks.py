"""The rules of a resolved job config that no plan decision covers, run by `job.plan.make_plan` (and so by
`GRPOJobConfig.validate()`) before any actor starts.

Each error names the keys and the allowed values. The loss, the GPU layout, the engine's options and the
weight transport are checked where the plan decides them (`job.plan.make_plan`), not here. One field's own
bounds and allowed values are in its type (`rayllm_rl.config.Limit`, `Literal`).
"""
from __future__ import annotations

import difflib
from typing import Any

from rayllm_rl.config import check_fields
from rayllm_rl.environments import environment_task
from rayllm_rl.envs import task_registry
from rayllm_rl.envs.task_registry import PROMPT_TASK, task_entry
from rayllm_rl.callbacks import check_callback_paths
from rayllm_rl.object_path import import_object
from rayllm_rl.job.presets import PRESET_KEYS, get_key

IN_PROCESS_ENGINE = "transformers"
"""The one engine `trainer.backend=local` runs (in this process, on the CPU)."""

BUILTIN_WORKFLOWS = ("auto", "rlvr", "multi_turn", "env", "openai_agent", "python_tool")
"""The built-in values of `rollout.workflow` (`factories.build_workflow` builds each); any other value is an import
path 'package.module:Name' of a workflow of your own, or "python:<name>" for one given to `train(workflow=...)`."""


def check_job(cfg: Any, environment: bool = True, inputs: Any = None) -> None:
    """The checks of a resolved config (`presets.resolve_presets`) that no plan decision makes; `inputs`: the
    job's objects (`job.inputs.JobInputs`; None = those the config's import paths name). `environment=False`
    skips the checks of this machine (the extras installed), for a dry run that plans other machines."""
    from rayllm_rl.job.inputs import JobInputs

    check_fields(cfg)
    inputs = inputs if inputs is not None else JobInputs.of(cfg)
    check_task(cfg, inputs)
    unresolved = [key for key in PRESET_KEYS if get_key(cfg, key) is None]
    if unresolved:
        raise ValueError(f"task={cfg.task!r} has no preset for {unresolved}; set them")
    check_rollout_fields(cfg, inputs)
    check_placement(cfg)
    check_local_backend(cfg)
    cfg.trackers.check()
    check_callback_paths(cfg.trainer.callbacks)  # a callback that does not import fails here, naming the key
    cfg.reward.check(environment)
    from rayllm_rl.storage import check_root, storage_root

    check_root(cfg.trainer.storage_root, "trainer.storage_root")
    if environment:  # this machine runs the job: each optional feature used has its extra installed
        from rayllm_rl.extras import check_extras

        check_extras(cfg)
        storage_root(cfg.trainer.storage_root)  # $RAYLLM_STORAGE_ROOT, where this machine sets it
    check_lora(cfg)


def check_rollout_fields(cfg: Any, inputs: Any = None) -> None:
    """`rollout.workflow` is a built-in workflow or one of the user's (`inputs.workflow`, the job's JobInputs), and a
    rollout field the chosen workflow never reads is a mistake, not a no-op: a custom workflow reads `max_turns`
    and `turn_discount` when its class or factory takes them as keywords."""

    r, defaults = cfg.rollout, type(cfg.rollout)()
    custom = getattr(inputs, "workflow", None)
    if custom is None and r.workflow not in BUILTIN_WORKFLOWS:
        close = difflib.get_close_matches(r.workflow, BUILTIN_WORKFLOWS, n=3, cutoff=0.6)
        raise ValueError(f"rollout.workflow={r.workflow!r} is neither a built-in workflow {list(BUILTIN_WORKFLOWS)}"
                         + (f" (close: {close})" if close else "") + " nor an import path 'package.module:Name' of "
                         "a workflow of your own (docs/extending.md)")
    turns = {"multi_turn", "env", "python_tool", "auto"}
    readers = {"max_turns": turns, "turn_discount": {"multi_turn"}}
    for key, builtin in readers.items():
        value = getattr(r, key)
        if value == getattr(defaults, key):
            continue
        if custom is not None and not custom.takes(key):
            raise ValueError(f"rollout.{key}={value} is not read by {custom.label}: its class or factory takes no "
                             f"{key!r} keyword")
        if custom is None and r.workflow not in builtin:
            raise ValueError(f"rollout.max_turns={value} is read only by rollout.workflow in {sorted(builtin)} (or a "
                             f"workflow of your own taking max_turns); rollout.workflow={r.workflow} is single-turn"
                             if key == "max_turns" else
                             f"rollout.turn_discount is read only by rollout.workflow=multi_turn (or a workflow of "
                             f"your own taking turn_discount), not {r.workflow}")
    if bool(r.agent) != (r.workflow == "openai_agent"):
        raise ValueError("rollout.agent='package.module:async_fn' goes with rollout.workflow=openai_agent and only "
                         f"with it (got workflow={r.workflow}, agent={r.agent!r})")
    if r.workflow == "openai_agent":
        import_object(r.agent)  # an agent that cannot be imported fails here, not in the env workers
    entry = task_entry(cfg.task)
    if r.workflow == "env" and entry.rows != "factory" and not entry.has_env:
        with_env = sorted(name for name, e in task_registry.TASKS.items() if e.has_env)
        raise ValueError(f"rollout.workflow=env needs a task with a ChatEnv ({', '.join(with_env)}); "
                         f"task={cfg.task} has none: use rollout.workflow=rlvr or multi_turn")


def check_task(cfg: Any, inputs: Any) -> None:
    """The task is a built-in one or a custom one given by import path or object (`task_registry.task_entry`),
    and what it reads matches what was given: the reward functions go with the prompt task only, which needs
    them; a task that generates its rows refuses data.path / data.eval_path and datasets given in Python; a
    custom factory reads its own rows; the `data.*` keys only one task reads (its entry's `data_keys`) are
    refused for the others, and checked for it."""
    entry = task_entry(cfg.task)
    if inputs.reward_fns and not entry.takes_reward:
        where = f"reward.fn={cfg.reward.fn}" if cfg.reward.fn else "reward_fn="
        raise ValueError(f"{where} is the reward of task={PROMPT_TASK} (set with task unset, or task={PROMPT_TASK}); "
                         f"task={cfg.task} scores with its own reward: unset task to train on data.path's rows with "
                         "yours, or add a reward model or judge to the task's rule (reward.model, reward.judge)")
    if entry.takes_reward and entry.needs_reward and not inputs.reward_fns:
        raise ValueError(f"task={cfg.task} scores with your reward: set reward.fn=package.module:function (or pass "
                         "train(reward_fn=...))")
    environment = getattr(inputs, "environment", None)
    if environment is not None and cfg.task != environment_task(environment):
        raise ValueError(f"environment= is played by task={environment_task(environment)} (set with "
                         f"task unset); task={cfg.task} does not read it")
    given = {"data.path": cfg.data.path, "data.eval_path": cfg.data.eval_path,
             "train_dataset=": inputs.train_dataset is not None, "eval_dataset=": inputs.eval_dataset is not None}
    refused = {"generated": ("data.path", "data.eval_path", "train_dataset=", "eval_dataset="),
               "factory": ("train_dataset=", "eval_dataset=")}.get(entry.rows, ())
    for key in refused:
        if given[key]:
            how = ("its rows are generated (data.eval_size sets the held-out rows)" if entry.rows == "generated" else
                   "its factory makes its own rows (it gets data_cfg: read data.path there)")
            value = f"={given[key]!r}" if isinstance(given[key], str) else ""
            hint = "; to train on your rows with your reward, set reward.fn" if entry.rows == "generated" else ""
            raise ValueError(f"{key}{value} is not read by task={cfg.task}: {how}; unset it{hint}")
    defaults = type(cfg.data)()
    for name, other in task_registry.TASKS.items():
        for key in other.data_keys:
            if other is not entry and getattr(cfg.data, key) != getattr(defaults, key):
                raise ValueError(f"data.{key} is read only by task={name}, not task={cfg.task}")
    for key in entry.data_keys:
        check = getattr(getattr(cfg.data, key), "check", None)
        if callable(check):
            check()


def check_placement(cfg: Any) -> None:
    """What colocation needs of the schedule and the labels, node labels and the namespace (the GPU counts are
    checked where the plan lays them out: `placement_rules.gpu_layout`)."""
    from rayllm_rl.job.placement_rules import NODE_LABEL_KEYS, check_node_labels

    rc = cfg.ray
    colocated = rc.placement == "colocated"
    if colocated and cfg.rollout.max_staleness != 0:
        raise ValueError(f"ray.placement=colocated needs rollout.max_staleness=0 (got {cfg.rollout.max_staleness}): "
                         "the replica sleeps while the learner trains, so nothing is generated during a step and "
                         "an older policy's batch would buy staleness without any overlap")
    for key in NODE_LABEL_KEYS:
        check_node_labels(key, getattr(rc, key))
    if colocated and dict(rc.replica_node_labels or {}) != dict(rc.learner_node_labels or {}):
        raise ValueError("ray.placement=colocated puts replica i and learner rank i on one GPU: "
                         f"ray.replica_node_labels ({rc.replica_node_labels or {}}) and ray.learner_node_labels "
                         f"({rc.learner_node_labels or {}}) must be equal")
    if not rc.namespace.strip():
        raise ValueError("ray.namespace must not be empty (default 'rayllm_rl')")


def check_local_backend(cfg: Any) -> None:
    """`trainer.backend=local` runs every role in this process on the CPU: the Transformers engine, one
    reward model and one judge; a setting asking for more needs trainer.backend=ray."""
    if cfg.trainer.backend != "local":
        return
    if cfg.ray.placement == "colocated":
        raise ValueError("ray.placement=colocated is a placement of the Ray backend's actors: set trainer.backend=ray "
                         "(got local; the local backend runs everything in one process already)")
    if cfg.ray.sync_transport != "auto":
        raise ValueError(f"ray.sync_transport={cfg.ray.sync_transport} is the Ray backend's weight transport: the "
                         "local backend hands the weights to its engine in this process; set trainer.backend=ray, "
                         "or leave ray.sync_transport=auto")
    m, j = cfg.reward.model, cfg.reward.judge
    engines = {"inference.engine": cfg.inference.engine, **({"reward.judge.engine": j.engine} if j.path else {})}
    for key, engine in engines.items():
        if engine != IN_PROCESS_ENGINE:
            raise ValueError(f"{key}={engine} runs in Ray replica actors: set trainer.backend=ray")
    device = dict(cfg.inference.options or {}).get("device", "auto")
    if device not in ("auto", "cpu"):
        raise ValueError(f"inference.options.device={device} with trainer.backend=local: the local backend runs its "
                         "engine in this process on the CPU; set trainer.backend=ray with ray.gpus_per_replica > 0")
    limits = {**({"reward.model.num_actors": (m.num_actors, 1), "reward.model.gpus_per_actor": (m.gpus_per_actor, 0)}
                 if m.path else {}),
              **({"reward.judge.num_replicas": (j.num_replicas, 1),
                  "reward.judge.gpus_per_replica": (j.gpus_per_replica, 0)} if j.path else {})}
    for key, (value, allowed) in limits.items():
        if value != allowed:
            raise ValueError(f"{key}={value} needs trainer.backend=ray: the local backend runs one in-process "
                             f"scorer on the CPU ({key.rsplit('.', 1)[-1]}={allowed})")


def check_lora(cfg: Any) -> None:
    """`model.lora.*` and what a LoRA policy cannot do, each naming the key."""
    cfg.model.lora.check("model.lora")
    if cfg.model.lora.rank > 0 and cfg.algo.kl_reward_coef > 0:
        raise ValueError(f"algo.kl_reward_coef={cfg.algo.kl_reward_coef} with model.lora.rank={cfg.model.lora.rank}: "
                         "a LoRA policy's reference is its own base model (the learner, adapter off), which "
                         "serves the loss's KL (algo.kl_coef) inside the train step but not the reward before it; "
                         "use algo.kl_coef, or model.lora.rank=0")

