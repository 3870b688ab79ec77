"""Conversation-shaping ChatEnv transforms: AddThinkingPrompt and TemplateTransform (TorchRL names)."""
from __future__ import annotations

import random
from typing import Any, Callable

import torch
from tensordict import TensorDictBase

from rayllm_rl.envs.transforms import Transform

DEFAULT_THINKING_PROMPTS = (
    "But wait, let me think about this more carefully...",
    "Hmm, let me double-check my reasoning.",
    "Wait, is that right? Let me reconsider.",
)


class AddThinkingPrompt(Transform):
    """When `cond(td_next_elem)` holds after a step (default: the step's reward is below
    `threshold`), ask the model to keep thinking instead of ending the episode.

    The prompt (`prompt`, or one of `DEFAULT_THINKING_PROMPTS` at random with
    `random_prompt=True`) is added as a new `role` message (default "user", a new turn: the
    past tokens stay untouched, so the IncrementalTokenizer stays token-exact). `undo_done`
    clears done/terminated so the env continues; `zero_reward` zeroes the step's reward so an
    early wrong answer is not credited. At most `max_prompts` prompts per episode (counted in
    `thinking_prompts`, carried between steps). Must run after the reward transform that sets
    the reward and done flags.
    """

    carry_keys = ("thinking_prompts",)

    def __init__(self, cond: Callable[[TensorDictBase], bool] | None = None, *, prompt: str | None = None,
                 random_prompt: bool = False, role: str = "user", threshold: float = 1.0,
                 undo_done: bool = True, zero_reward: bool = True, max_prompts: int = 1, seed: int = 0) -> None:
        super().__init__()
        if max_prompts < 1:
            raise ValueError(f"max_prompts must be >= 1, got {max_prompts}")
        self.cond = cond if cond is not None else self._reward_below
        self.prompt = prompt
        self.random_prompt = random_prompt
        self.role = role
        self.threshold = threshold
        self.undo_done = undo_done
        self.zero_reward = zero_reward
        self.max_prompts = max_prompts
        self._rng = random.Random(seed)

    def _reward_below(self, elem: TensorDictBase) -> bool:
        reward = elem.get("reward", None)
        return reward is not None and float(reward.sum()) < self.threshold

    def _text(self) -> str:
        if self.prompt is not None and not self.random_prompt:
            return self.prompt
        return self._rng.choice(DEFAULT_THINKING_PROMPTS)

    def reset(self, td: TensorDictBase) -> TensorDictBase:
        for elem in td.unbind(0):
            elem["thinking_prompts"] = torch.zeros((), dtype=torch.long)
        return td

    def step(self, td_next: TensorDictBase, td_action: TensorDictBase) -> TensorDictBase:
        for nxt in td_next.unbind(0):
            used = int(nxt.get("thinking_prompts", torch.zeros((), dtype=torch.long)))
            if used >= self.max_prompts or not self.cond(nxt):
                continue
            self.env.add_messages(nxt, {"role": self.role, "content": self._text()})
            nxt["thinking_prompts"] = torch.tensor(used + 1, dtype=torch.long)
            if self.zero_reward and "reward" in nxt.keys():
                nxt["reward"] = torch.zeros_like(nxt["reward"])
            if self.undo_done:
                nxt["done"] = torch.zeros(1, dtype=torch.bool)
                nxt["terminated"] = torch.zeros(1, dtype=torch.bool)
        return td_next

    def __repr__(self) -> str:
        return f"AddThinkingPrompt(role={self.role!r}, max_prompts={self.max_prompts}, threshold={self.threshold})"


class TemplateTransform(Transform):
    """Renders the conversation with a given chat template instead of the tokenizer's own.

    For base models without a chat template, or to train with a custom format: on reset and
    step, `("text", "prompt")` (and `("tokens", "prompt")` with `tokenize=True`) are rebuilt
    from `("history", "prompt")` with `chat_template` (a Jinja string, as
    `tokenizer.apply_chat_template(chat_template=...)` takes) plus the generation prompt. It
    must be used in history mode and without an IncrementalTokenizer (which would keep the
    tokenizer's own template); token-exact multi-turn needs a template whose rendering of a
    prefix is a prefix of the rendering of the whole, which this transform checks per step.
    """

    def __init__(self, tokenizer, chat_template: str, *, tokenize: bool = True,
                 template_kwargs: dict[str, Any] | None = None) -> None:
        super().__init__()
        if not chat_template:
            raise ValueError("TemplateTransform needs a non-empty chat_template")
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.tokenize = tokenize
        self.template_kwargs = dict(template_kwargs or {})

    def set_env(self, env) -> None:
        if env.input_mode != "history":
            raise ValueError(f"TemplateTransform needs input_mode='history', env has {env.input_mode!r}")
        if env._tokenizer_transform is not None:
            raise ValueError("TemplateTransform cannot be combined with an IncrementalTokenizer")
        super().set_env(env)

    def render(self, chat: list[dict[str, str]]) -> str:
        return self.tokenizer.apply_chat_template(chat, chat_template=self.chat_template, tokenize=False,
                                                  add_generation_prompt=True, **self.template_kwargs)

    def _write(self, elem: TensorDictBase, previous: str | None = None) -> None:
        text = self.render(self.env.history_of(elem, "prompt").to_chat())
        if previous is not None and not text.startswith(previous):
            raise ValueError("TemplateTransform: the template re-renders the past differently at this step; "
                             "multi-turn training with it would not be token-exact")
        elem["text", "prompt"] = text
        if self.tokenize:
            elem["tokens", "prompt"] = torch.tensor(
                self.tokenizer(text, add_special_tokens=False)["input_ids"], dtype=torch.long)

    def reset(self, td: TensorDictBase) -> TensorDictBase:
        for elem in td.unbind(0):
            self._write(elem)
        return td

    def step(self, td_next: TensorDictBase, td_action: TensorDictBase) -> TensorDictBase:
        for nxt, act in zip(td_next.unbind(0), td_action.unbind(0)):
            prev = act.get(("text", "prompt"), None)
            self._write(nxt, prev.data if hasattr(prev, "data") else prev)
        return td_next

    def __repr__(self) -> str:
        return f"TemplateTransform(tokenize={self.tokenize})"
