"""An episode's reward: the environment's own, plus TRL-style reward functions that read the environment.

TRL's contract (`GRPOTrainer(reward_funcs=..., environment_factory=...)`): a reward function is called with lists,
one item per completion, `prompts`, `completions` (each the list of messages after the prompt), `completion_ids`,
`environments` (the instances the episodes played) and every row field, and returns a list of floats (None: not
applicable to that completion, left out of the sum). Here each episode is scored alone, so every list has one item.
The environment's own reward (an OpenEnv episode's sum of `obs.reward`, a TRL class's `get_reward()`) is added with
weight 1, as TRL adds `get_reward` (an environment without a reward of its own needs a reward function: the task
refuses it before start). The workflow calls `EpisodeReward` through a `RewardCaller` (timeouts, failed
samples by cause, counters), with the environment and the transcript as keywords.
"""
from __future__ import annotations

import inspect
import math
from typing import Any, Callable, Sequence


def _component(fn: Callable[..., Any], i: int) -> str:
    name = getattr(fn, "__name__", "") or f"fn{i}"
    return f"reward_{name}" if name.isidentifier() and name != "<lambda>" else f"reward_fn{i}"


class EpisodeReward:
    """`reward(prompt, completion, prompt_ids, completion_ids, *, environment, env_reward, transcript, **row)` ->
    {"reward": env_reward + sum(w_i * f_i), "env_reward": ..., "reward_<f_i name>": f_i's value}."""

    def __init__(self, reward_funcs: Sequence[Callable[..., Any]] = (), weights: Sequence[float] = ()) -> None:
        self.reward_funcs = tuple(reward_funcs)
        self.weights = tuple(weights) or (1.0,) * len(self.reward_funcs)
        if len(self.weights) != len(self.reward_funcs):
            raise ValueError(f"{len(self.weights)} reward weights for {len(self.reward_funcs)} reward functions")
        self.names = [_component(f, i) for i, f in enumerate(self.reward_funcs)]
        self.component_keys = ("env_reward", *self.names)
        """Declared for `RewardCaller`: every trajectory carries the same components."""
        self.__name__ = "EpisodeReward"

    async def __call__(self, prompt: str, completion: str, prompt_ids: list[int], completion_ids: list[int], *,
                       environment: Any, env_reward: float | None, transcript: dict[str, list], **row: Any) -> dict:
        total = 0.0 if env_reward is None else float(env_reward)
        out = {"env_reward": total}
        columns = {k: [v] for k, v in row.items()}
        for name, weight, fn in zip(self.names, self.weights, self.reward_funcs):
            value = fn(prompts=[transcript["prompt"]], completions=[transcript["completion"]],
                       completion_ids=[list(completion_ids)], environments=[environment], trainer_state=None,
                       **columns)
            if inspect.isawaitable(value):
                value = await value
            if not isinstance(value, Sequence) or len(value) != 1:
                raise ValueError(f"reward function {name[len('reward_'):]} returned {value!r:.80}; TRL's contract is a "
                                 "list with one reward per completion (here 1)")
            score = value[0]
            out[name] = math.nan if score is None else float(score)
            if score is not None:
                total += weight * float(score)
        out["reward"] = total
        return {k: (0.0 if math.isnan(v) else v) for k, v in out.items()}
