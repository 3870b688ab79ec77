"""Reference-KL on rollout batches: fetch reference logprobs, turn the KL into a reward penalty.

TorchRL's RetrieveKL / KLRewardTransform, on the trajectory TensorDict of
`rayllm_rl/data/trajectory.py`: rewards are per sequence, so the per-token KL penalty is summed
over the completion's tokens (the return of TorchRL's dense per-token reward).
"""
from __future__ import annotations

from typing import Callable

import torch
from tensordict import TensorDict

from rayllm_rl.objectives.grpo import KL_ESTIMATORS, kl_estimate


class RetrieveKL:
    """Writes `ref_logprobs` `[N, T]` from `ref_logprobs_fn(batch)` (a FrozenModel's
    `compute_logprobs`, or a call to a reference actor) and the per-token KL `kl` `[N, T]`
    (estimator `k1` = logp_behav - logp_ref by default; 0 off the loss mask)."""

    def __init__(self, ref_logprobs_fn: Callable[[TensorDict], torch.Tensor], estimator: str = "k1"):
        if estimator not in KL_ESTIMATORS:
            raise ValueError(f"unknown KL estimator {estimator!r}; valid: {list(KL_ESTIMATORS)}")
        self.ref_logprobs_fn = ref_logprobs_fn
        self.estimator = estimator

    def __call__(self, batch: TensorDict) -> TensorDict:
        ref = torch.as_tensor(self.ref_logprobs_fn(batch), dtype=torch.float32)
        if ref.shape != batch["logprobs"].shape:
            raise ValueError(f"reference logprobs have shape {tuple(ref.shape)}, "
                             f"batch logprobs {tuple(batch['logprobs'].shape)}")
        mask = batch["loss_mask"].bool()
        batch["ref_logprobs"] = torch.where(mask, ref, torch.zeros_like(ref))
        kl = kl_estimate(batch["logprobs"].float(), batch["ref_logprobs"], self.estimator)
        batch["kl"] = torch.where(mask, kl, torch.zeros_like(kl))
        return batch


class KLRewardTransform:
    """`rewards -= coef * sum_t kl_t` over each completion's tokens; writes `kl_penalty` `[N]`
    (the amount subtracted) so it is reported next to the other reward components.
    Needs `kl` from RetrieveKL."""

    def __init__(self, coef: float):
        if coef < 0:
            raise ValueError(f"KL reward coefficient must be >= 0, got {coef}")
        self.coef = float(coef)

    def __call__(self, batch: TensorDict) -> TensorDict:
        if "kl" not in batch.keys():
            raise ValueError("KLRewardTransform needs the batch's 'kl' (run RetrieveKL first)")
        penalty = self.coef * (batch["kl"] * batch["loss_mask"]).sum(-1)
        batch["kl_penalty"] = penalty.float()
        batch["rewards"] = batch["rewards"] - batch["kl_penalty"]
        return batch
