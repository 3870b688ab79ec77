"""Multi-turn retry-with-feedback (AReaL's math agent), token-in/token-out.

Unlike the seed's version, the past is never re-tokenized: turn t+1's prompt is exactly the
tokens the engine saw and produced at turn t, followed by the tokens of the feedback message,
so the trajectory trains on the tokens the model really saw. The dataset row is not mutated,
and a first-turn success keeps the full reward (discount^(turns-1)).
"""
from __future__ import annotations

import random
from typing import Any, Callable, Mapping

from tensordict import TensorDict

from rayllm_rl.data.chat_template import next_turns_text
from rayllm_rl.data.trajectory import TrajectoryBuilder
from rayllm_rl.inference.protocol import InferenceEngine, LLMRequest, SamplingParams
from rayllm_rl.workflows.base import RolloutWorkflow
from rayllm_rl.workflows.rewards import RewardCaller
from rayllm_rl.workflows.rlvr import row_fields, row_messages, tokenize_prompt


def turns_suffix_ids(tokenizer, last_tokens: list[int], messages: list[dict[str, str]]) -> list[int]:
    """Tokens that close the assistant turn (if generation was cut) and open the next: `messages` (one turn, or
    several, e.g. the results of two tool calls), then the next assistant header."""
    closing = "" if last_tokens and last_tokens[-1] == tokenizer.eos_token_id else tokenizer.eos_token
    # not a render of the lone messages: SmolLM2's and Qwen's templates would put a default system turn before them
    return list(tokenizer.encode(closing + next_turns_text(tokenizer, messages), add_special_tokens=False))


def feedback_suffix_ids(tokenizer, last_tokens: list[int], content: str, role: str = "user") -> list[int]:
    """`turns_suffix_ids` of one `role` message: the tokens that close the assistant turn and open the next one."""
    return turns_suffix_ids(tokenizer, last_tokens, [{"role": role, "content": content}])


class MultiTurnWorkflow(RolloutWorkflow):
    """Retry until `reward >= success_threshold` or `max_turns`, discounting later successes."""

    def __init__(
        self,
        reward_fn: Callable[..., Any],
        tokenizer,
        sampling: SamplingParams,
        max_turns: int = 3,
        turn_discount: float = 0.9,
        feedback: str = "Your answer is not correct. Please try to answer it again.",
        success_threshold: float = 1.0,
        prompt_key: str = "messages",
        reward_timeout_s: float = 30.0,
    ):
        if max_turns < 1:
            raise ValueError(f"max_turns must be >= 1, got {max_turns}")
        self.reward = RewardCaller(reward_fn, timeout_s=reward_timeout_s)
        self.tokenizer = tokenizer
        self.sampling = sampling
        self.max_turns = max_turns
        self.turn_discount = turn_discount
        self.feedback = feedback
        self.success_threshold = success_threshold
        self.prompt_key = prompt_key

    async def arun_episode(self, engine: InferenceEngine, data: Mapping[str, Any]) -> TensorDict:
        row = row_fields(data)
        prompt_ids = list(data.get("prompt_ids")
                          or tokenize_prompt(self.tokenizer, row_messages(data, self.prompt_key)))
        group_id = int(data.get("group_id", random.getrandbits(62)))
        rid = f"mt{group_id}-{random.getrandbits(32)}"
        traj = TrajectoryBuilder()
        traj.add_prompt(prompt_ids)
        scores, turns = self.reward.failed(), 0
        while turns < self.max_turns:
            if turns > 0:
                traj.add_context(feedback_suffix_ids(self.tokenizer, traj.input_ids, self.feedback))
            resp = await engine.agenerate(LLMRequest(input_ids=list(traj.input_ids), sampling=self.sampling, rid=rid))
            if resp.input_tokens != traj.input_ids:  # the engine must have seen exactly our tokens
                raise RuntimeError(f"episode {rid}: engine input differs from the trajectory prefix")
            traj.add_generated(resp)
            turns += 1
            completion = self.tokenizer.decode(resp.output_tokens, skip_special_tokens=True)
            scores = await self.reward.score(self.tokenizer.decode(resp.input_tokens), completion,
                                             resp.input_tokens, resp.output_tokens, **row)
            if scores["reward"] >= self.success_threshold:
                break
        final = scores.pop("reward") * self.turn_discount ** (turns - 1)
        return traj.build(final, group_id, num_turns=float(turns), **scores)
