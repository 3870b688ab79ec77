"""Build task, workflow and sampling from a job config (shared by the local trainer and Ray actors)."""
from __future__ import annotations

from rayllm_rl.envs.task import Task, make_task
from rayllm_rl.inference.protocol import SamplingParams
from rayllm_rl.orchestration.job_config import GRPOJobConfig
from rayllm_rl.workflows.rlvr import RLVRWorkflow


def build_task(cfg: GRPOJobConfig) -> Task:
    return make_task(cfg.task.name, max_operand=cfg.task.max_operand, eval_size=cfg.task.eval_size,
                     seed=cfg.trainer.seed)


def build_sampling(cfg: GRPOJobConfig) -> SamplingParams:
    r = cfg.rollout
    return SamplingParams(max_new_tokens=r.max_new_tokens, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k)


def build_workflow(cfg: GRPOJobConfig, task: Task, tokenizer) -> RLVRWorkflow:
    return RLVRWorkflow(task.reward_fn, tokenizer, build_sampling(cfg), group_size=cfg.rollout.group_size)


def sft_chats(task: Task, rows: list[dict]) -> list[list[dict]]:
    """Demonstration chats for the SFT warm start."""
    return [r["messages"] + [{"role": "assistant", "content": task.sft_target(r)}] for r in rows]


def has_reward_variance(episode) -> bool:
    """DAPO dynamic sampling: keep a group only if its rewards are not all equal."""
    r = episode["rewards"]
    return bool((r != r[0]).any())


def build_episode_filter(cfg: GRPOJobConfig):
    return has_reward_variance if cfg.algo.dynamic_sampling else None


def shape_rewards(batch, cfg: GRPOJobConfig):
    """Apply reward shaping that depends on the rollout (DAPO overlong penalty) in place."""
    if cfg.algo.overlong_buffer_len > 0:
        from rayllm_rl.objectives.dapo import overlong_reward_shaping

        lengths = batch["loss_mask"].sum(-1)
        batch["rewards"] = batch["rewards"] + overlong_reward_shaping(
            lengths, cfg.rollout.max_new_tokens, cfg.algo.overlong_buffer_len, cfg.algo.overlong_penalty)
    return batch
