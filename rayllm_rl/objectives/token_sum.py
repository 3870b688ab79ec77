"""Tinker's built-in losses, token by token and SUMMED (never averaged), as Tinker documents them; and the bridge
that lets our own losses (`objectives.LOSSES`) take the same data.

Each loss is a small module with one tensor signature (prime-rl's shape):

    loss(logp [N, T], inputs: {name: [N, T] float tensor}, mask [N, T]) -> LossOutput

`logp` are the learner's log-probabilities of the datum's `target_tokens` at each position, `inputs` the datum's
other `loss_fn_inputs` (`weights`, `logprobs` = the sampler's, `advantages`, ...), padded with 0 to the longest
datum, and `mask` is 1 on each datum's own positions (0 on padding). Tinker's semantics (docs /losses):

- cross_entropy:       -(logp * weights).sum()          (weights default to 1)
- importance_sampling: -(exp(logp - logprobs) * advantages).sum()
- ppo:                 -min(r * A, clip(r, lo, hi) * A).sum(),          r = exp(logp - logprobs)
- cispo:               -(sg(clip(r, lo, hi)) * logp * A).sum()

with `lo`, `hi` = `clip_low_threshold`, `clip_high_threshold` from `loss_fn_config` (default 0.8, 1.2: Tinker's
epsilon 0.2), or per token from the datum's inputs of those names. A sum splits over micro-batches and over the
SDK's request chunks without any weighting (`normalizer` is 1): the gradients just add up.
"""
from __future__ import annotations

from typing import Any, Mapping

import torch

from rayllm_rl.objectives.base import Loss, LossOutput

CLIP_LOW, CLIP_HIGH = 0.8, 1.2
"""Tinker's PPO / CISPO ratio bounds when the config and the data give none (epsilon 0.2 each side)."""
OWN_PREFIX = "rayllm_rl:"
"""`rayllm_rl:<name>` names our own loss `name` of `objectives.LOSSES` (also where a Tinker loss has that name)."""


class SummedLoss(torch.nn.Module):
    """A Tinker loss: per-token terms, summed over the mask. Subclasses name the inputs they need (`requires`)
    and give the per-token loss `per_token(logp, inputs) -> [N, T]`; `config` is the call's `loss_fn_config`."""

    name = ""
    requires: tuple[str, ...] = ()
    config_keys: tuple[str, ...] = ()
    scores_sampled_tokens = True
    """The targets were drawn by a sampler, so a sampling mask the data carries is replayed when they are scored
    (False for demonstrations: cross_entropy scores over the full softmax)."""

    def __init__(self, config: Mapping[str, Any] | None = None):
        super().__init__()
        config = dict(config or {})
        if unknown := sorted(set(config) - set(self.config_keys)):
            raise ValueError(f"loss_fn_config for {self.name!r} has unknown keys {unknown}; it takes "
                             f"{list(self.config_keys) or 'none'}")
        self.config = {k: float(v) for k, v in config.items()}

    def normalizer(self, mask: torch.Tensor) -> float:
        """Micro-batch weighting (the learner's contract): a sum needs none."""
        return 1.0

    def forward(self, logp: torch.Tensor, inputs: Mapping[str, torch.Tensor], mask: torch.Tensor) -> LossOutput:
        if missing := [k for k in self.requires if k not in inputs]:
            raise ValueError(f"loss {self.name!r} needs loss_fn_inputs {list(self.requires)}; the data lacks "
                             f"{missing} (it has {sorted(inputs)})")
        for key in self.requires:
            if inputs[key].shape != logp.shape:
                raise ValueError(f"loss_fn_inputs[{key!r}] has shape {tuple(inputs[key].shape)}, not the targets' "
                                 f"{tuple(logp.shape)}")
        per = self.per_token(logp, inputs)
        loss = torch.where(mask != 0, per, torch.zeros_like(per)).sum()
        return LossOutput(loss, {"loss:sum": float(loss.detach())})

    def _bounds(self, inputs: Mapping[str, torch.Tensor]) -> tuple[Any, Any]:
        lo = inputs.get("clip_low_threshold", self.config.get("clip_low_threshold", CLIP_LOW))
        hi = inputs.get("clip_high_threshold", self.config.get("clip_high_threshold", CLIP_HIGH))
        return lo, hi


class CrossEntropy(SummedLoss):
    """`weights` default to 1 at every position: Tinker's own `forward(data, "cross_entropy")` example, and the
    SDK's forward for `forward_backward_custom`, send `target_tokens` alone."""

    name, scores_sampled_tokens = "cross_entropy", False

    def per_token(self, logp, inputs):
        return -logp * inputs["weights"] if "weights" in inputs else -logp


class ImportanceSampling(SummedLoss):
    name, requires = "importance_sampling", ("logprobs", "advantages")

    def per_token(self, logp, inputs):
        return -torch.exp(logp - inputs["logprobs"]) * inputs["advantages"]


class PPO(SummedLoss):
    name, requires, config_keys = "ppo", ("logprobs", "advantages"), ("clip_low_threshold", "clip_high_threshold")

    def per_token(self, logp, inputs):
        ratio, adv = torch.exp(logp - inputs["logprobs"]), inputs["advantages"]
        lo, hi = self._bounds(inputs)
        return -torch.minimum(ratio * adv, torch.clamp(ratio, lo, hi) * adv)


class CISPO(SummedLoss):
    name, requires, config_keys = "cispo", ("logprobs", "advantages"), ("clip_low_threshold", "clip_high_threshold")

    def per_token(self, logp, inputs):
        lo, hi = self._bounds(inputs)
        weight = torch.clamp(torch.exp(logp - inputs["logprobs"]), lo, hi).detach()
        return -weight * logp * inputs["advantages"]


TINKER_LOSSES: dict[str, type[SummedLoss]] = {cls.name: cls for cls in (CrossEntropy, ImportanceSampling, PPO, CISPO)}
"""Tinker's loss names this package computes. Not here: `dro`, `gspo`, `stable_reinforce` (they need the server's
stability records), `custom` (the SDK's `forward_backward_custom` runs the user's loss on its side and sends
`cross_entropy` with the gradient as weights, so it works through `cross_entropy`)."""


class OwnLoss(torch.nn.Module):
    """One of our losses (`objectives.LOSSES`) on Tinker's data: `logprobs` are the behaviour logprobs,
    `advantages` per token, the datum's `mask` input (if any, else every position) the trained tokens, `prox` the
    current weights' logprobs (the call scores at the weights that were there before any update). It reduces
    with its own aggregation (a mean, not Tinker's sum) and reports `loss:mean`."""

    def __init__(self, loss: Loss):
        super().__init__()
        self.loss, self.name = loss, type(loss).__name__
        self.scores_sampled_tokens = loss.scores_sampled_tokens

    def normalizer(self, mask: torch.Tensor) -> float:
        return float(self.loss.normalizer(mask))

    def forward(self, logp: torch.Tensor, inputs: Mapping[str, torch.Tensor], mask: torch.Tensor) -> LossOutput:
        if missing := [k for k in ("logprobs", "advantages") if k not in inputs]:
            raise ValueError(f"loss {self.name} needs loss_fn_inputs 'logprobs' and 'advantages'; the data lacks "
                             f"{missing} (it has {sorted(inputs)})")
        trained = inputs["mask"] * mask if "mask" in inputs else mask
        prox = logp.detach() if self.loss.needs_prox_logp else None
        out = self.loss(logp, inputs["logprobs"], prox, inputs["advantages"], trained, inputs.get("ref_logprobs"))
        return LossOutput(out.loss, {"loss:mean": float(out.loss.detach()),
                                     **{f"{k}:mean": v for k, v in out.metrics.items() if k != "loss"}})


def make_token_loss(name: str, config: Mapping[str, Any] | None = None) -> torch.nn.Module:
    """The loss `forward_backward(data, name, config)` trains with: Tinker's (`TINKER_LOSSES`), else ours
    (`objectives.LOSSES`, also as `rayllm_rl:<name>`) built with `config` as its options' keywords."""
    from rayllm_rl.objectives import LOSSES, make_loss

    if name in TINKER_LOSSES:
        return TINKER_LOSSES[name](config)
    own = name[len(OWN_PREFIX):] if name.startswith(OWN_PREFIX) else name
    if own in LOSSES:
        try:
            return OwnLoss(make_loss(own, **dict(config or {})))
        except TypeError as exc:
            raise ValueError(f"loss_fn_config for {name!r}: {exc}") from None
    raise ValueError(f"unknown loss_fn {name!r}: Tinker's are {sorted(TINKER_LOSSES)} (dro, gspo, stable_reinforce "
                     f"are not computed here), ours {sorted(LOSSES)} (also as '{OWN_PREFIX}<name>')")
