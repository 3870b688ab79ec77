"""Single-turn RL with verifiable rewards: n completions of one prompt share a `group_id`."""
from __future__ import annotations

import asyncio
import random
from typing import Any, Callable, Mapping

from tensordict import TensorDict

from rayllm_rl.data.failures import ATTEMPT_KEY, COLLECTOR_KEYS, SAMPLES_KEY, cause_of, failed_row
from rayllm_rl.data.trajectory import TrajectoryBuilder, concat_padded
from rayllm_rl.inference.protocol import InferenceEngine, LLMRequest, SamplingParams
from rayllm_rl.workflows.base import RolloutWorkflow
from rayllm_rl.workflows.rewards import REWARD_ARGS, RewardCaller


def row_fields(data: Mapping[str, Any]) -> dict[str, Any]:
    """The dataset row's own fields (what reward functions get as `**row`): without the collector's
    `prompt_ids`, `group_id` and re-run keys (`COLLECTOR_KEYS`), and without a field named as one of the
    reward's positional arguments (`REWARD_ARGS`: a TRL-style `prompt` column; the env path's RewardTransform
    drops them too)."""
    return {k: v for k, v in data.items()
            if k not in ("prompt_ids", "group_id") and k not in REWARD_ARGS and k not in COLLECTOR_KEYS}


def samples_of(data: Mapping[str, Any], group_size: int) -> tuple[int, str]:
    """(how many samples to run: the collector's `num_samples` when it runs a prompt's failed samples again, else
    `group_size`; a suffix that keeps a re-run's request ids apart from the first run's)."""
    attempt = data.get(ATTEMPT_KEY)
    return int(data.get(SAMPLES_KEY, group_size)), f"a{int(attempt)}" if attempt else ""


def row_messages(row: Mapping[str, Any], prompt_key: str = "messages") -> list[dict[str, str]]:
    """The chat messages of a dataset row: `row[prompt_key]` as messages or as a user string."""
    if prompt_key not in row:
        raise ValueError(f"dataset row has no {prompt_key!r} field (fields: {sorted(row)})")
    value = row[prompt_key]
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if (isinstance(value, list) and value
            and all(isinstance(m, Mapping) and "role" in m and "content" in m for m in value)):
        return [dict(m) for m in value]
    raise ValueError(f"dataset row field {prompt_key!r} must be a string or a list of {{role, content}} messages, "
                     f"got {value!r:.120}")


def tokenize_prompt(tokenizer, messages: list[dict[str, str]]) -> list[int]:
    """Chat-template the messages with the generation prompt, as a list of token ids."""
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False))


class RLVRWorkflow(RolloutWorkflow):
    """Group sampling: `group_size` completions per prompt, each scored by `reward_fn`. A request the engine
    fails (raises, or its server is lost) fails that sample alone: its row is a placeholder (`failed_row`)."""

    def __init__(
        self,
        reward_fn: Callable[..., Any],
        tokenizer,
        sampling: SamplingParams,
        group_size: int = 8,
        prompt_key: str = "messages",
        reward_timeout_s: float = 30.0,
    ):
        self.reward = RewardCaller(reward_fn, timeout_s=reward_timeout_s)
        self.tokenizer = tokenizer
        self.sampling = sampling
        self.group_size = group_size
        self.prompt_key = prompt_key

    async def arun_episode(self, engine: InferenceEngine, data: Mapping[str, Any]) -> TensorDict:
        messages = row_messages(data, self.prompt_key)
        prompt_ids = data.get("prompt_ids") or tokenize_prompt(self.tokenizer, messages)
        group_id = int(data.get("group_id", random.getrandbits(62)))
        n, again = samples_of(data, self.group_size)
        base_rid = f"g{group_id}{again}"
        answered = await asyncio.gather(*[
            engine.agenerate(LLMRequest(input_ids=list(prompt_ids), sampling=self.sampling, rid=f"{base_rid}-{i}"))
            for i in range(n)
        ], return_exceptions=True)
        trajs = [failed_row(group_id, cause_of(r), prompt_ids) for r in answered if isinstance(r, BaseException)]
        responses = [r for r in answered if not isinstance(r, BaseException)]
        prompt_text = self.tokenizer.decode(prompt_ids)
        row = row_fields(data)
        completions = [self.tokenizer.decode(resp.output_tokens, skip_special_tokens=True) for resp in responses]
        # the group's completions are scored at once: a reward model or judge batches them together
        all_scores = await asyncio.gather(*[self.reward.score(prompt_text, completion, resp.input_tokens,
                                                              resp.output_tokens, **row)
                                            for resp, completion in zip(responses, completions)])
        for resp, scores in zip(responses, all_scores):
            traj = TrajectoryBuilder()
            traj.add_prompt(resp.input_tokens)
            traj.add_generated(resp)
            trajs.append(traj.build(scores.pop("reward"), group_id, truncated=float(resp.stop_reason == "length"),
                                    **scores))
        return concat_padded(trajs)
