"""`VerifiersWorkflow`: one rollout of a verifiers environment, its model calls served by our engine.

    row's vf_input -> env.rollout(input, client, model)          verifiers' own loop: turns, tool calls, env_response
        each model call: vf.OpenAIChatCompletionsClient -> openai.AsyncOpenAI -> ChatCompletionsApp (in process,
        no port: agents/openai_proxy.py) -> engine.agenerate; the proxy records prompt ids, output ids, logprobs,
        policy versions
    rubric.score_rollout(state) -> the reward and its components  (environments/verifiers_env.RubricReward)
    the recorded conversation -> one trajectory                  (ChatCompletionsSession.trajectories)

So every token trained on, its logprob and its policy version are the engine's: verifiers' messages only choose what
the next prompt is, and a request that continues the conversation reuses the recorded ids (nothing re-tokenized).
The proxy renders the request's `tools` with the chat template and reads the reply's Hermes
`<tool_call>{...}</tool_call>` blocks as OpenAI `tool_calls`, which `ToolEnv` runs.

An episode fails by its cause (`guard_sample`, docs/failed-episodes.md), never as a reward of 0: an
`env_response` (or a tool with `stop_errors`) that raises; an error verifiers catches into `state["error"]`
(re-raised here); a rollout past `data.verifiers.rollout_timeout_s` (`timeout`); a rubric function that raises
(`reward_raised`, through `RewardCaller`).
"""
from __future__ import annotations

import asyncio
import json
import random
from typing import Any, Mapping

from tensordict import TensorDict

from rayllm_rl.agents.openai_proxy import ChatCompletionsSession, openai_client
from rayllm_rl.inference.protocol import InferenceEngine, SamplingParams
from rayllm_rl.workflows.base import RolloutWorkflow
from rayllm_rl.workflows.rewards import RewardCaller
from rayllm_rl.workflows.rlvr import row_fields

MODEL_NAME = "rayllm-policy"
"""The model name verifiers' client asks for (the proxy serves the policy under any name)."""


class VerifiersRolloutError(RuntimeError):
    """verifiers ended the rollout with an error of its own (`state["error"]`): the sample fails (cause `raised`)."""


class VerifiersWorkflow(RolloutWorkflow):
    """One rollout of `source`'s environment per call, scored by `reward` (a `RubricReward`)."""

    def __init__(self, source, reward, tokenizer, sampling: SamplingParams) -> None:
        self.source = source
        self.env = source.load()  # once per workflow (an env worker's): its rubric made strict
        self.tool_parser = source.parser()
        self.reward = RewardCaller(reward)
        self.tokenizer = tokenizer
        self.sampling = sampling

    async def arun_episode(self, engine: InferenceEngine, data: Mapping[str, Any]) -> TensorDict:
        import verifiers as vf

        env = self.env
        row = row_fields(data)
        group_id = int(data.get("group_id", random.getrandbits(62)))
        session = ChatCompletionsSession(engine, self.tokenizer, default_max_tokens=self.sampling.max_new_tokens,
                                         sampling=self.sampling, rid=f"vf{group_id}-{random.getrandbits(32)}",
                                         tool_parser=self.tool_parser)
        client = openai_client(session, timeout_s=self.source.timeout_s)
        try:
            state = await asyncio.wait_for(env.rollout(json.loads(row["vf_input"]), vf.OpenAIChatCompletionsClient(
                client), MODEL_NAME, {}), self.source.timeout_s)
        except asyncio.TimeoutError:
            raise TimeoutError(f"a rollout of {self.source.label} ran past data.verifiers.rollout_timeout_s="
                               f"{self.source.timeout_s:g}s") from None
        finally:
            await client.close()
        if state.get("error") is not None:
            err = state["error"]
            raise VerifiersRolloutError(f"{self.source.label}'s rollout ended with {type(err).__name__}: "
                                        f"{err}") from err
        if state.get("timed_out"):
            raise TimeoutError(f"a rollout of {self.source.label} ran past its timeout_seconds={env.timeout_seconds}")
        if not session.records:
            raise RuntimeError(f"{self.source.label}'s rollout made no chat completion")
        last = session.records[-1]
        scores = await self.reward.score(self.tokenizer.decode(last.prompt_ids), last.reply["content"],
                                         last.prompt_ids, last.output_ids, state=state, rubric=env.rubric)
        reward = scores.pop("reward")
        trajectories = session.trajectories(reward, group_id, num_turns=float(len(state["trajectory"])), **scores)
        if len(trajectories) != 1:  # verifiers' MultiTurnEnv extends one conversation; the proxy must have seen that
            raise RuntimeError(f"{self.source.label}'s rollout made {len(trajectories)} conversations, not one: a "
                               "request did not continue the previous one (its messages were rewritten)")
        return trajectories[0]


def make_workflow(tokenizer, sampling, group_size: int, task, sample_timeout_s=None, *, source):
    """The task's rollout workflow (built in each env worker with the job's keywords, `factories.build_workflow`):
    `group_size` independent rollouts of the row, one `group_id`; each sample that fails (or runs past
    `rollout.sample_timeout_s`) fails alone. The
    environment's own `max_turns` bounds its turns (`rollout.max_turns` is not read)."""
    from rayllm_rl.workflows.grouped import GroupedWorkflow

    return GroupedWorkflow(VerifiersWorkflow(source, task.reward_fn, tokenizer, sampling), group_size,
                           timeout_s=sample_timeout_s)

