"""ChatEnv transforms (TorchRL-style): data loading, incremental tokenization, step counting,
policy versions and rewards.

Protocol (duck-typed; subclass `Transform` for the defaults). Every hook receives and
returns a `LazyStackedTensorDict` of batch size `[B]` stacked on dim 0, so
`td.unbind(0)` yields the per-element TensorDicts *by reference*: setting keys on them
edits the batch in place.

* `prime(td) -> td`   before `ChatEnv.reset` builds the prompt (fills `query`, ...);
* `reset(td) -> td`   after the prompt is built;
* `step(td_next, td_action) -> td_next`   after `ChatEnv.step` made `full` the next prompt;
* `carry_keys`        keys the env copies from the action to the next TensorDict;
* `env`               back-reference set by `ChatEnv.append_transform` (mode, tokenizer,
                      `history_of`, `add_messages`).
"""
from __future__ import annotations

import logging
import random
from typing import Any, Callable, Mapping

import torch
from tensordict import NonTensorData, TensorDictBase

from rayllm_rl.data.chat_template import chat_suffix, decode_tokens, encode_text
from rayllm_rl.data.history import History

__all__ = [
    "Transform",
    "DataLoadingPrimer",
    "IncrementalTokenizer",
    "StepCounter",
    "PolicyVersion",
    "RewardTransform",
    "has_key",
]

logger = logging.getLogger(__name__)


class Transform:
    """Base transform: every hook is the identity; `env` is set when appended to a ChatEnv."""

    carry_keys: tuple[str, ...] = ()

    def __init__(self) -> None:
        self.env = None

    def set_env(self, env) -> None:
        """Called by `ChatEnv.append_transform`; override to validate against the env."""
        self.env = env

    def prime(self, td: TensorDictBase) -> TensorDictBase:
        return td

    def reset(self, td: TensorDictBase) -> TensorDictBase:
        return td

    def step(self, td_next: TensorDictBase, td_action: TensorDictBase) -> TensorDictBase:
        return td_next

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


def _text(value: Any) -> str:
    """A str stored as NonTensorData, or the str itself."""
    return value.data if isinstance(value, NonTensorData) else value


def has_key(td: TensorDictBase, key) -> bool:
    """Whether `td` holds a non-None entry at (nested) `key`, tensor or not."""
    try:
        return td.get(key, None) is not None
    except (KeyError, AttributeError):
        return False


# ---------------------------------------------------------------------------- data loading
class DataLoadingPrimer(Transform):
    """Fills `query` (the user prompt) on reset from a dataset, in shuffled epochs.

    The prompt (`row[prompt_key]` or `prompt_key(row)`) is either a str (the user message)
    or a list of `{"role", "content"}` dicts (a ready prompt chat, e.g. a `messages`
    column): the latter also goes to `"messages"` and `query` is its last message's text.

    Each drawn prompt is used `repeats` times in a row (GRPO group sampling); every draw
    gets a fresh `group_id` (int64, shape `[]` per element), so the same row in a later
    epoch is a new group. The whole row (a dict) is kept under `"row"` (non-tensor) and
    its index under `"row_index"`; both and `group_id` are carried to every next step.
    A reset whose elements all carry a `"row"` already (rows chosen by a collector, as in the
    Ray env workers) is left as is: the caller's data wins over the primer's own stream.
    """

    carry_keys = ("row", "row_index", "group_id")

    def __init__(
        self,
        dataset,
        *,
        prompt_key: str | Callable[[dict], str] = "question",
        batch_size: int | None = None,
        repeats: int = 1,
        shuffle: bool = True,
        seed: int = 0,
    ) -> None:
        super().__init__()
        if len(dataset) == 0:
            raise ValueError("DataLoadingPrimer needs a non-empty dataset")
        if repeats < 1:
            raise ValueError(f"repeats must be >= 1, got {repeats}")
        self.dataset = dataset
        self.prompt_key = prompt_key
        self.batch_size = batch_size
        self.repeats = int(repeats)
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        self._rng = random.Random(seed)
        self._order: list[int] = []
        self._cursor = 0
        self._current: tuple[int, int, dict, Any] | None = None
        self._left = 0  # repeats left for the current draw
        self._next_group = 0

    def set_env(self, env) -> None:
        if self.batch_size is not None and self.batch_size != env.batch_size[0]:
            raise ValueError(f"DataLoadingPrimer batch_size={self.batch_size} != env batch size {env.batch_size[0]}")
        super().set_env(env)

    def _prompt_of(self, index: int, row: Mapping[str, Any]) -> str | list[dict[str, str]]:
        key = self.prompt_key
        if callable(key):
            where = f"dataset row {index}: prompt_key callable {getattr(key, '__name__', repr(key))!r}"
            try:
                prompt = key(row)
            except Exception as err:
                raise ValueError(f"{where} failed: {err!r}") from err
        else:
            if key not in row:
                raise ValueError(f"dataset row {index} has no prompt key {key!r} (keys: {sorted(row)})")
            where, prompt = f"dataset row {index}, key {key!r}", row[key]
        if isinstance(prompt, str):
            return prompt
        if isinstance(prompt, (list, tuple)) and prompt and all(
            isinstance(m, Mapping) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in prompt
        ):
            return [{"role": m["role"], "content": m["content"]} for m in prompt]
        raise ValueError(
            f"{where}: expected a str prompt or a non-empty list of role/content messages, "
            f"got {type(prompt).__name__}"
        )

    def _draw_row(self) -> int:
        if self._cursor >= len(self._order):
            if self._order:
                self.epoch += 1
            self._order = list(range(len(self.dataset)))
            if self.shuffle:
                self._rng.shuffle(self._order)
            self._cursor = 0
        index = self._order[self._cursor]
        self._cursor += 1
        return index

    def sample(self, n: int | None = None) -> list[tuple[int, int, dict, Any]]:
        """The next `n` items `(row_index, group_id, row, prompt)` of the repeated stream."""
        n = n if n is not None else (self.batch_size or 1)
        out = []
        for _ in range(n):
            if self._left == 0:
                index = self._draw_row()
                row = dict(self.dataset[index])
                self._current = (index, self._next_group, row, self._prompt_of(index, row))
                self._next_group += 1
                self._left = self.repeats
            self._left -= 1
            out.append(self._current)
        return out

    def prime(self, td: TensorDictBase) -> TensorDictBase:
        elems = td.unbind(0)
        if all("row" in e.keys() for e in elems):
            return td  # the caller (a collector feeding an env worker) already chose the rows
        for elem, (index, group, row, prompt) in zip(elems, self.sample(len(elems))):
            if isinstance(prompt, str):
                elem["query"] = prompt
            else:
                elem["query"] = prompt[-1]["content"]
                elem["messages"] = NonTensorData([dict(m) for m in prompt])
            elem["row"] = NonTensorData(dict(row))
            elem["row_index"] = torch.tensor(index, dtype=torch.long)
            elem["group_id"] = torch.tensor(group, dtype=torch.long)
        return td

    def __repr__(self) -> str:
        return f"DataLoadingPrimer(n_rows={len(self.dataset)}, repeats={self.repeats}, shuffle={self.shuffle})"


# ---------------------------------------------------------------------------- tokenization
class IncrementalTokenizer(Transform):
    """Keeps `("tokens", "prompt")` in sync with `("history", "prompt")`, token-first.

    Reset tokenizes the whole prompt (with the generation prompt). On step the base is the
    policy's `("tokens", "full")` if present, else the previous `("tokens", "prompt")` (of
    the action TensorDict); only the text that the chat template adds after that base
    (the response if the policy gave no tokens, the closing `<|im_end|>\\n` the model did
    not emit, the new messages and the generation prompt) is tokenized and appended:
    see `chat_suffix`. With ChatML every message starts with the special `<|im_start|>`,
    so tokenizing the suffix alone yields the same ids as tokenizing the whole text, and
    the past ids are never touched. ChatEnv runs this transform after all the others.
    """

    def __init__(self, tokenizer=None) -> None:
        super().__init__()
        self.tokenizer = tokenizer

    def set_env(self, env) -> None:
        if env.input_mode != "history":
            raise ValueError(f"IncrementalTokenizer needs input_mode='history', env has {env.input_mode!r}")
        if self.tokenizer is None:
            self.tokenizer = env.tokenizer
        if self.tokenizer is None:
            raise ValueError("IncrementalTokenizer needs a tokenizer")
        super().set_env(env)

    def reset(self, td: TensorDictBase) -> TensorDictBase:
        for elem in td.unbind(0):
            prompt = elem["history"].prompt
            elem["tokens", "prompt"] = prompt.apply_chat_template(
                self.tokenizer, add_generation_prompt=True, tokenize=True
            )
        return td

    def step(self, td_next: TensorDictBase, td_action: TensorDictBase) -> TensorDictBase:
        for nxt, act in zip(td_next.unbind(0), td_action.unbind(0)):
            nxt["tokens", "prompt"] = self._next_tokens(nxt, act)
        return td_next

    def _next_tokens(self, nxt: TensorDictBase, act: TensorDictBase) -> torch.Tensor:
        new_prompt = nxt["history"].prompt
        if has_key(act, ("tokens", "full")):
            base = torch.as_tensor(act["tokens", "full"], dtype=torch.long).reshape(-1)
            prev = act["history"].full
        elif has_key(act, ("tokens", "prompt")):
            base = torch.as_tensor(act["tokens", "prompt"], dtype=torch.long).reshape(-1)
            prev = act["history"].prompt
        else:
            logger.warning("IncrementalTokenizer: no previous tokens in the action; tokenizing the whole prompt")
            return new_prompt.apply_chat_template(self.tokenizer, add_generation_prompt=True, tokenize=True)
        prev_chat, new_chat = prev.to_chat(), new_prompt.to_chat()
        if new_chat[: len(prev_chat)] != prev_chat:
            logger.warning("IncrementalTokenizer: next prompt does not extend the previous one; re-tokenizing")
            return new_prompt.apply_chat_template(self.tokenizer, add_generation_prompt=True, tokenize=True)
        suffix = chat_suffix(
            self.tokenizer, decode_tokens(self.tokenizer, base), prev_chat, new_chat[len(prev_chat):]
        )
        return torch.cat([base, encode_text(self.tokenizer, suffix)])


# ---------------------------------------------------------------------------- counters
class StepCounter(Transform):
    """Counts steps per element in `step_count` (int64 `[1]`); at `max_steps` sets truncated and done."""

    def __init__(self, max_steps: int | None = None) -> None:
        super().__init__()
        if max_steps is not None and max_steps < 1:
            raise ValueError(f"max_steps must be >= 1, got {max_steps}")
        self.max_steps = max_steps

    def reset(self, td: TensorDictBase) -> TensorDictBase:
        for elem in td.unbind(0):
            elem["step_count"] = torch.zeros(1, dtype=torch.long)
            elem["truncated"] = torch.zeros(1, dtype=torch.bool)
        return td

    def step(self, td_next: TensorDictBase, td_action: TensorDictBase) -> TensorDictBase:
        for nxt, act in zip(td_next.unbind(0), td_action.unbind(0)):
            prev = act.get("step_count", None)
            count = (prev.reshape(1).long() if prev is not None else torch.zeros(1, dtype=torch.long)) + 1
            nxt["step_count"] = count
            if self.max_steps is not None and int(count) >= self.max_steps:
                nxt["truncated"] = torch.ones(1, dtype=torch.bool)
                nxt["done"] = torch.ones(1, dtype=torch.bool)
        return td_next

    def __repr__(self) -> str:
        return f"StepCounter(max_steps={self.max_steps})"


class PolicyVersion(Transform):
    """Writes `policy_version` (int64 `[]` per element) on reset and step.

    Give an int (then `increment()` bumps it after each weight update) or a zero-argument
    callable returning the version (e.g. `lambda: engine.version`).
    """

    def __init__(self, version: int | Callable[[], int] = 0) -> None:
        super().__init__()
        self._getter = version if callable(version) else None
        self._version = 0 if callable(version) else int(version)

    @property
    def version(self) -> int:
        return int(self._getter()) if self._getter is not None else self._version

    def increment(self) -> int:
        """Bump the stored version (int mode only) and return it."""
        if self._getter is not None:
            raise TypeError("PolicyVersion reads its version from a getter; increment the source instead")
        self._version += 1
        return self._version

    def _write(self, td: TensorDictBase) -> TensorDictBase:
        version = self.version
        for elem in td.unbind(0):
            elem["policy_version"] = torch.tensor(version, dtype=torch.long)
        return td

    def reset(self, td: TensorDictBase) -> TensorDictBase:
        return self._write(td)

    def step(self, td_next: TensorDictBase, td_action: TensorDictBase) -> TensorDictBase:
        return self._write(td_next)

    def __repr__(self) -> str:
        return f"PolicyVersion(version={self.version})"


# ---------------------------------------------------------------------------- rewards


class RewardTransform(Transform):
    """Scores the last assistant message with an AReaL-style `reward_fn` on every step.

    `reward_fn(prompt, completions, prompt_ids, completion_ids, **row)` gets the prompt
    text the policy saw (generation prompt included), the content of the last assistant
    message (no end-of-turn token), their token ids (the policy's own when the action
    holds them, else a tokenization of the generated text) and the dataset row of a
    DataLoadingPrimer (keys clashing with the four arguments dropped). It may be sync or async
    and may return a number or a mapping with "reward" plus components (GSM8K's
    `reward_answer`, ...): the reward is added to `reward` (float32 `[1, 1]` per element, so
    `(B, 1, 1)` batched: the sparse-reward shape) and each component is written under its own
    key with the same shape, as in TorchRL's GSM8KRewardParser. A reward_fn that raises or runs
    past `timeout_s`, or returns NaN/inf, gives 0.0 with the `failed` key set (data/failures.py: the
    trajectory is a failed sample), a warning and `num_errors` / `num_timeouts` /
    `num_nonfinite` += 1, never a crash (see `RewardCaller`). Done/terminated are set when `set_done` is True, or, when
    `set_done` is a callable `(completion: str) -> bool` (e.g. IFEvalScorer.done: an answer
    block is present), when it returns True.
    """

    def __init__(self, reward_fn: Callable[..., Any], *, set_done: bool | Callable[[str], bool] = True,
                 tokenizer=None, timeout_s: float = 30.0, only_when_done: bool = False) -> None:
        super().__init__()
        from rayllm_rl.workflows.rewards import RewardCaller

        # a RewardCaller may be passed (shared by many envs, so its counters cover them all)
        self.caller = reward_fn if isinstance(reward_fn, RewardCaller) else RewardCaller(reward_fn, timeout_s=timeout_s)
        self.reward_fn = self.caller.reward_fn
        self.set_done = set_done
        self.only_when_done = only_when_done
        """Score only steps an earlier transform marked done (e.g. a tool agent's final answer)."""
        self.tokenizer = tokenizer

    @property
    def num_errors(self) -> int:
        return self.caller.num_errors

    @property
    def num_timeouts(self) -> int:
        return self.caller.num_timeouts

    @property
    def num_nonfinite(self) -> int:
        return self.caller.num_nonfinite

    def set_env(self, env) -> None:
        super().set_env(env)
        if self.tokenizer is None:
            self.tokenizer = env.tokenizer
        if self.tokenizer is None:
            raise ValueError("RewardTransform needs a tokenizer (from the env or the constructor)")

    def step(self, td_next: TensorDictBase, td_action: TensorDictBase) -> TensorDictBase:
        for nxt, act in zip(td_next.unbind(0), td_action.unbind(0)):
            if self.only_when_done and not bool(nxt.get("done", torch.zeros(1, dtype=torch.bool)).any()):
                if self.caller.component_keys:  # same keys on every step, 0 until the final one
                    for key in self.caller.component_keys:
                        nxt[key] = torch.zeros(1, 1)
                continue
            try:
                args = self._arguments(act)
            except Exception as err:  # a malformed action must not kill the rollout either
                self.caller.num_errors += 1
                logger.warning("RewardTransform: could not build reward arguments (%r); the trajectory failed", err)
                args, scores = None, self.caller.failure("reward_raised")
            else:
                scores = self.caller.score_sync(**args)
            previous = nxt.get("reward", None)
            value = torch.tensor([[scores.pop("reward")]], dtype=torch.float32)
            nxt["reward"] = value if previous is None else previous.reshape(1, 1) + value
            for key, v in scores.items():
                nxt[key] = torch.tensor([[v]], dtype=torch.float32)
            done = self.set_done(args["completions"] if args else "") if callable(self.set_done) else self.set_done
            if done:
                nxt["done"] = torch.ones(1, dtype=torch.bool)
                nxt["terminated"] = torch.ones(1, dtype=torch.bool)
        return td_next

    def _arguments(self, act: TensorDictBase) -> dict[str, Any]:
        env, tok = self.env, self.tokenizer
        full: History = env.history_of(act, "full")
        roles = full.role if full.batch_size[0] else []
        last = max((i for i, r in enumerate(roles) if r == "assistant"), default=None)
        completion = full[last].content if last is not None else ""
        if has_key(act, ("tokens", "prompt")):
            prompt_ids = torch.as_tensor(act["tokens", "prompt"], dtype=torch.long).reshape(-1)
            prompt = decode_tokens(tok, prompt_ids)
        else:
            if env.input_mode == "text":
                prompt = _text(act["text", "prompt"])
            else:
                prompt = env.history_of(act, "prompt").apply_chat_template(tok, add_generation_prompt=True)
            prompt_ids = encode_text(tok, prompt)
        if has_key(act, ("tokens", "response")):
            completion_ids = torch.as_tensor(act["tokens", "response"], dtype=torch.long).reshape(-1)
        elif has_key(act, ("tokens", "full")) and has_key(act, ("tokens", "prompt")):
            full_ids = torch.as_tensor(act["tokens", "full"], dtype=torch.long).reshape(-1)
            completion_ids = full_ids[prompt_ids.numel():]
        elif (env.input_mode == "text" and has_key(act, ("text", "full"))
              and _text(act["text", "full"]).startswith(prompt)):
            completion_ids = encode_text(tok, _text(act["text", "full"])[len(prompt):])
        else:
            completion_ids = encode_text(tok, completion)
        row = act["row"] if has_key(act, "row") else {}
        from rayllm_rl.workflows.rewards import REWARD_ARGS  # the row fields the reward's positional args shadow

        extra = {k: v for k, v in dict(row).items() if k not in REWARD_ARGS}
        return dict(
            prompt=prompt,
            completions=completion,
            prompt_ids=prompt_ids.tolist(),
            completion_ids=completion_ids.tolist(),
            **extra,
        )

    def __repr__(self) -> str:
        name = getattr(self.reward_fn, "__name__", repr(self.reward_fn))
        return f"RewardTransform({name}, set_done={self.set_done}, num_errors={self.num_errors})"
