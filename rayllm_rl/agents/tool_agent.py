"""Tool-using agents as a ChatEnv: the model calls tools (sandboxed Python, MCP) until it answers.

`ToolAgentWorkflow` plays a history-mode ChatEnv with tool transforms through `ChatEnvWorkflow`.
The tool results are appended as tokens after the model's own ids (IncrementalTokenizer), so the
past is never re-tokenized, and they are masked out of the loss because only engine-generated
tokens are trained on. A conversation ends when the model writes a turn without a tool call, or
after `max_turns` turns. The reward is scored once, on that final turn.
"""
from __future__ import annotations

import functools
from typing import Any, Callable, Sequence

from rayllm_rl.envs.chat_env import ChatEnv
from rayllm_rl.envs.transforms import RewardTransform, Transform
from rayllm_rl.inference.protocol import SamplingParams
from rayllm_rl.workflows.chat_env_workflow import ChatEnvWorkflow
from rayllm_rl.workflows.rewards import RewardCaller


class ToolAgentEnv(ChatEnv):
    """ChatEnv + tool transforms (each must set done on a turn without a call) + a final-turn reward."""

    def __init__(self, tokenizer, tools: Sequence[Transform], reward_fn: Callable[..., Any] | None = None,
                 system_prompt: str | None = None) -> None:
        super().__init__(tokenizer, input_mode="history", system_prompt=system_prompt, batch_size=1,
                         with_tokenizer=True)
        for tool in tools:
            self.append_transform(tool)
        self.reward_transform = None
        if reward_fn is not None:  # after the tools: it sees their done flag
            self.reward_transform = RewardTransform(reward_fn, set_done=False, only_when_done=True)
            self.append_transform(self.reward_transform)


def _make_env(tokenizer, make_tools, caller, system_prompt):
    return ToolAgentEnv(tokenizer, make_tools(), caller, system_prompt)


class ToolAgentWorkflow(ChatEnvWorkflow):
    """`group_size` tool-using conversations per row (one episode); `make_tools()` builds fresh tool
    transforms per conversation (e.g.
    `lambda: [PythonInterpreter(RemoteExecutor(service), done_when_no_code=True)]`)."""

    def __init__(self, tokenizer, make_tools: Callable[[], Sequence[Transform]], sampling: SamplingParams, *,
                 reward_fn: Callable[..., Any] | None = None, system_prompt: str | None = None,
                 group_size: int = 4, max_turns: int = 4, prompt_key: str = "messages") -> None:
        caller = RewardCaller(reward_fn) if reward_fn is not None else None
        make_env = functools.partial(_make_env, tokenizer, make_tools, caller, system_prompt)
        super().__init__(make_env, sampling, group_size=group_size, max_turns=max_turns, prompt_key=prompt_key)
        self.reward = caller  # known here: no probe env (and its tools) needed for the counters
