"""A task bundles train/eval prompt datasets, a verifiable reward and optional SFT demonstrations."""
from __future__ import annotations

import dataclasses
from typing import Any, Callable


@dataclasses.dataclass
class Task:
    """What a training job needs to know about a task, independent of the algorithm."""

    name: str
    train: Any
    """`datasets.Dataset` of prompt rows (a `messages` field plus reward fields)."""
    eval: Any
    """Held-out `datasets.Dataset` (never trained on)."""
    reward_fn: Callable[..., float]
    """AReaL signature: reward_fn(prompt, completions, prompt_ids, completion_ids, **row)."""
    sft_target: Callable[[dict], str] | None = None
    """Row -> assistant demonstration text for the SFT warm start (None: no warm start)."""


def make_task(name: str, **kwargs: Any) -> Task:
    """Build a registered task by name."""
    if name == "arithmetic":
        from rayllm_rl.envs.arithmetic import arithmetic_reward, make_arithmetic_splits, sft_target

        train, eval_ = make_arithmetic_splits(**kwargs)
        return Task("arithmetic", train, eval_, arithmetic_reward, sft_target)
    raise ValueError(f"unknown task {name!r}; available: ['arithmetic']")
