"""A frozen reference policy: token logprobs of fixed weights, for KL penalties."""
from __future__ import annotations

import os
from pathlib import Path

import torch
from tensordict import TensorDict

from rayllm_rl.learner.learner import batched_token_logprobs


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


class ReferenceModel:
    """Loads a model with `from_pretrained` (or takes a copy of given weights) and never trains it.

    `compute_logprobs(td)` returns `[N, T]` token-aligned log pi_ref (column 0 and padding 0) at
    the same temperature as the learner, micro-batched to bound memory. In the Ray backend it runs
    inside a reference actor (orchestration.actors.ReferenceActor).
    """

    def __init__(self, model_path: str, *, temperature: float = 1.0, micro_batch_size: int = 16,
                 dtype: torch.dtype = torch.float32, named_tensors: dict[str, torch.Tensor] | None = None):
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype)
        if named_tensors is not None:
            self.load_weights(named_tensors)
        self.model.eval().requires_grad_(False)
        self.temperature = temperature
        self.micro_batch_size = micro_batch_size

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
        return batched_token_logprobs(self.model, td, self.micro_batch_size, self.temperature)
