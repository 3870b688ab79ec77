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

Errors name the row. A script that runs out of replies before the episode ends is refused. So is one that raises,
and so is a row whose episode failed (`failed` set): the warm start never imitates a broken episode.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
from typing import Any, Callable, Mapping, Sequence

import torch

from rayllm_rl.inference.protocol import LLMRequest, LLMResponse

DEMONSTRATION_TIMEOUT_S = 300.0
"""All the demonstrations of one SFT batch together (each step of the environment has its own `call_timeout_s`)."""


class ScriptedEngine:
    """An `InferenceEngine` whose replies are given: the i-th `agenerate` returns the i-th reply's tokens, closed by
    the end-of-turn token, with logprob 0 and policy version 0 (an SFT batch trains on neither)."""

    def __init__(self, tokenizer, replies: Sequence[str], label: str = "") -> None:
        self.tokenizer, self.replies, self.label, self.turn = tokenizer, list(replies), label, 0

    async def agenerate(self, request: LLMRequest) -> LLMResponse:
        if self.turn >= len(self.replies):
            raise ValueError(f"the demonstration of {self.label} has {len(self.replies)} replies, but its episode "
                             f"asked for reply {self.turn + 1}: the script must play the episode to its end")
        reply = self.replies[self.turn]
        self.turn += 1
        tokens = list(self.tokenizer.encode(reply, add_special_tokens=False)) + [self.tokenizer.eos_token_id]
        return LLMResponse(list(request.input_ids), tokens, [0.0] * len(tokens), [0] * len(tokens), "stop",
                           rid=request.rid)


def script_of(demonstrate: Callable[[dict], Any], row: Mapping[str, Any], label: str) -> list[str]:
    """The row's replies as a list of strings; ValueError naming the row for anything else."""
    try:
        replies = demonstrate(dict(row))
    except Exception as exc:
        raise ValueError(f"data.openenv.demonstration raised on {label}: {type(exc).__name__}: {exc}") from exc
    if isinstance(replies, str) or not isinstance(replies, Sequence) or not replies or not all(
            isinstance(r, str) for r in replies):
        raise ValueError(f"data.openenv.demonstration returned {replies!r:.120} for {label}: expected a non-empty list "
                         "of reply strings, one per assistant turn")
    return list(replies)


async def play_demonstrations(make_workflow: Callable[[int], Any], demonstrate: Callable[[dict], Any], tokenizer,
                              rows: Sequence[Mapping[str, Any]]):
    """One demonstrated episode per row, as the SFT batch `[len(rows), T]`. `make_workflow(max_turns)` builds the
    task's `EnvWorkflow` for a script of that many replies."""
    from rayllm_rl.data.failures import FAILED_KEY, cause_of_code
    from rayllm_rl.data.trajectory import concat_padded

    async def one(i: int, row: Mapping[str, Any]):
        label = f"row {i} (seed={row.get('seed')})"
        replies = script_of(demonstrate, row, label)
        episode = await make_workflow(len(replies)).arun_episode(ScriptedEngine(tokenizer, replies, label),
                                                                 {**row, "group_id": i})
        failed = episode.get(FAILED_KEY, None)
        if failed is not None and bool((failed != 0).any()):
            raise ValueError(f"the demonstration of {label} failed ({cause_of_code(float(failed.max()))}): the SFT "
                             "warm start imitates only episodes that finish")
        return episode

    batch = concat_padded(await asyncio.gather(*[one(i, r) for i, r in enumerate(rows)]))
    batch["advantages"] = torch.zeros(batch.batch_size[0])
    return batch


def demonstration_batch(make_workflow: Callable[[int], Any], demonstrate: Callable[[dict], Any], tokenizer,
                        rows: Sequence[Mapping[str, Any]]):
    """`play_demonstrations` from sync code (the SFT warm start on the driver), on a thread of its own so that a
    caller already inside an event loop (a notebook) is not blocked; bounded by `DEMONSTRATION_TIMEOUT_S`."""
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="demonstrations")
    try:
        future = pool.submit(asyncio.run, play_demonstrations(make_workflow, demonstrate, tokenizer, rows))
        try:
            return future.result(timeout=DEMONSTRATION_TIMEOUT_S)
        except concurrent.futures.TimeoutError:
            raise TimeoutError(f"{len(rows)} demonstrations did not finish within {DEMONSTRATION_TIMEOUT_S:g} s") \
                from None
    finally:
        pool.shutdown(wait=False)
