"""`EnvWorkflow`: one episode of an OpenEnv or TRL environment, token-in/token-out (AReaL's `arun_episode`).

    prompt chat (+ the first observation, + the tools) -> ids            add_prompt (not trained)
    repeat up to max_turns:
        engine.agenerate(ids so far) -> reply tokens                      add_generated (trained, logprobs, versions)
        session.act(reply text) -> the next turns, reward, done
        done: stop; else the next turns' tokens after the reply's         add_context (not trained)

The past is never re-tokenized: the next prompt is exactly the tokens the engine saw and produced plus the tokens of
the template's rendering of the new turns (`next_turns_text`, closing the reply with its end-of-turn token when the
engine stopped without it). One episode is one trajectory; `task.make_workflow` groups `group_size` of them
(`GroupedWorkflow`). An environment that raises, a call past its bound or a lost server ends the episode with that
exception: `GroupedWorkflow`'s `guard_sample` makes it a failed sample of its cause (`raised`, `timeout`,
`server_lost`; docs/failed-episodes.md), never a reward of 0.

Per-trajectory metrics: `num_turns`, `invalid_actions` (replies without a valid action, fed back), `tool_calls`,
`env_done` (1 when the environment ended the episode, 0 when max_turns cut it), `env_steps` (an OpenEnv
environment's own `state.step_count` at the end), and the reward's components.
"""
from __future__ import annotations

import contextlib
import json
import random
from typing import Any, Mapping

from tensordict import TensorDict

from rayllm_rl.data.trajectory import TrajectoryBuilder
from rayllm_rl.inference.protocol import InferenceEngine, LLMRequest, SamplingParams
from rayllm_rl.tools.mcp_tools import system_prompt_for_tools
from rayllm_rl.workflows.base import RolloutWorkflow
from rayllm_rl.workflows.multi_turn import turns_suffix_ids
from rayllm_rl.workflows.rewards import RewardCaller
from rayllm_rl.workflows.rlvr import row_fields


_PROBE_TOOL = {"type": "function", "function": {"name": "probe_tool", "description": "d",
                                                 "parameters": {"type": "object", "properties": {}}}}
_RENDERS_TOOLS: dict[str, bool] = {}
"""Chat template text -> whether it renders `tools=` (`renders_tools`)."""


def renders_tools(tokenizer) -> bool:
    """Whether the tokenizer's chat template shows `tools=` (a one-message chat renders differently with a tool);
    else the prompt carries the tools in a Hermes-style system block (`system_prompt_for_tools`), as the MCP tools'."""
    template = str(tokenizer.chat_template or "")
    if template not in _RENDERS_TOOLS:
        chat = [{"role": "user", "content": "x"}]
        plain = tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
        _RENDERS_TOOLS[template] = plain != tokenizer.apply_chat_template(chat, tools=[_PROBE_TOOL], tokenize=False,
                                                                           add_generation_prompt=True)
    return _RENDERS_TOOLS[template]


def prompt_messages(row: Mapping[str, Any], first: str | None, tools: list[dict],
                    tokenizer) -> tuple[list[dict[str, str]], dict[str, Any]]:
    """(the episode's prompt chat, the keywords of `apply_chat_template`): the row's `messages` with the first
    observation appended to the last user message (TRL's rule; a new user message when there is none), and the
    tools either as `tools=` (a template that renders them) or a system block. ValueError when no user turn results."""
    messages = [{"role": m["role"], "content": m["content"]} for m in row.get("messages") or ()]
    if first:
        if messages and messages[-1]["role"] == "user":
            messages[-1] = {**messages[-1], "content": messages[-1]["content"] + first}
        else:
            messages.append({"role": "user", "content": first})
    if not any(m["role"] == "user" for m in messages):
        raise ValueError("the episode has no user turn: the environment's reset gave no observation and "
                         "data.openenv.prompt is empty")
    if not tools:
        return messages, {}
    if renders_tools(tokenizer):
        return messages, {"tools": tools}
    if messages[0]["role"] == "system":
        messages[0] = {**messages[0], "content": system_prompt_for_tools(tools, messages[0]["content"])}
    else:
        messages.insert(0, {"role": "system", "content": system_prompt_for_tools(tools)})
    return messages, {}


class EnvWorkflow(RolloutWorkflow):
    """One episode of `source` (an `EnvSource`) per call, scored by `reward` (an `EpisodeReward`)."""

    def __init__(self, source, reward, tokenizer, sampling: SamplingParams, max_turns: int = 1,
                 reward_timeout_s: float = 30.0) -> None:
        if max_turns < 1:
            raise ValueError(f"max_turns must be >= 1, got {max_turns}")
        self.source = source
        self.reward = RewardCaller(reward, timeout_s=reward_timeout_s)
        self.tokenizer = tokenizer
        self.sampling = sampling
        self.max_turns = max_turns

    async def arun_episode(self, engine: InferenceEngine, data: Mapping[str, Any]) -> TensorDict:
        session = await self.source.open()
        try:
            episode = await self._play(session, engine, data)
        except BaseException:
            with contextlib.suppress(Exception):  # the episode's own error is its cause, not a failed close after it
                await session.close()
            raise
        await session.close()
        return episode

    async def _play(self, session, engine: InferenceEngine, data: Mapping[str, Any]) -> TensorDict:
        row = row_fields(data)
        group_id = int(data.get("group_id", random.getrandbits(62)))
        rid = f"oe{group_id}-{random.getrandbits(32)}"
        first = await session.start(row)
        messages, template_kwargs = prompt_messages(row, first, list(session.tools), self.tokenizer)
        prompt_ids = list(self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                             return_dict=False, **template_kwargs))
        traj = TrajectoryBuilder()
        traj.add_prompt(prompt_ids)
        completion: list[dict[str, str]] = []
        generated: list[int] = []
        turns = invalid = calls = 0
        done = False
        while turns < self.max_turns:
            resp = await engine.agenerate(LLMRequest(input_ids=list(traj.input_ids), sampling=self.sampling, rid=rid))
            if resp.input_tokens != traj.input_ids:  # the engine must have seen exactly our tokens
                raise RuntimeError(f"episode {rid}: engine input differs from the trajectory prefix")
            traj.add_generated(resp)
            generated += resp.output_tokens
            turns += 1
            reply = self.tokenizer.decode(resp.output_tokens, skip_special_tokens=True)
            step = await session.act(reply)
            invalid += int(step.invalid)
            calls += step.tool_calls
            completion += [{"role": "assistant", "content": reply}, *step.messages]
            done = step.done
            if done or turns >= self.max_turns:
                break
            traj.add_context(turns_suffix_ids(self.tokenizer, traj.input_ids, step.messages))
        env_reward = await session.env_reward()
        state = await session.state()
        counted = {"env_steps": float(state["step_count"])} if "step_count" in state else {}
        transcript = {"prompt": messages, "completion": completion}
        scores = await self.reward.score(self.tokenizer.decode(prompt_ids), json.dumps(completion), prompt_ids,
                                         generated, environment=session.env, env_reward=env_reward,
                                         transcript=transcript, **row)
        reward = scores.pop("reward")
        return traj.build(reward, group_id, num_turns=float(turns), invalid_actions=float(invalid),
                          tool_calls=float(calls), env_done=float(done), **counted, **scores)
