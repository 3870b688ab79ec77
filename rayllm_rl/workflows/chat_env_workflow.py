"""Run a TorchRL-style ChatEnv (e.g. GSM8KEnv) as an AReaL workflow, token-in/token-out.

This is how task environments run inside the Ray env workers: the collector hands a dataset
row to `arun_episode`, which plays `group_size` independent single-conversation envs against
the inference engine and returns the group's trajectories. The engine's prompt at every turn
is the env's `("tokens", "prompt")` (IncrementalTokenizer: the previous turn's exact ids plus
the tokens of what the env appended), and the trajectory is exactly those ids, so nothing is
re-tokenized; tokens the env added (feedback, tool results) are masked out of the loss.
"""
from __future__ import annotations

import asyncio
import functools
import random
from typing import Any, Callable, Mapping

import torch
from tensordict import NonTensorData, TensorDict

from rayllm_rl.data.history import History
from rayllm_rl.data.trajectory import TrajectoryBuilder, concat_padded
from rayllm_rl.inference.protocol import InferenceEngine, LLMRequest, SamplingParams
from rayllm_rl.workflows.base import RolloutWorkflow
from rayllm_rl.workflows.rlvr import row_fields, row_messages

_NOT_COMPONENTS = frozenset({"done", "terminated", "truncated", "reward", "step_count", "policy_version",
                             "row_index", "group_id"})


class ChatEnvWorkflow(RolloutWorkflow):
    """`group_size` episodes of `make_env()` (a batch-1 history-mode ChatEnv with an
    IncrementalTokenizer) per dataset row, each up to `max_turns` policy turns.

    Trajectory reward = the sum of the env's step rewards (the return); per-sequence components
    (`reward_answer`, `success`, ...) are those of the last step; `num_turns` is recorded.
    """

    def __init__(self, make_env: Callable[[], Any], sampling: SamplingParams, group_size: int = 8,
                 max_turns: int = 1, prompt_key: str = "messages"):
        if max_turns < 1:
            raise ValueError(f"max_turns must be >= 1, got {max_turns}")
        self.make_env = make_env
        self.sampling = sampling
        self.group_size = group_size
        self.max_turns = max_turns
        self.prompt_key = prompt_key

    @functools.cached_property
    def reward(self):
        """The RewardCaller of the envs' RewardTransform, for its call/error/timeout counters (the
        task's make_env shares one caller between all the envs it builds; read from one probe env)."""
        env = self.make_env()
        try:
            transform = getattr(env, "reward_transform", None)
            return transform.caller if transform is not None else None
        finally:
            env.close()

    async def arun_episode(self, engine: InferenceEngine, data: Mapping[str, Any]) -> TensorDict:
        group_id = int(data.get("group_id", random.getrandbits(62)))
        row = row_fields(data)
        trajs = await asyncio.gather(*[
            self._episode(engine, row, group_id, f"env{group_id}-{i}") for i in range(self.group_size)
        ])
        return concat_padded(trajs)

    async def _episode(self, engine: InferenceEngine, row: dict, group_id: int, rid: str) -> TensorDict:
        env = self.make_env()
        try:
            return await self._play(env, engine, row, group_id, rid)
        finally:
            env.close()  # transforms holding resources (an MCP pool of their own) release them per episode

    async def _play(self, env, engine: InferenceEngine, row: dict, group_id: int, rid: str) -> TensorDict:
        elem = TensorDict(batch_size=[])
        messages = env.messages_of(row) if hasattr(env, "messages_of") else row_messages(row, self.prompt_key)
        elem["messages"] = NonTensorData(messages)
        elem["row"] = NonTensorData(dict(row))
        elem["group_id"] = torch.tensor(group_id, dtype=torch.long)
        obs = env.reset(elem.unsqueeze(0))
        traj = TrajectoryBuilder()
        total, turns, truncated = 0.0, 0, 0.0
        while turns < self.max_turns:
            prompt_ids = obs[0]["tokens", "prompt"].tolist()
            try:
                traj.add_prompt(prompt_ids)  # only the tokens the env appended are new (masked out)
            except ValueError as exc:
                raise RuntimeError(f"episode {rid}: the env's {exc}") from None
            resp = await engine.agenerate(LLMRequest(input_ids=prompt_ids, sampling=self.sampling, rid=rid))
            traj.add_generated(resp)
            turns += 1
            truncated = float(resp.stop_reason == "length")
            text = env.tokenizer.decode(resp.output_tokens, skip_special_tokens=True)
            act = obs.unbind(0)[0]
            act["history"].full = act["history"].prompt.append(
                History(role="assistant", content=text, is_complete=torch.tensor(not truncated)))
            act["tokens", "full"] = torch.tensor(prompt_ids + resp.output_tokens, dtype=torch.long)
            act["tokens", "response"] = torch.tensor(resp.output_tokens, dtype=torch.long)
            stepped = await asyncio.to_thread(env.step, act.unsqueeze(0))  # rewards may block (verifiers)
            nxt = stepped[0]["next"]
            total += float(nxt.get("reward", torch.zeros(1, 1)).sum())
            if bool(nxt["done"].any()):
                break
            obs = env.step_mdp(stepped)
        components = {k: float(nxt[k].reshape(-1)[0]) for k in nxt.keys()  # those of the last step
                      if isinstance(k, str) and k not in _NOT_COMPONENTS and isinstance(nxt.get(k), torch.Tensor)
                      and nxt.get(k).is_floating_point()}
        return traj.build(total, group_id, truncated=truncated, num_turns=float(turns), **components)
