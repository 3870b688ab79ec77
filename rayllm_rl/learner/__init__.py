"""The training worker: single-process or FSDP2 data-parallel `Learner`, and its checkpoints."""
from __future__ import annotations

from rayllm_rl.learner.checkpoint import load_checkpoint, save_checkpoint
from rayllm_rl.learner.distributed import (
    DistConfig,
    destroy_distributed,
    init_distributed,
    iter_full_tensors,
    launch_local,
    shard_model,
)
from rayllm_rl.learner.learner import Learner, OptimConfig
from rayllm_rl.learner.logprobs import token_budget_micro_batches, token_logprobs

__all__ = [
    "DistConfig",
    "Learner",
    "OptimConfig",
    "destroy_distributed",
    "init_distributed",
    "iter_full_tensors",
    "launch_local",
    "load_checkpoint",
    "save_checkpoint",
    "shard_model",
    "token_budget_micro_batches",
    "token_logprobs",
]
