"""The `algo.*` section: one options class per loss, told apart by `algo.name` (a discriminated union).

Each class is its loss's options class (`rayllm_rl.objectives.options`: only the options that loss reads, with
its defaults, e.g. DAPO's clip-higher clip_eps_high) plus the fields every loss shares (`AlgoBase`: reward shaping,
KL-in-reward, advantages, read outside the loss). So `algo.name=cispo algo.kl_coef=0.1` fails when the config is
read (`rayllm_rl.config` names the key and the losses that take it), and `build_loss` hands the loss its options
object: no default is written here, and no signature is read.
"""
from __future__ import annotations

import dataclasses
from typing import Literal

from rayllm_rl.config import NonNegFloat, NonNegInt
from rayllm_rl.objectives import LOSSES, AdvantageConfig, make_loss, read_as
from rayllm_rl.objectives.options import (
    Aggregated, CISPOOptions, DAPOOptions, DecoupledPPOOptions, DrGRPOOptions, GRPOOptions, GRPOTISOptions,
)


@dataclasses.dataclass
class AlgoBase:
    """What every loss's options hold: fields read outside the loss (batch preparation, episode filter)."""

    name: str = ""
    """Loss name: grpo, dapo, dr_grpo, cispo, ppo_decoupled, grpo_tis, sft (rayllm_rl.objectives.LOSSES)."""
    kl_reward_coef: NonNegFloat = 0.0
    """KL-in-reward (KLRewardTransform): reward -= coef * sum_t (logp_behav - logp_ref) over the
    completion, with reference logprobs from a frozen reference model (0 = off)."""
    dynamic_sampling: bool = False
    """DAPO: drop groups whose rewards are all equal and sample new prompts to keep the batch full."""
    overlong_buffer_len: NonNegInt = 0
    """DAPO overlong shaping: linear penalty over the last N tokens of the budget (0 = off)."""
    overlong_penalty: float = 1.0
    """DAPO overlong shaping: penalty at (and beyond) the full generation budget."""
    advantage: AdvantageConfig = dataclasses.field(default_factory=AdvantageConfig)
    """How rewards become advantages (group/global normalisation, RLOO)."""

    def loss_options(self, max_new_tokens: int | None = None):
        """The options object of the loss `name` names (its `options_class`), from this section's fields of it;
        a field the section does not expose (SFT's) keeps the options class's default."""
        return read_as(LOSSES[self.name].options_class, self)

    def build_loss(self, max_new_tokens: int | None = None):
        """The loss `name` names, built from this class's options (`max_new_tokens`: the generation budget)."""
        if self.name not in LOSSES:
            raise ValueError(f"unknown algo.name {self.name!r}; choose one of {sorted(LOSSES)}")
        own = type(self)().name
        if self.name != own:
            raise ValueError(f"algo.name={self.name!r} was assigned on the options of algo.name={own}: pick another "
                             f"loss with algo.name=... in YAML or an override, or build ALGOS[{self.name!r}]()")
        return make_loss(self.name, self.loss_options(max_new_tokens))


@dataclasses.dataclass
class GRPOAlgo(GRPOOptions, AlgoBase):
    """`algo.name=grpo`: GRPOLoss's options (GRPOOptions) and the shared fields."""

    name: Literal["grpo"] = "grpo"


@dataclasses.dataclass
class DAPOAlgo(DAPOOptions, AlgoBase):
    """`algo.name=dapo`: DAPOLoss's options (DAPOOptions) and the shared fields."""

    name: Literal["dapo"] = "dapo"


@dataclasses.dataclass
class DrGRPOAlgo(DrGRPOOptions, AlgoBase):
    """`algo.name=dr_grpo`: DrGRPOLoss's options (DrGRPOOptions) and the shared fields."""

    name: Literal["dr_grpo"] = "dr_grpo"

    def loss_options(self, max_new_tokens: int | None = None) -> DrGRPOOptions:
        """`max_tokens=None` is the generation budget, when one is known (else DrGRPOLoss's own normaliser)."""
        options = super().loss_options(max_new_tokens)
        return options if options.max_tokens is not None else dataclasses.replace(options, max_tokens=max_new_tokens)


@dataclasses.dataclass
class CISPOAlgo(CISPOOptions, AlgoBase):
    """`algo.name=cispo`: CISPOLoss's options (CISPOOptions) and the shared fields."""

    name: Literal["cispo"] = "cispo"


@dataclasses.dataclass
class PPODecoupledAlgo(DecoupledPPOOptions, AlgoBase):
    """`algo.name=ppo_decoupled`: DecoupledPPOLoss's options (DecoupledPPOOptions) and the shared fields."""

    name: Literal["ppo_decoupled"] = "ppo_decoupled"


@dataclasses.dataclass
class GRPOTISAlgo(GRPOTISOptions, AlgoBase):
    """`algo.name=grpo_tis`: GRPOTISLoss's options (GRPOTISOptions) and the shared fields."""

    name: Literal["grpo_tis"] = "grpo_tis"


@dataclasses.dataclass
class SFTAlgo(Aggregated, AlgoBase):
    """Supervised fine-tuning as the RL-phase loss (SFTLoss): only `aggregation` of `SFTOptions` is a key here, as
    it always was (SFTOptions says why); `build_loss` gives the loss the others at their defaults."""

    name: Literal["sft"] = "sft"


AlgoConfig = GRPOAlgo | DAPOAlgo | DrGRPOAlgo | CISPOAlgo | PPODecoupledAlgo | GRPOTISAlgo | SFTAlgo
"""The type of `GRPOJobConfig.algo`: `algo.name` picks the member (rayllm_rl.config reads it so)."""

ALGOS: dict[str, type[AlgoBase]] = {cls().name: cls for cls in AlgoConfig.__args__}
"""`algo.name` -> its options class, one per loss of `objectives.LOSSES`."""
