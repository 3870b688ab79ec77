"""Train agents written against the `openai` SDK: AReaL's "any agent code" workflow.

`agent_fn(client, data) -> reward | (reward, info)` is ordinary async agent code that calls
`client.chat.completions.create(...)` (an `openai.AsyncOpenAI`). Each episode gets a fresh
recording session, so the completions it makes become trajectories. Their tokens, logprobs and
versions are exactly what the engine produced. The reward may come from the agent or from
`reward_fn(prompt, completions, prompt_ids, completion_ids, **row)`, which scores the last
completion.
"""
from __future__ import annotations

import asyncio
import inspect
import random
from typing import Any, Awaitable, Callable, Mapping

from tensordict import TensorDict

from rayllm_rl.agents.openai_proxy import ChatCompletionsSession, openai_client
from rayllm_rl.data.trajectory import concat_padded
from rayllm_rl.inference.protocol import InferenceEngine, SamplingParams
from rayllm_rl.workflows.base import RolloutWorkflow
from rayllm_rl.workflows.rewards import RewardCaller
from rayllm_rl.workflows.rlvr import row_fields


class OpenAIAgentWorkflow(RolloutWorkflow):
    """Runs `group_size` concurrent episodes of `agent_fn` per row; one trajectory per conversation.

    A raising agent, or one that exceeds `episode_timeout_s`, fails its episode: the collector
    counts it and the error names the agent. A reward function that fails gives 0 and bumps a
    counter, as everywhere else.
    """

    def __init__(self, agent_fn: Callable[[Any, Mapping[str, Any]], Awaitable[Any]], tokenizer, *,
                 group_size: int = 4, reward_fn: Callable[..., Any] | None = None,
                 max_tokens: int = 256, episode_timeout_s: float = 600.0, sampling: SamplingParams | None = None):
        if not inspect.iscoroutinefunction(agent_fn):
            raise TypeError("agent_fn must be an async function taking (client, data)")
        self.agent_fn = agent_fn
        self.tokenizer = tokenizer
        self.group_size = group_size
        self.reward = RewardCaller(reward_fn) if reward_fn is not None else None
        self.max_tokens = max_tokens
        self.episode_timeout_s = episode_timeout_s
        self.sampling = sampling
        """The job's temperature / top-p / top-k, which the learner scores at (None: the requests' own)."""

    async def _episode(self, engine: InferenceEngine, data: Mapping[str, Any], group_id: int) -> list[TensorDict]:
        session = ChatCompletionsSession(engine, self.tokenizer, default_max_tokens=self.max_tokens,
                                         sampling=self.sampling)
        client = openai_client(session)
        try:
            result = await asyncio.wait_for(self.agent_fn(client, data), self.episode_timeout_s)
        finally:
            await client.close()
        if not session.records:
            raise RuntimeError(f"agent {self.agent_fn.__name__} made no chat completion")
        extra: dict[str, float] = {}
        if self.reward is not None:
            last = session.records[-1]
            row = row_fields(data)
            scores = await self.reward.score(self.tokenizer.decode(last.prompt_ids), last.reply["content"],
                                             last.prompt_ids, last.output_ids, **row)
            reward = scores.pop("reward")
            extra = scores
        else:
            reward = result[0] if isinstance(result, tuple) else result
            if reward is None:
                raise ValueError(f"agent {self.agent_fn.__name__} returned no reward and no reward_fn is set")
        return session.trajectories(float(reward), group_id, **extra)

    async def arun_episode(self, engine: InferenceEngine, data: Mapping[str, Any]) -> TensorDict:
        group_id = int(data.get("group_id", random.getrandbits(62)))
        groups = await asyncio.gather(*[self._episode(engine, data, group_id) for _ in range(self.group_size)])
        return concat_padded([t for trajs in groups for t in trajs])
