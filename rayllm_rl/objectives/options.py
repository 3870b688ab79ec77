"""Each loss's options: one dataclass per loss, the one place where its defaults, limits and docstrings are written.

A loss reads its options object: `GRPOLoss(GRPOOptions(clip_eps_low=0.1))`, or keyword overrides that build one,
`GRPOLoss(clip_eps_low=0.1)`. The job's `algo.*` classes (`rayllm_rl.job.algo_config`) are these classes plus the
fields read outside the loss, so the config, its `--help` and the losses share each default. The shared parts are
mixins (`PPOClip`, `KLPenalty`, `Aggregated`, `Proximal`): a loss's class holds only the options it reads, so a key
of another loss fails when a config is read. The field types carry their limits (`rayllm_rl.config`), checked
where a config is read; the losses keep their own checks for Python callers who build options by hand.
"""
from __future__ import annotations

import dataclasses
from typing import Annotated, Any, Literal, TypeVar

from rayllm_rl.config import Limit, NonNegFloat, PosFloat, PosInt

Aggregation = Literal["token-mean", "seq-mean", "seq-sum"]
O = TypeVar("O")

CLIP_HIGHER = 0.28
"""DAPO's clip-higher upper bound (Yu et al. 2025): DAPO's clip_eps_high, and CISPO's weight cap by default."""
DR_GRPO_MAX_TOKENS = 1024
"""Dr.GRPO's normaliser when `DrGRPOOptions.max_tokens` is None and no generation budget fills it (a job fills it
with rollout.max_new_tokens)."""


@dataclasses.dataclass
class PPOClip:
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
class KLPenalty:
    """The KL penalties inside the loss."""

    kl_coef: NonNegFloat = 0.0
    """Coefficient of the KL penalty to the reference policy (0 = off)."""
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    """KL estimator: k1, k2 or k3."""
    kl_behav_coef: NonNegFloat = 0.0
    """Coefficient of the KL penalty to the inference (behaviour) policy that sampled the tokens (0 = off)."""


@dataclasses.dataclass
class Aggregated:
    """How the per-token losses become one scalar."""

    aggregation: Aggregation = "token-mean"
    """Loss aggregation: token-mean, seq-mean or seq-sum."""


@dataclasses.dataclass
class Proximal:
    """Where the proximal logprobs come from, for the losses that weigh against them."""

    prox_logp_method: Literal["recompute", "loglinear"] = "recompute"
    """How the learner gets the proximal logprobs: 'recompute' (one extra forward pass before the update) or
    'loglinear' (AReaL's interpolation between the behaviour logprobs and the training forward by token
    version, no extra pass; see loglinear_prox_logp)."""


@dataclasses.dataclass
class GRPOOptions(KLPenalty, PPOClip):
    """GRPO (GRPOLoss); `ratio_level=sequence` is GSPO."""

    aggregation: Aggregation | None = None
    """Loss aggregation; None = seq-mean with ratio_level=sequence, else token-mean."""
    ratio_level: Literal["token", "sequence"] = "token"
    """'token' or 'sequence' (GSPO's sequence-level ratio)."""


@dataclasses.dataclass
class DAPOOptions(Aggregated, PPOClip):
    """DAPO (DAPOLoss): clip-higher, token-mean, no KL penalty."""

    clip_eps_high: NonNegFloat = CLIP_HIGHER


@dataclasses.dataclass
class DrGRPOOptions(KLPenalty, PPOClip):
    """Dr.GRPO (DrGRPOLoss): a constant length normaliser."""

    max_tokens: PosInt | None = None
    """Dr.GRPO's constant length normaliser (None = rollout.max_new_tokens)."""


@dataclasses.dataclass
class CISPOOptions(Aggregated):
    """CISPO (CISPOLoss): clipped importance weights, no PPO clip."""

    clip_eps_low: NonNegFloat | None = None
    """Lower weight clip (None = no lower clip)."""
    clip_eps_high: NonNegFloat = CLIP_HIGHER
    """Upper weight clip."""


@dataclasses.dataclass
class DecoupledPPOOptions(Proximal, Aggregated, KLPenalty, PPOClip):
    """Decoupled PPO (DecoupledPPOLoss): the behaviour weight exp(logp_prox - logp_behav), capped or masked."""

    behav_weight_cap: PosFloat = 5.0
    """Cap of the behaviour weight exp(logp_prox - logp_behav)."""
    behav_weight_mode: Literal["cap", "mask"] = "cap"
    """'cap' (truncate the weight) or 'mask' (drop tokens above the cap)."""


@dataclasses.dataclass
class GRPOTISOptions(Proximal, Aggregated, KLPenalty, PPOClip):
    """GRPO with truncated importance sampling (GRPOTISLoss)."""

    tis_level: Literal["token", "sequence"] = "token"
    """Truncated importance sampling at 'token' or 'sequence' level."""
    tis_mode: Literal["truncate", "mask"] = "truncate"
    """'truncate' or 'mask' weights above tis_cap."""
    tis_cap: PosFloat = 2.0
    """Cap of the importance weight exp(logp_prox - logp_behav)."""


@dataclasses.dataclass
class SFTOptions(Aggregated):
    """Supervised fine-tuning (SFTLoss).

    The job's `algo.name=sft` exposes only `aggregation` (`SFTAlgo` derives from `Aggregated`, not from this class),
    as it did before these options moved here: the other four (TorchRL's MinorSFT, a KL pull toward the reference)
    were never job keys, and making them keys is a change of the config surface to make on its own. So a job's
    SFTLoss takes them at these defaults: plain NLL."""

    loss_function: Literal["sft", "minor_sft"] = "sft"
    """'sft' (the NLL of the target tokens) or 'minor_sft' (TorchRL's MinorSFT, regularised toward a reference)."""
    beta: float = 0.1
    """minor_sft's scale of each sequence's log-ratio to the reference (x_i = beta * ...)."""
    kl_to_ref_coeff: NonNegFloat = 0.0
    """Coefficient of a k3 KL penalty to the reference (loss_function 'sft' only; 0 = off)."""
    normalize_by_seq_length: bool = True
    """minor_sft: divide each sequence's log-ratio by its number of target tokens (TorchRL's default)."""


def resolve(cls: type[O], options: Any, overrides: dict[str, Any], owner: str) -> O:
    """The options a loss `owner` reads: `options` when given (an instance of `cls`), else `cls(**overrides)`.

    Both at once is a ValueError (one would silently win); a key `cls` lacks is a TypeError naming the keys it
    has (DAPOLoss takes no kl_coef), as a keyword argument the loss did not take always was.
    """
    if options is None:
        unknown = sorted(set(overrides) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise TypeError(f"{owner} takes no option {', '.join(unknown)}; its options ({cls.__name__}): "
                            f"{[f.name for f in dataclasses.fields(cls)]}")
        return cls(**overrides)
    if overrides:
        raise ValueError(f"{owner} takes an options object or keyword overrides, not both: got a "
                         f"{type(options).__name__} and {sorted(overrides)} (dataclasses.replace(options, ...) "
                         "changes some of an options object's fields)")
    if not isinstance(options, cls):
        raise TypeError(f"{owner} reads a {cls.__name__}, got a {type(options).__name__}")
    return options


def read_as(cls: type[O], options: Any) -> O:
    """`options` (a dataclass) seen as a `cls`: each field of `cls` that `options` has, the others at `cls`'s defaults.

    A loss built on another reads its options so (DAPOOptions read as GRPOOptions: no KL penalty, token-level
    ratios), and the job builds a loss's options from its `algo` section so.
    """
    own = {f.name for f in dataclasses.fields(options)}
    return cls(**{f.name: getattr(options, f.name) for f in dataclasses.fields(cls) if f.name in own})

