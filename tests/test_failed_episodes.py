"""A failed episode is not a zero (issue Y, item 3): a workflow, an engine request or a reward that raises, hangs or
loses its server gives failed samples, counted by cause, and `rollout.on_failure` decides what their group does.

The advantages of a group of 4 with one failed sample (rewards 1, 0, 1 and a reward that raised) are derived here by
hand under each policy and compared with what the job's advantage stage computes on the stored episode. The tiny
model's real engine and the real RLVR / grouped workflows run; fakes only reach a failure (a reward that raises on
its 4th call, an engine request that loses its connection, an episode that never returns)."""
from __future__ import annotations

import asyncio
import json
import math
import typing
from pathlib import Path

import pytest
import torch
from datasets import Dataset

from rayllm_rl.config import ConfigError, load_config
from rayllm_rl.data.failures import CAUSES, FAILED_KEY, cause_of, code_of
from rayllm_rl.data.loader import PromptLoader
from rayllm_rl.inference.protocol import SamplingParams
from rayllm_rl.job.config import GRPOJobConfig, RolloutConfig
from rayllm_rl.objectives.advantages import AdvantageConfig, compute_advantages
from rayllm_rl.rollout.collector import LLMCollector, run_and_store
from rayllm_rl.rollout.failures import ON_FAILURE, POLICIES, FailurePolicy, run_group
from rayllm_rl.rollout.staleness import StalenessController
from rayllm_rl.workflows.grouped import GroupedWorkflow
from rayllm_rl.workflows.multi_turn import MultiTurnWorkflow
from rayllm_rl.workflows.rewards import RewardCaller
from rayllm_rl.workflows.rlvr import RLVRWorkflow
from rollout_helpers import collect_batch

ROW = {"messages": [{"role": "user", "content": "What is 2+3?"}], "answer": "5", "group_id": 7}
SAMPLING = SamplingParams(max_new_tokens=4)
EPS = AdvantageConfig().eps  # GRPO's default: group mean, population std, + eps


def in_order(rewards):
    """An async reward returning `rewards[k]` on its k-th call (raising where the entry is an exception). The RLVR
    workflow scores a group's completions as tasks started in row order, so call k scores row k."""
    calls = []

    async def reward(prompt, completion, prompt_ids, completion_ids, **row):
        calls.append(completion)
        value = rewards[len(calls) - 1]
        if isinstance(value, BaseException):
            raise value
        return value

    reward.calls = calls
    return reward


def store(workflow, engine, policy: str, row=ROW, **rules):
    """Run `row` under `policy` through the collector's runner; (what it stored or None, its outcome)."""
    stored = []

    async def put(td):
        stored.append(td)

    outcome = asyncio.run(run_and_store(workflow, engine, dict(row), put, None,
                                        FailurePolicy(policy, **{"group_size": 4, "resample_budget": 1, **rules})))
    assert len(stored) == int(outcome.accepted)
    return (stored[0] if stored else None), outcome


def advantages(td) -> list[float]:
    return compute_advantages(td["rewards"], td["group_id"], AdvantageConfig()).tolist()


def by_hand(rewards: list[float]) -> list[float]:
    """(r - mean) / (population std + eps), written out."""
    n = len(rewards)
    mean = sum(rewards) / n
    std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / n)
    return [(r - mean) / (std + EPS) for r in rewards]


# ---------------------------------------------------------------- one failed sample, by hand, under each policy
@pytest.fixture()
def group_of_four(engine, tokenizer):
    """A group of 4 whose 4th reward raises; a re-run's sample (the 5th call) scores 1."""
    reward = in_order([1.0, 0.0, 1.0, RuntimeError("checker crashed"), 1.0])
    return RLVRWorkflow(reward, tokenizer, SAMPLING, group_size=4), reward


def test_zero_keeps_the_failed_sample_as_a_0_in_the_group(group_of_four, engine):
    wf, _ = group_of_four
    td, outcome = store(wf, engine, "zero")
    # mean over 4 = (1 + 0 + 1 + 0) / 4 = 0.5; population std = sqrt(4 * 0.25 / 4) = 0.5
    assert td["rewards"].tolist() == [1.0, 0.0, 1.0, 0.0] and FAILED_KEY not in td.keys()
    expected = [0.5 / (0.5 + EPS), -0.5 / (0.5 + EPS), 0.5 / (0.5 + EPS), -0.5 / (0.5 + EPS)]
    assert advantages(td) == pytest.approx(expected, abs=1e-6) == by_hand([1.0, 0.0, 1.0, 0.0])
    assert outcome.failures == {"reward_raised": 1} and not outcome.dropped


def test_drop_takes_the_groups_statistics_over_the_finished_samples(group_of_four, engine):
    wf, _ = group_of_four
    td, outcome = store(wf, engine, "drop")
    # the failed row is gone: mean over 3 = 2/3; population std = sqrt(((1/3)^2 * 2 + (2/3)^2) / 3) = sqrt(2) / 3
    assert td["rewards"].tolist() == [1.0, 0.0, 1.0]
    std = math.sqrt(2) / 3
    expected = [(1 / 3) / (std + EPS), -(2 / 3) / (std + EPS), (1 / 3) / (std + EPS)]
    assert advantages(td) == pytest.approx(expected, abs=1e-6)
    assert expected[0] == pytest.approx(0.7071, abs=1e-4)  # 1/sqrt(2): not the 1.0 `zero` gives the same row
    assert outcome.failures == {"reward_raised": 1} and outcome.resampled == 0


def test_drop_group_trains_on_nothing_of_the_group(group_of_four, engine):
    wf, reward = group_of_four
    td, outcome = store(wf, engine, "drop_group")
    assert td is None and outcome.dropped and not outcome.accepted
    assert outcome.failures == {"reward_raised": 1} and len(reward.calls) == 4


def test_resample_runs_the_missing_sample_again_and_the_group_is_whole(group_of_four, engine):
    wf, reward = group_of_four
    td, outcome = store(wf, engine, "resample")
    # the re-run generated one sample (num_samples=1): its reward, the 5th call, is 1
    assert len(reward.calls) == 5 and outcome.resampled == 1
    assert td["rewards"].tolist() == [1.0, 0.0, 1.0, 1.0] and td["group_id"].tolist() == [7] * 4
    # mean = 3/4; population std = sqrt((3 * 0.25^2 + 0.75^2) / 4) = sqrt(0.1875)
    std = math.sqrt(0.1875)
    expected = [0.25 / (std + EPS), -0.75 / (std + EPS), 0.25 / (std + EPS), 0.25 / (std + EPS)]
    assert advantages(td) == pytest.approx(expected, abs=1e-6)
    assert outcome.failures == {"reward_raised": 1} and outcome.accepted


def test_resample_falls_back_to_drop_and_drop_needs_min_finished(engine, tokenizer):
    boom = RuntimeError("down")
    always = in_order([1.0] + [boom] * 6)  # the re-run's samples fail too
    td, outcome = store(RLVRWorkflow(always, tokenizer, SAMPLING, group_size=4), engine, "resample",
                        min_finished=1)
    assert td["rewards"].tolist() == [1.0] and outcome.failures == {"reward_raised": 3 + 3}
    assert outcome.resampled == 3 and len(always.calls) == 7  # 4, then the 3 missing once (budget 1)
    few = in_order([1.0, boom, boom, boom])
    td, outcome = store(RLVRWorkflow(few, tokenizer, SAMPLING, group_size=4), engine, "drop")  # min_finished 2
    assert td is None and outcome.dropped and outcome.failures == {"reward_raised": 3}


# ---------------------------------------------------------------- workflows and engines that fail
class FailsOn:
    """A single-trajectory workflow that raises or hangs on the calls named, else runs `inner` (a real one)."""

    def __init__(self, inner, raise_on=(), hang_on=()):
        self.inner, self.raise_on, self.hang_on, self.calls = inner, set(raise_on), set(hang_on), 0

    async def arun_episode(self, engine, data):
        self.calls += 1
        if self.calls in self.raise_on:
            raise ValueError("env step crashed")
        if self.calls in self.hang_on:
            await asyncio.sleep(3600)
        return await self.inner.arun_episode(engine, data)


class LosesServerOn:
    """The engine, except that its `n`-th request fails as a dropped connection does."""

    def __init__(self, engine, n: int):
        self.engine, self.n, self.requests = engine, n, 0

    @property
    def version(self):
        return self.engine.version

    async def agenerate(self, req):
        self.requests += 1
        if self.requests == self.n:
            raise ConnectionResetError("inference server went away")
        return await self.engine.agenerate(req)


def test_a_sample_that_raises_or_hangs_fails_alone(engine, tokenizer):
    inner = MultiTurnWorkflow(lambda *a, **k: 1.0, tokenizer, SAMPLING)
    asyncio.run(inner.arun_episode(engine, ROW))  # warm: the samples that finish do so well within the bound
    grouped = GroupedWorkflow(FailsOn(inner, raise_on={2}, hang_on={3}), group_size=4, timeout_s=6.0)
    td, outcome = store(grouped, engine, "drop")
    assert outcome.failures == {"raised": 1, "timeout": 1} and td["rewards"].tolist() == [1.0, 1.0]


def test_the_multi_turn_workflow_of_a_job_bounds_each_sample_by_rollout_sample_timeout_s(engine, tokenizer):
    """`rollout.workflow=multi_turn` with `rollout.sample_timeout_s`: the job's workflow fails the one sample that
    hangs (cause `timeout`) and trains on the others; without it only the attempt's bound applies."""
    from rayllm_rl.orchestration.factories import build_task, build_workflow

    cfg = cfg_of("task=arithmetic", "data.eval_size=1", "rollout.workflow=multi_turn", "rollout.group_size=4",
                 "rollout.max_turns=2", "rollout.max_new_tokens=4", "rollout.sample_timeout_s=6")
    task = build_task(cfg)
    workflow = build_workflow(cfg, task, tokenizer)
    assert isinstance(workflow, GroupedWorkflow) and workflow.timeout_s == 6.0
    assert build_workflow(cfg_of("task=arithmetic", "rollout.workflow=multi_turn"), task, tokenizer).timeout_s is None
    row = {**task.train[0], "group_id": 7}
    asyncio.run(workflow.workflow.arun_episode(engine, row))  # warm: the samples that finish do so well within it
    workflow.workflow = FailsOn(workflow.workflow, hang_on={3})  # the job's own agent, its third sample hanging
    td, outcome = store(workflow, engine, "drop", row=row)
    assert outcome.failures == {"timeout": 1} and td["rewards"].shape[0] == 3


def test_a_lost_server_fails_its_request_alone(engine, tokenizer):
    wf = RLVRWorkflow(lambda *a, **k: 1.0, tokenizer, SAMPLING, group_size=4)
    td, outcome = store(wf, LosesServerOn(engine, 2), "drop")
    assert outcome.failures == {"server_lost": 1} and td["rewards"].tolist() == [1.0, 1.0, 1.0]


def test_a_chat_env_whose_reward_raises_marks_that_conversation_failed(engine, tokenizer):
    """The env path: the env's RewardTransform scores through a RewardCaller; its failure reaches the trajectory
    as the `failed` key (a component of the last step), and `drop` keeps the conversations that finished."""
    from rayllm_rl.envs.dataset_envs import DatasetChatEnv
    from rayllm_rl.workflows.chat_env_workflow import ChatEnvWorkflow

    rows = [{"question": "What is 2+3?", "answer": "5"}]
    caller = RewardCaller(in_order([1.0, RuntimeError("verifier crashed"), 0.0]))  # one caller, as a task shares it
    wf = ChatEnvWorkflow(lambda: DatasetChatEnv(Dataset.from_list(rows), tokenizer, reward_fn=caller,
                                                prompt_key="question"), SAMPLING, group_size=3)
    td = asyncio.run(wf.arun_episode(engine, {**rows[0], "group_id": 5}))  # which conversation is 2nd: any
    assert sorted(td["failed"].tolist()) == [0.0, 0.0, code_of("reward_raised")]
    assert sorted(td["rewards"][td["failed"] == 0].tolist()) == [0.0, 1.0]
    caller.reward_fn = in_order([1.0, RuntimeError("verifier crashed"), 0.0])
    stored, outcome = store(wf, engine, "drop", row={**rows[0], "group_id": 6}, group_size=3)
    assert outcome.failures == {"reward_raised": 1} and sorted(stored["rewards"].tolist()) == [0.0, 1.0]


def test_an_episode_that_raises_or_hangs_fails_its_whole_group():
    class Raises:
        group_size = 3

        async def arun_episode(self, engine, data):
            raise RuntimeError("sandbox crashed")

    class Hangs(Raises):
        async def arun_episode(self, engine, data):
            await asyncio.sleep(3600)

    for wf, cause, error in ((Raises(), "raised", "RuntimeError: sandbox crashed"),
                             (Hangs(), "timeout", "TimeoutError: no episode within 0.2s (rollout.episode_timeout_s)")):
        got = asyncio.run(run_group(wf, None, dict(ROW), FailurePolicy("resample", 3, 2, 1, attempt_timeout_s=0.2)))
        # the run and its one re-run each failed all 3 samples
        assert (got.episode, got.causes, got.resampled, got.dropped, got.error) == (None, {cause: 6}, 3, True, error)


def test_causes_of_exceptions():
    class RayActorError(Exception):  # Ray's class, as this layer sees it: by name
        pass

    lost = RuntimeError("its env worker died 3 times")
    lost.__cause__ = RayActorError("actor died")
    assert [cause_of(e) for e in (TimeoutError(), asyncio.TimeoutError(), ConnectionRefusedError(), lost,
                                  ValueError("x"))] == ["timeout", "timeout", "server_lost", "server_lost", "raised"]
    assert [code_of(c) for c in CAUSES] == list(range(1, len(CAUSES) + 1))
    with pytest.raises(ValueError, match="unknown failure cause 'oops'"):
        code_of("oops")


# ---------------------------------------------------------------- the collector counts by cause and goes on
def test_the_collector_counts_reward_failures_by_cause_and_finishes(engine, tokenizer):
    async def reward(prompt, completion, prompt_ids, completion_ids, mode, **row):
        if mode == "raise":
            raise RuntimeError("judge unreachable")
        if mode == "hang":
            await asyncio.sleep(60)
        return 1.0

    rows = [{"messages": ROW["messages"], "answer": "5", "mode": m} for m in ("ok", "raise", "hang", "ok")]
    wf = RLVRWorkflow(reward, tokenizer, SAMPLING, group_size=2, reward_timeout_s=0.2)
    loader = PromptLoader(Dataset.from_list(rows), shuffle=False)
    batch, stats = asyncio.run(collect_batch(engine, wf, loader, 2, failures=FailurePolicy("drop_group", 2)))
    assert batch["rewards"].tolist() == [1.0] * 4
    assert (stats["failed_episodes/reward_raised"], stats["failed_episodes/reward_timeout"]) == (2, 2)
    assert (stats["failed_episodes"], stats["dropped_groups"], stats["finished_episodes"]) == (4, 2, 2)


def test_groups_lost_in_a_row_end_the_run_naming_the_error():
    class Broken:
        group_size = 2

        async def arun_episode(self, engine, data):
            raise KeyError("no such tool")

    async def run():
        async def put(td):
            raise AssertionError("nothing is stored")

        collector = LLMCollector(PromptLoader(Dataset.from_list([{"q": 1}]), shuffle=False),
                                 lambda row: run_and_store(Broken(), None, row, put, None, FailurePolicy("drop", 2)),
                                 StalenessController(2, 0), max_consecutive_failures=3)
        with pytest.raises(RuntimeError, match=r"[34] consecutive episodes failed; last: KeyError: 'no such tool'"):
            await asyncio.wait_for(collector.run(), 30)
        return collector.stats()

    stats = asyncio.run(run())
    assert stats["dropped_groups"] >= 3 and stats["failed_episodes/raised"] == 2 * stats["dropped_groups"]


# ---------------------------------------------------------------- config
def cfg_of(*overrides: str) -> GRPOJobConfig:
    return load_config(GRPOJobConfig, list(overrides))


def test_the_policies_are_the_configs_values_and_resample_is_the_default():
    allowed = typing.get_args(typing.get_type_hints(RolloutConfig)["on_failure"])
    assert allowed == ON_FAILURE == tuple(POLICIES) and RolloutConfig().on_failure == "resample"


@pytest.mark.parametrize("overrides, message", [
    (["rollout.on_failure=bogus"], r"rollout.on_failure.*'bogus' is not one of \('resample', 'drop', 'drop_group', "
                                   r"'zero'\)"),
    (["rollout.on_failure=drop", "rollout.resample_budget=3"],
     r"rollout.resample_budget=3 applies to rollout.on_failure=resample only, not 'drop'"),
    (["rollout.resample_budget=0"], r"rollout.resample_budget=0 never resamples: set rollout.on_failure=drop"),
    (["rollout.on_failure=zero", "rollout.min_finished=2"], r"rollout.min_finished=2 applies to .*not 'zero'"),
    (["rollout.group_size=4", "rollout.min_finished=5"], r"rollout.min_finished=5 is more than rollout.group_size=4"),
    (["rollout.episode_timeout_s=30", "rollout.sample_timeout_s=30"],
     r"rollout.sample_timeout_s=30 must be under rollout.episode_timeout_s=30"),
])
def test_bad_failure_settings_fail_at_config_time(overrides, message):
    with pytest.raises((ConfigError, ValueError), match=message):
        cfg_of(*overrides)


def test_the_plan_resolves_the_failure_policy():
    from rayllm_rl.job.plan import make_plan

    plan = make_plan(cfg_of("rollout.group_size=4", "trainer.call_timeout_s=90"), environment=False)
    assert plan.failure_policy() == FailurePolicy("resample", 4, 2, 2, 90.0)
    assert plan.failure_policy().deadline_s == 3 * 90.0
    plan = make_plan(cfg_of("rollout.group_size=1", "rollout.on_failure=drop", "rollout.episode_timeout_s=5"),
                     environment=False)
    assert plan.failure_policy() == FailurePolicy("drop", 1, 1, 2, 5.0) and plan.failure_policy().deadline_s == 5.0
    with pytest.raises(ValueError, match=r"rollout.on_failure='nope': allowed values are \['resample', 'drop'"):
        FailurePolicy("nope")


# ---------------------------------------------------------------- a job whose reward raises on some calls
@pytest.mark.slow
def test_a_job_whose_reward_raises_sometimes_finishes_and_records_failures_by_cause(tmp_path, small_job_cfg):
    """The local backend, 3 steps: a user reward raising on every 5th call never scores 0; each step's record
    counts the failed samples by cause, and the run ends."""
    from rayllm_rl import train
    from rayllm_rl.envs.arithmetic import make_arithmetic_splits

    train_rows, held = make_arithmetic_splits(max_operand=9, eval_size=16)
    calls = []

    def flaky(prompt, completion, prompt_ids, completion_ids, **columns):
        calls.append(1)
        if len(calls) % 5 == 0:
            raise RuntimeError("grader timed out upstream")
        return float("<answer>" in completion)

    summary = train(small_job_cfg("trainer.backend=local", "trainer.steps=3", "rollout.on_failure=drop", "sft.steps=0"),
                    reward_fn=flaky, train_dataset=train_rows, eval_dataset=held)
    records = [json.loads(line) for line in (Path(summary["run_dir"]) / "metrics.jsonl").read_text().splitlines()]
    rl = [r for r in records if r["phase"] == "rl"]
    assert summary["steps"] == 3 and len(rl) == 3
    raised = [r.get("failed_episodes/reward_raised", 0) for r in rl]
    assert raised[-1] > 0 and raised == sorted(raised)  # totals so far, step by step
    assert summary["episode_failures"]["failed_episodes/reward_raised"] == summary["failed_episodes"] >= raised[-1]
    # the reward's own counter counts its calls, the evaluations' too (they share the user's function)
    assert summary["reward_failures"]["reward_errors"] >= summary["failed_episodes"]
    assert all(r["seqs"] <= 4 * 4 for r in rl) and any(r["seqs"] < 4 * 4 for r in rl)  # failed rows not trained on
    assert all(torch.isfinite(torch.tensor(r["reward"])) for r in rl)
