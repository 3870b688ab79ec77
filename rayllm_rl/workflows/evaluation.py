"""Greedy evaluation: mean reward of one greedy answer per held-out prompt."""
from __future__ import annotations

import asyncio
from typing import Any, Callable, Iterable, Mapping

from rayllm_rl.inference.protocol import InferenceEngine, LLMRequest, SamplingParams
from rayllm_rl.workflows.rewards import RewardCaller
from rayllm_rl.workflows.rlvr import row_fields, row_messages, tokenize_prompt


async def evaluate_greedy(engine: InferenceEngine, tokenizer, rows: Iterable[Mapping[str, Any]],
                          reward_fn: Callable[..., Any], max_new_tokens: int, prompt_key: str = "messages",
                          progress: Callable[[int], Any] | None = None) -> dict[str, float]:
    """Returns {"eval_reward": mean reward, "eval_n": prompts, "eval_<component>": mean of each component}.
    `progress(1)` is called as each answer comes back (a progress bar's tick)."""
    rows = list(rows)
    reward = RewardCaller(reward_fn)
    sampling = SamplingParams(max_new_tokens=max_new_tokens, greedy=True)
    prompts = [tokenize_prompt(tokenizer, row_messages(r, prompt_key)) for r in rows]

    async def answer(prompt):
        resp = await engine.agenerate(LLMRequest(input_ids=prompt, sampling=sampling))
        if progress is not None:
            progress(1)
        return resp

    responses = await asyncio.gather(*[answer(p) for p in prompts])
    totals: dict[str, float] = {}
    for row, resp in zip(rows, responses):
        text = tokenizer.decode(resp.output_tokens, skip_special_tokens=True)
        scores = await reward.score(tokenizer.decode(resp.input_tokens), text, resp.input_tokens, resp.output_tokens,
                                    **row_fields(row))
        for k, v in scores.items():
            totals[k] = totals.get(k, 0.0) + v
    n = max(1, len(rows))
    out = {f"eval_{k}": v / n for k, v in totals.items()}
    out.setdefault("eval_reward", 0.0)
    out["eval_n"] = float(len(rows))
    return out
