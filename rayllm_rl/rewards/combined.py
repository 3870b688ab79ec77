"""The reward the policy trains on: the task's rule, a reward model and a judge, combined by weights.

    reward = reward.rule_weight * rule + reward.model.weight * rm + reward.judge.weight * judge

`CombinedReward` is an AReaL-signature reward function, so every workflow and env takes it in place
of the task's rule. Each part is called through its own `RewardCaller` (its own timeout and
counters), all three at once: a part that raises, times out or returns garbage (NaN, a wrong shape,
an unreadable verdict) scores 0, logs a warning, counts in `reward_<part>_errors` /
`_timeouts` / `_nonfinite` and marks the trajectory failed (the `failed` key of data/failures.py,
the first failed part's cause; `rollout.on_failure` decides what it does), never crashing the
episode. Each trajectory carries the components
`reward_rule`, `reward_model`, `reward_model_failed`, `reward_judge`, `reward_judge_failed` (those of
the parts that are on) beside the rule's own, so each step's record logs their batch means (the
`_failed` means are the share of that step's completions whose part failed); `counters()` adds the
totals to the summary's `reward_failures`.
"""
from __future__ import annotations

import asyncio
from typing import Any, Callable, Mapping

from rayllm_rl.data.failures import FAILED_KEY, score_failure
from rayllm_rl.rewards.config import RewardConfig
from rayllm_rl.workflows.rewards import RewardCaller, component_keys_of

RULE_TIMEOUT_S = 30.0
"""Timeout of the task's rule reward inside the combination (RLVRWorkflow's default)."""


def _part_reward(name: str, scorer: Any) -> Callable[..., Any]:
    """A part scorer (`async score(prompt, completion, row) -> float`) as a reward function that also says
    it succeeded: RewardCaller's failure result has `ok` 0.0."""
    async def part(prompt: str, completions: str, prompt_ids: list[int], completion_ids: list[int], **row: Any):
        return {"reward": await scorer.score(prompt, completions, row), "ok": 1.0}

    part.__name__ = f"reward.{name}"
    part.component_keys = ("ok",)  # declared: a failure before any success still reads ok = 0.0
    return part


class CombinedReward:
    """rule_weight * rule(...) + sum of weight * part.score(...), with per-part components and counters."""

    bounds_own_time = True
    """Each part has its own timeout: the workflow's RewardCaller adds none around the sum."""

    def __init__(self, rule_fn: Callable[..., Any], rule_weight: float, parts: Mapping[str, tuple[float, Any, float]]):
        """`parts`: name -> (weight, scorer, timeout_s); a scorer has `async score(prompt, completion, row)`."""
        self.rule = RewardCaller(rule_fn, timeout_s=RULE_TIMEOUT_S)
        self.rule_weight = float(rule_weight)
        self.weights = {name: float(w) for name, (w, _, _) in parts.items()}
        self.scorers = {name: scorer for name, (_, scorer, _) in parts.items()}
        self.callers = {name: RewardCaller(_part_reward(name, scorer), timeout_s=timeout)
                        for name, (_, scorer, timeout) in parts.items()}
        own = ("reward_rule", *(k for name in parts for k in (f"reward_{name}", f"reward_{name}_failed")))
        rule_keys = component_keys_of(rule_fn)
        self.component_keys = (*rule_keys, *own) if rule_keys else ()
        """Declared when the rule declares its own; else the workflow learns them from the first result."""

    @classmethod
    def from_config(cls, cfg: RewardConfig, rule_fn: Callable[..., Any],
                    scorers: Mapping[str, Any]) -> "CombinedReward":
        """The combination `cfg` asks for over the backend's `scorers` ({"model": ..., "judge": ...})."""
        missing = [name for name in cfg.parts() if name not in scorers]
        if missing:
            raise ValueError(f"reward.{missing[0]} is on but the backend provided no scorer for it")
        return cls(rule_fn, cfg.rule_weight, {name: (weight, scorers[name], getattr(cfg, name).timeout_s)
                                              for name, weight in cfg.parts().items()})

    async def __call__(self, prompt: str, completions: str, prompt_ids: list[int], completion_ids: list[int],
                       **row: Any) -> dict[str, float]:
        args = (prompt, completions, prompt_ids, completion_ids)
        names = list(self.callers)
        rule, *scored = await asyncio.gather(self.rule.score(*args, **row),
                                             *[self.callers[n].score(*args, **row) for n in names])
        out = {k: v for k, v in rule.items() if k != "reward"}
        out["reward_rule"] = rule["reward"]
        total = self.rule_weight * rule["reward"]
        for name, result in zip(names, scored):
            out[f"reward_{name}"] = result["reward"]
            out[f"reward_{name}_failed"] = 1.0 - result["ok"]
            total += self.weights[name] * result["reward"]
            if score_failure(result) and not score_failure(out):  # the rule's own failure (in `out`) comes first
                out[FAILED_KEY] = score_failure(result)
        return {"reward": total, **out}

    def counters(self) -> dict[str, int]:
        """Failures of each part (`reward_model_errors`, `reward_judge_timeouts`, ..., `reward_judge_unparsed`)
        and of the rule (added to the workflow's own `reward_errors` etc.)."""
        rule = self.rule.counters()
        out = {k: v for k, v in rule.items() if k != "reward_calls"}
        for name, caller in self.callers.items():
            out.update({f"reward_{name}_{k.removeprefix('reward_')}": v for k, v in caller.counters().items()})
            extra = getattr(self.scorers[name], "counters", None)
            out.update(extra() if callable(extra) else {})
        return out
