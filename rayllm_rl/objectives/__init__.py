"""Loss functions and advantage estimators; every loss follows the `Loss` contract in `base.py`."""
from __future__ import annotations

from rayllm_rl.objectives.advantages import (
    AdvantageConfig,
    compute_advantages,
    global_advantages,
    group_advantages,
    masked_normalize,
)
from rayllm_rl.objectives.base import Loss, LossOutput
from rayllm_rl.objectives.grpo import GRPOLoss, aggregate, kl_estimate, masked_mean
from rayllm_rl.objectives.sft import SFTLoss

LOSSES: dict[str, type[Loss]] = {"grpo": GRPOLoss, "sft": SFTLoss}


def make_loss(name: str, **kwargs) -> Loss:
    """Build the loss registered under `name` in `LOSSES` with keyword arguments `kwargs`."""
    try:
        cls = LOSSES[name]
    except KeyError:
        raise ValueError(f"unknown loss {name!r}; valid names: {sorted(LOSSES)}") from None
    return cls(**kwargs)


__all__ = [
    "LOSSES",
    "AdvantageConfig",
    "GRPOLoss",
    "Loss",
    "LossOutput",
    "SFTLoss",
    "aggregate",
    "compute_advantages",
    "global_advantages",
    "group_advantages",
    "kl_estimate",
    "make_loss",
    "masked_mean",
    "masked_normalize",
]
