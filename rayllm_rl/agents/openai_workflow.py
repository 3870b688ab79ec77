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
import logging
import random
from typing import Any, Awaitable, Callable, Mapping

from tensordict import TensorDict

from rayllm_rl.agents.openai_proxy import ChatCompletionsSession, openai_client
from rayllm_rl.data.failures import COLLECTOR_KEYS, cause_of, failed_row
from rayllm_rl.data.trajectory import concat_padded
from rayllm_rl.inference.protocol import InferenceEngine, SamplingParams
from rayllm_rl.workflows.base import RolloutWorkflow
from rayllm_rl.workflows.rewards import RewardCaller
from rayllm_rl.workflows.rlvr import row_fields, samples_of

log = logging.getLogger(__name__)


class OpenAIAgentWorkflow(RolloutWorkflow):
    """Runs `group_size` concurrent episodes of `agent_fn` per row; one trajectory per conversation.

    A raising agent, or one that exceeds `episode_timeout_s`, is a failed sample (its placeholder
    row, data/failures.py; the warning names the agent); the group's other agents go on. A reward
    function that fails marks its trajectories failed and bumps a counter, as everywhere else;
    `rollout.on_failure` decides what the group does.
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

    async def _sample(self, engine: InferenceEngine, data: Mapping[str, Any], group_id: int) -> list[TensorDict]:
        """One agent episode's trajectories, or its placeholder failed row if the agent raised or timed out."""
        try:
            return await self._episode(engine, data, group_id)
        except Exception as exc:  # noqa: BLE001 - one agent's failure is its sample's, not the group's
            log.warning("agent %s failed (%s): %s: %s", self.agent_fn.__name__, cause_of(exc), type(exc).__name__, exc)
            return [failed_row(group_id, cause_of(exc))]

    async def arun_episode(self, engine: InferenceEngine, data: Mapping[str, Any]) -> TensorDict:
        group_id = int(data.get("group_id", random.getrandbits(62)))
        n, _ = samples_of(data, self.group_size)
        row = {k: v for k, v in data.items() if k not in COLLECTOR_KEYS}
        groups = await asyncio.gather(*[self._sample(engine, row, group_id) for _ in range(n)])
        return concat_padded([t for trajs in groups for t in trajs])
