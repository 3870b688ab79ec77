"""Task presets: what a job field left None (or `model.dtype=auto`) becomes, resolved by one pure function.

`resolve_presets(cfg)` returns a new config with every such field filled from `TASK_PRESETS[cfg.task]`
(`LORA_LR_PRESETS` over it for a LoRA job) and the placement's dtype; `cfg` itself is left as it was.
A value the user set is never replaced, since only None and "auto" are filled. The config a user holds
(from `load_config`, YAML, Python) stays unresolved, so changing its task or GPUs and resolving again
takes the new presets; a resolved config's values are all the user's from then on.
"""
from __future__ import annotations

import copy
from typing import Any

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
"""Per task, the value each task-dependent field (left None) takes at `resolve_presets`; the same keys
for every task. docs/recipes.md says why each value."""

LORA_LR_PRESETS: dict[str, dict[str, Any]] = {
    # the tiny demo model is random: a LoRA job adapts it after the demo's full-weight SFT warm start
    # (orchestration/sft_warmup.py, sft_warmed_demo_model), so no adapter SFT on top
    "arithmetic": {"optim.lr": 5e-4, "sft.steps": 0},
    "gsm8k": {"optim.lr": 1e-5, "sft.lr": 1e-4},
    "math": {"optim.lr": 1e-5, "sft.lr": 1e-4},
    "ifeval": {"optim.lr": 1e-5, "sft.lr": 1e-4},
    "reasoning_gym": {"optim.lr": 1e-5, "sft.lr": 1e-4},
}
"""With `model.lora.rank > 0`, these replace TASK_PRESETS' values: an adapter is trained at about 10x the
full-weight learning rate (the usual LoRA rule, e.g. Thinking Machines' "LoRA Without Regret"; TRL's LoRA
examples use 1e-5..2e-4). A value the user sets still wins (docs/lora.md)."""

PRESET_KEYS = tuple(TASK_PRESETS["arithmetic"])
"""The task-dependent keys (every task's preset sets these)."""


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
    """{dotted key: value} the presets give `cfg`'s task and placement (an unknown task gives none of
    TASK_PRESETS' keys: the job's checks report it)."""
    wanted = dict(TASK_PRESETS.get(cfg.task, {}))
    wanted["model.dtype"] = auto_dtype(cfg)
    if cfg.model.lora.rank > 0:  # an adapter learns at a higher rate than full weights (docs/lora.md)
        wanted.update(LORA_LR_PRESETS.get(cfg.task, {}))
    return wanted


def resolve_presets(cfg: Any) -> Any:
    """A new config: `cfg` with each field it leaves None (and `model.dtype=auto`) filled from
    `preset_values(cfg)`. Idempotent; `cfg` is not changed."""
    out = copy.deepcopy(cfg)
    for key, value in preset_values(cfg).items():
        *path, field = key.split(".")
        section = get_key(out, ".".join(path)) if path else out
        if getattr(section, field) in (None, "auto"):
            setattr(section, field, value)
    return out
