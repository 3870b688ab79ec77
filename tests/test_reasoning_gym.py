"""task=reasoning_gym: rows from reasoning-gym's generators with distinct train and eval seeds and no eval
question among the training questions, its own scorer on the answer a real model writes, config errors that
name the key, and the task running through the driver's workflows (rlvr, env, multi_turn)."""
from __future__ import annotations

import json

import pytest

from rayllm_rl.config import apply_dict, parse_overrides
from rayllm_rl.envs.reasoning_gym_task import ReasoningGymConfig, make_splits, messages
from rayllm_rl.job.config import GRPOJobConfig
from rayllm_rl.rewards.reasoning_gym import ReasoningGymReward, extract_answer

CHAIN = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2}


def job(*overrides: str) -> GRPOJobConfig:
    return apply_dict(GRPOJobConfig(), parse_overrides(["task=reasoning_gym", *overrides]))


def test_rows_have_distinct_seeds_and_no_eval_question_in_training():
    cfg = ReasoningGymConfig(dataset="chain_sum", options=dict(CHAIN), train_size=3000, seed=5, eval_seed=6,
                             instruction="Answer with a number.")
    train, held = make_splits(cfg, 200)
    assert len(held) == 200 and {r["rg_seed"] for r in held} == {6} and {r["rg_seed"] for r in train} == {5}
    eval_questions = {r["question"] for r in held}
    assert not eval_questions & {r["question"] for r in train}
    assert len({r["question"] for r in train}) == len(train)  # no repeats either
    assert 1000 < len(train) < 3000  # chain_sum draws many one-digit pairs again: repeats and eval questions go
    row = train[0]
    assert row["messages"] == [{"role": "user", "content": row["question"] + " Answer with a number."}]
    again, _ = make_splits(cfg, 200)
    assert again[:5] == train[:5]  # deterministic from the seeds
    assert make_splits(ReasoningGymConfig(dataset="chain_sum", options=dict(CHAIN), train_size=50, seed=5,
                                          eval_seed=6), 32)[1]["question"] == held["question"][:32]


def test_a_question_space_too_small_for_the_sizes_fails_clearly():
    tiny = ReasoningGymConfig(dataset="chain_sum", options={"min_terms": 2, "max_terms": 2, "min_digits": 1,
                                                             "max_digits": 1}, train_size=5000)
    with pytest.raises(ValueError, match="question space is too small"):
        make_splits(tiny, 200)


@pytest.mark.parametrize("completion, answer, tagged", [
    ("The answer is -4.", "-4", False),
    ("5 - 9 = -4", "-4", False),
    ("First 5 - 9, so <answer> -4 </answer>. Done, 7 steps.", "-4", True),
    ("<answer>3</answer> then <answer>-4</answer>", "-4", True),
    ("It is 1,204 in total.", "1204", False),
    ("", None, False),
    ("no number here", None, False),
])
def test_extraction_takes_tags_then_the_last_number(completion, answer, tagged):
    assert extract_answer(completion, numeric=True) == (answer, tagged)


def test_non_numeric_answers_fall_back_to_the_last_line():
    assert extract_answer("Let me think.\nThe word reversed is:\n  olleh.  \n", numeric=False) == ("olleh", False)
    assert extract_answer("<answer>olleh</answer>", numeric=False) == ("olleh", True)


def test_reward_is_the_generators_own_scorer():
    cfg = ReasoningGymConfig(dataset="chain_sum", options=dict(CHAIN), train_size=100)
    _, held = make_splits(cfg, 8)
    row = held[0]
    reward = ReasoningGymReward("chain_sum", dict(CHAIN))
    right, wrong = row["answer"], str(int(row["answer"]) + 1)
    assert reward("p", f"{row['question']} {right}", **row) == {"reward": 1.0, "score": 1.0, "answer_tag": 0.0,
                                                               "answered": 1.0}
    assert reward("p", f"The answer is {wrong}.", **row)["reward"] == 0.0
    assert reward("p", "nothing", **row) == {"reward": 0.0, "score": 0.0, "answer_tag": 0.0, "answered": 0.0}
    shaped = ReasoningGymReward("chain_sum", dict(CHAIN), format_weight=0.25)
    assert shaped("p", f"<answer>{wrong}</answer>", **row) == {"reward": 0.25, "score": 0.0, "answer_tag": 1.0,
                                                               "answered": 1.0}
    assert shaped("p", f"<answer>{right}</answer>", **row)["reward"] == 1.25
    # gsm_symbolic scores partial credit its own way: the scorer is reasoning-gym's, not a copy of it
    gsm = ReasoningGymReward("gsm_symbolic", {})
    entry = gsm.entry(3, 10, 4)
    assert gsm.score(f"so {entry['answer']}", entry)["score"] == 1.0
    assert 0.0 < gsm.score("so 0", entry)["score"] < 0.1


def test_reward_refuses_rows_it_cannot_regenerate():
    reward = ReasoningGymReward("chain_sum", dict(CHAIN))
    with pytest.raises(ValueError, match="rg_seed"):
        reward("p", "1", question="q", answer="1")
    with pytest.raises(ValueError, match="regenerates as .* not the row's"):
        reward("p", "1", question="What is 1+1?", answer="2", rg_seed=1, rg_size=10, rg_index=0)


@pytest.mark.parametrize("overrides, match", [
    (["data.reasoning_gym.dataset=chainsum"], r"not a reasoning-gym generator; close ones: \['chain_sum'"),
    (["data.reasoning_gym.options.max_term=3"], r"options\.max_term: chain_sum has no such option .*'max_terms'"),
    (["data.reasoning_gym.options.max_terms=x"], r"options\.max_terms.*expected an int"),
    (["data.reasoning_gym.options.min_terms=4", "data.reasoning_gym.options.max_terms=2"],
     "max_terms must be >= min_terms"),
    (["data.reasoning_gym.eval_seed=1"], "seed and eval_seed are both 1"),
    (["data.path=x.jsonl"], r"data\.path='x\.jsonl' is not read by task=reasoning_gym"),
    (["task=gsm8k", "data.path=x.jsonl", "data.reasoning_gym.seed=5"], "read only by task=reasoning_gym"),
])
def test_config_errors_name_the_key(overrides, match):
    with pytest.raises(ValueError, match=match):
        job(*overrides).validate(environment=False)


def test_command_line_options_take_the_generators_types():
    cfg = job("data.reasoning_gym.options.max_terms=3", "data.reasoning_gym.options.allow_negation=true").validate(
        environment=False)
    assert cfg.data.reasoning_gym.options == {"max_terms": 3, "allow_negation": True}
    assert cfg.rollout.max_new_tokens == 512 and cfg.data.eval_size == 200  # the task's presets


def test_system_prompt_and_instruction():
    cfg = ReasoningGymConfig(system_prompt="Be brief.", instruction="Number only.")
    assert messages(cfg, "2 + 2 =") == [{"role": "system", "content": "Be brief."},
                                        {"role": "user", "content": "2 + 2 = Number only."}]


def test_eval_size_limits_an_eval_path_too(tmp_path):
    """data.eval_size is honoured for every task: with data.eval_path it takes a seeded sample of it."""
    from rayllm_rl.envs.task_registry import make_task

    train, held = tmp_path / "train.jsonl", tmp_path / "test.jsonl"
    train.write_text("".join(json.dumps({"question": f"q{i}", "answer": f"#### {i}"}) + "\n" for i in range(20)))
    held.write_text("".join(json.dumps({"question": f"t{i}", "answer": f"#### {i}"}) + "\n" for i in range(50)))
    cfg = apply_dict(GRPOJobConfig(), parse_overrides(["task=gsm8k", f"data.path={train}", f"data.eval_path={held}",
                                                       "data.eval_size=12"])).validate(environment=False)
    task = make_task(cfg.task, cfg.data, seed=0)
    assert len(task.train) == 20 and len(task.eval) == 12 and set(task.eval["question"]) <= {f"t{i}" for i in range(50)}


@pytest.mark.slow
@pytest.mark.parametrize("workflow", ["rlvr", "env", "multi_turn"])
def test_a_job_runs_the_task_in_each_workflow(workflow, tmp_path):
    """Two RL steps of the local backend on the tiny model: the rows reach the workflow, the reward components
    of reasoning-gym's scorer come back per step and in the eval."""
    from rayllm_rl.api.entry import train

    cfg = job(f"rollout.workflow={workflow}", "trainer.backend=local", "trainer.steps=2", "data.eval_size=4",
              "rollout.prompts_per_step=2", "rollout.group_size=2", "rollout.max_new_tokens=6",
              "data.reasoning_gym.train_size=200", f"trainer.run_dir={tmp_path}", "trainer.checkpoint_every=0",
              *(["rollout.max_turns=2"] if workflow != "rlvr" else []),
              "data.reasoning_gym.options.max_digits=2", "data.reasoning_gym.options.max_terms=2")
    summary = train(cfg)
    assert summary["steps"] == 2 and summary["eval_prompts"] == 4
    assert {"score", "answer_tag", "answered"} <= set(summary["eval_after"]) - {"eval_reward"} | {
        k.removeprefix("eval_") for k in summary["eval_after"]}
    records = [json.loads(line) for line in (tmp_path.glob("*/metrics.jsonl").__next__()).read_text().splitlines()]
    steps = [r for r in records if r.get("phase") == "rl"]
    assert len(steps) == 2 and all(0.0 <= r["reward"] <= 1.0 for r in steps)

