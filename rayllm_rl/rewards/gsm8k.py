"""GSM8K: final-answer extraction, number normalisation and a shaped `<think>/<answer>` reward.

The dataset (openai/gsm8k, config "main") stores the reference as worked reasoning with
calculator annotations (`48/2 = <<48/2=24>>24`) followed by `#### 72`. Completions are asked
to reason inside `<think>...</think>` and give the number inside `<answer>...</answer>`.

`GSM8KRewardParser` follows TorchRL's GSM8KRewardParser (format components plus a success term
that overrides them) on a [0, 1] scale. Completion text is untrusted model output: parsing is
regex/str.find based, linear in its length, and never raises on it.
"""
from __future__ import annotations

import re
import unicodedata
from fractions import Fraction
from typing import Any

__all__ = [
    "GSM8K_SYSTEM_PROMPT",
    "GSM8KRewardParser",
    "extract_tag_blocks",
    "gsm8k_final_answer",
    "gsm8k_prompt",
    "gsm8k_sft_target",
    "normalize_number",
    "numbers_in",
]

GSM8K_SYSTEM_PROMPT = (
    "A conversation between User and Assistant. The user asks a question, and the Assistant solves it. "
    "The assistant first thinks about the reasoning process in the mind and then provides the user with "
    "the answer. The reasoning process and answer are enclosed within <think></think> and "
    "<answer></answer> tags, respectively, i.e., <think>reasoning process here</think> "
    "<answer>answer here</answer>. The answer is a single number, without units."
)

_MAX_DIGITS = 300
"""Number tokens with more digits are ignored: no real answer is that long, and Python refuses to
convert ints of more than 4300 digits (sys.int_max_str_digits), which must not make us raise."""

# A number token: optional sign (only when it cannot be a binary minus/plus, i.e. not right after
# a letter, digit or closing bracket), optional currency, then either a comma-grouped integer
# ("1,000"), plain digits or a bare decimal (".5"), optionally followed by "/denominator".
# Bounded whitespace keeps matching linear on adversarial text.
_NUM_RE = re.compile(
    r"(?:(?<![0-9A-Za-z_)\]])(?P<sign>[-+]))?"
    r"(?:[$€£¥][ \t]{0,3})?"
    r"(?<![0-9.])"
    r"(?P<mag>(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?|\.\d+)"
    r"(?:[ \t]{0,3}/[ \t]{0,3}(?P<den>\d+(?:\.\d+)?)(?![\d/]))?"
)
_LATEX_FRAC_RE = re.compile(r"\\[dt]?frac\{\s*([-+]?[\d.,]+)\s*\}\{\s*([\d.,]+)\s*\}")
_CALC_RE = re.compile(r"<<[^<>]*>>")


def _prepare(text: str) -> str:
    """NFKC (fullwidth digits/currency), unicode minus and fraction slash, LaTeX number syntax."""
    text = unicodedata.normalize("NFKC", str(text))
    text = text.replace("\u2212", "-").replace("\u2044", "/").replace("{,}", ",")
    if "frac" in text:
        text = _LATEX_FRAC_RE.sub(r"\1/\2", text)
    return text


def _canonical(value: Fraction) -> str:
    """'72', '-3.5', '0.75' for terminating decimals; 'p/q' otherwise (so 2/6 == 1/3)."""
    num, den = value.numerator, value.denominator
    if den == 1:
        return str(num)
    twos = fives = 0
    rest = den
    while rest % 2 == 0:
        rest //= 2
        twos += 1
    while rest % 5 == 0:
        rest //= 5
        fives += 1
    if rest != 1:
        return f"{num}/{den}"
    places = max(twos, fives)
    scaled = abs(num) * 10**places // den
    digits = str(scaled).rjust(places + 1, "0")
    body = f"{digits[:-places]}.{digits[-places:]}".rstrip("0").rstrip(".")
    return f"-{body}" if num < 0 else body


def _token_value(match: re.Match) -> str | None:
    mag, den = match.group("mag"), match.group("den")
    if len(mag) + len(den or "") > _MAX_DIGITS:
        return None
    try:
        value = Fraction(mag.replace(",", ""))
        if den is not None:
            den_value = Fraction(den)
            if den_value == 0:
                return None
            value /= den_value
    except (ValueError, ZeroDivisionError):
        return None
    if match.group("sign") == "-":
        value = -value
    return _canonical(value)


def numbers_in(text: str) -> list[str]:
    """Every number in `text`, in order, each normalised as by `normalize_number`."""
    values = (_token_value(m) for m in _NUM_RE.finditer(_prepare(text)))
    return [v for v in values if v is not None]


def normalize_number(text: Any) -> str | None:
    """The canonical value of the LAST number in `text`, or None if it holds none.

    Thousands separators, currency, units and percent signs, surrounding punctuation, a leading
    "+" and trailing zeros go ("$1,000.00 dollars" -> "1000", "18%" -> "18", "-3.50" -> "-3.5");
    simple fractions become decimals when they terminate ("3/4" -> "0.75", else "1/3"). Unicode
    minus and fullwidth forms count ("−3", "＄７２"). A "-" right after a letter or digit is
    read as subtraction, not a sign ("10-3" ends in 3).
    """
    if text is None:
        return None
    matches = list(_NUM_RE.finditer(_prepare(text)))
    for m in reversed(matches):
        value = _token_value(m)
        if value is not None:
            return value
    return None


def gsm8k_final_answer(answer_field: str) -> str:
    """The normalised number after the last `####` of a GSM8K reference answer."""
    text = str(answer_field)
    head, sep, tail = text.rpartition("####")
    if not sep:
        raise ValueError(f"GSM8K answer has no '####' final-answer marker: {text[-200:]!r}")
    value = normalize_number(tail)
    if value is None:
        raise ValueError(f"GSM8K answer has no number after '####': {tail.strip()[:200]!r}")
    return value


def extract_tag_blocks(text: str, tag: str) -> list[str]:
    """Contents of `<tag>...</tag>` blocks, each from an opening tag to the NEXT closing tag.

    Linear-time (str.find, no backtracking). Malformed markup is tolerated: an unclosed block is
    dropped, a nested opening tag is kept as text ("<a><a>7</a></a>" -> ["<a>7"]), a stray
    closing tag is ignored.
    """
    opening, closing = f"<{tag}>", f"</{tag}>"
    blocks: list[str] = []
    pos = 0
    while True:
        start = text.find(opening, pos)
        if start < 0:
            return blocks
        end = text.find(closing, start + len(opening))
        if end < 0:  # no closing tag after this opening tag, so none after any later one either
            return blocks
        blocks.append(text[start + len(opening):end])
        pos = end + len(closing)


def _truth_from_row(row: dict[str, Any]) -> str:
    if "answer" not in row or row["answer"] is None:
        raise ValueError("GSM8K reward needs the row's 'answer' field (a '#### N' answer or a number)")
    answer = str(row["answer"])
    if "####" in answer:
        return gsm8k_final_answer(answer)
    value = normalize_number(answer)
    if value is None:
        raise ValueError(f"GSM8K row field 'answer' holds no number: {answer[:200]!r}")
    return value


class GSM8KRewardParser:
    """Shaped GSM8K reward (TorchRL's GSM8KRewardParser semantics, [0, 1] scale).

    Components for one completion and the true final number:
      reward_think     `think_weight` if exactly one non-empty `<think>` block
      reward_answer    `answer_weight` if exactly one non-empty `<answer>` block
      reward_contained `contained_weight` if the true number is one of the numbers in some answer block
      reward_right     `right_weight` if the last number of the LAST answer block equals it
      success          1.0 iff reward_right
    reward = `success_reward` on success, else think + answer + contained (0.4 at most), so
    a correct answer always beats any formatting-only score.

    Called with AReaL's reward signature; the truth comes from `row["answer"]` (a full GSM8K
    answer with `####`, or an already final number). A missing/numberless `answer` is a data
    error and raises ValueError; the completion text never makes it raise.
    """

    component_keys = ("reward_answer", "reward_think", "reward_right", "reward_contained", "success")

    def __init__(self, think_weight: float = 0.1, answer_weight: float = 0.1, contained_weight: float = 0.2,
                 right_weight: float = 1.0, success_reward: float = 1.0) -> None:
        self.think_weight = think_weight
        self.answer_weight = answer_weight
        self.contained_weight = contained_weight
        self.right_weight = right_weight
        self.success_reward = success_reward

    def score(self, completion: str, truth: str) -> dict[str, float]:
        """The reward dict for `completion` against an already normalised true number."""
        completion = "" if completion is None else str(completion)
        thinks = extract_tag_blocks(completion, "think")
        answers = extract_tag_blocks(completion, "answer")
        reward_think = self.think_weight if len(thinks) == 1 and thinks[0].strip() else 0.0
        reward_answer = self.answer_weight if len(answers) == 1 and answers[0].strip() else 0.0
        contained = any(truth in numbers_in(block) for block in answers)
        reward_contained = self.contained_weight if contained else 0.0
        right = bool(answers) and normalize_number(answers[-1]) == truth
        reward_right = self.right_weight if right else 0.0
        success = 1.0 if right else 0.0
        reward = self.success_reward if right else reward_think + reward_answer + reward_contained
        return {"reward": float(reward), "reward_answer": float(reward_answer), "reward_think": float(reward_think),
                "reward_right": float(reward_right), "reward_contained": float(reward_contained), "success": success}

    def __call__(self, prompt: str, completions: str, prompt_ids: Any = None, completion_ids: Any = None,
                 **row: Any) -> dict[str, float]:
        return self.score(completions, _truth_from_row(row))

    def __repr__(self) -> str:
        return (f"GSM8KRewardParser(think={self.think_weight}, answer={self.answer_weight}, "
                f"contained={self.contained_weight}, right={self.right_weight}, success={self.success_reward})")


def gsm8k_prompt(question: str) -> list[dict[str, str]]:
    """Chat messages for a question (TorchRL's GSM8KPrepareQuestion): system format rules + user question."""
    return [{"role": "system", "content": GSM8K_SYSTEM_PROMPT}, {"role": "user", "content": str(question)}]


def gsm8k_sft_target(row: dict[str, Any]) -> str:
    """A warm-start demonstration: the reference reasoning (calculator annotations removed) in
    `<think>` and the normalised final number in `<answer>`."""
    if "answer" not in row:
        raise ValueError("gsm8k_sft_target needs the row's 'answer' field")
    answer = str(row["answer"])
    final = gsm8k_final_answer(answer)
    reasoning = _CALC_RE.sub("", answer.rpartition("####")[0]).strip()
    return f"<think>{reasoning}</think><answer>{final}</answer>"
