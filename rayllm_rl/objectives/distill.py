"""On-policy distillation's signal: the per-token reverse KL to a teacher, on the tokens the student sampled.

For a sampled token x_t, `teacher_kl_t = log pi_student(x_t) - log pi_teacher(x_t)` is a one-sample estimate of
KL(pi_student || pi_teacher) at that position (reverse KL: the student is penalised where it puts mass the
teacher does not). Its negative is the token's advantage: dense (one value per token, not per sequence) and
on-policy (the student drew x_t), as in Thinking Machines' on-policy distillation and verl's, AReaL's and TRL's.
The policy loss is unchanged: the job's loss (its PPO ratio and clipping) takes advantages `[N, T]`.

`log pi_student` is the behaviour logprob the engine returned with the token (the sampler's: tempered, over
the kept set under top-k / top-p), so the teacher must score the same token the same way (docs/distillation.md).
"""
from __future__ import annotations

import torch


def teacher_kl(student_logp: torch.Tensor, teacher_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """`log pi_student - log pi_teacher` per sampled token `[N, T]`, 0 off `mask` (prompt, tool output, padding)."""
    if student_logp.shape != teacher_logp.shape or student_logp.shape != mask.shape:
        raise ValueError(f"teacher_kl: student logprobs {tuple(student_logp.shape)}, teacher logprobs "
                         f"{tuple(teacher_logp.shape)} and the mask {tuple(mask.shape)} must have one shape [N, T]")
    diff = student_logp.to(teacher_logp.dtype) - teacher_logp
    return torch.where(mask != 0, diff, torch.zeros_like(diff))


def distill_advantages(kl: torch.Tensor, mask: torch.Tensor, coef: float,
                       task_advantages: torch.Tensor | None = None, task_coef: float = 1.0) -> torch.Tensor:
    """Per-token advantages `[N, T]`: `task_coef * A_task[:, None] - coef * kl` on masked tokens, 0 elsewhere.

    `kl` `[N, T]` from `teacher_kl`; `task_advantages` `[N]` (a task reward's group advantages) or None for
    distillation alone."""
    if coef < 0 or task_coef < 0:
        raise ValueError(f"distillation weights must be >= 0, got coef={coef}, task_coef={task_coef}")
    adv = -float(coef) * kl
    if task_advantages is not None:
        if tuple(task_advantages.shape) != tuple(kl.shape[:1]):
            raise ValueError(f"task advantages have shape {tuple(task_advantages.shape)}, expected "
                             f"{tuple(kl.shape[:1])} (one per row)")
        adv = adv + float(task_coef) * task_advantages.to(adv.dtype)[:, None]
    return torch.where(mask != 0, adv, torch.zeros_like(adv))
