"""A generative judge: a prompt template, an engine that answers it, and a parser that reads a score.

`Judge.score(prompt, completion, row)` fills the template with the row's question, the policy's
completion and the row's fields, sends it through the judge tokenizer's chat template to any engine
with the inference protocol's `agenerate` (the `judge-<i>` replicas through a router on Ray, an
in-process engine locally), decodes the greedy verdict and parses it into [0, 1]. A verdict the
parser cannot read raises `JudgeParseError` (the caller gives 0 and counts it).
"""
from __future__ import annotations

import re
import uuid
from typing import Any, Mapping

from rayllm_rl.inference.protocol import LLMRequest, SamplingParams
from rayllm_rl.rewards.config import JudgeConfig, check_template

YES_NO_RE = re.compile(r"\b(yes|no)\b", re.IGNORECASE)


class JudgeParseError(ValueError):
    """The judge's text holds no score the parser can read (or one outside its range)."""


class ScoreParser:
    """Judge text -> a score in [0, 1].

    'regex': group 1 of the first match of `regex` is a number in [min_score, max_score], scaled linearly
    to [0, 1]. 'yes_no': the first word 'yes' is 1, 'no' is 0 (case-insensitive). Anything else raises
    JudgeParseError naming what was read."""

    def __init__(self, kind: str = "regex", regex: str = r"(-?\d+(?:\.\d+)?)", min_score: float = 0.0,
                 max_score: float = 10.0):
        if kind not in ("regex", "yes_no"):
            raise ValueError(f"reward.judge.parser must be 'regex' or 'yes_no', got {kind!r}")
        if kind == "regex" and not min_score < max_score:
            raise ValueError(f"reward.judge.min_score={min_score} must be < reward.judge.max_score={max_score}")
        self.kind, self.pattern = kind, re.compile(regex) if kind == "regex" else YES_NO_RE
        self.min_score, self.max_score = min_score, max_score

    def __call__(self, text: str) -> float:
        match = self.pattern.search(text)
        if match is None:
            raise JudgeParseError(f"no {'score' if self.kind == 'regex' else 'yes/no'} in the judge's text "
                                  f"{text!r:.200}")
        if self.kind == "yes_no":
            return 1.0 if match.group(1).lower() == "yes" else 0.0
        try:
            value = float(match.group(1))
        except (TypeError, ValueError):
            raise JudgeParseError(f"the judge's score {match.group(1)!r} is not a number "
                                  f"(text {text!r:.200})") from None
        if not self.min_score <= value <= self.max_score:  # NaN fails too
            raise JudgeParseError(f"the judge's score {value:g} is outside [{self.min_score:g}, {self.max_score:g}] "
                                  f"(text {text!r:.200})")
        return (value - self.min_score) / (self.max_score - self.min_score)


def last_user_message(row: Mapping[str, Any], prompt: str) -> str:
    """The question the policy answered: the row's last user message, else its prompt text."""
    messages = row.get("messages")
    if isinstance(messages, list):
        users = [m.get("content", "") for m in messages if isinstance(m, Mapping) and m.get("role") == "user"]
        if users:
            return str(users[-1])
    return prompt


class Judge:
    """Grades completions with a generative model: template -> engine.agenerate -> parser."""

    def __init__(self, engine: Any, tokenizer: Any, template: str, parser: ScoreParser, *, system_prompt: str = "",
                 max_new_tokens: int = 32):
        """`engine`: anything with `async agenerate(LLMRequest) -> LLMResponse`; `tokenizer`: the judge model's."""
        check_template(template)
        self.engine, self.tokenizer, self.template, self.parser = engine, tokenizer, template, parser
        self.system_prompt = system_prompt
        self.sampling = SamplingParams(max_new_tokens=max_new_tokens, greedy=True)
        self.num_unparsed = 0
        """Verdicts the parser could not read (each scored 0 by the caller)."""

    @classmethod
    def from_config(cls, cfg: JudgeConfig, engine: Any, tokenizer: Any) -> "Judge":
        return cls(engine, tokenizer, cfg.template, ScoreParser(cfg.parser, cfg.regex, cfg.min_score, cfg.max_score),
                   system_prompt=cfg.system_prompt, max_new_tokens=cfg.max_new_tokens)

    def message(self, prompt: str, completion: str, row: Mapping[str, Any]) -> str:
        """The template filled in; KeyError naming a field that neither the judge nor the row has."""
        fields = {**{k: v for k, v in row.items() if isinstance(k, str)},
                  "question": last_user_message(row, prompt), "completion": completion, "prompt": prompt}
        try:
            return self.template.format_map(fields)
        except KeyError as exc:
            raise KeyError(f"reward.judge.template uses {{{exc.args[0]}}}, which is neither question, completion, "
                           f"prompt nor a field of the row ({sorted(k for k in row if isinstance(k, str))})") from None

    def prompt_ids(self, prompt: str, completion: str, row: Mapping[str, Any]) -> list[int]:
        """The judge's prompt tokens: its chat template (generation prompt added) when it has one."""
        text = self.message(prompt, completion, row)
        if self.tokenizer.chat_template:
            turns = ([{"role": "system", "content": self.system_prompt}] if self.system_prompt else [])
            turns.append({"role": "user", "content": text})
            return list(self.tokenizer.apply_chat_template(turns, add_generation_prompt=True, tokenize=True,
                                                           return_dict=False))
        return list(self.tokenizer(self.system_prompt + text)["input_ids"])

    async def verdict(self, prompt: str, completion: str, row: Mapping[str, Any]) -> str:
        """The judge's greedy text for one completion."""
        request = LLMRequest(input_ids=self.prompt_ids(prompt, completion, row), sampling=self.sampling,
                             rid=f"judge-{uuid.uuid4().hex}")
        response = await self.engine.agenerate(request)
        return self.tokenizer.decode(response.output_tokens, skip_special_tokens=True)

    async def score(self, prompt: str, completion: str, row: Mapping[str, Any]) -> float:
        """The parsed verdict in [0, 1] (the part interface of `rewards.combined.CombinedReward`)."""
        text = await self.verdict(prompt, completion, row)
        try:
            return self.parser(text)
        except JudgeParseError:
            self.num_unparsed += 1
            raise

    def counters(self) -> dict[str, int]:
        return {"reward_judge_unparsed": self.num_unparsed}

    def close(self) -> None:
        """Close the engine if this judge owns one that can be closed (the local backend's)."""
        close = getattr(self.engine, "close", None)
        if callable(close):
            close()
