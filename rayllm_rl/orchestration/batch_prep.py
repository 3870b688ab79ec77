"""Turn a rollout batch into a training batch (rewards -> advantages) and summarise it for the logs.

`prepare_batch` runs where the batch is (the replay buffer's actor on Ray, the driver's process
locally), so the driver sees only `step_metadata`: scalars and short lists, never tensors.
"""
from __future__ import annotations

import torch

from rayllm_rl.orchestration.job_config import GRPOJobConfig

SEQ_CORE = frozenset({"rewards", "group_id", "advantages", "prox_version"})


def reward_component_means(batch) -> dict[str, float]:
    """Batch means of the per-sequence extras (reward components, success, truncated, num_turns)."""
    return {k: float(batch[k].float().mean()) for k in batch.keys()
            if k not in SEQ_CORE and batch[k].dim() == 1}


def rewards_to_advantages(batch, cfg: GRPOJobConfig, ref_logprobs_fn=None, *, version: int | None = None):
    """Rollout batch `[N]` -> training batch `[N']`; returns it (use the returned batch: it may be smaller).

    In order: reward shaping (DAPO overlong), reference KL (reference logprobs, KL-in-reward),
    then with `rollout.keep_top_k = k > 0` only the trajectories TorchRL's TopKRewardSelector
    keeps: of each group, at most k of those whose shaped reward is above the group's median
    (ties: the earlier row), so a uniform group keeps none and the batch may shrink to 0 rows
    (N' = the kept rows, in their order); then `advantages` `[N']` from the rewards and groups of
    the kept rows (a group that keeps one row gets advantage 0 with `algo.advantage.mean`). `version` is the policy
    version the learner trains this batch from; when given it is stamped as `prox_version` `[N']`
    (`algo.prox_logp_method=loglinear` needs it and raises without it).
    """
    from rayllm_rl.data.selectors import TopKRewardSelector
    from rayllm_rl.objectives import compute_advantages
    from rayllm_rl.objectives.kl_reward import KLRewardTransform, RetrieveKL

    if cfg.algo.prox_logp_method == "loglinear" and version is None:
        raise ValueError("algo.prox_logp_method=loglinear needs the policy version of the batch: "
                         "call rewards_to_advantages(batch, cfg, ref_fn, version=version)")
    shape_rewards(batch, cfg)
    if ref_logprobs_fn is not None:
        RetrieveKL(ref_logprobs_fn)(batch)
        if cfg.algo.kl_reward_coef > 0:
            KLRewardTransform(cfg.algo.kl_reward_coef)(batch)
    if cfg.rollout.keep_top_k > 0:
        batch = TopKRewardSelector(cfg.rollout.keep_top_k)(batch)
    batch["advantages"] = compute_advantages(batch["rewards"], batch["group_id"], cfg.algo.advantage)
    if version is not None:
        batch["prox_version"] = torch.full(batch["rewards"].shape, int(version), dtype=torch.long)
    return batch


def shape_rewards(batch, cfg: GRPOJobConfig):
    """Apply reward shaping that depends on the rollout (DAPO overlong penalty) in place."""
    if cfg.algo.overlong_buffer_len > 0:
        from rayllm_rl.objectives.dapo import overlong_reward_shaping

        lengths = batch["loss_mask"].sum(-1)
        batch["rewards"] = batch["rewards"] + overlong_reward_shaping(
            lengths, cfg.rollout.max_new_tokens, cfg.algo.overlong_buffer_len, cfg.algo.overlong_penalty)
    return batch


def prepare_batch(batch, cfg: GRPOJobConfig, version: int, ref_logprobs: torch.Tensor | None = None):
    """Rollout batch -> (training batch, its step metadata). `ref_logprobs` `[N, T]`: the frozen
    reference's logprobs of the rollout batch (None: no KL term)."""
    ref_fn = None if ref_logprobs is None else (lambda _batch: ref_logprobs)
    batch = rewards_to_advantages(batch, cfg, ref_fn, version=version)
    return batch, step_metadata(batch, version)


def step_metadata(batch, version: int) -> dict:
    """What the driver logs of a training batch trained from `version`: plain numbers and lists."""
    from rayllm_rl.orchestration.reporting import prompts_digest
    from rayllm_rl.rollout.replay_buffer import batch_staleness_stats

    lag = batch_staleness_stats(batch, version)
    return {"reward": float(batch["rewards"].mean()), "seqs": batch.batch_size[0],
            "gen_tokens": int(batch["loss_mask"].sum()), "advantage_abs_mean": float(batch["advantages"].abs().mean()),
            "staleness_mean": lag["mean_lag"], "staleness_max": lag["max_lag"],
            "token_versions": sorted(set(batch["versions"][batch["loss_mask"]].tolist())),
            "episode_ids": sorted(set(batch["group_id"].tolist())), "data_sha": prompts_digest(batch),
            "batch_bytes": int(batch.bytes()), **reward_component_means(batch)}
