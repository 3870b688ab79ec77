"""The `algo.*` section: one options class per loss, told apart by `algo.name` (a discriminated union).

Each class holds the fields every loss shares (`AlgoBase`: reward shaping, KL-in-reward, advantages)
and only the options its loss reads, with that loss's own defaults (DAPO's clip_eps_high is 0.28). So
`algo.name=cispo algo.kl_coef=0.1` fails when the config is read (`rayllm_rl.config` names the key and
the losses that take it), and `build_loss` passes the options as they are: no signature is read.
"""
from __future__ import annotations

import dataclasses
from typing import Annotated, Literal

from rayllm_rl.config import Limit, NonNegFloat, NonNegInt, PosFloat, PosInt
from rayllm_rl.objectives import AdvantageConfig

Aggregation = Literal["token-mean", "seq-mean", "seq-sum"]


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

    def loss_options(self, max_new_tokens: int | None = None) -> dict:
        """The keyword arguments of the loss: every field this class adds to `AlgoBase`."""
        shared = {f.name for f in dataclasses.fields(AlgoBase)}
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in shared}

    def build_loss(self, max_new_tokens: int | None = None):
        """The loss `name` names, built from this class's options (`max_new_tokens`: the generation budget)."""
        from rayllm_rl.objectives import LOSSES, make_loss

        if self.name not in LOSSES:
            raise ValueError(f"unknown algo.name {self.name!r}; choose one of {sorted(LOSSES)}")
        own = type(self)().name
        if self.name != own:
            raise ValueError(f"algo.name={self.name!r} was assigned on the options of algo.name={own}: pick another "
                             f"loss with algo.name=... in YAML or an override, or build ALGOS[{self.name!r}]()")
        return make_loss(self.name, **self.loss_options(max_new_tokens))


@dataclasses.dataclass
class _PPOClip:
    """The PPO ratio clip."""

    clip_eps_low: NonNegFloat = 0.2
    """Lower ratio clip: ratios below 1 - clip_eps_low are clipped."""
    clip_eps_high: NonNegFloat = 0.2
    """Upper ratio clip: ratios above 1 + clip_eps_high are clipped."""
    clip_ratio_c: Annotated[float, Limit(gt=1)] | None = None
    """Dual-clip (verl's clip_ratio_c, 3.0 there when on; None = off, must be > 1): for a negative
    advantage the per-token loss is capped at clip_ratio_c * |A|, so tokens with ratio > clip_ratio_c
    give no gradient."""


@dataclasses.dataclass
class _KLPenalty:
    """The KL penalties inside the loss."""

    kl_coef: NonNegFloat = 0.0
    """Coefficient of the KL penalty to the reference policy (0 = off)."""
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    """KL estimator: k1, k2 or k3."""
    kl_behav_coef: NonNegFloat = 0.0
    """Coefficient of the KL penalty to the inference (behaviour) policy that sampled the tokens (0 = off)."""


@dataclasses.dataclass
class _Aggregation:
    aggregation: Aggregation = "token-mean"
    """Loss aggregation: token-mean, seq-mean or seq-sum."""


@dataclasses.dataclass
class _Proximal:
    prox_logp_method: Literal["recompute", "loglinear"] = "recompute"
    """How the learner gets the proximal logprobs: 'recompute' (one extra forward pass before the update) or
    'loglinear' (AReaL's interpolation between the behaviour logprobs and the training forward by token
    version, no extra pass; see loglinear_prox_logp)."""


@dataclasses.dataclass
class GRPOAlgo(_KLPenalty, _PPOClip, AlgoBase):
    """GRPO (GRPOLoss); `ratio_level=sequence` is GSPO."""

    name: Literal["grpo"] = "grpo"
    aggregation: Aggregation | None = None
    """Loss aggregation; None = seq-mean with ratio_level=sequence, else token-mean."""
    ratio_level: Literal["token", "sequence"] = "token"
    """'token' or 'sequence' (GSPO's sequence-level ratio)."""


@dataclasses.dataclass
class DAPOAlgo(_Aggregation, _PPOClip, AlgoBase):
    """DAPO (DAPOLoss): clip-higher, token-mean, no KL penalty."""

    name: Literal["dapo"] = "dapo"
    clip_eps_high: NonNegFloat = 0.28


@dataclasses.dataclass
class DrGRPOAlgo(_KLPenalty, _PPOClip, AlgoBase):
    """Dr.GRPO (DrGRPOLoss): a constant length normaliser."""

    name: Literal["dr_grpo"] = "dr_grpo"
    max_tokens: PosInt | None = None
    """Dr.GRPO's constant length normaliser (None = rollout.max_new_tokens)."""

    def loss_options(self, max_new_tokens: int | None = None) -> dict:
        options = super().loss_options(max_new_tokens)
        if options["max_tokens"] is None:
            options["max_tokens"] = max_new_tokens
        if options["max_tokens"] is None:  # no budget known: DrGRPOLoss's own default
            del options["max_tokens"]
        return options


@dataclasses.dataclass
class CISPOAlgo(_Aggregation, AlgoBase):
    """CISPO (CISPOLoss): clipped importance weights, no PPO clip."""

    name: Literal["cispo"] = "cispo"
    clip_eps_low: NonNegFloat | None = None
    """Lower weight clip (None = no lower clip)."""
    clip_eps_high: NonNegFloat = 0.28
    """Upper weight clip."""


@dataclasses.dataclass
class PPODecoupledAlgo(_Proximal, _Aggregation, _KLPenalty, _PPOClip, AlgoBase):
    """Decoupled PPO (DecoupledPPOLoss): the behaviour weight exp(logp_prox - logp_behav), capped or masked."""

    name: Literal["ppo_decoupled"] = "ppo_decoupled"
    behav_weight_cap: PosFloat = 5.0
    """Cap of the behaviour weight exp(logp_prox - logp_behav)."""
    behav_weight_mode: Literal["cap", "mask"] = "cap"
    """'cap' (truncate the weight) or 'mask' (drop tokens above the cap)."""


@dataclasses.dataclass
class GRPOTISAlgo(_Proximal, _Aggregation, _KLPenalty, _PPOClip, AlgoBase):
    """GRPO with truncated importance sampling (GRPOTISLoss)."""

    name: Literal["grpo_tis"] = "grpo_tis"
    tis_level: Literal["token", "sequence"] = "token"
    """Truncated importance sampling at 'token' or 'sequence' level."""
    tis_mode: Literal["truncate", "mask"] = "truncate"
    """'truncate' or 'mask' weights above tis_cap."""
    tis_cap: PosFloat = 2.0
    """Cap of the importance weight exp(logp_prox - logp_behav)."""


@dataclasses.dataclass
class SFTAlgo(_Aggregation, AlgoBase):
    """Supervised fine-tuning as the RL-phase loss (SFTLoss)."""

    name: Literal["sft"] = "sft"


AlgoConfig = GRPOAlgo | DAPOAlgo | DrGRPOAlgo | CISPOAlgo | PPODecoupledAlgo | GRPOTISAlgo | SFTAlgo
"""The type of `GRPOJobConfig.algo`: `algo.name` picks the member (rayllm_rl.config reads it so)."""

ALGOS: dict[str, type[AlgoBase]] = {cls().name: cls for cls in AlgoConfig.__args__}
"""`algo.name` -> its options class, one per loss of `objectives.LOSSES`."""
