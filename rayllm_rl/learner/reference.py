"""A frozen reference policy: token logprobs of fixed weights, for KL penalties."""
from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import torch
from tensordict import TensorDict

from rayllm_rl.learner.learner import OptimConfig
from rayllm_rl.learner.logprobs import batched_token_logprobs, check_chunked_head
from rayllm_rl.learner.shared_prompt import check_shared_prompt, shared_prompt_logprobs, supports_shared_prompt
from rayllm_rl.sampling_mask import SamplingMask


REFERENCE_FILE = "reference.safetensors"
"""The reference weights inside a training checkpoint, so a resumed run keeps its original reference."""


def load_reference_weights(checkpoint_dir: str | os.PathLike) -> dict[str, torch.Tensor]:
    """The reference weights a checkpoint saved with `ReferenceModel.save`."""
    from safetensors.torch import load_file

    path = Path(checkpoint_dir) / REFERENCE_FILE
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing: the checkpoint was saved by a run without a reference KL "
                                "term, so the reference policy of this run cannot be restored")
    return load_file(str(path))


@dataclasses.dataclass(frozen=True)
class ReferenceSpec:
    """What the frozen reference is built from, the same in every backend (`JobPlan.reference_spec`): the
    learner's temperature, dtype and batching (`optim.max_tokens_per_micro_batch`, `optim.logprob_chunk_size`)."""

    model_path: str
    temperature: float = 1.0
    dtype: str = "float32"
    max_tokens_per_micro_batch: int = OptimConfig.max_tokens_per_micro_batch
    logprob_chunk_size: int = OptimConfig.logprob_chunk_size

    def build(self, weights: dict[str, torch.Tensor] | str | os.PathLike, device: torch.device | str = "cpu"):
        """The `ReferenceModel` holding `weights`: the policy's tensors, or a checkpoint directory with
        `reference.safetensors` (a resumed run keeps its reference); the model path is resolved on this node."""
        from rayllm_rl.hub import resolve_model_path

        named = weights if isinstance(weights, dict) else load_reference_weights(weights)
        return ReferenceModel(resolve_model_path(self.model_path), temperature=self.temperature,
                              max_tokens_per_micro_batch=self.max_tokens_per_micro_batch,
                              logprob_chunk_size=self.logprob_chunk_size, dtype=getattr(torch, self.dtype),
                              named_tensors=named, device=device)


class ReferenceModel:
    """Loads a model with `from_pretrained` (or takes a copy of given weights) and never trains it.

    `compute_logprobs(td)` returns `[N, T]` token-aligned log pi_ref (column 0 and padding 0; with
    `share_prompts`, only the loss-mask tokens) at the same temperature as the learner, batched like the
    learner: micro-batches of at most `max_tokens_per_micro_batch` tokens, the LM head in chunks of
    `logprob_chunk_size` positions (see `OptimConfig`). In the Ray backend it runs inside a reference actor
    (orchestration.ray.actors.ReferenceActor), or the teacher's (`TeacherActor`).
    """

    def __init__(self, model_path: str, *, temperature: float = 1.0,
                 max_tokens_per_micro_batch: int = OptimConfig.max_tokens_per_micro_batch,
                 logprob_chunk_size: int = OptimConfig.logprob_chunk_size, dtype: torch.dtype = torch.float32,
                 named_tensors: dict[str, torch.Tensor] | None = None, device: torch.device | str = "cpu",
                 sampling_mask: SamplingMask = SamplingMask(), share_prompts: bool = False):
        """`device`: where the frozen model runs (a GPU in the learner's dtype, next to learner rank 0);
        `sampling_mask`: the rollout's top-k / top-p, replayed so tokens are scored over the sampler's kept set;
        `share_prompts`: score only the loss-mask tokens, each group's prompt run once (`learner.shared_prompt`),
        where the model supports it (a teacher reads no other token)."""
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype)
        if named_tensors is not None:
            self.load_weights(named_tensors)
        self.device = torch.device(device)
        self.model.to(self.device).eval().requires_grad_(False)
        self.temperature = temperature
        if max_tokens_per_micro_batch < 1 or logprob_chunk_size < 0:
            raise ValueError(f"ReferenceModel needs max_tokens_per_micro_batch >= 1 and logprob_chunk_size >= 0, got "
                             f"{max_tokens_per_micro_batch} and {logprob_chunk_size}")
        self.max_tokens_per_micro_batch = max_tokens_per_micro_batch
        self.logprob_chunk_size = logprob_chunk_size
        self.sampling_mask = sampling_mask
        check_chunked_head(self.model, logprob_chunk_size)
        self.share_prompts = share_prompts and logprob_chunk_size > 0 and supports_shared_prompt(self.model)
        if self.share_prompts:
            check_shared_prompt(self.model, logprob_chunk_size)

    def load_weights(self, named: dict[str, torch.Tensor]) -> None:
        """Replace the reference weights (e.g. with the policy right after its SFT warm start)."""
        missing, unexpected = self.model.load_state_dict(named, strict=False)
        if unexpected:
            raise ValueError(f"reference weights have unexpected tensors: {unexpected[:5]}")
        params = {k for k, _ in self.model.named_parameters()}
        if params - set(named):
            raise ValueError(f"reference weights lack parameters: {sorted(params - set(named))[:5]}")

    def save(self, checkpoint_dir: str | os.PathLike) -> str:
        """Write the frozen weights to `checkpoint_dir/reference.safetensors` (tied tensors stored apart)."""
        from safetensors.torch import save_file

        os.makedirs(checkpoint_dir, exist_ok=True)
        path = str(Path(checkpoint_dir) / REFERENCE_FILE)
        save_file({k: v.detach().clone().contiguous() for k, v in self.model.state_dict().items()}, path)
        return path

    def compute_logprobs(self, td: TensorDict) -> torch.Tensor:
        if self.share_prompts:
            return shared_prompt_logprobs(self.model, td, self.max_tokens_per_micro_batch, self.temperature,
                                          self.device, chunk_size=self.logprob_chunk_size, mask=self.sampling_mask)
        return batched_token_logprobs(self.model, td, self.max_tokens_per_micro_batch, self.temperature, self.device,
                                      chunk_size=self.logprob_chunk_size, mask=self.sampling_mask)
