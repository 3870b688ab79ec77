"""Demonstrations of an environment task for the SFT warm start: scripted replies played through the environment.

A model that never calls a tool gets no reward from a tool environment, so GRPO has nothing to push on (every
group's advantages are 0). As TRL, verl and AReaL users do, the job first imitates a few solved episodes. Here a
demonstration is what the user knows, the replies: `data.openenv.demonstration='package.module:fn'`, with
`fn(row) -> [reply, reply, ...]`, the text of each assistant turn in order. For the calculator, that is the tool call
of the multiplication, then the tool call of its answer.

The replies are played through the real environment by the task's own `EnvWorkflow`, with `ScriptedEngine` in the
engine's place. So the demonstration's tokens are exactly the ones an RL episode would have: the same prompt, tools,
observations and chat-template turns. Its `loss_mask` marks the replies' tokens (each closed by the end-of-turn
token `eos_token_id`, the one the engine stops on) and nothing else. Shapes: the batch is `[n, T]`, one row per
demonstrated episode, with zero `advantages` like every SFT batch (`data.sft.make_sft_batch`).

Errors name the key and the row. Refused: a script that raises or returns no list of strings; one that runs out of
replies before the episode ends, or whose episode ends with replies left over; a reply the environment took as an
invalid action; and an episode that failed (`failed` set, or raised). The warm start never imitates a broken episode.
"""
from __future__ import annotations

import asyncio
import functools
from typing import Any, Callable, Mapping, Sequence

import torch

from rayllm_rl.inference.protocol import LLMRequest, LLMResponse
from rayllm_rl.loop_thread import run_bounded

DEMONSTRATION_TIMEOUT_S = 600.0
"""All the demonstrations of one SFT batch together (each call into the environment has its own bound); past it the
episodes are cancelled (their sessions closed) and a TimeoutError says so."""


def demonstrations_of(path: str, key: str, play: Callable[..., Any], *args: Any) -> Callable[..., Any] | None:
    """`Task.demonstrate` of a task=openenv / verifiers job: `play(*args, fn, tokenizer, rows)`, with `fn` the function
    `path` (the value of `key`) names; None when `path` is empty (no demonstrations)."""
    from rayllm_rl.object_path import import_object

    return functools.partial(play, *args, import_object(path, key)) if path else None


class ScriptedEngine:
    """An `InferenceEngine` whose replies are given: the i-th `agenerate` returns the i-th reply's tokens, closed by
    the end-of-turn token, with logprob 0 and policy version -1 (the mark of a token no engine sampled, as
    `make_sft_batch`'s: mismatch figures and traces leave it out)."""

    def __init__(self, tokenizer, replies: Sequence[str], label: str = "", key: str = "the demonstration") -> None:
        self.tokenizer, self.replies, self.label, self.key, self.turn = tokenizer, list(replies), label, key, 0

    async def agenerate(self, request: LLMRequest) -> LLMResponse:
        if self.turn >= len(self.replies):
            raise ValueError(f"{self.key} of {self.label} has {len(self.replies)} replies, but its episode asked for "
                             f"reply {self.turn + 1}: the script must play the episode to its end")
        reply = self.replies[self.turn]
        self.turn += 1
        tokens = list(self.tokenizer.encode(reply, add_special_tokens=False)) + [self.tokenizer.eos_token_id]
        return LLMResponse(list(request.input_ids), tokens, [0.0] * len(tokens), [-1] * len(tokens), "stop",
                           rid=request.rid)


def script_of(demonstrate: Callable[[dict], Any], row: Mapping[str, Any], label: str, key: str) -> list[str]:
    """The row's replies as a list of strings; ValueError naming the key and the row for anything else."""
    try:
        replies = demonstrate(dict(row))
    except Exception as exc:
        raise ValueError(f"{key} raised on {label}: {type(exc).__name__}: {exc}") from exc
    if isinstance(replies, str) or not isinstance(replies, Sequence) or not replies or not all(
            isinstance(r, str) for r in replies):
        raise ValueError(f"{key} returned {replies!r:.120} for {label}: expected a non-empty list of reply strings, "
                         "one per assistant turn")
    return list(replies)


async def play_demonstrations(make_workflow: Callable[[int], Any], demonstrate: Callable[[dict], Any], tokenizer,
                              rows: Sequence[Mapping[str, Any]], key: str = "the demonstration",
                              label_of: Callable[[int, Mapping[str, Any]], str] | None = None):
    """One demonstrated episode per row, as the SFT batch `[len(rows), T]`. `make_workflow(replies)` builds the
    task's workflow for a script of that many replies; `label_of(i, row)` names a row in errors."""
    from rayllm_rl.data.failures import FAILED_KEY, cause_of_code
    from rayllm_rl.data.trajectory import concat_padded

    label_of = label_of or (lambda i, row: f"the row with seed={row.get('seed')}")

    async def one(i: int, row: Mapping[str, Any]):
        label = label_of(i, row)
        replies = script_of(demonstrate, row, label, key)
        engine = ScriptedEngine(tokenizer, replies, label, key)
        try:
            episode = await make_workflow(len(replies)).arun_episode(engine, {**row, "group_id": i})
        except Exception as exc:
            if isinstance(exc, ValueError) and str(exc).startswith(key):  # the script stopped short: named already
                raise
            raise ValueError(f"the demonstration of {label} ({key}) raised in the environment: "
                             f"{type(exc).__name__}: {exc}") from exc
        failed = episode.get(FAILED_KEY, None)
        if failed is not None and bool((failed != 0).any()):
            raise ValueError(f"the demonstration of {label} ({key}) failed ({cause_of_code(float(failed.max()))}): "
                             "the SFT warm start imitates only episodes that finish")
        invalid = episode.get("invalid_actions", None)
        if invalid is not None and float(invalid.sum()) > 0:
            raise ValueError(f"{key} of {label}: the environment took {int(invalid.sum())} of its replies as invalid "
                             "actions (a tool name or argument it does not have?); the warm start would imitate them")
        if engine.turn < len(replies):
            raise ValueError(f"{key} of {label} has {len(replies)} replies, but its episode ended after "
                             f"{engine.turn}: the replies left over would never be trained on")
        return episode

    batch = concat_padded(await asyncio.gather(*[one(i, r) for i, r in enumerate(rows)]))
    batch["advantages"] = torch.zeros(batch.batch_size[0])
    return batch


def demonstration_batch(make_workflow: Callable[[int], Any], demonstrate: Callable[[dict], Any], tokenizer,
                        rows: Sequence[Mapping[str, Any]], key: str = "the demonstration",
                        label_of: Callable[[int, Mapping[str, Any]], str] | None = None,
                        timeout_s: float = DEMONSTRATION_TIMEOUT_S):
    """`play_demonstrations` from sync code (the SFT warm start on the driver), with an event loop of its own on a
    daemon thread (`run_bounded`), so it runs the same whether or not the caller is inside one (a notebook). Past
    `timeout_s` the episodes are cancelled on that loop and a TimeoutError is raised here."""
    what = f"{len(rows)} demonstrations ({key})"

    async def bounded():
        try:
            return await asyncio.wait_for(play_demonstrations(make_workflow, demonstrate, tokenizer, rows, key,
                                                              label_of), timeout_s)
        except asyncio.TimeoutError:
            raise TimeoutError(f"{what} did not finish within {timeout_s:g} s") from None

    # the loop's own bound fires first; run_bounded's only if cancelling the episodes hangs
    return run_bounded(lambda: asyncio.run(bounded()), timeout_s + 30.0, what)
