"""task=verifiers: verifiers environments of the classic API (verifiers 0.3.1: `ToolEnv`, `SingleTurnEnv`,
`MultiTurnEnv`) written here, their rollouts served by the tiny model through our chat-completions proxy; the
ToolEnv trained on the local backend and on Ray, its turns checked token by token; the SingleTurnEnv and the
MultiTurnEnv trained on the local backend, their rewards recomputed from the replies; the failure paths (a rubric
function and an env_response that raise) as failed samples by cause; examples/verifiers_calculator (its environment
and its train.py at the small size).

Runs in .venv-envs (verifiers 0.3.1 needs mcp<2, which cannot share .venv with the `mcp` extra's mcp 2.3:
docs/environments.md); `make test` runs it there, and conftest.py leaves it out of a venv without verifiers.

The tiny model writes no `<tool_call>` blocks, so the ToolEnv's tool-call parser (`data.verifiers.tool_parser`,
`every_reply_calls_count`) reads every reply as one call of the `count` tool: each episode lasts exactly `TOOL_TURNS`
turns, and the test knows each tool result the model was shown.
"""
from __future__ import annotations

import asyncio
import json
import signal
from pathlib import Path

import pytest
import verifiers as vf
from datasets import Dataset

from job_helpers import ScriptPolicy, replies_of, rl_records, trace_samples
from ray_sessions import JOB_ENV, local_ray_session

TOOL_TURNS = 2
"""Turns of a ToolEnv episode: a call of `count`, its result, a last reply (max_turns ends it)."""
ROWS = [{"question": f"Count the letters of {w}.", "answer": str(len(w))} for w in ("cat", "horse", "ox", "zebra")]


def count(text: str) -> str:
    """Count the letters of a text.

    Args:
        text: The text whose ASCII letters are counted.

    Returns:
        How many letters it has.
    """
    return f"{sum(c.isascii() and c.isalpha() for c in text)} letters"


def every_reply_calls_count(text: str) -> list:
    """The tool parser for the tiny model: every reply is one call of `count` with the reply as its text."""
    return [("count", {"text": text})]


def letters(text: str) -> int:
    return sum(c.isascii() and c.isalpha() for c in text)


def short_reply(completion, **kwargs) -> float:
    """1 / (1 + the letters of the assistant's replies): dense, so the tiny model's random replies score apart."""
    said = "".join(m.content or "" for m in completion if m.role == "assistant")
    return 1.0 / (1 + letters(said))


def says_answer(completion, answer, **kwargs) -> float:
    """1 when the last reply holds the row's answer."""
    return float(answer in (completion[-1].content or ""))


def dataset() -> Dataset:
    return Dataset.from_list(ROWS)


def tool_env() -> vf.ToolEnv:
    return vf.ToolEnv(dataset=dataset(), tools=[count], max_turns=TOOL_TURNS,
                      rubric=vf.Rubric(funcs=[short_reply, says_answer], weights=[1.0, 0.5]))


def load_environment(**kwargs) -> vf.Environment:
    """What `data.verifiers.env_id=test_verifiers_env` loads (verifiers' `load_environment`): the ToolEnv."""
    return tool_env()


class EchoEnv(vf.MultiTurnEnv):
    """A MultiTurnEnv whose env_response tells the model how many letters its reply had."""

    async def env_response(self, messages, state, **kwargs):
        return [{"role": "user", "content": f"You said {letters(messages[-1].content or '')} letters."}]


class BrokenEnv(vf.MultiTurnEnv):
    async def env_response(self, messages, state, **kwargs):
        raise RuntimeError("the simulator crashed")


class SlowEnv(vf.MultiTurnEnv):
    async def env_response(self, messages, state, **kwargs):
        await asyncio.sleep(30)  # past data.verifiers.rollout_timeout_s: cancelled with the rollout
        return []


def broken_reward(completion, **kwargs) -> float:
    raise ZeroDivisionError("a rubric bug")


def single_env() -> vf.SingleTurnEnv:
    return vf.SingleTurnEnv(dataset=dataset(), system_prompt="Answer with a number.",
                            rubric=vf.Rubric(funcs=[short_reply, says_answer]))


def echo_env(**kwargs) -> EchoEnv:
    return EchoEnv(dataset=dataset(), max_turns=2, rubric=vf.Rubric(funcs=[short_reply]), **kwargs)


# ---------------------------------------------------------------------------- parts, no job
def test_the_rubric_is_the_reward_and_its_functions_the_components():
    from rayllm_rl.environments.verifiers_config import VerifiersConfig
    from rayllm_rl.environments.verifiers_env import RubricReward, component_names, resolve_verifiers, rows

    source, env = resolve_verifiers(VerifiersConfig(), tool_env())
    assert component_names(env.rubric) == ("reward_short_reply", "reward_says_answer", "reward_num_turns",
                                           "reward_total_tool_calls", "reward_count_calls")
    (row, *_) = rows(env, 0, source.label)
    assert row["messages"] == [{"role": "user", "content": "Count the letters of cat."}]
    assert json.loads(row["vf_input"])["answer"] == "3" and len(rows(env, 2, source.label)) == 2

    async def scored(replies):
        state = await env.init_state(json.loads(row["vf_input"]), vf.OpenAIChatCompletionsClient(None), "m")
        state["completion"] = [vf.AssistantMessage(content=r) for r in replies]
        state["trajectory"] = [{} for _ in replies]
        return await RubricReward(component_names(env.rubric))("", "", [], [], state=state, rubric=env.rubric)

    out = asyncio.run(scored(["ab", "it is 3"]))
    assert out["reward_short_reply"] == pytest.approx(1 / 7) and out["reward_says_answer"] == 1.0
    assert out["reward"] == pytest.approx(1 / 7 + 0.5) and out["reward_num_turns"] == 2.0


def test_bad_environments_fail_before_anything_starts_naming_the_problem():
    from rayllm_rl.environments.verifiers_config import VerifiersConfig
    from rayllm_rl.environments.verifiers_env import resolve_verifiers
    from rayllm_rl.environments.verifiers_task import make_task
    from rayllm_rl.job.config import DataConfig

    with pytest.raises(ValueError, match="needs one environment.*none was given"):
        resolve_verifiers(VerifiersConfig())
    with pytest.raises(ValueError, match="needs one environment.*env_id and environment="):
        resolve_verifiers(VerifiersConfig(env_id="test_verifiers_env"), tool_env())
    with pytest.raises(ValueError, match="not a verifiers Environment"):
        resolve_verifiers(VerifiersConfig(), object())
    with pytest.raises(ValueError, match="no module 'no_such_env_pkg'"):
        VerifiersConfig(env_id="org/no-such-env-pkg").check()
    with pytest.raises(ValueError, match="score a group of rollouts"):
        resolve_verifiers(VerifiersConfig(), vf.SingleTurnEnv(dataset=dataset(), rubric=vf.Rubric(
            funcs=[lambda completions, **kw: [1.0] * len(completions)])))
    with pytest.raises(ValueError, match="data.eval_size=2 but test_verifiers_env has no eval_dataset"):
        make_task(DataConfig(eval_size=2, verifiers=VerifiersConfig(env_id="test_verifiers_env")))
    handler = signal.getsignal(signal.SIGTERM)
    source, env = resolve_verifiers(VerifiersConfig(env_id="test_verifiers_env", env_args={}))
    assert isinstance(env, vf.ToolEnv) and source.load() is env and source.label == "test_verifiers_env"
    assert signal.getsignal(signal.SIGTERM) is handler  # verifiers' Environment replaced it; the job's is back


def episode_of(tiny_model_path, env, row: int = 0, **cfg_keys):
    """One group of 2 rollouts of `env` with the real tiny engine, as the collector runs it (`run_group`, the
    failure policy `drop`)."""
    from transformers import AutoTokenizer

    from rayllm_rl.environments.verifiers_config import VerifiersConfig
    from rayllm_rl.environments.verifiers_env import RubricReward, component_names, resolve_verifiers, rows
    from rayllm_rl.environments.verifiers_workflow import make_workflow
    from rayllm_rl.envs.task import Task
    from rayllm_rl.inference.protocol import SamplingParams
    from rayllm_rl.inference.transformers.engine import TransformersEngine
    from rayllm_rl.rollout.failures import FailurePolicy, run_group

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    source, env = resolve_verifiers(VerifiersConfig(**cfg_keys), env)
    task = Task("verifiers", None, None, RubricReward(component_names(env.rubric)))
    workflow = make_workflow(tokenizer, SamplingParams(max_new_tokens=5), 2, task, source=source)
    engine = TransformersEngine(tiny_model_path, seed=0, device="cpu")

    async def go():
        await engine.start()
        try:
            return await run_group(workflow, engine, {**rows(env, 0, source.label)[row], "group_id": 7},
                                   FailurePolicy("drop", group_size=2))
        finally:
            await engine.aclose()

    return asyncio.run(go())


# (environment, cause, what the warning says, data.verifiers.rollout_timeout_s). The cases that raise get a bound far
# past a loaded machine's rollout of the tiny model (at 0.5 s a busy CI worker timed out before the raise); the one
# that hangs gets a short bound, reached whether its model turn is quick or slow.
FAILING = {
    "rubric_raises": (lambda: vf.SingleTurnEnv(dataset=dataset(), rubric=vf.Rubric(funcs=[short_reply, broken_reward])),
                      "reward_raised", "ZeroDivisionError: a rubric bug", 60.0),
    "env_response_raises": (lambda: BrokenEnv(dataset=dataset(), max_turns=3, rubric=vf.Rubric(funcs=[short_reply])),
                            "raised", "RuntimeError: the simulator crashed", 60.0),
    "rollout_times_out": (lambda: SlowEnv(dataset=dataset(), max_turns=3, rubric=vf.Rubric(funcs=[short_reply])),
                          "timeout", "ran past data.verifiers.rollout_timeout_s=0.5s", 0.5),
}


@pytest.mark.parametrize("case", list(FAILING))
def test_a_rubric_or_env_response_that_raises_or_hangs_fails_its_samples_by_cause_never_a_zero(tiny_model_path, case,
                                                                                              caplog):
    env, cause, said, timeout_s = FAILING[case]
    result = episode_of(tiny_model_path, env(), rollout_timeout_s=timeout_s)
    assert result.causes == {cause: 2} and result.episode is None and result.dropped
    assert caplog.text.count(said) == 2  # the warning of each failed sample names what raised


def test_a_hermes_tool_call_from_the_proxy_is_the_call_tool_env_runs():
    """The proxy's OpenAI `tool_calls` (from the reply's Hermes block), read by verifiers' own client, are what
    `ToolEnv.env_response` runs; a tool parser of the user's gives the same."""
    from openai.types.chat import ChatCompletion

    from rayllm_rl.agents.openai_proxy import parse_tool_calls

    text = 'Let me count. <tool_call>{"name": "count", "arguments": {"text": "zebra!"}}</tool_call>'
    assert [c["function"] for c in parse_tool_calls(text, every_reply_calls_count)] == [
        {"name": "count", "arguments": json.dumps({"text": text})}]
    env = tool_env()

    async def run():
        native = ChatCompletion.model_validate({
            "id": "c", "object": "chat.completion", "created": 0, "model": "m", "choices": [{
                "index": 0, "finish_reason": "tool_calls",
                "message": {"role": "assistant", "content": text, "tool_calls": parse_tool_calls(text)}}]})
        response = await vf.OpenAIChatCompletionsClient(None).from_native_response(native)
        state = await env.init_state(json.loads(json.dumps(ROWS[0] | {"prompt": []})), vf.OpenAIChatCompletionsClient(
            None), "m")
        return response.message, await env.env_response([response.message], state)

    message, (tool,) = asyncio.run(run())
    assert message.content == text and [(c.name, json.loads(c.arguments)) for c in message.tool_calls] == [
        ("count", {"text": "zebra!"})]
    assert tool.role == "tool" and tool.content == "5 letters" and tool.tool_call_id == message.tool_calls[0].id


# ---------------------------------------------------------------------------- jobs
JOB = ["task=verifiers", "trainer.steps=2", "rollout.prompts_per_step=2", "rollout.group_size=2",
       "rollout.max_new_tokens=5", "sft.steps=0", "data.eval_size=0", "trainer.eval_every=0", "trainer.log_every=100",
       "trainer.call_timeout_s=120", "trainer.seed=1"]
"""2 RL steps of 2 rows x 2 rollouts of at most 5 tokens a turn, no warm start, no eval; a seed at which the tiny
model never replies with nothing (verifiers aborts a rollout on an empty reply, EmptyModelResponseError: here a
failed sample, cause `raised`)."""
TOOLS = [*JOB, "data.verifiers.tool_parser=test_verifiers_env:every_reply_calls_count"]


def answer_of(sample) -> str:
    """The row's answer, told by the traced prompt's word."""
    return next(r["answer"] for r in ROWS if r["question"] in sample["prompt"])


def check_job(summary, tokenizer, turns: int, feedback, weight_answer: float) -> None:
    """2 steps trained on rollouts of exactly `turns` turns, none failed; each traced row's turns token by token and
    its reward recomputed from its replies: `short_reply` + `weight_answer` x `says_answer`."""
    rl = rl_records(summary)
    assert summary["steps"] == 2 and len(rl) == 2 and summary["failed_episodes"] == 0
    for rec in rl:
        assert rec["num_turns"] == turns and rec["seqs"] == 2 * 2 and rec["reward_num_turns"] == turns
    samples = trace_samples(summary)
    assert len(samples) >= 2
    rewards = []
    for sample in samples:
        replies = replies_of(sample, tokenizer, turns, lambda _k, reply: feedback(reply))
        short = 1.0 / (1 + letters("".join(replies)))
        right = float(answer_of(sample) in replies[-1])
        assert sample["components"]["reward_short_reply"] == pytest.approx(short, abs=1e-5)
        assert sample["reward"] == pytest.approx(short + weight_answer * right, abs=1e-5)
        rewards.append(sample["reward"])
    assert len(set(rewards)) > 1  # dense: the replies scored apart


def tool_feedback(reply: str) -> list[dict]:
    return [{"role": "tool", "content": count(reply)}]


def test_a_tool_env_trains_on_the_local_backend_token_by_token(tmp_path, tokenizer, tiny_model_path):
    from rayllm_rl import train

    summary = train(overrides=[*TOOLS, f"model.path={tiny_model_path}", "trainer.backend=local",
                               f"trainer.run_dir={tmp_path}"], environment=tool_env())
    assert summary["backend"] == "local"
    check_job(summary, tokenizer, TOOL_TURNS, tool_feedback, 0.5)
    for rec in rl_records(summary):
        assert rec["reward_total_tool_calls"] == TOOL_TURNS and rec["reward_count_calls"] == TOOL_TURNS


@pytest.mark.parametrize("form", ["single", "multi"])
def test_single_and_multi_turn_envs_train_on_the_local_backend(form, tmp_path, tokenizer, tiny_model_path):
    from rayllm_rl import train

    env = single_env() if form == "single" else echo_env()
    # task unset (JOB[1:]): a verifiers Environment given sets task=verifiers
    summary = train(overrides=[*JOB[1:], f"model.path={tiny_model_path}", "trainer.backend=local",
                               f"trainer.run_dir={tmp_path}"], environment=env)
    assert json.loads((Path(summary["run_dir"]) / "config.json").read_text())["task"] == "verifiers"
    feedback = lambda reply: [{"role": "user", "content": f"You said {letters(reply)} letters."}]  # noqa: E731
    check_job(summary, tokenizer, 1 if form == "single" else 2, feedback, 1.0 if form == "single" else 0.0)


@pytest.mark.ray
@pytest.mark.fixture_owned("processes", "shm segments", "named actors")
def test_a_tool_env_by_id_trains_in_ray_env_workers_token_by_token(tmp_path, tokenizer, tiny_model_path):
    """One local Ray; the environment loaded by id in the env workers (`load_environment` of this module, which
    reaches them through PYTHONPATH)."""
    import os

    from rayllm_rl import train

    tests_dir = os.path.dirname(os.path.abspath(__file__))
    env = {**JOB_ENV, "PYTHONPATH": os.pathsep.join(filter(None, [tests_dir, os.environ.get("PYTHONPATH")]))}
    with local_ray_session("test_verifiers_env", num_cpus=2, runtime_env={"env_vars": env}):
        summary = train(overrides=[*TOOLS, "data.verifiers.env_id=test_verifiers_env", f"model.path={tiny_model_path}",
                                   "trainer.backend=ray", f"trainer.run_dir={tmp_path}"])
    assert summary["backend"] == "ray"
    check_job(summary, tokenizer, TOOL_TURNS, tool_feedback, 0.5)


# ---------------------------------------------------------------------------- examples/verifiers_calculator
VF_CALCULATOR = Path(__file__).resolve().parents[1] / "examples" / "verifiers_calculator"


@pytest.fixture(scope="module")
def vf_calculator():
    """The example's environment module (its folder on sys.path, as its train.py puts it, so that
    `data.verifiers.env_id=calculator_env` loads it) and train.py (loaded under a name of its own)."""
    import importlib.util
    import sys

    sys.path.insert(0, str(VF_CALCULATOR))
    sys.modules.pop("calculator_env", None)  # the other example has a calculator_env.py too
    import calculator_env

    spec = importlib.util.spec_from_file_location("verifiers_calculator_train", VF_CALCULATOR / "train.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    return calculator_env, script


def test_the_verifiers_calculator_poses_evaluates_and_scores_through_verifiers(vf_calculator):
    from rayllm_rl.environments.verifiers_config import VerifiersConfig
    from rayllm_rl.environments.verifiers_env import resolve_verifiers

    mod, _ = vf_calculator
    env = mod.load_environment(num_questions=3, seed=3, max_turns=2)
    assert isinstance(env, vf.ToolEnv) and env.max_turns == 2 and len(env.get_dataset()) == 3
    row = env.get_dataset()[0]
    assert (row["question"], row["answer"]) == ("What is 343 * 86?", "29498")
    assert row["prompt"] == [{"role": "system", "content": mod.SYSTEM_PROMPT},
                             {"role": "user", "content": "What is 343 * 86?"}]
    (tool,) = env.tool_defs
    assert tool.name == "calculator" and tool.description == "Evaluate arithmetic."
    assert list(tool.parameters["properties"]) == ["expression"]
    for expression, value in (("343 * 86", "29498"), ("(1 + 2) ** 3 - 7 // 2", "24"), ("7 / 2", "3.5")):
        assert mod.calculator(expression) == value
    with pytest.raises(ValueError, match="is not allowed"):
        mod.calculator("__import__('os')")
    with pytest.raises(ValueError, match="at least 1"):
        mod.load_environment(num_questions=0)

    async def run(replies, calls=()):
        state = await env.init_state(dict(row), vf.OpenAIChatCompletionsClient(None), "m")
        tool_calls = [vf.ToolCall(id=f"c{i}", name="calculator", arguments=json.dumps({"expression": e}))
                      for i, e in enumerate(calls)]
        said = [vf.AssistantMessage(content="", tool_calls=tool_calls)] if calls else []
        results = await env.env_response(said, state) if calls else []
        state["completion"] = [*said, *results, *(vf.AssistantMessage(content=r) for r in replies)]
        state["trajectory"] = [{} for _ in range(len(said) + len(replies))]
        await env.rubric.score_rollout(state)  # verifiers' own scoring: the weighted sum and the metrics
        return [m.content for m in results], state["reward"], state["metrics"]

    results, reward, metrics = asyncio.run(run(["It is 29,498."], calls=["343 * 86", "open('x')"]))
    assert results[0] == "29498" and results[1].startswith("Error: ") and "is not allowed" in results[1]
    assert reward == 1.0 and metrics["correct_answer"] == 1.0
    assert (metrics["total_tool_calls"], metrics["calculator_calls"], metrics["num_turns"]) == (2.0, 2, 2.0)
    for wrong in ("29497", "about twenty nine thousand", "29498 or 29497"):
        assert asyncio.run(run([wrong]))[1] == 0.0, wrong
    source, by_id = resolve_verifiers(VerifiersConfig(env_id="calculator_env", env_args={"num_questions": 2}))
    assert isinstance(by_id, vf.ToolEnv) and len(by_id.get_dataset()) == 2 and source.label == "calculator_env"


def calculate_everything(text: str) -> list:
    """A tool parser for the tiny model (which writes no tool call): every reply is a `calculator` call of it."""
    return [("calculator", {"expression": text})]


def test_the_verifiers_calculator_example_trains_two_local_steps(vf_calculator, tmp_path, tokenizer):
    """The example's train.py in process at its small size, 2 steps, every reply made a calculator call (so each
    episode runs its 3 turns, each tool result the model was shown known); each traced row's turns checked token by
    token and its reward recomputed from its last reply."""
    mod, script = vf_calculator
    out = script.main(["--steps", "2", "--backend", "local", "--questions", "8", "--out", str(tmp_path),
                       "data.verifiers.tool_parser=test_verifiers_env:calculate_everything"])
    assert (out["steps"], out["backend"], out["failed_episodes"], out["turns"], out["tool_calls"]) == (
        2, "local", 0, 3.0, 3.0)
    rl = rl_records({"run_dir": out["run_dir"]})
    assert len(rl) == 2 and all(r["seqs"] == 2 * 4 and r["reward_calculator_calls"] == 3.0 for r in rl)
    # the reward is correct_answer alone (weight 1; the ToolEnv's metrics weigh 0), in [0, 1]
    assert all(r["reward"] == r["reward_correct_answer"] and 0.0 <= r["reward"] <= 1.0 for r in rl)
    first, last = rl[0]["reward"], rl[1]["reward"]
    assert out["reward"] == pytest.approx([first, last], abs=1e-4)
    assert out["correct"] == pytest.approx((first + last) / 2, abs=1e-4)

    def feedback(reply: str) -> list[dict]:
        try:
            result = mod.calculator(reply)
        except ValueError as exc:
            result = f"Error: {exc}"
        return [{"role": "tool", "content": result}]

    samples = trace_samples({"run_dir": out["run_dir"]})
    assert samples
    for sample in samples:
        assert "What is " in sample["prompt"] and "Tools: calculator(expression)" in sample["prompt"]
        replies = replies_of(sample, tokenizer, 3, lambda _k, reply: feedback(reply), lossy=True)
        a, b = (int(x) for x in sample["prompt"].split("What is ")[1].split("?")[0].split(" * "))
        right = mod.correct_answer([vf.AssistantMessage(content=replies[-1])], str(a * b))
        assert sample["reward"] == sample["components"]["reward_correct_answer"] == right


def vf_calculator_task(mod, eval_size: int = 0, **env_args):
    from types import SimpleNamespace

    from rayllm_rl.environments.verifiers_task import make_task
    from rayllm_rl.job.config import DataConfig

    data = DataConfig(eval_size=eval_size)
    data.verifiers.demonstration = "calculator_env:demonstration"
    return make_task(data, 0, SimpleNamespace(environment=mod.load_environment(**env_args)))


def test_a_verifiers_demonstration_is_its_rollout_through_the_proxy_and_only_its_replies_are_trained(vf_calculator,
                                                                                                    tmp_path):
    """The SFT batch of 3 rows of the calculator ToolEnv: each row's trained tokens are exactly the scripted replies'
    (the tool call, then the number), each closed by the end-of-turn token; the untrained ones hold the tool's
    result; the rubric scored every demonstration 1."""
    from transformers import AutoTokenizer

    mod, script = vf_calculator
    tokenizer = AutoTokenizer.from_pretrained(script.tiny_model_with_tools(tmp_path))
    task = vf_calculator_task(mod, num_questions=4, max_turns=3)
    rows = [task.train[i] for i in range(3)]
    batch = task.demonstrate(tokenizer, rows)
    assert batch["input_ids"].shape[0] == 3 and batch["rewards"].tolist() == [1.0] * 3
    for i, row in enumerate(rows):
        vf_row = json.loads(row["vf_input"])
        replies = mod.demonstration(vf_row)
        ids, mask = batch["input_ids"][i].tolist(), batch["loss_mask"][i].tolist()
        want = [t for r in replies for t in tokenizer.encode(r, add_special_tokens=False) + [tokenizer.eos_token_id]]
        assert [t for t, m in zip(ids, mask) if m] == want
        seen = batch["attention_mask"][i].tolist()
        context = tokenizer.decode([t for t, m, a in zip(ids, mask, seen) if a and not m])
        assert vf_row["question"] in context and vf_row["answer"] in context  # the question; the tool's result


def test_the_verifiers_held_out_evaluation_plays_the_eval_dataset_one_greedy_rollout_each(vf_calculator, tmp_path):
    """data.eval_size=5 takes the environment's eval_dataset (the seeds after its training rows'); with a policy that
    plays the demonstration but answers wrong when the first factor is even, eval_reward is exactly the share of odd
    first factors."""
    from transformers import AutoTokenizer

    from rayllm_rl.job.config import GRPOJobConfig
    from rayllm_rl.orchestration.factories import build_evaluation

    mod, script = vf_calculator
    tokenizer = AutoTokenizer.from_pretrained(script.tiny_model_with_tools(tmp_path))
    task = vf_calculator_task(mod, eval_size=5, num_questions=4, max_turns=3, eval_questions=8)
    held = [json.loads(r["vf_input"]) for r in task.eval]
    assert [r["question"] for r in held] == [mod.question(s)[0] for s in range(4, 9)]
    by_question = {r["question"]: r for r in held}

    def policy(text: str) -> list[str]:
        row = next(r for q, r in by_question.items() if q in text)
        a = int(mod.QUESTION.fullmatch(row["question"]).group(1))
        return [r if a % 2 else r.replace(row["answer"], str(int(row["answer"]) + 1)) for r in mod.demonstration(row)]

    odd = sum(int(mod.QUESTION.fullmatch(r["question"]).group(1)) % 2 for r in held)
    cfg = GRPOJobConfig()
    cfg.task, cfg.rollout.max_new_tokens = "verifiers", 64
    out = asyncio.run(build_evaluation(cfg, task, tokenizer)(ScriptPolicy(tokenizer, policy)))
    assert out["eval_n"] == 5.0 and out["eval_failed"] == 0.0 and 0 < odd < 5
    assert out["eval_reward"] == pytest.approx(odd / 5) and out["eval_reward_calculator_calls"] == 1.0
