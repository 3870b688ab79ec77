"""Your rows, your reward (task=prompts), custom tasks and the task registry: config resolution, the task's rows
and reward, the worker part shipped to env workers, and every bad input failing before any actor starts (and in
the dry run), each naming the key and the problem. No Ray cluster, no training (tests/test_user_task_jobs.py)."""
from __future__ import annotations

import asyncio
import json
import sys
import textwrap
from pathlib import Path

import pytest

from rayllm_rl.data.failures import code_of
from rayllm_rl.config import load_config
from rayllm_rl.envs.arithmetic import make_arithmetic_splits
from rayllm_rl.orchestration.factories import build_task
from rayllm_rl.job.config import GRPOJobConfig
from rayllm_rl.job.inputs import JobInputs
from rayllm_rl.workflows.rewards import RewardCaller
from rayllm_rl.workflows.rlvr import row_fields

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = Path(__file__).parent / "fixtures"

MODULE = '''
import asyncio
import re

ANSWER = re.compile(r"<answer>\\s*(-?\\d+)\\s*</answer>")


def score(prompt, completion, prompt_ids, completion_ids, answer, **columns):
    """1 if the <answer> is the row's answer; `tagged` says whether there was one."""
    m = ANSWER.search(completion)
    return {"reward": float(m is not None and m.group(1) == str(answer)), "tagged": float(m is not None)}


async def brevity(prompt, completion, prompt_ids, completion_ids, **columns):
    await asyncio.sleep(0)
    return -len(completion) / 100


def two_args(prompt, completion):
    return 0.0


def no_number(prompt, completion, prompt_ids, completion_ids, **columns):
    return "yes"


def no_reward_key(prompt, completion, prompt_ids, completion_ids, **columns):
    return {"score": 1.0}


def raises(prompt, completion, prompt_ids, completion_ids, **columns):
    return columns["missing"]


def make_echo(data_cfg, seed):
    """A custom task: say the row's word back."""
    from datasets import Dataset

    from rayllm_rl.envs.task import Task

    def rows(words):
        return Dataset.from_list([{"messages": [{"role": "user", "content": f"say {w}"}], "word": w} for w in words])

    def said(prompt, completion, prompt_ids, completion_ids, word, **row):
        return float(word in completion)

    return Task("echo", rows(["red", "green", "blue"]), rows(["pink"]), said)
'''


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    """`myreward` (the functions above) importable from a folder of its own, as a user's module is."""
    (tmp_path / "myreward.py").write_text(MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("myreward", None)
    yield tmp_path
    sys.modules.pop("myreward", None)


def arithmetic_rows(max_operand: int = 4, eval_size: int = 5) -> tuple[list[dict], list[dict]]:
    """(train, held-out) rows of messages + answer (+ a demonstration), from the built-in arithmetic pairs."""
    train, held = make_arithmetic_splits(max_operand=max_operand, eval_size=eval_size)
    keep = lambda ds: [{"messages": r["messages"], "answer": r["answer"],  # noqa: E731
                        "demo": f"<answer>{r['answer']}</answer>"} for r in ds]
    return keep(train), keep(held)


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture
def rows_file(tmp_path) -> Path:
    return write_jsonl(tmp_path / "rows.jsonl", arithmetic_rows()[0])


def job(*overrides: str) -> GRPOJobConfig:
    return load_config(GRPOJobConfig, list(overrides))


def score(task, completion: str, row: dict) -> dict:
    """What an env worker's workflow gets for `completion` on `row` (the task's reward through a RewardCaller)."""
    return asyncio.run(RewardCaller(task.reward_fn).score("prompt", completion, [1], [2], **row_fields(row)))


def test_setting_reward_fn_is_enough_the_task_becomes_prompts_with_its_presets(user_module, rows_file):
    loaded = job("reward.fn=myreward:score", f"data.path={rows_file}")
    cfg = loaded.validate()
    assert loaded.task is None and loaded.rollout.max_new_tokens is None  # the user's config stays unresolved
    assert cfg.task == "prompts"
    assert (cfg.rollout.max_new_tokens, cfg.data.eval_size, cfg.sft.steps, cfg.optim.lr) == (512, 100, 0, 1e-6)
    assert job().validate().task == "arithmetic"  # no reward: the demo, as before
    task = build_task(cfg)
    assert task.name == "prompts" and (len(task.train), len(task.eval)) == (16, 4)  # 20 rows: a fifth held out
    first = task.train[0]
    assert first["messages"][0]["role"] == "user" and "+" in first["messages"][0]["content"]
    right, wrong = f"<answer>{first['answer']}</answer>", "<answer>-1</answer>"
    assert score(task, right, first) == {"reward": 1.0, "tagged": 1.0}  # its components, declared by the probe
    assert score(task, wrong, first) == {"reward": 0.0, "tagged": 1.0}
    assert score(task, "no idea", first) == {"reward": 0.0, "tagged": 0.0}
    assert task.reward_fn.columns == ("answer", "demo")  # every column but the prompt's reaches the reward


def test_a_string_prompt_column_is_one_user_message_after_the_system_prompt():
    from datasets import Dataset

    seen = []

    def grade(prompt, completion, prompt_ids, completion_ids, **columns):
        seen.append(sorted(columns))
        return 0.5

    rows = Dataset.from_list([{"question": f"What is {i}+1?", "answer": str(i + 1), "level": i % 3} for i in range(10)])
    cfg = job("data.prompt_column=question", "data.system_prompt=Be brief.", "data.eval_size=2")
    inputs = JobInputs.of(cfg, reward_fn=grade, train_dataset=rows)
    task = build_task(cfg.validate(inputs=inputs), inputs)
    assert task.name == "prompts" and (len(task.train), len(task.eval)) == (8, 2)
    assert task.train[0]["messages"] == [{"role": "system", "content": "Be brief."},
                                         {"role": "user", "content": task.train[0]["question"]}]
    assert seen == [["answer", "level"]]  # the probe: the columns but the prompt's, as keywords
    assert score(task, "2", task.train[0]) == {"reward": 0.5}


def test_several_reward_functions_are_weighted_and_each_is_logged_by_name(user_module, rows_file):
    cfg = job("reward.fn=[myreward:score,myreward:brevity]", "reward.fn_weights=[1.0,0.5]", f"data.path={rows_file}")
    task = build_task(cfg.validate())
    assert task.reward_fn.component_keys == ("reward_score", "score_tagged", "reward_brevity")
    row = task.train[0]
    right = f"<answer>{row['answer']}</answer>"
    brevity = -len(right) / 100
    out = score(task, right, row)
    assert out == pytest.approx({"reward": 1.0 + 0.5 * brevity, "reward_score": 1.0, "score_tagged": 1.0,
                                 "reward_brevity": brevity})


def test_a_reward_that_fails_at_run_time_scores_zero_and_is_counted_per_function():
    from rayllm_rl.rewards.user_reward import UserReward

    def right(prompt, completion, prompt_ids, completion_ids, **columns):
        return 1.0

    def flaky(prompt, completion, prompt_ids, completion_ids, **columns):
        raise RuntimeError("service down")

    async def slow(prompt, completion, prompt_ids, completion_ids, **columns):
        await asyncio.sleep(5)
        return 1.0

    both = UserReward([right, flaky], [1.0, 2.0], timeout_s=0.2)
    assert asyncio.run(both("p", "c", [], [])) == {"reward": 1.0, "reward_right": 1.0, "reward_flaky": 0.0,
                                                   "failed": code_of("reward_raised")}  # one failed: the sum too
    assert both.counters() == {"reward_right_errors": 0, "reward_right_timeouts": 0, "reward_right_nonfinite": 0,
                               "reward_flaky_errors": 1, "reward_flaky_timeouts": 0, "reward_flaky_nonfinite": 0}
    alone = RewardCaller(UserReward([slow], timeout_s=0.2))  # one function: the workflow's counters
    assert asyncio.run(alone.score("p", "c", [], [])) == {"reward": 0.0, "failed": code_of("reward_timeout")}
    assert alone.counters()["reward_timeouts"] == 1 and alone.timeout_s is None  # timed by its own caller
    assert UserReward([right, right, lambda *a, **k: 0.0]).names == ("right", "right_2", "lambda")


BAD_REWARDS = [
    ("reward.fn=nosuchmodule:score", r"cannot import reward.fn='nosuchmodule:score': No module named 'nosuchmodule'"),
    ("reward.fn=myreward:scor", r"cannot import reward.fn='myreward:scor': module 'myreward' has no attribute 'scor'; "
                                r"close names: \['score'\]"),
    ("reward.fn=myreward:two_args", r"reward.fn='myreward:two_args': cannot be called as fn\(prompt, completion, "
                                    r"prompt_ids, completion_ids, \*\*columns\) with the columns \['answer', 'demo'\]: "
                                    r"too many positional arguments"),
    ("reward.fn=myreward:no_number", r"reward.fn='myreward:no_number' returned str 'yes' on the probe row: expected a "
                                     r"float, or a dict"),
    ("reward.fn=myreward:no_reward_key",
     r"reward.fn='myreward:no_reward_key' returned dict .* mapping without 'reward'"),
    ("reward.fn=myreward:raises", r"reward.fn='myreward:raises' raised KeyError: 'missing' on the probe \(the first "
                                  r"training row's columns \['answer', 'demo'\], completion ''\)"),
    ("data.prompt_column=question", r"first row: no column 'question' \(data.prompt_column\) to take the prompt from; "
                                    r"the columns are \['answer', 'demo', 'messages'\]"),
]


@pytest.mark.parametrize("override,message", BAD_REWARDS)
def test_a_bad_reward_or_prompt_column_fails_the_dry_run_naming_it(user_module, rows_file, capsys, override, message):
    """The dry run imports the reward and reads the first row only: it reports each mistake the job would hit."""
    from test_recipes import grpo_main

    args = [f"data.path={rows_file}", override] + (["reward.fn=myreward:score"] if "reward.fn" not in override else [])
    with pytest.raises(ValueError, match=message):
        grpo_main()([*args, "--dry-run"])
    assert "DRY RUN" not in capsys.readouterr().out


@pytest.mark.parametrize("override,message", BAD_REWARDS)
def test_a_bad_reward_or_prompt_column_fails_the_job_before_ray_starts(user_module, rows_file, tmp_path, override,
                                                                         message):
    import ray

    from rayllm_rl import train

    args = [f"data.path={rows_file}", override, f"trainer.run_dir={tmp_path}"]
    args += ["reward.fn=myreward:score"] if "reward.fn" not in override else []
    with pytest.raises(ValueError, match=message.replace("first row: ", "line 1: ")):
        train(overrides=args)
    assert not ray.is_initialized()


def test_eval_prompts_that_are_training_prompts_are_refused_naming_how_many(user_module, tmp_path, capsys):
    from test_recipes import grpo_main

    train_rows, held = arithmetic_rows()
    rows = write_jsonl(tmp_path / "rows.jsonl", train_rows + held[:3])
    held_file = write_jsonl(tmp_path / "held.jsonl", held)
    message = r"data.eval_path='.*held.jsonl': 3 of its 5 distinct eval prompts are also training prompts"
    args = ["reward.fn=myreward:score", f"data.path={rows}", f"data.eval_path={held_file}"]
    with pytest.raises(ValueError, match=message):
        grpo_main()([*args, "--dry-run"])
    with pytest.raises(ValueError, match=message):
        build_task(job(*args).validate())
    assert capsys.readouterr().out == ""
    from datasets import Dataset

    def grade(prompt, completion, prompt_ids, completion_ids, **columns):
        return 0.0

    with pytest.raises(ValueError, match=r"eval_dataset: 3 of its 5 distinct eval prompts are also training prompts"):
        inputs = JobInputs.of(job(), reward_fn=grade, train_dataset=Dataset.from_list(train_rows + held[:3]),
                              eval_dataset=held)
        build_task(job().validate(inputs=inputs), inputs)
    # held out of one source: a prompt repeated in it is taken out of training, never an error
    repeated = write_jsonl(tmp_path / "repeated.jsonl", train_rows + train_rows[:4])
    task = build_task(job("reward.fn=myreward:score", f"data.path={repeated}", "data.eval_size=4").validate())
    held_prompts = {json.dumps(m) for m in task.eval["messages"]}
    assert not held_prompts & {json.dumps(m) for m in task.train["messages"]} and len(task.eval) == 4


def test_python_objects_that_cannot_work_fail_before_ray_naming_the_keyword(tmp_path):
    import ray
    from datasets import Dataset, DatasetDict

    from rayllm_rl import train

    train_rows, held = arithmetic_rows()

    def grade(prompt, completion, prompt_ids, completion_ids, **columns):
        return 1.0

    rows = Dataset.from_list(train_rows)
    run = [f"trainer.run_dir={tmp_path}"]
    cases = [
        (dict(reward_fn=lambda prompt, completion: 0.0, train_dataset=rows),
         r"reward_fn \(<lambda>\): cannot be called as fn\(prompt, completion, prompt_ids, completion_ids, "
         r"\*\*columns\)"),
        (dict(reward_fn=grade, train_dataset=Dataset.from_list([{"prompt": "1+1=", "answer": "2"}])),
         r"train_dataset, row 1: no column 'messages' \(data.prompt_column\) to take the prompt from; the columns are "
         r"\['answer', 'prompt'\]"),
        (dict(reward_fn=grade, train_dataset=DatasetDict(train=rows)), r"train_dataset is a DatasetDict with splits "
                                                                       r"\['train'\]: pass one split"),
        (dict(reward_fn=grade), r"task=prompts reads its prompts from data.path .* or from train\(train_dataset=...\)"),
        (dict(reward_fn=[grade, grade], reward_weights=[1.0], train_dataset=rows),
         r"reward_weights=\[1.0\] has 1 weights for 2 reward functions"),
        (dict(reward_fn="myreward:score", train_dataset=rows), r"reward_fn \(str\) is a str, not a callable"),
        (dict(train_dataset=rows), r"train_dataset= is not read by task=arithmetic: its rows are generated"),
    ]
    for kwargs, message in cases:
        with pytest.raises(ValueError, match=message):
            train(overrides=run, **kwargs)
    with pytest.raises(ValueError, match=r"reward_fn= is the reward of task=prompts .* task=gsm8k scores with its own"):
        train(overrides=[*run, "task=gsm8k"], reward_fn=grade, train_dataset=rows)
    with pytest.raises(ValueError, match=r"reward_fn= and reward.fn=\['m:f'\] both give the reward: give one"):
        train(overrides=[*run, "reward.fn=m:f"], reward_fn=grade)
    with pytest.raises(ValueError, match=r"task=prompts scores with your reward: set reward.fn"):
        train(overrides=[*run, "task=prompts"], train_dataset=rows)
    assert not ray.is_initialized()


def test_every_built_in_tasks_worker_part_pickles_small_and_scores_as_on_the_driver(tmp_path):
    """Env workers get the driver's task minus its rows, by value: each built-in one (and the prompt task with a
    reward defined right here, which no worker could import) is inlined by Ray and scores a row the same."""
    from ray import cloudpickle

    from rayllm_rl.orchestration.ray.backend import worker_part
    from rayllm_rl.orchestration.ray.cluster import INLINE_LIMIT_BYTES

    limit = 3

    def capped(prompt, completion, prompt_ids, completion_ids, answer, **columns):  # a closure over `limit`
        return float(completion.count(answer) >= 1) * min(limit, 1)

    train_rows, _ = arithmetic_rows()
    inputs = JobInputs.of(job(), reward_fn=capped, train_dataset=train_rows)
    configs = {"arithmetic": (job(), None), "prompts": (job(), inputs),
               "reasoning_gym": (job("task=reasoning_gym", "data.reasoning_gym.train_size=50", "data.eval_size=5"),
                                 None)}
    for name in ("gsm8k", "math", "ifeval"):
        configs[name] = (job(f"task={name}", f"data.path={FIXTURES / f'{name}.jsonl'}", "data.eval_size=1"), None)
    for name, (cfg, given) in configs.items():
        task = build_task(cfg.validate(inputs=given), given)
        part = worker_part(task)  # the check RayBackend runs before any env worker starts
        blob = cloudpickle.dumps(part)
        assert part.train is None and part.eval is None and len(blob) < INLINE_LIMIT_BYTES // 10, (name, len(blob))
        row, shipped = task.train[0], cloudpickle.loads(blob)
        # (math: no answer to check, so its verifier process does not start here; test_worker_part_of_math_...)
        for completion in ("no",) if name == "math" else ("<answer>4</answer>", "no"):
            assert score(shipped, completion, row) == score(task, completion, row), name
        assert (shipped.env_cls, shipped.sft_target is None) == (task.env_cls, task.sft_target is None)


def test_a_worker_part_too_big_to_inline_fails_naming_the_task_and_what_to_do():
    from datasets import Dataset

    from rayllm_rl.envs.task import Task
    from rayllm_rl.orchestration.ray.backend import worker_part

    table = {str(i): i for i in range(20_000)}  # captured by the reward: it would travel with every env worker

    def lookup(prompt, completion, prompt_ids, completion_ids, **columns):
        return float(completion in table)

    rows = Dataset.from_list([{"messages": [{"role": "user", "content": "hi"}]}])
    with pytest.raises(ValueError, match=r"env worker: constructor argument 0 \(task 'big' without its rows: "
                                         r"reward fn, env class, SFT target\) pickles to \d+ bytes, >= 102400 .* "
                                         r"keep large data .* out of the reward's closure and attributes: load it "
                                         r"inside the reward from a path"):
        worker_part(Task("big", rows, rows, lookup))


def test_a_new_built_in_task_is_one_registry_entry(monkeypatch, user_module, capsys):
    """One TaskEntry in a copy of the table: its name validates, its presets and prompt length apply, the dry run
    plans it, and the job builds it with its factory."""
    from types import MappingProxyType

    from rayllm_rl.envs import task_registry
    from rayllm_rl.job.describe import describe_job
    from rayllm_rl.job.plan_text import describe_presets

    entry = task_registry.TaskEntry(
        "myreward:make_echo_task", dict(task_registry.TASKS["gsm8k"].presets, **{"rollout.max_new_tokens": 7}),
        {}, prompt_tokens=9, rows="generated")
    (user_module / "myreward.py").write_text(MODULE + textwrap.dedent('''
        def make_echo_task(data_cfg, seed, inputs):
            return make_echo(data_cfg, seed)
        '''))
    monkeypatch.setattr(task_registry, "TASKS", MappingProxyType({**task_registry.TASKS, "echo": entry}))
    cfg = job("task=echo").validate()
    assert cfg.rollout.max_new_tokens == 7 and cfg.optim.lr == 1e-6
    task = build_task(cfg)
    assert task.name == "echo" and len(task.train) == 3
    assert "echo" in describe_presets()
    assert describe_job(cfg)["memory"]["kv_cache_per_replica"]["sequence_tokens"] == 9 + 7


def test_a_task_by_import_path_or_object_takes_the_prompt_tasks_presets(user_module, capsys):
    from test_recipes import dry_run_json

    cfg = job("task=myreward:make_echo").validate()
    assert cfg.task == "myreward:make_echo" and cfg.rollout.max_new_tokens == 512 and cfg.data.eval_size == 100
    task = build_task(cfg)
    assert task.name == "echo" and (len(task.train), len(task.eval)) == (3, 1)
    assert score(task, "red!", task.train[0]) == {"reward": 1.0}
    plan = dry_run_json(capsys, "task=myreward:make_echo")
    assert plan["task"] == "myreward:make_echo" and plan["data"]["train"]["kind"] == "factory"
    from test_recipes import grpo_main

    grpo_main()(["task=myreward:make_echo", "--dry-run"])
    assert "data (train): myreward:make_echo: rows made by the factory at start" in capsys.readouterr().out
    # the same factory as a Python object
    import myreward

    inputs = JobInputs.of(job(), task=myreward.make_echo)
    resolved = job().validate(inputs=inputs)
    assert resolved.task == "python:make_echo" and build_task(resolved, inputs).name == "echo"
    with pytest.raises(ValueError, match=r"cannot import task='myreward:make_ech': module 'myreward' has no attribute"):
        job("task=myreward:make_ech").validate()
    given = JobInputs.of(job("task=myreward:make_echo"), train_dataset=[{"messages": "x"}])
    with pytest.raises(ValueError, match=r"train_dataset= is not read by task=myreward:make_echo: its factory makes"):
        job("task=myreward:make_echo").validate(inputs=given)


def test_grpo_trainer_translates_trls_arguments_into_the_job():
    from rayllm_rl import GRPOTrainer

    def grade(prompt, completion, prompt_ids, completion_ids, **columns):
        return 1.0

    rows, _ = arithmetic_rows()
    trainer = GRPOTrainer(model="/models/m", reward_funcs=[grade], train_dataset=rows,
                          args={"trainer.steps": 3, "rollout": {"group_size": 4}}, reward_weights=[2.0])
    assert (trainer.config.model.path, trainer.config.trainer.steps, trainer.config.rollout.group_size) == \
        ("/models/m", 3, 4)
    assert trainer.config.task is None  # resolved when train() validates it
    assert GRPOTrainer(args=["trainer.steps=2"]).config.trainer.steps == 2
    with pytest.raises(TypeError, match="pass the model's local directory or hub id"):
        GRPOTrainer(model=object())
    with pytest.raises(ValueError, match="both name the model"):
        GRPOTrainer(model="a/b", args=["model.path=c/d"])


@pytest.mark.slow
def test_worker_part_of_math_ships_its_verifier_settings_not_its_process():
    """The driver's MathRewardFn has started its math-verify process (greedy eval runs on the driver): the worker
    part pickles without it, and the env worker's copy starts its own on first use, scoring the same."""
    from ray import cloudpickle

    from rayllm_rl.orchestration.ray.backend import worker_part

    task = build_task(job("task=math", f"data.path={FIXTURES / 'math.jsonl'}", "data.eval_size=1").validate())
    row = dict(task.train[0])
    answer = f"<answer>{row.get('answer') or 'x'}</answer>"
    try:
        on_driver = score(task, answer, row)
        assert task.reward_fn.verifier.process is not None  # started here
        shipped = cloudpickle.loads(cloudpickle.dumps(worker_part(task)))
        assert shipped.reward_fn.verifier.process is None
        assert score(shipped, answer, row) == on_driver
    finally:
        task.reward_fn.close()
        if "shipped" in locals():
            shipped.reward_fn.close()
