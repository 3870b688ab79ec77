"""Your reward and your rows reach the job: a reward defined inside the test (no worker could import it) and a
`datasets.Dataset` given to `train()` / `GRPOTrainer`, on the local backend and in Ray env workers (shipped by
value), scoring every sample of a short run. That they teach the model: test_examples' user_reward example. A
reward by import path: test_examples (`jobs/grpo.py`), test_ray_job_submit (on Ray)."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from ray_sessions import JOB_ENV, local_ray_session

pytestmark = pytest.mark.slow

TAGGED_EVERY = 4
"""One demonstration in this many puts the answer in <answer> tags; the others give the bare number. The warm
start so leaves a policy that tags about a third to a half of its answers, on any prompt."""

HELD_OUT = "held-out share of greedy answers in <answer> tags (30 sums never trained on)"
"""What carries over to prompts GRPO never saw. The user's reward pays 0.5 for an answer in tags and 0.5 more for
the right one: GRPO teaches the tags, which carry over, while this tiny model gets few unseen sums right in a minute
(the `right` share stays ~0.1). Measured on a loaded 2-core machine: local backend, seeds 0-2, held-out reward +0.25,
+0.32, +0.32 (the tagged share 0.4-0.5 -> 1.0, the training reward ~0.11 -> ~0.39); Ray backend, seed 0, +0.23. The
tagged share is a mean of 30 binary item scores, so its rise is judged by a sign test over the items
(`assert_greedy_gain`), in the worst case its two means allow (every item tagged after: none lost its tags)."""


def arithmetic_datasets(max_operand: int = 9, eval_size: int = 30):
    """(train, held-out) `datasets.Dataset`s of the user's shape: messages, answer, and a demonstration column;
    every (a, b) pair is in one of them only (the built-in arithmetic pairs)."""
    from datasets import Dataset

    from rayllm_rl.envs.arithmetic import make_arithmetic_splits

    def user_rows(ds):
        return Dataset.from_list([{"messages": r["messages"], "answer": r["answer"],
                                   "demo": f"<answer>{r['answer']}</answer>" if i % TAGGED_EVERY == 0 else r["answer"]}
                                  for i, r in enumerate(ds)])

    train, held = make_arithmetic_splits(max_operand=max_operand, eval_size=eval_size)
    return user_rows(train), user_rows(held)


def rl_records(summary) -> list[dict]:
    lines = (Path(summary["run_dir"]) / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["phase"] == "rl"]


def assert_scored_by_the_users_reward(summary, steps: int) -> None:
    """Every step ran the user's reward on every sample, with no error, and logged its components as the closure
    computed them: reward = (tagged + right) / 2, right <= tagged (a step's means keep both). The held-out rows were
    scored before and after with the same reward."""
    rl = rl_records(summary)
    assert len(rl) == steps and summary["failed_episodes"] == 0
    calls = summary["reward_failures"]
    assert calls["reward_calls"] >= steps * 8 * 8 and calls["reward_errors"] == calls["reward_timeouts"] == 0, calls
    for r in rl:
        assert 0 <= r["right"] <= r["tagged"] <= 1 and r["reward"] == pytest.approx((r["tagged"] + r["right"]) / 2)
    assert summary["eval_prompts"] == 30
    assert {"eval_reward", "eval_tagged", "eval_right"} <= set(summary["eval_before"]) & set(summary["eval_after"])


SHORT = ["data.sft_column=demo", "sft.steps=10", "sft.batch_size=32", "sft.lr=1e-3", "rollout.prompts_per_step=8",
         "rollout.group_size=8", "rollout.max_new_tokens=8", "trainer.steps=4", "optim.lr=2e-4", "trainer.eval_every=0",
         "trainer.log_every=1000", "trainer.call_timeout_s=120"]
"""A short warm start on the demonstration column, then 4 GRPO steps: what these tests show is the reward and the
rows reaching the job (as objects, by value to the workers); that the same reward teaches the same rows is
test_examples' user_reward example (60 SFT and 60 GRPO steps, `HELD_OUT`'s bounds), and that the Ray backend learns
is test_ray_pipeline's."""


def graded_reward():
    """The user's reward, made inside a function: pickled by value, as one defined in a notebook is."""
    answer_re = re.compile(r"<answer>\s*(-?\d+)\s*</answer>")

    def graded(prompt, completion, prompt_ids, completion_ids, answer, **columns):
        m = answer_re.search(completion)
        tagged, right = float(m is not None), float(m is not None and m.group(1) == str(answer))
        return {"reward": 0.5 * tagged + 0.5 * right, "tagged": tagged, "right": right}

    return graded


def test_a_reward_defined_in_the_test_trains_on_the_local_backend(tmp_path):
    """TRL's front door, one process: the reward and the datasets are objects (`SHORT`)."""
    from rayllm_rl import GRPOTrainer

    train_rows, held = arithmetic_datasets()
    summary = GRPOTrainer(reward_funcs=graded_reward(), train_dataset=train_rows, eval_dataset=held,
                          args=[*SHORT, "trainer.backend=local", f"trainer.run_dir={tmp_path}"]).train()
    assert summary["backend"] == "local"
    assert_scored_by_the_users_reward(summary, 4)


@pytest.mark.ray
def test_a_reward_defined_in_the_test_reaches_the_ray_env_workers_by_value_and_trains(tmp_path):
    """The env worker gets the task's worker part in its constructor arguments: the reward is a closure of this
    test, which no worker process can import, and it scores every episode there (`reward_calls` are counted by
    the env workers), its components logged each step (`SHORT`)."""
    import ray

    from rayllm_rl import train

    graded = graded_reward()
    assert "<locals>" in graded.__qualname__
    train_rows, held = arithmetic_datasets()
    with local_ray_session("test_user_task_jobs", num_cpus=2, runtime_env={"env_vars": JOB_ENV}):
        summary = train(overrides=[*SHORT, f"trainer.run_dir={tmp_path}", "ray.sync_timeout_s=60"],
                        reward_fn=graded, train_dataset=train_rows, eval_dataset=held)
        assert ray.is_initialized()  # the session's Ray, left running by the job
    assert summary["backend"] == "ray"
    assert_scored_by_the_users_reward(summary, 4)
