"""The learner's optimizer settings (`OptimConfig`: AdamW, batching, the learning-rate schedule) and the
schedule itself (`lr_scale`): a warm-up, then constant, linear or cosine decay to a floor."""

from __future__ import annotations

import dataclasses
import math
from typing import Literal

from rayllm_rl.learner.logprobs import DEFAULT_CHUNK


@dataclasses.dataclass
class OptimConfig:
    """AdamW and batching settings of the learner."""

    lr: float = 1e-3
    """Peak learning rate."""
    weight_decay: float = 0.0
    """AdamW decoupled weight decay."""
    beta1: float = 0.9
    """AdamW beta1."""
    beta2: float = 0.99
    """AdamW beta2."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this value (<= 0 disables)."""
    max_tokens_per_micro_batch: int = 16384
    """Padded tokens (rows x longest row) per forward/backward; gradients accumulate over micro-batches.
    Rows are sorted by length, so padding stays small. 16384 (8 rows of 2k, or 4 of 4k) keeps the
    activations of a ~1.5B model within a few GB of GPU memory (less with `activation_checkpointing`),
    since the LM head never holds more than `logprob_chunk_size` positions of logits; a row longer than
    this is a micro-batch of its own."""
    micro_batch_size: int = 0
    """Optional cap on rows per micro-batch on top of the token budget (0 = no row cap)."""
    logprob_chunk_size: int = DEFAULT_CHUNK
    """Positions per LM-head chunk when computing logprobs and entropy: one `[chunk, V]` float32 block of
    logits lives at a time (0.31 GB at 512 x 151,936, Qwen2.5's vocabulary), while each chunk's
    `[chunk, H] x [H, V]` matmul stays large enough to run at full speed. 0 = full-vocabulary logits
    (only for models whose logits are post-processed, e.g. soft-capped)."""
    activation_checkpointing: bool = False
    """Recompute each decoder layer's activations in backward (HF gradient checkpointing, non-reentrant):
    less memory for long sequences, about one more forward of compute."""
    num_minibatches: int = 1
    """Optimizer steps per epoch over a rollout batch (1 = fully on-policy)."""
    epochs: int = 1
    """Passes over each rollout batch."""
    warmup_steps: int = 0
    """Linear warm-up of the learning rate over this many optimizer steps."""
    lr_schedule: Literal["constant", "linear", "cosine"] = "constant"
    """After the warm-up: hold the peak (constant, TRL's GRPOConfig has linear, verl's actor constant), or
    decay it to `min_lr_ratio` x lr at optimizer step `decay_steps`, in a line or a half cosine."""
    min_lr_ratio: float = 0.0
    """Where a linear or cosine decay ends, as a share of `lr` (0 = down to zero)."""
    decay_steps: int | None = None
    """The optimizer step (warm-up included) at which the decay reaches `min_lr_ratio`; later steps stay
    there. A job leaves it None: trainer.steps x epochs x num_minibatches (`job.presets`). A learner built
    directly needs it with a schedule other than constant."""
    share_prompts: bool = True
    """Train rows that share a prompt (a GRPO group) in one packed row, the prompt run once
    (learner/shared_prompt.py): the same logprobs and gradient, the decoder's work cut by ~(G-1)/G of the
    prompt's tokens. Used where the model supports it (`supports_shared_prompt`: sdpa or eager attention, no
    sliding window); false keeps padded rows (e.g. long rows on flash-attention, where the dense 4D mask costs
    more than the prompt)."""

    def __post_init__(self) -> None:
        if self.max_tokens_per_micro_batch < 1:
            raise ValueError(f"optim.max_tokens_per_micro_batch={self.max_tokens_per_micro_batch}: must be >= 1")
        if self.micro_batch_size < 0:
            raise ValueError(f"optim.micro_batch_size={self.micro_batch_size}: must be >= 0 (0 = no row cap)")
        if self.logprob_chunk_size < 0:
            raise ValueError(f"optim.logprob_chunk_size={self.logprob_chunk_size}: must be >= 0 "
                             "(0 = full-vocabulary logits)")
        if self.lr_schedule not in ("constant", "linear", "cosine"):
            raise ValueError(f"optim.lr_schedule={self.lr_schedule!r}: must be constant, linear or cosine")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(f"optim.min_lr_ratio={self.min_lr_ratio}: must be in [0, 1] (a share of optim.lr)")
        if self.lr_schedule != "constant" and self.decay_steps is not None and self.decay_steps <= self.warmup_steps:
            raise ValueError(f"optim.lr_schedule={self.lr_schedule} decays until optim.decay_steps="
                             f"{self.decay_steps}, which must be after the warm-up (optim.warmup_steps="
                             f"{self.warmup_steps})")


def lr_scale(optim: OptimConfig, step: int) -> float:
    """The share of `optim.lr` for the optimizer step after `step` steps taken (the k = step + 1-th): k / warmup
    during the warm-up, then the schedule over progress p = (k - warmup) / (decay_steps - warmup), held at 1
    once p reaches 1: constant 1, linear 1 - p (1 - m), cosine m + (1 - m)(1 + cos(pi p)) / 2, m = min_lr_ratio."""
    k, w = step + 1, optim.warmup_steps
    if w > 0 and k < w:
        return k / w
    if optim.lr_schedule == "constant":
        return 1.0
    if optim.decay_steps is None:
        raise ValueError(f"optim.lr_schedule={optim.lr_schedule} needs optim.decay_steps (the step where the decay "
                         "ends); a job sets it from trainer.steps")
    span = optim.decay_steps - w  # <= 0 only for a job whose trainer.steps ends within the warm-up
    p = 1.0 if span <= 0 else min(1.0, max(0.0, (k - w) / span))
    m = optim.min_lr_ratio
    if optim.lr_schedule == "linear":
        return 1.0 - p * (1.0 - m)
    return m + (1.0 - m) * 0.5 * (1.0 + math.cos(math.pi * p))
