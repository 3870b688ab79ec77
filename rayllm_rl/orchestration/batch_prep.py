"""Turn a rollout batch into a training batch (rewards -> advantages) and summarise it for the logs."""
from __future__ import annotations

from rayllm_rl.orchestration.job_config import GRPOJobConfig

SEQ_CORE = frozenset({"rewards", "group_id", "advantages"})


def reward_component_means(batch) -> dict[str, float]:
    """Batch means of the per-sequence extras (reward components, success, truncated, num_turns)."""
    return {k: float(batch[k].float().mean()) for k in batch.keys()
            if k not in SEQ_CORE and batch[k].dim() == 1}


def rewards_to_advantages(batch, cfg: GRPOJobConfig, ref_logprobs_fn=None):
    """Rollout batch -> training batch, in place: reward shaping (DAPO overlong), reference KL
    (reference logprobs, KL-in-reward), then `advantages` `[N]` from the rewards and groups."""
    from rayllm_rl.objectives import compute_advantages
    from rayllm_rl.objectives.kl_reward import KLRewardTransform, RetrieveKL

    shape_rewards(batch, cfg)
    if ref_logprobs_fn is not None:
        RetrieveKL(ref_logprobs_fn)(batch)
        if cfg.algo.kl_reward_coef > 0:
            KLRewardTransform(cfg.algo.kl_reward_coef)(batch)
    batch["advantages"] = compute_advantages(batch["rewards"], batch["group_id"], cfg.algo.advantage)
    return batch


def shape_rewards(batch, cfg: GRPOJobConfig):
    """Apply reward shaping that depends on the rollout (DAPO overlong penalty) in place."""
    if cfg.algo.overlong_buffer_len > 0:
        from rayllm_rl.objectives.dapo import overlong_reward_shaping

        lengths = batch["loss_mask"].sum(-1)
        batch["rewards"] = batch["rewards"] + overlong_reward_shaping(
            lengths, cfg.rollout.max_new_tokens, cfg.algo.overlong_buffer_len, cfg.algo.overlong_penalty)
    return batch
