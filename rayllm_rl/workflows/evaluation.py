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


async def evaluate_episodes(engine: InferenceEngine, workflow, rows: Iterable[Mapping[str, Any]],
                            progress: Callable[[int], Any] | None = None) -> dict[str, float]:
    """The held-out evaluation of a task that plays episodes (task=openenv): one greedy episode of `workflow` (the
    task's own, built with greedy sampling and one sample a row) per row, all concurrently.

    Returns {"eval_reward": mean episode reward, "eval_n": rows, "eval_failed": failed episodes, "eval_<key>": the
    mean of each per-episode metric (`num_turns`, `tool_calls`, `invalid_actions`, `env_done`, the reward's
    components)}. The means are over the episodes that finished: a failed one (an environment that raised, a call
    past its bound) is counted in `eval_failed` and `eval_failed/<cause>`, never scored 0 (docs/failed-episodes.md);
    when none finished there is no score, and a RuntimeError names the causes."""
    from rayllm_rl.data.failures import FAILED_KEY, cause_of_code
    from rayllm_rl.data.trajectory import TOKEN_KEYS

    rows = list(rows)

    async def play(i: int, row: Mapping[str, Any]):
        episode = await workflow.arun_episode(engine, {**row, "group_id": i})
        if progress is not None:
            progress(1)
        return episode

    episodes = await asyncio.gather(*[play(i, r) for i, r in enumerate(rows)])
    totals: dict[str, float] = {}
    causes: dict[str, int] = {}
    finished = 0
    for episode in episodes:
        for j in range(episode.batch_size[0]):
            if FAILED_KEY in episode.keys() and float(episode[FAILED_KEY][j]) != 0:
                cause = cause_of_code(float(episode[FAILED_KEY][j]))
                causes[cause] = causes.get(cause, 0) + 1
                continue
            finished += 1
            for key, value in episode.items():
                if key in TOKEN_KEYS or key in ("group_id", FAILED_KEY) or value.dim() != 1:
                    continue
                name = "reward" if key == "rewards" else key
                totals[name] = totals.get(name, 0.0) + float(value[j])
    if rows and not finished:
        raise RuntimeError(f"every one of the {len(rows)} held-out episodes failed ({causes}): no evaluation score "
                           "(the env workers' logs say why)")
    out = {f"eval_{k}": v / max(1, finished) for k, v in totals.items()}
    out.setdefault("eval_reward", 0.0)
    out.update(eval_n=float(len(rows)), eval_failed=float(sum(causes.values())),
               **{f"eval_failed/{c}": float(n) for c, n in causes.items()})
    return out
