"""Task presets: what a job field left None (or `model.dtype=auto`) becomes, resolved by one pure function.

`resolve_presets(cfg)` returns a new config with `task` resolved and every such field filled from the task's
registry entry (`envs/task_registry.py`; its LoRA presets over it for a LoRA job) and the placement's dtype;
`cfg` itself is left as it was. A value the user set is never replaced, since only None and "auto" are
filled. The config a user holds (from `load_config`, YAML, Python) stays unresolved, so changing its task or
GPUs and resolving again takes the new presets; a resolved config's values are all the user's from then on.
"""
from __future__ import annotations

import copy
from typing import Any

from rayllm_rl.envs.task_registry import PRESET_KEYS as PRESET_KEYS  # re-exported: job/checks.py imports it here
from rayllm_rl.envs.task_registry import TASKS, find_entry, resolve_task_name
from rayllm_rl.environments import environment_task
from rayllm_rl.workflows.custom import PYTHON_WORKFLOW_PREFIX

TASK_PRESETS: dict[str, dict[str, Any]] = {name: dict(entry.presets) for name, entry in TASKS.items()}
"""Per built-in task, the value each task-dependent field (left None) takes at `resolve_presets`; the same keys
for every task. A copy of the registry's presets (`envs/task_registry.py`) as the package ships it, for
reading; `resolve_presets` reads the registry itself. docs/recipes.md says why each value."""

LORA_LR_PRESETS: dict[str, dict[str, Any]] = {name: dict(entry.lora_presets) for name, entry in TASKS.items()}
"""(A copy of the registry's, as TASK_PRESETS.) With `model.lora.rank > 0`, these replace TASK_PRESETS' values: an
adapter is trained at about 10x the full-weight learning rate (the usual LoRA rule, e.g. Thinking Machines' "LoRA
Without Regret"; TRL's LoRA examples use 1e-5..2e-4). A value the user sets still wins (docs/lora.md)."""


def get_key(cfg: Any, key: str) -> Any:
    """The value of a dotted key such as "rollout.max_new_tokens"."""
    for part in key.split("."):
        cfg = getattr(cfg, part)
    return cfg


def auto_dtype(cfg: Any) -> str:
    """What `model.dtype=auto` means for this placement: bfloat16 when the learner ranks and the replicas
    run on GPUs (every GPU since Ampere computes in bf16), else float32 (CPU: exact logprobs)."""
    return "bfloat16" if cfg.ray.gpus_per_learner > 0 and cfg.ray.gpus_per_replica > 0 else "float32"


def preset_values(cfg: Any) -> dict[str, Any]:
    """{dotted key: value} the presets give `cfg`'s task (resolved) and placement: the registry entry's, the
    prompt task's for a custom task (`CUSTOM`), none for an unknown task (the job's checks report it)."""
    entry = find_entry(cfg.task)
    wanted = dict(entry.presets) if entry else {}
    wanted["model.dtype"] = auto_dtype(cfg)
    if cfg.model.lora.rank > 0 and entry:  # an adapter learns at a higher rate than full weights (docs/lora.md)
        wanted.update(entry.lora_presets)
    return wanted


def resolve_presets(cfg: Any, inputs: Any = None) -> Any:
    """A new config: `cfg` with `task` resolved (`task_registry.resolve_task_name`: left unset, `prompts` when a
    reward function is given by `reward.fn` or in `inputs` (the job's JobInputs), a task object's
    "python:<name>", `openenv` / `verifiers` for an environment object, else `arithmetic`) and each field it leaves
    None (and `model.dtype=auto`) filled from `preset_values`; `rollout.workflow` left "auto" is "python:<name>" for
    a workflow given as a Python object; a decaying `optim.lr_schedule` without `optim.decay_steps` ends at the last
    RL optimizer step. Idempotent; `cfg` is not changed."""
    out = copy.deepcopy(cfg)
    environment = getattr(inputs, "environment", None)
    out.task = resolve_task_name(cfg.task, bool(cfg.reward.fn) or bool(getattr(inputs, "reward_fns", ())),
                                 getattr(inputs, "python_task", "") or None,
                                 environment_task(environment) if environment is not None else None)
    python_workflow = getattr(inputs, "python_workflow", "")
    if python_workflow and out.rollout.workflow == "auto":  # train(workflow=...): named in config.json and the logs
        out.rollout.workflow = PYTHON_WORKFLOW_PREFIX + python_workflow
    for key, value in preset_values(out).items():
        *path, field = key.split(".")
        section = get_key(out, ".".join(path)) if path else out
        if getattr(section, field) in (None, "auto"):
            setattr(section, field, value)
    if out.optim.lr_schedule != "constant" and out.optim.decay_steps is None:  # the decay ends with the last step
        out.optim.decay_steps = out.trainer.steps * out.optim.epochs * out.optim.num_minibatches
    return out
