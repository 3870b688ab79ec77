"""Loss functions and advantage estimators; every loss follows the `Loss` contract in `base.py` and reads its
options from one dataclass (`options.py`)."""
from __future__ import annotations

from rayllm_rl.objectives.advantages import (
    AdvantageConfig,
    compute_advantages,
    global_advantages,
    group_advantages,
    masked_normalize,
)
from rayllm_rl.objectives.base import Loss, LossOutput, aggregate, masked_mean
from rayllm_rl.objectives.cispo import CISPOLoss
from rayllm_rl.objectives.dapo import DAPOLoss, DrGRPOLoss, overlong_reward_shaping
from rayllm_rl.objectives.grpo import GRPOLoss, kl_estimate
from rayllm_rl.objectives.importance import GRPOTISLoss, TruncatedIS
from rayllm_rl.objectives.options import (
    Aggregated,
    CISPOOptions,
    DAPOOptions,
    DecoupledPPOOptions,
    DrGRPOOptions,
    GRPOOptions,
    GRPOTISOptions,
    KLPenalty,
    PPOClip,
    Proximal,
    SFTOptions,
    read_as,
)
from rayllm_rl.objectives.ppo_decoupled import DecoupledPPOLoss, loglinear_prox_logp
from rayllm_rl.objectives.sft import SFTLoss

LOSSES: dict[str, type[Loss]] = {
    "grpo": GRPOLoss,
    "sft": SFTLoss,
    "dapo": DAPOLoss,
    "dr_grpo": DrGRPOLoss,
    "cispo": CISPOLoss,
    "ppo_decoupled": DecoupledPPOLoss,
    "grpo_tis": GRPOTISLoss,
}


def make_loss(name: str, options: object | None = None, /, **kwargs) -> Loss:
    """Build the loss registered under `name` in `LOSSES` from its options object (`options_class`) or from
    keyword arguments `kwargs` that build one."""
    try:
        cls = LOSSES[name]
    except KeyError:
        raise ValueError(f"unknown loss {name!r}; valid names: {sorted(LOSSES)}") from None
    return cls(options, **kwargs)


__all__ = [
    "LOSSES",
    "AdvantageConfig",
    "Aggregated",
    "CISPOLoss",
    "CISPOOptions",
    "DAPOLoss",
    "DAPOOptions",
    "DecoupledPPOLoss",
    "DecoupledPPOOptions",
    "DrGRPOLoss",
    "DrGRPOOptions",
    "GRPOLoss",
    "GRPOOptions",
    "GRPOTISLoss",
    "GRPOTISOptions",
    "KLPenalty",
    "Loss",
    "LossOutput",
    "PPOClip",
    "Proximal",
    "SFTLoss",
    "SFTOptions",
    "TruncatedIS",
    "aggregate",
    "compute_advantages",
    "global_advantages",
    "group_advantages",
    "kl_estimate",
    "loglinear_prox_logp",
    "make_loss",
    "masked_mean",
    "masked_normalize",
    "overlong_reward_shaping",
    "read_as",
]
