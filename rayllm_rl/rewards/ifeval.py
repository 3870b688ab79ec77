"""IFEval scoring: strict/loose instruction-following accuracies and a shaped RL reward.

`score_ifeval` computes IFEval's four accuracies for one response (the google-research
evaluation protocol: strict = the checkers on the response; loose = any of eight relaxed
variants passes). `IFEvalScorer` is the AReaL-signature reward (TorchRL `IfEvalScorer`
semantics): the model thinks in `<think>...</think>` and answers in `<answer>...</answer>`; the
checkers run on the last answer, and the reward adds a format score, a structure score and a
completion bonus.
"""
from __future__ import annotations

import dataclasses
import json
from typing import Any, Mapping, Sequence

from rayllm_rl.rewards.gsm8k import extract_tag_blocks
from rayllm_rl.rewards.ifeval_checkers import CHECKERS

DEFAULT_WEIGHTS = (0.4, 0.3, 0.2, 0.1)
"""Weights of (prompt_level_strict, inst_level_strict, prompt_level_loose, inst_level_loose)."""


@dataclasses.dataclass
class IFEvalScoreData:
    """IFEval accuracies of one response (each in [0, 1]) and the per-instruction results."""

    prompt_level_strict_acc: float
    inst_level_strict_acc: float
    prompt_level_loose_acc: float
    inst_level_loose_acc: float
    strict_results: list[bool] = dataclasses.field(default_factory=list)
    """Per instruction, in `instruction_id_list` order: followed under the strict protocol."""
    loose_results: list[bool] = dataclasses.field(default_factory=list)
    """Per instruction: followed under the loose protocol."""


def loose_variants(response: str) -> list[str]:
    """IFEval's loose-protocol candidates: the response, without its first line, without its last
    line, without both, and each of those four with every `*` removed (original order)."""
    lines = response.split("\n")
    no_first = "\n".join(lines[1:]).strip()
    no_last = "\n".join(lines[:-1]).strip()
    no_both = "\n".join(lines[1:-1]).strip()
    return [response, response.replace("*", ""), no_first, no_last, no_both,
            no_first.replace("*", ""), no_last.replace("*", ""), no_both.replace("*", "")]


def normalize_instruction_ids(instruction_id_list: Any) -> list[str]:
    """The instruction ids as a list of str (accepts a JSON string or any sequence); ValueError if
    empty, malformed or containing an unknown id."""
    ids = instruction_id_list
    if isinstance(ids, str):
        try:
            ids = json.loads(ids)
        except ValueError as err:
            raise ValueError("IFEval field 'instruction_id_list' is not a JSON list: "
                             f"{instruction_id_list!r:.120}") from err
    if isinstance(ids, (str, bytes, Mapping)) or (not isinstance(ids, Sequence) and not hasattr(ids, "tolist")):
        raise ValueError(f"IFEval field 'instruction_id_list' must be a list of ids, got {instruction_id_list!r:.120}")
    ids = list(ids.tolist() if hasattr(ids, "tolist") else ids)
    if not ids:
        raise ValueError("IFEval field 'instruction_id_list' is empty")
    for iid in ids:
        if iid not in CHECKERS:
            raise ValueError(f"unknown IFEval instruction id {iid!r}; known: {sorted(CHECKERS)}")
    return ids


def normalize_kwargs(kwargs: Any, n: int) -> list[dict[str, Any]]:
    """`n` kwargs dicts with None values dropped. Accepts None (all empty), a JSON string, or a list
    of dicts / None / JSON strings (the parquet IFEval lists every kwarg name, unused ones null)."""
    if kwargs is None:
        return [{} for _ in range(n)]
    if isinstance(kwargs, str):
        try:
            kwargs = json.loads(kwargs)
        except ValueError as err:
            raise ValueError(f"IFEval field 'kwargs' is not valid JSON: {kwargs!r:.120}") from err
    if hasattr(kwargs, "tolist"):
        kwargs = kwargs.tolist()
    if isinstance(kwargs, Mapping) or not isinstance(kwargs, Sequence):
        raise ValueError(f"IFEval field 'kwargs' must be a list of dicts, got {kwargs!r:.120}")
    if len(kwargs) != n:
        raise ValueError(f"IFEval field 'kwargs' has {len(kwargs)} entries for {n} instructions")
    out = []
    for kw in kwargs:
        if isinstance(kw, str):
            kw = json.loads(kw) if kw.strip() else {}
        if kw is None:
            kw = {}
        if not isinstance(kw, Mapping):
            raise ValueError(f"IFEval field 'kwargs' entries must be dicts, got {kw!r:.120}")
        out.append({k: v for k, v in kw.items() if v is not None})
    return out


def score_ifeval(response: str, instruction_id_list: Any, kwargs: Any,
                 prompt: str | None = None) -> IFEvalScoreData:
    """IFEval strict and loose accuracies of `response`. An instruction is never followed by a blank
    response. `prompt` fills `prompt_to_repeat` for combination:repeat_prompt when the kwargs lack it.
    ValueError for unknown ids or malformed kwargs."""
    ids = normalize_instruction_ids(instruction_id_list)
    all_kwargs = normalize_kwargs(kwargs, len(ids))
    variants: list[str] | None = None
    strict, loose = [], []
    for iid, kw in zip(ids, all_kwargs):
        if iid == "combination:repeat_prompt" and "prompt_to_repeat" not in kw and prompt is not None:
            kw = {**kw, "prompt_to_repeat": prompt}
        check = CHECKERS[iid]
        ok = check(response, **kw) and bool(response.strip())  # always run: malformed kwargs raise
        strict.append(ok)
        if not ok:
            variants = variants if variants is not None else loose_variants(response)
            ok = any(v.strip() and check(v, **kw) for v in variants[1:])
        loose.append(ok)
    n = len(ids)
    return IFEvalScoreData(
        prompt_level_strict_acc=float(all(strict)),
        inst_level_strict_acc=sum(strict) / n,
        prompt_level_loose_acc=float(all(loose)),
        inst_level_loose_acc=sum(loose) / n,
        strict_results=strict,
        loose_results=loose,
    )


class IFEvalScorer:
    """IFEval reward with TorchRL `IfEvalScorer` semantics and AReaL's reward signature.

    reward = format_score + structure_score + completion_bonus, where (defaults)
      format_score     = 0.4*prompt_strict + 0.3*inst_strict + 0.2*prompt_loose + 0.1*inst_loose (max 1.0),
      structure_score  = 0.5 [exactly one non-empty <think>] + 0.5 [exactly one non-empty <answer>],
      completion_bonus = 0.2 if the response is complete (default: a closed <answer> block exists).
    The checkers see the content of the LAST `<answer>...</answer>` block, or the whole response when
    there is none. Weights summing to 1 keep format_score in [0, 1].
    """

    component_keys = ("format_score", "structure_score", "completion_bonus", "prompt_level_strict_acc",
                      "inst_level_strict_acc", "prompt_level_loose_acc", "inst_level_loose_acc", "success")

    def __init__(self, weights: Sequence[float] = DEFAULT_WEIGHTS, think_score: float = 0.5,
                 answer_score: float = 0.5, completion_bonus: float = 0.2):
        weights = tuple(float(w) for w in weights)
        if len(weights) != 4 or any(w < 0 for w in weights):
            raise ValueError(f"IFEvalScorer weights must be 4 non-negative numbers "
                             f"(prompt_strict, inst_strict, prompt_loose, inst_loose), got {weights}")
        self.weights = weights
        self.think_score = float(think_score)
        self.answer_score = float(answer_score)
        self.completion_bonus = float(completion_bonus)

    @staticmethod
    def parse(completion: str) -> tuple[list[str], list[str]]:
        """(think block contents, answer block contents) of a completion, in order."""
        return extract_tag_blocks(completion, "think"), extract_tag_blocks(completion, "answer")

    @staticmethod
    def done(completion: str) -> bool:
        """True once a closed `<answer>...</answer>` block is present (TorchRL's set_done_if_answer)."""
        return bool(extract_tag_blocks(completion, "answer"))

    def score(self, completion: str, instruction_id_list: Any, kwargs: Any = None,
              prompt: str | None = None, complete: bool | None = None) -> dict[str, float]:
        """All reward components of one completion (see the class docstring)."""
        think, answers = self.parse(completion)
        text = answers[-1] if answers else completion
        data = score_ifeval(text, instruction_id_list, kwargs, prompt=prompt)
        w = self.weights
        format_score = (w[0] * data.prompt_level_strict_acc + w[1] * data.inst_level_strict_acc
                        + w[2] * data.prompt_level_loose_acc + w[3] * data.inst_level_loose_acc)
        structure = (self.think_score if len(think) == 1 and think[0].strip() else 0.0) \
            + (self.answer_score if len(answers) == 1 and answers[0].strip() else 0.0)
        if complete is None:
            complete = bool(answers)
        bonus = self.completion_bonus if complete else 0.0
        return {
            "reward": format_score + structure + bonus,
            "format_score": format_score,
            "structure_score": structure,
            "completion_bonus": bonus,
            "prompt_level_strict_acc": data.prompt_level_strict_acc,
            "inst_level_strict_acc": data.inst_level_strict_acc,
            "prompt_level_loose_acc": data.prompt_level_loose_acc,
            "inst_level_loose_acc": data.inst_level_loose_acc,
            "success": 1.0 if data.prompt_level_strict_acc == 1.0 else 0.0,
        }

    def __call__(self, prompt: str, completions: str, prompt_ids: Any = None, completion_ids: Any = None,
                 **row: Any) -> dict[str, float]:
        """AReaL signature. `row` needs `instruction_id_list` and `kwargs` (list of dicts or JSON);
        an optional `complete` overrides the completion test. `prompt` (as the policy saw it, chat
        template included) only stands in for a missing `prompt_to_repeat`, which real rows carry."""
        if row.get("instruction_id_list") is None:
            raise ValueError(f"IFEval row has no 'instruction_id_list' field (fields: {sorted(row)})")
        return self.score(completions, row["instruction_id_list"], row.get("kwargs"),
                          prompt=prompt, complete=row.get("complete"))


ifeval_reward = IFEvalScorer()
"""A default-weight `IFEvalScorer` instance, usable directly as a task's reward_fn."""
