"""What a model's own chat template needs from us beyond `apply_chat_template`: assistant-token masks for
templates without `{% generation %}` marks, and the text of one more turn without re-rendering the past.

Real templates differ from the tiny model's: SmolLM2's and Qwen2.5's have no generation marks (HF's
`return_assistant_tokens_mask` then returns all zeros), and both insert a default system message when a
chat does not start with one, so rendering a lone user message adds a system turn nobody sent. Both
helpers here work on renders of whole chats and take differences of them, which holds for any
prefix-stable template (ChatML, Llama 3, Mistral, ...).
"""
from __future__ import annotations

import re
from typing import Any

import torch

_PLACEHOLDER_CHAT = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"},
                     {"role": "assistant", "content": "a"}]
"""A complete exchange the next turn is rendered after (its own text is cut off again)."""
_GENERATION_MARK = re.compile(r"\{%-?\s*generation\s*-?%\}")


def _render(tokenizer, chat: list[dict], generation_prompt: bool, chat_template: str | None, **kwargs: Any) -> str:
    extra = {"chat_template": chat_template} if chat_template is not None else {}
    return tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=generation_prompt, **extra,
                                         **kwargs)


def has_generation_marks(tokenizer, chat_template: str | None = None) -> bool:
    """True when the template marks assistant text with `{% generation %}` (HF computes the mask then)."""
    template = chat_template if chat_template is not None else tokenizer.chat_template
    return isinstance(template, str) and _GENERATION_MARK.search(template) is not None


def assistant_spans(tokenizer, chat: list[dict], chat_template: str | None = None, **kwargs: Any) -> list[tuple[int, int]]:
    """Character spans [start, end) of each assistant message in `render(chat)`: from the end of the
    assistant header (what `add_generation_prompt` adds) to the end of the message's rendering, less the
    whitespace the template puts after its end-of-turn token. So a span holds the content and the
    end-of-turn token (`<|im_end|>`), as a `{% generation %}` block does."""
    spans = []
    for i, message in enumerate(chat):
        if message.get("role") != "assistant":
            continue
        start = len(_render(tokenizer, chat[:i], True, chat_template, **kwargs))
        text = _render(tokenizer, chat[:i + 1], False, chat_template, **kwargs)
        end = len(text.rstrip())
        if end < start:
            raise ValueError(f"chat template is not prefix-stable at message {i}: cannot locate the assistant's text")
        spans.append((start, end))
    return spans


def assistant_token_mask(tokenizer, chat: list[dict], *, add_generation_prompt: bool = False,
                         chat_template: str | None = None, **kwargs: Any) -> dict[str, torch.Tensor]:
    """`{"input_ids", "assistant_masks"}` of `chat` under the tokenizer's template (1-d LongTensor and
    BoolTensor): HF's own mask when the template has generation marks; else the tokens whose text starts
    inside an `assistant_spans` span (a fast tokenizer's offsets), tokenized from the same rendered text."""
    if has_generation_marks(tokenizer, chat_template):
        extra = {"chat_template": chat_template} if chat_template is not None else {}
        out = tokenizer.apply_chat_template(chat, tokenize=True, return_dict=True, return_assistant_tokens_mask=True,
                                            add_generation_prompt=add_generation_prompt, **extra, **kwargs)
        return {"input_ids": torch.as_tensor(list(out["input_ids"]), dtype=torch.long),
                "assistant_masks": torch.as_tensor(list(out["assistant_masks"]), dtype=torch.bool)}
    text = _render(tokenizer, chat, add_generation_prompt, chat_template, **kwargs)
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    spans = assistant_spans(tokenizer, chat, chat_template, **kwargs)
    mask = [any(s <= a < e for s, e in spans) for a, _ in enc["offset_mapping"]]
    return {"input_ids": torch.as_tensor(enc["input_ids"], dtype=torch.long),
            "assistant_masks": torch.as_tensor(mask, dtype=torch.bool)}


def next_turn_text(tokenizer, role: str, content: str, *, generation_prompt: bool = True) -> str:
    """The text that follows a finished assistant turn's end-of-turn token when one more `role` message (and
    the next assistant header) is rendered: e.g. ChatML's "\n<|im_start|>user\n...<|im_end|>\n<|im_start|>
    assistant\n". Taken as the difference of two renders of a placeholder exchange, with and without the
    message, so a template's default system message (added to a chat that starts without one) never
    appears in it, as it would in a render of the lone message."""
    before = _render(tokenizer, _PLACEHOLDER_CHAT, False, None).rstrip()
    after = _render(tokenizer, _PLACEHOLDER_CHAT + [{"role": role, "content": content}], generation_prompt, None)
    if not after.startswith(before):
        raise ValueError("the chat template is not prefix-stable (adding a message re-renders earlier ones): the "
                         "next turn cannot be appended token-in/token-out")
    return after[len(before):]
