"""rayllm_rl: Ray-native RL post-training for LLMs.

    from rayllm_rl import GRPOJobConfig, train
    summary = train(GRPOJobConfig(), ["trainer.steps=50", "rollout.max_staleness=1"])
    summary = train(reward_fn=my_reward, train_dataset=my_rows)          # your rows, your reward (task=prompts)
    summary = GRPOTrainer(model="Qwen/Qwen2.5-0.5B-Instruct", reward_funcs=my_reward, train_dataset=my_rows).train()

Names are resolved lazily, so importing `rayllm_rl.data` (or any other core module) does not
import Ray: only `rayllm_rl.orchestration.ray` (and the Ray weight transports) do.
"""
from __future__ import annotations

__version__ = "0.2.0"
"""The package's version, kept here only (pyproject.toml reads it; CHANGELOG.md says what each one changed)."""

_LAZY = {
    "train": ("rayllm_rl.api.entry", "train"),
    "GRPOJobConfig": ("rayllm_rl.job.config", "GRPOJobConfig"),
    "GRPOTrainer": ("rayllm_rl.api.trainer", "GRPOTrainer"),
    "JobInputs": ("rayllm_rl.job.inputs", "JobInputs"),
    "Task": ("rayllm_rl.envs.task", "Task"),
    "load_config": ("rayllm_rl.config", "load_config"),
}

__all__ = sorted(_LAZY)


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        module, attr = _LAZY[name]
        return getattr(importlib.import_module(module), attr)
    raise AttributeError(f"module 'rayllm_rl' has no attribute {name!r}")
