"""Chat data model: `History` (chat messages as a TensorClass) and `ChatHistory` (as in TorchRL's LLM API).

Representation (the same as TorchRL's):

* one message is a 0-d `History` (`role`/`content` are strings, `is_complete` a 0-d bool tensor);
* one conversation is a 1-d `History` of batch size `[n_messages]`: `role` and `content`
  are non-tensor string stacks, `is_complete` a bool tensor of shape `[n_messages]`;
* a batch of conversations is a *lazy stack* (`tensordict.lazy_stack`) of 1-d Histories
  along dim 0, of batch size `[B, n]`, or `[B, -1]` when the lengths differ. Indexing is
  elementwise (`h[i]` is conversation i, `h[..., -1]` the last message of every one) and
  `h.unbind(0)` gives the conversations back.

Every method of `History` accepts both a single conversation and a batch; batched ops
loop over `unbind(0)` and `lazy_stack` the results, so ragged batches never need padding.
"""
from __future__ import annotations

from typing import Any, Iterable, Sequence

import torch
from tensordict import TensorClass, lazy_stack

from rayllm_rl.data.chat_template import assistant_token_mask

__all__ = ["History", "ChatHistory", "CHATML_NAMES", "IM_START", "IM_END"]

IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
CHATML_NAMES = frozenset({"chatml", "chatml_format", "qwen"})
"""Template names that `History.from_text` parses (all render ChatML)."""
_CHATML_PADS = ("<|endoftext|>",)


class History(TensorClass["nocast"]):
    """Chat messages with batch dims `(..., n_messages)`; see the module docstring."""

    role: str
    content: str
    is_complete: bool = True

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_messages(
        cls,
        roles: Sequence[str],
        contents: Sequence[str],
        is_complete: Sequence[bool] | None = None,
    ) -> "History":
        """One conversation (batch size `[n]`) from parallel lists of roles/contents/flags."""
        roles, contents = list(roles), list(contents)
        if len(roles) != len(contents):
            raise ValueError(f"{len(roles)} roles but {len(contents)} contents")
        flags = [True] * len(roles) if is_complete is None else [bool(f) for f in is_complete]
        if len(flags) != len(roles):
            raise ValueError(f"{len(roles)} messages but {len(flags)} is_complete flags")
        for i, (r, c) in enumerate(zip(roles, contents)):
            if not isinstance(r, str) or not isinstance(c, str):
                raise TypeError(f"message {i}: role and content must be str, got {type(r)}, {type(c)}")
        return cls(
            role=roles,
            content=contents,
            is_complete=torch.tensor(flags, dtype=torch.bool),
            batch_size=[len(roles)],
        )

    @classmethod
    def from_chats(cls, chats: Sequence[dict] | Sequence[Sequence[dict]]) -> "History":
        """`list[dict]` -> one conversation `[n]`; `list[list[dict]]` -> lazy stack `[B, n|-1]`.

        Each dict needs `role` and `content`; an optional `is_complete` key is honoured.
        """
        chats = list(chats)
        if not chats or isinstance(chats[0], dict):
            if not all(isinstance(m, dict) for m in chats):
                raise TypeError("a conversation must be a list of dicts")
            try:
                return cls.from_messages(
                    [m["role"] for m in chats],
                    [m["content"] for m in chats],
                    [m.get("is_complete", True) for m in chats],
                )
            except KeyError as err:
                raise ValueError(f"chat message without {err.args[0]!r} key") from err
        return lazy_stack([cls.from_chats(chat) for chat in chats])

    @classmethod
    def from_text(
        cls,
        text: str | Sequence[str],
        chat_template_name: str = "chatml",
        *,
        drop_generation_prompt: bool = True,
    ) -> "History":
        """Parse chat-templated text back into messages (ChatML only).

        Each `<|im_start|>role\\ncontent<|im_end|>` block is one message; a trailing block
        without `<|im_end|>` (a generation cut short) is kept with `is_complete=False`. A
        trailing empty assistant header (the generation prompt) is dropped unless
        `drop_generation_prompt=False`. Text before the first `<|im_start|>` (a bare
        response body) becomes an assistant message. A list of texts gives a lazy stack.
        """
        if not isinstance(text, str):
            return lazy_stack(
                [cls.from_text(t, chat_template_name, drop_generation_prompt=drop_generation_prompt) for t in text]
            )
        if chat_template_name not in CHATML_NAMES:
            raise NotImplementedError(
                f"from_text parses {sorted(CHATML_NAMES)} templates, not {chat_template_name!r}"
            )
        roles, contents, flags = _parse_chatml(text, drop_generation_prompt)
        return cls.from_messages(roles, contents, flags)

    # ------------------------------------------------------------------ conversion
    def _conversations(self) -> list["History"]:
        """The 1-d conversations of this History (leading dims flattened)."""
        if self.batch_dims == 0:
            raise RuntimeError("a single message (0-d History) is not a conversation")
        if self.batch_dims == 1:
            return [self]
        out = []
        for sub in self.unbind(0):
            out.extend(sub._conversations())
        return out

    def _lists(self) -> tuple[list[str], list[str], list[bool]]:
        """(roles, contents, is_complete) of a 1-d History, or of a 0-d one as one message."""
        if self.batch_dims == 0:
            return [self.role], [self.content], [bool(_flag_list(self.is_complete, 1)[0])]
        if self.batch_dims != 1:
            raise RuntimeError("_lists needs a single conversation")
        n = self.batch_size[0]
        if n == 0:
            return [], [], []
        return list(self.role), list(self.content), _flag_list(self.is_complete, n)

    def to_chat(self) -> list[dict[str, str]]:
        """A single conversation (1-d History) as `[{"role", "content"}, ...]`."""
        roles, contents, _ = self._lists()
        return [{"role": r, "content": c} for r, c in zip(roles, contents)]

    def to_chats(self) -> list[list[dict[str, str]]]:
        """Every conversation as a list of message dicts (leading batch dims flattened)."""
        return [conv.to_chat() for conv in self._conversations()]

    def apply_chat_template(
        self,
        tokenizer,
        *,
        add_generation_prompt: bool = False,
        tokenize: bool = False,
        return_assistant_tokens_mask: bool = False,
        chat_template: str | None = None,
        continue_final_message: bool | None = None,
        **kwargs: Any,
    ):
        """Render with the HF tokenizer's chat template.

        Returns, for a single conversation: the text (`tokenize=False`), a LongTensor of ids
        (`tokenize=True`), or `{"input_ids": LongTensor, "assistant_masks": BoolTensor}`
        (`return_assistant_tokens_mask=True`, which implies tokenizing; the mask covers each assistant
        message's text and end-of-turn token, from the template's `{% generation %}` marks or, for a
        template without them, from renders of the chat's prefixes: data/chat_template.py); for a batch, a list
        of texts / list of tensors / dict of lists. A trailing incomplete message is rendered
        open (HF `continue_final_message`) unless a generation prompt is asked for.
        """
        if return_assistant_tokens_mask:
            tokenize = True
        results = []
        for conv in self._conversations():
            chat = conv.to_chat()
            _, _, flags = conv._lists()
            cont = continue_final_message
            if cont is None:
                cont = bool(flags) and not flags[-1] and not add_generation_prompt
            call = dict(
                add_generation_prompt=add_generation_prompt,
                continue_final_message=cont,
                tokenize=tokenize,
                **kwargs,
            )
            if return_assistant_tokens_mask:  # also for templates without {% generation %} marks (SmolLM2, Qwen)
                results.append(assistant_token_mask(tokenizer, chat, add_generation_prompt=add_generation_prompt,
                                                    chat_template=chat_template, continue_final_message=cont, **kwargs))
                continue
            if chat_template is not None:
                call["chat_template"] = chat_template
            if tokenize:
                call["return_dict"] = True
            out = tokenizer.apply_chat_template(chat, **call)
            results.append(torch.as_tensor(list(out["input_ids"]), dtype=torch.long) if tokenize else out)
        if self.batch_dims == 1:
            return results[0]
        if return_assistant_tokens_mask:
            return {k: [r[k] for r in results] for k in ("input_ids", "assistant_masks")}
        return results

    # ------------------------------------------------------------------ growth
    def extend(self, other: "History | dict | Sequence", *, inplace: bool = False, dim: int = -1) -> "History":
        """Append the messages of `other` to every conversation (only along the last dim).

        `other` has either the same batch dims (several messages per conversation) or one
        fewer (one message per conversation); dicts and lists of dicts are converted with
        `from_chats`. Returns a new History, or rebinds `self` when `inplace=True`.
        """
        if self.batch_dims == 0:
            raise RuntimeError("cannot extend a single message; use a 1-d History")
        if dim < 0:
            dim += self.batch_dims
        if dim != self.batch_dims - 1:
            raise ValueError(f"History can only be extended along the message dim (-1), got dim={dim}")
        if isinstance(other, dict):
            other = History.from_chats([other])
        elif not isinstance(other, History):
            other = History.from_chats(other)
        if self.batch_dims == 1:
            if other.batch_dims not in (0, 1):
                raise ValueError(f"cannot extend a conversation with a History of batch dims {other.batch_dims}")
            r0, c0, f0 = self._lists()
            r1, c1, f1 = other._lists()
            result = History.from_messages(r0 + r1, c0 + c1, f0 + f1)
        else:
            if other.batch_dims not in (self.batch_dims, self.batch_dims - 1):
                raise ValueError(
                    f"cannot extend a History with batch dims {self.batch_dims} by one with {other.batch_dims}"
                )
            if other.batch_size[0] != self.batch_size[0]:
                raise ValueError(f"batch mismatch: {self.batch_size[0]} vs {other.batch_size[0]} conversations")
            result = lazy_stack([a.extend(b) for a, b in zip(self.unbind(0), other.unbind(0))])
        if inplace:
            self.__dict__["_tensordict"] = result.__dict__["_tensordict"]
            return self
        return result

    def append(self, message: "History | dict", *, inplace: bool = False, dim: int = -1) -> "History":
        """Append one message per conversation (a History with one fewer batch dim, or a dict)."""
        if isinstance(message, History) and message.batch_dims != self.batch_dims - 1:
            raise ValueError(
                f"append expects a History with {self.batch_dims - 1} batch dims, got {message.batch_dims}"
            )
        return self.extend(message, inplace=inplace, dim=dim)

    @property
    def num_messages(self) -> list[int]:
        """Number of messages of every conversation (flattened like `to_chats`)."""
        return [conv.batch_size[0] for conv in self._conversations()]


class ChatHistory(TensorClass["nocast"]):
    """The policy/env contract (as in TorchRL's LLM API): the policy sets `full`; the env makes it the next `prompt`.

    The Histories carry one more batch dim (messages) than the ChatHistory itself.
    """

    prompt: History | None = None
    response: History | None = None
    full: History | None = None


# ---------------------------------------------------------------------------- helpers
def _flag_list(value: Any, n: int) -> list[bool]:
    """`is_complete` as n Python bools, whether it is a tensor, a bool or a list."""
    if isinstance(value, torch.Tensor):
        flat = value.reshape(-1).tolist()
        return [bool(f) for f in flat] if len(flat) == n else [bool(flat[0])] * n
    if isinstance(value, Iterable) and not isinstance(value, (str, bytes)):
        flat = [bool(f) for f in value]
        return flat if len(flat) == n else [flat[0]] * n
    return [bool(value)] * n


def _parse_chatml(text: str, drop_generation_prompt: bool) -> tuple[list[str], list[str], list[bool]]:
    """Split ChatML text into (roles, contents, is_complete)."""
    stripped = True
    while stripped:  # trailing padding from decoded token batches
        stripped = False
        for pad in _CHATML_PADS:
            if text.endswith(pad):
                text, stripped = text[: -len(pad)], True
    roles: list[str] = []
    contents: list[str] = []
    flags: list[bool] = []
    parts = text.split(IM_START)
    if parts[0].strip():  # a bare response body with no header
        content, complete = _chatml_body(parts[0])
        roles.append("assistant"), contents.append(content), flags.append(complete)
    for part in parts[1:]:
        role, sep, rest = part.partition("\n")
        if not sep:  # header cut before its newline: an open message with no content yet
            roles.append(role), contents.append(""), flags.append(False)
            continue
        content, complete = _chatml_body(rest)
        roles.append(role), contents.append(content), flags.append(complete)
    if (
        drop_generation_prompt
        and roles
        and roles[-1] == "assistant"
        and contents[-1] == ""
        and not flags[-1]
    ):
        roles.pop(), contents.pop(), flags.pop()
    return roles, contents, flags


def _chatml_body(rest: str) -> tuple[str, bool]:
    """Content of one message block and whether it was closed by `<|im_end|>`."""
    if IM_END in rest:
        return rest.partition(IM_END)[0], True
    return rest, False
