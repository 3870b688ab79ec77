"""What a model's own chat template needs from us beyond `apply_chat_template`: assistant-token masks for
templates without `{% generation %}` marks, and the text of one more turn without re-rendering the past.

Real templates differ from the tiny model's: SmolLM2's and Qwen2.5's have no generation marks (HF's
`return_assistant_tokens_mask` then returns all zeros), and both insert a default system message when a
chat does not start with one, so rendering a lone user message adds a system turn nobody sent. Both
helpers here work on renders of whole chats and take differences of them, which holds for any
prefix-stable template (ChatML, Llama 3, Mistral, ...). Also the exact token/text round trip the envs and
the agent proxy use (`decode_tokens`, `encode_text`) and `chat_suffix`, the text that extends a rendered chat.
"""
from __future__ import annotations

import logging
import re
from typing import Any, Mapping, Sequence

import torch

logger = logging.getLogger(__name__)

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


def assistant_spans(tokenizer, chat: list[dict], chat_template: str | None = None,
                    **kwargs: Any) -> list[tuple[int, int]]:
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
    return next_turns_text(tokenizer, [{"role": role, "content": content}], generation_prompt=generation_prompt)


def next_turns_text(tokenizer, messages: Sequence[Mapping[str, str]], *, generation_prompt: bool = True) -> str:
    """`next_turn_text` of several messages at once (e.g. the results of two tool calls): rendered together after
    the placeholder exchange, so the template's separators between them are its own."""
    before = _render(tokenizer, _PLACEHOLDER_CHAT, False, None).rstrip()
    chat = _PLACEHOLDER_CHAT + [{"role": m["role"], "content": m["content"]} for m in messages]
    after = _render(tokenizer, chat, generation_prompt, None)
    if not after.startswith(before):
        raise ValueError("the chat template is not prefix-stable (adding a message re-renders earlier ones): the "
                         "next turn cannot be appended token-in/token-out")
    return after[len(before):]


# ---------------------------------------------------------------------------- token and text helpers
def decode_tokens(tokenizer, ids) -> str:
    """Exact text of token ids (special tokens kept, no whitespace clean-up)."""
    ids = ids.tolist() if isinstance(ids, torch.Tensor) else list(ids)
    return tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)


def encode_text(tokenizer, text: str) -> torch.Tensor:
    """Token ids of a text fragment (special-token strings become special ids, no BOS added)."""
    return torch.as_tensor(tokenizer(text, add_special_tokens=False)["input_ids"], dtype=torch.long)


def chat_suffix(
    tokenizer,
    prefix_text: str,
    prev_messages: Sequence[Mapping[str, str]],
    new_messages: Sequence[Mapping[str, str]],
    *,
    add_generation_prompt: bool = True,
) -> str:
    """Text to append to `prefix_text` so that it renders `prev_messages + new_messages`.

    `prefix_text` is what the model saw/produced for `prev_messages`; it may lack the
    template's closing of the last message (the model stops at `<|im_end|>` without the
    `\\n`, or is cut off before `<|im_end|>`). Normally the full rendering starts with
    `prefix_text` and the suffix is the rest; otherwise (the response text does not
    round-trip exactly) the suffix is the rendering of the new messages after the
    previous ones, preceded by whatever part of the last message's closing text
    `prefix_text` does not already end with.
    """
    prev, new = [dict(m) for m in prev_messages], [dict(m) for m in new_messages]

    def render(msgs, gen):
        return tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)

    rendered_all = render(prev + new, add_generation_prompt)
    if rendered_all.startswith(prefix_text):
        return rendered_all[len(prefix_text):]
    rendered_prev = render(prev, False)
    if rendered_all.startswith(rendered_prev):
        tail = rendered_all[len(rendered_prev):]
    else:  # a template that rewrites earlier turns: render the new messages alone
        logger.warning("chat template is not prefix-stable; rendering new messages on their own")
        tail = render(new, add_generation_prompt)
    closing = ""
    if prev and prev[-1]["content"]:
        pos = rendered_prev.rfind(prev[-1]["content"])
        if pos >= 0:
            closing = rendered_prev[pos + len(prev[-1]["content"]):]
    for k in range(len(closing), -1, -1):
        if prefix_text.endswith(closing[:k]):
            return closing[k:] + tail
    return closing + tail  # unreachable: closing[:0] == "" always matches
