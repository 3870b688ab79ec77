"""reasoning-gym's own scorers on what a real model writes: answer extraction and the task reward.

reasoning-gym (PyPI `reasoning-gym`) generates procedural tasks, each row with its reference
answer and metadata, and scores an answer string with its dataset's `score_answer(answer, entry)`
(1.0 right, partial credit for some tasks, 0.0 wrong). Its prompts ask for `<answer>` tags, but an
instruct model such as SmolLM2-135M-Instruct never writes them unprompted: it answers "17 + 25 =
42" or "The answer is 42.". So the answer handed to the scorer is, in this order:

1. the last non-empty `<answer>...</answer>` block, when the completion has one;
2. else, when the reference answer is a number, the last number of the completion (GSM8K's
   `normalize_number` reading: "1,000" is 1000, "-3" is minus three, "10-3" ends in 3);
3. else the last non-empty line, with surrounding spaces and a final period stripped.

Completion text is untrusted: nothing here raises on it.
"""
from __future__ import annotations

import functools
from typing import Any

from rayllm_rl.rewards.gsm8k import extract_tag_blocks, normalize_number, numbers_in


def is_number(text: Any) -> bool:
    """True when `text` is one number and nothing else ("-4", "3.5", "1,000"), as reference answers are."""
    text = str(text).strip()
    return bool(text) and len(numbers_in(text)) == 1 and normalize_number(text) is not None and not any(
        c.isalpha() for c in text)


def extract_answer(completion: str, numeric: bool) -> tuple[str | None, bool]:
    """(answer string for the scorer, whether it came from an `<answer>` tag); (None, False) if none.
    `numeric`: the reference answer is a number, so the fallback is the completion's last number."""
    completion = "" if completion is None else str(completion)
    blocks = [b.strip() for b in extract_tag_blocks(completion, "answer") if b.strip()]
    if blocks:
        return blocks[-1], True
    if numeric:
        return normalize_number(completion), False
    lines = [line.strip() for line in completion.splitlines() if line.strip()]
    return (lines[-1].removesuffix(".").strip() or None, False) if lines else (None, False)


@functools.lru_cache(maxsize=64)
def cached_dataset(name: str, options_key: tuple, seed: int, size: int):
    """One reasoning-gym dataset object per (generator, options, seed, size) in this process: its items are
    generated on demand and deterministically from (seed, index)."""
    import reasoning_gym

    return reasoning_gym.create_dataset(name, seed=seed, size=size, **dict(options_key))


def options_key(options: dict[str, Any]) -> tuple:
    """A hashable, order-free form of a generator's options (lists become tuples)."""
    return tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in options.items()))


class ReasoningGymReward:
    """AReaL-signature reward of a reasoning-gym task: the generator's own `score_answer` on the extracted
    answer, plus `format_weight` when the answer came in `<answer>` tags.

    Rows carry `rg_seed`, `rg_size` and `rg_index` (and the `question` as generated): the scorer's entry (answer and
    metadata, which arrow columns cannot always hold) is regenerated here from them, exactly, and its
    question checked against the row's, so a worker with another reasoning-gym version fails loudly.

    Components: `score` (the scorer's value, in [0, 1]), `answer_tag` (1 if tagged), `answered` (1 if any
    answer was found); `reward = score + format_weight * answer_tag`.
    """

    component_keys = ("score", "answer_tag", "answered")

    def __init__(self, dataset: str, options: dict[str, Any], format_weight: float = 0.0) -> None:
        self.dataset, self.options, self.format_weight = dataset, dict(options), float(format_weight)

    def entry(self, seed: int, size: int, index: int, question: str | None = None) -> dict[str, Any]:
        """Row `index` of the generator's dataset of seed `seed` and size `size` (answer, metadata, question)."""
        entry = cached_dataset(self.dataset, options_key(self.options), int(seed), int(size))[int(index)]
        if question is not None and entry["question"] != question:
            raise ValueError(f"reasoning-gym {self.dataset!r} row {index} of seed {seed} regenerates as "
                             f"{entry['question'][:80]!r}, not the row's {question[:80]!r}: the driver and this "
                             "worker run different reasoning-gym versions or options")
        return entry

    def score(self, completion: str, entry: dict[str, Any]) -> dict[str, float]:
        answer, tagged = extract_answer(completion, is_number(entry["answer"]))
        data = cached_dataset(self.dataset, options_key(self.options), 0, 1)
        try:
            value = float(data.score_answer(answer, entry))
        except Exception:  # noqa: BLE001 - a scorer choking on odd model text scores 0, never raises
            value = 0.0
        tag = 1.0 if tagged else 0.0
        return {"reward": value + self.format_weight * tag, "score": value, "answer_tag": tag,
                "answered": 0.0 if answer is None else 1.0}

    def __call__(self, prompt: str, completions: str, prompt_ids: Any = None, completion_ids: Any = None,
                 **row: Any) -> dict[str, float]:
        for key in ("rg_seed", "rg_size", "rg_index"):
            if key not in row:
                raise ValueError(f"reasoning-gym reward needs the row's {key!r} field "
                                 "(rows made by task=reasoning_gym)")
        return self.score(completions, self.entry(row["rg_seed"], row["rg_size"], row["rg_index"], row.get("question")))

    def __repr__(self) -> str:
        return f"ReasoningGymReward({self.dataset!r}, {self.options}, format_weight={self.format_weight})"
