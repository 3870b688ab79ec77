"""ChatEnv: a batch of conversations driven TorchRL-style (reset/step on TensorDicts), no torchrl.

Layout. Every TensorDict the env returns (and every one its transforms see) is a
`LazyStackedTensorDict` of batch size `[B]` stacked on dim 0: element `i` is a plain
TensorDict of batch size `[]`, so ragged data (messages, token ids) needs no padding.
Read a ragged key batched with `td.get(key, as_list=True)` (or `as_padded_tensor=True`),
or per element with `td[i][key]` / `td.unbind(0)`. Shapes below are per element; batched
they gain a leading `B` (e.g. `done` is `[B, 1]`, `reward` `[B, 1, 1]`).

Keys written by `reset()` (root of the returned TensorDict):
  every mode   "done", "terminated", "truncated"   bool [1], all False
               "query"                              str, kept from the input (or the primer)
  "history"    ("history",)  ChatHistory(prompt=History[n]) - only `prompt` set; read the
               History with ("history", "prompt")
  "text"       ("text", "prompt")    str: that chat rendered with the generation prompt
  "tokens"     ("tokens", "prompt")  int64 [L]: `apply_chat_template(chat, add_generation_prompt=True)`
  with_tokenizer (history mode only): also ("tokens", "prompt") as in tokens mode.
  transforms   DataLoadingPrimer: "query", "messages" (when the dataset prompt is a chat),
               "row" (dict), "row_index", "group_id" (int64 []);
               StepCounter: "step_count" int64 [1]; PolicyVersion: "policy_version" int64 [].
  The prompt chat comes from, by precedence, an input "messages" list of role/content
  dicts, the input "query" str (one user message; `system_prompt` is prepended to these
  two unless the chat starts with a system message) or an input ("history", "prompt")
  History used as is. Input "next"/"reward" entries are dropped; other input keys stay.

Keys `step(td)` reads (td = the reset/previous-next TensorDict plus the policy's outputs):
  "history"    ("history", "full")   History[n']: prompt + response (TorchRL's ChatHistory contract).
  "text"       ("text", "full")      str: prompt text + generated text.
  "tokens"     ("tokens", "full")    int64 [L]: prompt ids + generated ids, unpadded.
  Optional, used when present: ("tokens", "full") in history mode and ("tokens",
  "response") in any mode (the policy's exact ids, for IncrementalTokenizer and
  RewardTransform); every key listed in `carry_keys`.

`step(td)` returns a shallow copy of `td` (lazy stack) with a "next" entry holding:
  "history"    ("history",) ChatHistory(prompt=full [+ messages added by transforms]);
  "text"       ("text", "prompt") = full text [+ rendering of added messages + generation prompt];
  "tokens"     ("tokens", "prompt") = full ids [+ ids of that rendering];
  with_tokenizer ("tokens", "prompt") = the policy's ids + ids of what the template adds after them;
  "done"/"terminated"/"truncated" bool [1] (False unless a transform sets them);
  "reward" float32 [1, 1] with a RewardTransform (several add up); the carried keys
  ("query" and the transforms' `carry_keys`); "step_count"/"policy_version" from their
  transforms. `ChatEnv.step_mdp(td)` returns td["next"], the input of the next policy call.

Transforms see the same layout and edit it through `env.history_of(elem, which)` and
`env.add_messages(elem, messages)` so they work in every mode; in text and tokens mode
added messages are rendered once, after all transforms ran, so the generation prompt is
appended exactly once (text/tokens modes parse the conversation back from ChatML text, so
they need a ChatML template). The IncrementalTokenizer always runs last.
"""
from __future__ import annotations

from typing import Any, Iterable, Mapping, Sequence

import torch
from tensordict import LazyStackedTensorDict, NonTensorData, TensorDict, TensorDictBase, lazy_stack

from rayllm_rl.data.history import ChatHistory, History
from rayllm_rl.data.chat_template import chat_suffix, decode_tokens, encode_text
from rayllm_rl.envs.transforms import IncrementalTokenizer, has_key

__all__ = ["ChatEnv", "INPUT_MODES"]

INPUT_MODES = ("history", "text", "tokens")
_PENDING = "_pending_messages"
_FLAGS = ("done", "terminated", "truncated")


class ChatEnv:
    """Conversation state for a batch of `batch_size` chats; the policy writes `full`, the env
    makes it the next `prompt` and lets transforms add messages, rewards and done flags."""

    carry_keys: tuple[str, ...] = ("query", "row", "group_id")
    """Copied from each step's input to its "next" (the dataset row reward functions read)."""

    def __init__(
        self,
        tokenizer=None,
        *,
        input_mode: str = "history",
        system_prompt: str | None = None,
        batch_size: int | Sequence[int] = 1,
        transforms: Iterable[Any] | None = None,
        with_tokenizer: bool = False,
        user_role: str = "user",
        system_role: str = "system",
    ) -> None:
        if input_mode not in INPUT_MODES:
            raise ValueError(f"input_mode must be one of {INPUT_MODES}, got {input_mode!r}")
        if input_mode != "history" and tokenizer is None:
            raise ValueError(f"input_mode={input_mode!r} needs a tokenizer")
        if not isinstance(batch_size, int):
            batch_size = list(batch_size)
            if len(batch_size) != 1:
                raise ValueError(f"ChatEnv has exactly one batch dim, got batch_size={batch_size}")
            batch_size = int(batch_size[0])
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.tokenizer = tokenizer
        self.input_mode = input_mode
        self.system_prompt = system_prompt
        self.batch_size = torch.Size([batch_size])
        self.user_role = user_role
        self.system_role = system_role
        self._transforms: list[Any] = []
        self._tokenizer_transform: IncrementalTokenizer | None = None
        for t in transforms or ():
            self.append_transform(t)
        if with_tokenizer and self._tokenizer_transform is None:
            self.append_transform(IncrementalTokenizer(tokenizer))

    # ------------------------------------------------------------------ transforms
    @property
    def transforms(self) -> list[Any]:
        """Transforms in the order they run (the IncrementalTokenizer, if any, last)."""
        return self._transforms + ([self._tokenizer_transform] if self._tokenizer_transform else [])

    def append_transform(self, transform) -> "ChatEnv":
        """Add a transform (run after the existing ones) and return the env, TorchRL-style."""
        if hasattr(transform, "set_env"):
            transform.set_env(self)
        else:
            transform.env = self
        if isinstance(transform, IncrementalTokenizer):
            if self._tokenizer_transform is not None:
                raise ValueError("this env already has an IncrementalTokenizer")
            self._tokenizer_transform = transform
        else:
            self._transforms.append(transform)
        return self

    def close(self) -> None:
        """Release what the transforms hold (e.g. the MCP servers of an MCPToolTransform that owns its pool)."""
        for t in self.transforms:
            if callable(getattr(t, "close", None)):
                t.close()

    def _carry_keys(self) -> list[str]:
        keys = list(self.carry_keys)
        for t in self.transforms:
            keys += [k for k in getattr(t, "carry_keys", ()) if k not in keys]
        return keys

    # ------------------------------------------------------------------ reset / step
    def reset(self, td: TensorDictBase | None = None) -> LazyStackedTensorDict:
        """Start new conversations: `[system] + user(query)` per element (see module docstring)."""
        td = self._as_elements(td)
        for elem in td.unbind(0):
            for stale in ("next", "reward"):  # when handed a finished step's TensorDict
                if stale in elem.keys():
                    del elem[stale]
        for t in self.transforms:
            if hasattr(t, "prime"):
                td = self._as_elements(t.prime(td), copy=False)
        for i, elem in enumerate(td.unbind(0)):
            prompt = self._initial_history(elem, i)
            self._write_prompt(elem, prompt)
            for flag in _FLAGS:
                elem[flag] = torch.zeros(1, dtype=torch.bool)
        for t in self.transforms:
            if hasattr(t, "reset"):
                td = self._as_elements(t.reset(td), copy=False)
        return td

    def step(self, td: TensorDictBase) -> LazyStackedTensorDict:
        """Make the policy's `full` the next prompt, run the transforms, return td with "next"."""
        action = self._as_elements(td, copy=False)
        carry = self._carry_keys()
        nexts = []
        for i, act in enumerate(action.unbind(0)):
            nxt = TensorDict(batch_size=[])
            self._write_next_prompt(nxt, act, i)
            for flag in _FLAGS:
                nxt[flag] = torch.zeros(1, dtype=torch.bool)
            present = act.keys()
            for key in carry:
                if key in present:
                    nxt.set(key, act.get(key))
            nexts.append(nxt)
        td_next = lazy_stack(nexts)
        for t in self._transforms:
            if hasattr(t, "step"):
                td_next = self._as_elements(t.step(td_next, action), copy=False)
        self._render_pending(td_next)
        if self._tokenizer_transform is not None:
            td_next = self._as_elements(self._tokenizer_transform.step(td_next, action), copy=False)
        out = []
        for act, nxt in zip(action.unbind(0), td_next.unbind(0)):
            elem = act.copy()
            elem["next"] = nxt
            out.append(elem)
        return lazy_stack(out)

    @staticmethod
    def step_mdp(td: TensorDictBase) -> TensorDictBase:
        """The observation for the next policy call: `td["next"]`."""
        return td["next"]

    # ------------------------------------------------------------------ helpers for transforms
    def history_of(self, elem: TensorDictBase, which: str = "prompt") -> History:
        """The conversation `which` ("prompt" | "full" | "response") of one element, in any mode.

        Text/tokens modes parse the ChatML text (tokens are decoded first); messages that
        transforms added during this step are included in "prompt".
        """
        if which not in ("prompt", "full", "response"):
            raise ValueError(f"which must be prompt/full/response, got {which!r}")
        if self.input_mode == "history":
            chat = elem.get("history", None)
            hist = getattr(chat, which, None) if chat is not None else None
            if hist is None:
                raise KeyError(f"element has no ('history', {which!r})")
            return hist
        key = (self.input_mode, which)
        if not has_key(elem, key):
            raise KeyError(f"element has no {key}")
        value = elem[key]
        text = _as_str(value) if self.input_mode == "text" else decode_tokens(self.tokenizer, value)
        hist = History.from_text(text)
        pending = elem[_PENDING] if which == "prompt" and _PENDING in elem.keys() else None
        return hist.extend(pending) if pending else hist

    def add_messages(self, elem: TensorDictBase, messages: Sequence[Mapping[str, str]] | Mapping[str, str]) -> None:
        """Append messages (dicts with role/content) to one element's next prompt, in any mode."""
        if isinstance(messages, Mapping):
            messages = [messages]
        messages = [{"role": m["role"], "content": m["content"]} for m in messages]
        if not messages:
            return
        if self.input_mode == "history":
            elem.set(("history", "prompt"), self.history_of(elem, "prompt").extend(messages))
            return
        pending = list(elem[_PENDING]) if _PENDING in elem.keys() else []
        elem[_PENDING] = NonTensorData(pending + messages)

    # ------------------------------------------------------------------ internals
    def _as_elements(self, td: TensorDictBase | None, copy: bool = True) -> LazyStackedTensorDict:
        """Normalise to a lazy stack of B per-element TensorDicts (copies unless copy=False)."""
        b = self.batch_size[0]
        if td is None:
            return lazy_stack([TensorDict(batch_size=[]) for _ in range(b)])
        if td.batch_dims == 0 and b == 1:
            td = td.unsqueeze(0)
        if td.batch_size != self.batch_size:
            raise ValueError(f"expected a TensorDict of batch size {list(self.batch_size)}, got {list(td.batch_size)}")
        if isinstance(td, LazyStackedTensorDict) and td.stack_dim == 0 and not copy:
            return td
        return lazy_stack([e.copy() if copy else e for e in td.unbind(0)])

    def _initial_history(self, elem: TensorDictBase, i: int) -> History:
        keys = elem.keys()
        if "messages" in keys:  # a ready prompt chat (e.g. a dataset `messages` column)
            chat = [{"role": m["role"], "content": m["content"]} for m in elem["messages"]]
        elif "query" in keys:
            query = _as_str(elem["query"])
            if not isinstance(query, str):
                raise TypeError(f"reset: batch element {i}: 'query' must be a str, got {type(query).__name__}")
            chat = [{"role": self.user_role, "content": query}]
        elif getattr(elem.get("history", None), "prompt", None) is not None:
            return elem["history"].prompt  # the caller supplied a ready History prompt
        else:
            raise KeyError(
                f"reset: batch element {i} has no 'query' (or 'messages'); pass td['query'] "
                "or add a DataLoadingPrimer"
            )
        if self.system_prompt is not None and not (chat and chat[0]["role"] == self.system_role):
            chat = [{"role": self.system_role, "content": self.system_prompt}] + chat
        return History.from_chats(chat)

    def _write_prompt(self, elem: TensorDictBase, prompt: History) -> None:
        if self.input_mode == "history":
            elem["history"] = ChatHistory(prompt=prompt, batch_size=[])
        elif self.input_mode == "text":
            elem["text", "prompt"] = prompt.apply_chat_template(self.tokenizer, add_generation_prompt=True)
        else:
            elem["tokens", "prompt"] = prompt.apply_chat_template(
                self.tokenizer, add_generation_prompt=True, tokenize=True
            )

    def _write_next_prompt(self, nxt: TensorDictBase, act: TensorDictBase, i: int) -> None:
        mode = self.input_mode
        if mode == "history":
            chat = act.get("history", None)
            full = getattr(chat, "full", None) if chat is not None else None
            if full is None:
                raise KeyError(
                    f"step: batch element {i} has no ('history', 'full'); the policy must set "
                    "ChatHistory.full = prompt.extend(response) (TorchRL's ChatHistory contract)"
                )
            nxt["history"] = ChatHistory(prompt=full, batch_size=[])
            return
        if not has_key(act, (mode, "full")):
            raise KeyError(f"step: batch element {i} has no ({mode!r}, 'full'); the policy must write it")
        full = act[mode, "full"]
        if mode == "text":
            nxt["text", "prompt"] = _as_str(full)
        else:
            nxt["tokens", "prompt"] = torch.as_tensor(full, dtype=torch.long).reshape(-1)

    def _render_pending(self, td_next: TensorDictBase) -> None:
        """Text/tokens modes: append the rendering of messages transforms added (+ generation prompt)."""
        if self.input_mode == "history":
            return
        for elem in td_next.unbind(0):
            if _PENDING not in elem.keys():
                continue
            pending = list(elem[_PENDING])
            del elem[_PENDING]
            if not pending:
                continue
            key = (self.input_mode, "prompt")
            prefix = _as_str(elem[key]) if self.input_mode == "text" else decode_tokens(self.tokenizer, elem[key])
            prev = History.from_text(prefix).to_chat()
            suffix = chat_suffix(self.tokenizer, prefix, prev, pending)
            if self.input_mode == "text":
                elem[key] = prefix + suffix
            else:
                elem[key] = torch.cat([elem[key], encode_text(self.tokenizer, suffix)])

    def __repr__(self) -> str:
        return (
            f"ChatEnv(input_mode={self.input_mode!r}, batch_size={list(self.batch_size)}, "
            f"transforms={self.transforms})"
        )


def _as_str(value: Any) -> Any:
    return value.data if isinstance(value, NonTensorData) else value
