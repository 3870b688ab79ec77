"""task=openenv: an OpenEnv `Environment` written here and TRL's `environment_factory` form of the same game, played
token-in/token-out by the tiny model, trained on the local backend and on Ray; and the adapter's parts without Ray
(observation -> turn, reply -> action, reward / done, the three failure causes).

Runs in .venv-envs (openenv 0.10 cannot share .venv with the `mcp` extra: docs/environments.md); `make test`
runs it there, and conftest.py leaves it out of a venv without openenv.

The game (`CountEnv`): reset(seed) picks a digit t = seed % 10 and says "Say t."; each step's reward is
`step_reward(answer, digit asked)`, and the next observation asks for the next digit; the episode ends after
`STEPS` steps. The tiny model's replies are read whole as the answer (`parse_answer`, the user's action parser), so
every episode lasts exactly `STEPS` turns and the test knows each observation the model was shown.
"""
from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import pytest
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State

from job_helpers import ScriptPolicy, replies_of, rl_records, trace_samples
from ray_sessions import JOB_ENV, local_ray_session

STEPS = 2
"""Steps of a CountEnv episode (its observations ask for t, then t + 1)."""


class SayAction(Action):
    """Say something."""

    answer: str


class SayObservation(Observation):
    prompt: str = ""


def ask(digit: int) -> str:
    return f"Say {digit % 10}."


def step_reward(answer: str, digit: int) -> float:
    """1 for an answer holding the digit asked, else 1 / (1 + its ASCII letters): dense, so the tiny model's random
    replies score apart (the share of a step a word costs), and computable from a trace's text."""
    if str(digit % 10) in answer:
        return 1.0
    return 1.0 / (1 + sum(c.isascii() and c.isalpha() for c in answer))


class CountEnv(Environment[SayAction, SayObservation, State]):
    """The OpenEnv form: digits to say, one per step (see the module docstring)."""

    def __init__(self):
        super().__init__()
        self._state = State()
        self.target = 0

    def reset(self, seed=None, episode_id=None, **kwargs) -> SayObservation:
        self._state = State(episode_id=episode_id, step_count=0)
        self.target = int(seed or 0) % 10
        return SayObservation(prompt=ask(self.target))

    def step(self, action: SayAction, timeout_s=None, **kwargs) -> SayObservation:
        asked = (self.target + self._state.step_count) % 10
        self._state.step_count += 1
        done = self._state.step_count >= STEPS
        return SayObservation(prompt="" if done else ask(asked + 1), reward=step_reward(action.answer, asked),
                              done=done)

    @property
    def state(self) -> State:
        return self._state


def parse_answer(text: str) -> SayAction:
    """The user's action parser: the whole reply is the answer."""
    return SayAction(answer=text)


def parse_to_dict(text: str) -> dict:
    """A parser giving the action's fields (the adapter builds the Action)."""
    return {"answer": text}


class CountToolEnv:
    """TRL's environment_factory form of the same game: `say` is the tool, `get_reward` the environment's reward."""

    def __init__(self):
        self.target, self.said, self.reward = 0, 0, 0.0

    def reset(self, **row) -> str | None:
        self.target, self.said, self.reward = int(row["seed"]) % 10, 0, 0.0
        return " " + ask(self.target)

    def say(self, answer: str) -> str:
        """
        Say a digit.

        Args:
            answer: The digit to say.

        Returns:
            What to say next.
        """
        if self.said >= STEPS:
            raise ValueError("Game over.")
        self.reward += step_reward(answer, self.target + self.said)
        self.said += 1
        return ask(self.target + self.said)

    def get_reward(self) -> float:
        return self.reward


def say_everything(text: str) -> list:
    """The user's tool parser for the tiny model: every reply is one call of `say` with the reply as the answer."""
    return [("say", {"answer": text})]


def said_digits(environments, **kwargs) -> list[float]:
    """A TRL-style reward function reading the environments: how many times the digit asked was said."""
    return [float(env.reward) for env in environments]


# ---------------------------------------------------------------------------- adapter parts, no Ray
def cfg_of(**keys):
    from rayllm_rl.environments.config import OpenEnvConfig

    return OpenEnvConfig(**keys)


def test_a_tool_call_becomes_the_action_and_a_bad_reply_an_invalid_action():
    from rayllm_rl.environments.actions import InvalidAction, ReplyReader, action_class_of

    reader = ReplyReader(tool_name="step")
    assert action_class_of(CountEnv) is SayAction
    action = reader.action('<tool_call>{"name": "step", "arguments": {"answer": "7"}}</tool_call>', SayAction)
    assert isinstance(action, SayAction) and action.answer == "7"
    for reply, why in (("7", "no tool call"), ('<tool_call>{"name": "jump", "arguments": {}}</tool_call>',
                                                "unknown tool 'jump'"),
                       ('<tool_call>{"name": "step", "arguments": {"x": 1}}</tool_call>', "SayAction refused")):
        with pytest.raises(InvalidAction, match=why):
            reader.action(reply, SayAction)
    assert reader.action('<tool_call>{"name": "step", "arguments": {"answer": "1"}}</tool_call>', None) == \
        {"answer": "1"}  # a remote environment takes the fields as a dict
    assert ReplyReader(parse_answer).action("4 4", SayAction).answer == "4 4"


def test_an_observation_is_the_next_turn_and_reward_and_done_come_from_it():
    from rayllm_rl.environments.actions import ReplyReader, observation_text
    from rayllm_rl.environments.source import resolve_source

    assert observation_text(SayObservation(prompt="Say 3.", reward=1.0)) == "Say 3."
    assert json.loads(observation_text({"a": 1, "b": "x", "done": False})) == {"a": 1, "b": "x"}
    source = resolve_source(cfg_of(action_parser="test_openenv:parse_answer"), CountEnv)
    assert source.form == "openenv" and source.tools == () and isinstance(source.reader, ReplyReader)

    async def play():
        session = await source.open()
        first = await session.start({"seed": 13})
        one = await session.act("3")
        two = await session.act("ok 5")  # 4 was asked
        return first, one, two, await session.env_reward(), await session.state()

    first, one, two, total, state = asyncio.run(play())
    assert state["step_count"] == STEPS
    assert first == "Say 3."
    assert (one.messages, one.reward, one.done) == ([{"role": "user", "content": "Say 4."}], 1.0, False)
    assert (two.messages, two.reward, two.done) == ([], pytest.approx(1 / 3), True)  # 4 was asked: 2 letters
    assert total == pytest.approx(4 / 3)


class AsyncCountEnv(CountEnv):
    """CountEnv whose async twins are its own (its sync methods refuse): the adapter must await them."""

    def reset(self, seed=None, episode_id=None, **kwargs):
        raise RuntimeError("the sync reset ran")

    def step(self, action, timeout_s=None, **kwargs):
        raise RuntimeError("the sync step ran")

    async def reset_async(self, seed=None, episode_id=None, **kwargs):
        await asyncio.sleep(0)
        return CountEnv.reset(self, seed=seed, **kwargs)

    async def step_async(self, action, timeout_s=None, **kwargs):
        await asyncio.sleep(0)
        return CountEnv.step(self, action)


def test_an_environments_own_async_twins_are_awaited_and_a_parsers_dict_becomes_its_action():
    from rayllm_rl.environments.source import resolve_source

    source = resolve_source(cfg_of(action_parser="test_openenv:parse_to_dict", reset_kwargs={"level": 1}),
                            AsyncCountEnv)

    async def play():
        session = await source.open()
        return await session.start({"seed": 2}), await session.act("2 and 3"), await session.act("xy 3")

    first, one, two = asyncio.run(play())
    assert first == "Say 2." and (one.reward, one.done) == (1.0, False) and (two.reward, two.done) == (1.0, True)


def test_a_trl_tool_that_raises_or_is_unknown_answers_the_model_as_trl_does():
    from rayllm_rl.environments.source import resolve_source

    source = resolve_source(cfg_of(), CountToolEnv)
    call = '<tool_call>{{"name": "{}", "arguments": {{"answer": "{}"}}}}</tool_call>'

    async def play():
        session = await source.open()
        first = await session.start({"seed": 5, "messages": []})
        steps = [await session.act(call.format("say", d)) for d in (5, 6)]
        steps.append(await session.act(call.format("say", 7) + call.format("shout", 1)))
        steps.append(await session.act("no call"))
        return first, steps, await session.env_reward()

    first, steps, reward = asyncio.run(play())
    assert first == " Say 5." and reward == 2.0
    assert [s.messages for s in steps[:2]] == [[{"role": "tool", "content": "Say 6."}],
                                               [{"role": "tool", "content": "Say 7."}]]
    assert steps[2].messages == [{"role": "tool", "content": '{"error": "Game over."}'},
                                 {"role": "tool", "content": '{"error": "Tool shout not found."}'}]
    assert [(s.invalid, s.tool_calls, s.done) for s in steps] == [
        (False, 1, False), (False, 1, False), (True, 2, False), (False, 0, True)]


def test_the_tool_form_lists_the_action_as_a_tool_and_a_trl_class_its_methods():
    from rayllm_rl.environments.source import resolve_source

    tool = resolve_source(cfg_of(tool_name="say_it"), CountEnv).tools[0]["function"]
    assert tool["name"] == "say_it" and list(tool["parameters"]["properties"]) == ["answer"]
    trl = resolve_source(cfg_of(), CountToolEnv)
    assert trl.form == "trl"
    assert [t["function"]["name"] for t in trl.tools] == ["say"]
    assert trl.tools[0]["function"]["parameters"]["properties"]["answer"]["description"] == "The digit to say."


def test_tools_reach_the_prompt_through_the_template_or_a_hermes_block(tokenizer, tools_model):
    """The first observation is appended to the last user message (TRL's rule); the tools go through `tools=` when
    the chat template renders them, else into a Hermes `<tools>` system block (the tiny model's plain ChatML)."""
    from transformers import AutoTokenizer

    from rayllm_rl.environments.source import resolve_source
    from rayllm_rl.environments.workflow import prompt_messages

    tools = list(resolve_source(cfg_of(), CountToolEnv).tools)
    row = {"messages": [{"role": "user", "content": "Play:"}]}
    messages, kwargs = prompt_messages(row, " Say 1.", tools, tokenizer)
    assert kwargs == {} and messages[1] == {"role": "user", "content": "Play: Say 1."}
    assert messages[0]["role"] == "system" and '<tools>\n{"type": "function", "function": {"name": "say"' in \
        messages[0]["content"]
    messages, kwargs = prompt_messages(row, " Say 1.", tools, AutoTokenizer.from_pretrained(tools_model))
    assert kwargs == {"tools": tools} and messages == [{"role": "user", "content": "Play: Say 1."}]
    assert prompt_messages({"messages": []}, "Say 2.", [], tokenizer)[0] == [{"role": "user", "content": "Say 2."}]
    with pytest.raises(ValueError, match="no user turn"):
        prompt_messages({"messages": []}, None, [], tokenizer)


def test_bad_environments_fail_before_anything_starts_naming_the_problem():
    from rayllm_rl.environments.source import resolve_source

    with pytest.raises(ValueError, match="needs one environment.*none was given"):
        resolve_source(cfg_of())
    with pytest.raises(ValueError, match="not an instance"):
        resolve_source(cfg_of(), CountEnv())

    class Undocumented(CountToolEnv):
        def shout(self, word: str) -> str:
            return word

    with pytest.raises(ValueError, match="Undocumented.shout is a tool.*Args:"):
        resolve_source(cfg_of(), Undocumented)
    with pytest.raises(ValueError, match="cannot import data.openenv.env='nope:Env'"):
        cfg_of(env="nope:Env").check()

    from types import SimpleNamespace

    from rayllm_rl.environments.task import make_task
    from rayllm_rl.job.config import DataConfig

    class Silent:  # a TRL environment without get_reward, and no reward function
        def reset(self, **row):
            return None

    with pytest.raises(ValueError, match="Silent has no get_reward\\(\\) and no reward function was given"):
        make_task(DataConfig(eval_size=0), 0, SimpleNamespace(environment=Silent, reward_fns=(), reward_weights=()))
    with pytest.raises(ValueError, match="cannot import data.openenv.demonstration='test_openenv:nowhere'"):
        make_task(DataConfig(openenv=cfg_of(demonstration="test_openenv:nowhere")), 0,
                  SimpleNamespace(environment=CountToolEnv))
    task = make_task(DataConfig(eval_size=0, openenv=cfg_of(env="test_openenv:CountEnv", prompt="Go:", train_size=3,
                                                            seed=7, action_parser="test_openenv:parse_answer")))
    assert task.train.to_list() == [{"messages": [{"role": "user", "content": "Go:"}], "seed": s} for s in (7, 8, 9)]
    assert len(task.eval) == 0 and task.workflow is not None and task.demonstrate is None
    held = make_task(DataConfig(eval_size=2, openenv=cfg_of(env="test_openenv:CountEnv", prompt="Go:", train_size=3,
                                                            seed=7, action_parser="test_openenv:parse_answer")))
    assert [r["seed"] for r in held.eval] == [10, 11]  # after the training rows' seeds: never trained on


class Boom(CountEnv):
    def step(self, action, timeout_s=None, **kwargs):
        raise RuntimeError("the simulator crashed")


class Slow(CountEnv):
    def step(self, action, timeout_s=None, **kwargs):
        time.sleep(1.0)  # past call_timeout_s=0.3: the thread ends on its own after the sample failed
        return super().step(action)


def episode_of(tiny_model_path, env, **cfg_keys):
    """One group of 2 episodes of `env` with the real tiny engine, as the collector runs it (`run_group`, the
    failure policy `drop`)."""
    from transformers import AutoTokenizer

    from rayllm_rl.environments.rewards import EpisodeReward
    from rayllm_rl.environments.source import resolve_source
    from rayllm_rl.environments.task import make_workflow
    from rayllm_rl.envs.task import Task
    from rayllm_rl.inference.protocol import SamplingParams
    from rayllm_rl.inference.transformers.engine import TransformersEngine
    from rayllm_rl.rollout.failures import FailurePolicy, run_group

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    source = resolve_source(cfg_of(action_parser="test_openenv:parse_answer", prompt="Game:", **cfg_keys), env)
    task = Task("openenv", None, None, EpisodeReward())
    workflow = make_workflow(tokenizer, SamplingParams(max_new_tokens=5), 2, STEPS, task, source=source)
    engine = TransformersEngine(tiny_model_path, seed=0, device="cpu")

    async def go():
        await engine.start()
        try:
            return await run_group(workflow, engine, {"messages": [{"role": "user", "content": "Game:"}], "seed": 4,
                                                      "group_id": 7}, FailurePolicy("drop", group_size=2))
        finally:
            await engine.aclose()

    return asyncio.run(go())


@pytest.mark.parametrize("env, keys, cause", [(Boom, {}, "raised"), (Slow, {"call_timeout_s": 0.3}, "timeout")],
                         ids=["raises", "times_out"])
def test_an_environment_that_raises_or_hangs_fails_its_samples_by_cause_never_a_zero(tiny_model_path, env, keys,
                                                                                     cause):
    result = episode_of(tiny_model_path, env, **keys)
    assert result.causes == {cause: 2} and result.episode is None and result.dropped


@pytest.fixture()
def count_server():
    """CountEnv served by OpenEnv's own `create_app` with uvicorn on 127.0.0.1 (a port of its own), in a thread:
    `(base_url, stop)`; stopped after the test if it still runs."""
    import threading

    import uvicorn
    from openenv.core.env_server.http_server import create_app

    server = uvicorn.Server(uvicorn.Config(create_app(CountEnv, SayAction, SayObservation, env_name="count"),
                                           host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, name="count-server", daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the OpenEnv server did not start"
        time.sleep(0.05)
    port = server.servers[0].sockets[0].getsockname()[1]

    def stop():
        server.should_exit = True
        thread.join(timeout=15)
        assert not thread.is_alive()

    yield f"http://127.0.0.1:{port}", stop
    if thread.is_alive():
        stop()


def test_a_running_server_plays_through_openenvs_client_and_its_loss_is_server_lost(count_server):
    """`base_url`: the tool's schema comes from the server's /schema, the episode runs over OpenEnv's
    GenericEnvClient; the server going away mid-episode is `server_lost`, and a refused connection too."""
    import socket

    from rayllm_rl.data.failures import cause_of
    from rayllm_rl.environments.source import resolve_source

    base_url, stop = count_server
    source = resolve_source(cfg_of(base_url=base_url))
    assert source.form == "remote" and source.tools[0]["function"]["parameters"]["required"] == ["answer"]
    call = '<tool_call>{{"name": "step", "arguments": {{"answer": "{}"}}}}</tool_call>'

    async def play():
        session = await source.open()
        first = await session.start({"seed": 13})
        one = await session.act(call.format(3))
        state = await session.state()
        stop()
        with pytest.raises(ConnectionError) as lost:
            await session.act(call.format(4))
        return first, one, state, lost.value

    first, one, state, lost = asyncio.run(play())
    assert first == "Say 3." and state["step_count"] == 1
    assert (one.messages, one.reward, one.done, one.tool_calls) == ([{"role": "tool", "content": "Say 4."}], 1.0,
                                                                     False, 1)
    assert cause_of(lost) == "server_lost"

    with socket.socket() as s:  # a port that was free a moment ago: nothing listens there
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]

    async def refused():
        session = await resolve_source(cfg_of(base_url=f"http://127.0.0.1:{port}",
                                              action_parser="test_openenv:parse_answer")).open()
        await session.start({"seed": 1})

    with pytest.raises(ConnectionError) as info:
        asyncio.run(refused())
    assert cause_of(info.value) == "server_lost"


# ---------------------------------------------------------------------------- jobs: local and Ray, both forms
JOB = ["trainer.steps=2", "rollout.prompts_per_step=2", "rollout.group_size=4", "rollout.max_new_tokens=6",
       f"rollout.max_turns={STEPS}", "sft.steps=0", "data.eval_size=0", "trainer.eval_every=0", "trainer.log_every=100",
       "trainer.call_timeout_s=120", "data.openenv.train_size=64", "data.openenv.prompt=Play:"]
"""2 RL steps of 2 prompts x 4 episodes of `STEPS` turns of at most 6 tokens, no warm start, no eval."""
OPENENV = [*JOB, "task=openenv", "data.openenv.env=test_openenv:CountEnv",
           "data.openenv.action_parser=test_openenv:parse_answer", "data.eval_size=3"]
"""The OpenEnv form also evaluates 3 held-out seeds before RL and after (one greedy episode each, on the driver)."""
TRL = [*JOB[:4], f"rollout.max_turns={STEPS + 1}", *JOB[5:], "data.openenv.tool_parser=test_openenv:say_everything"]
"""The TRL form given as objects (`GRPOTrainer(environment_factory=..., reward_funcs=...)`); STEPS + 1 turns: the
third call of `say` answers {"error": "Game over."}, fed back as TRL does, and max_turns ends the episode."""


TOOLS_BLOCK = ("{% if tools %}<|im_start|>system\nTools: {% for t in tools %}{{ t.function.name }}"
               "({{ t.function.parameters.properties | list | join(', ') }}) {% endfor %}<|im_end|>\n{% endif %}")
"""A compact tool list at the start of the chat, as real models' templates render `tools=` (the Hermes block the
prompt gets under a template without tools would not fit the tiny model's 512 positions with three turns)."""


@pytest.fixture(scope="module")
def tools_model(tiny_model_path, tmp_path_factory) -> str:
    """The tiny model with a chat template that renders `tools=` (`TOOLS_BLOCK` before its ChatML)."""
    import shutil

    path = tmp_path_factory.mktemp("tools_model") / "model"
    shutil.copytree(tiny_model_path, path)
    template = path / "chat_template.jinja"
    template.write_text(TOOLS_BLOCK + template.read_text())
    return str(path)


def openenv_job(tmp_path, backend: str, model: str):
    """The OpenEnv form by import path (`data.openenv.env`, `data.openenv.action_parser`)."""
    from rayllm_rl import train

    return train(overrides=[*OPENENV, f"model.path={model}", f"trainer.backend={backend}",
                            f"trainer.run_dir={tmp_path}"])


def trl_job(tmp_path, backend: str, model: str):
    """The TRL form as a TRL user writes it: the class and the reward function as objects."""
    from rayllm_rl import GRPOTrainer

    return GRPOTrainer(model, environment_factory=CountToolEnv, reward_funcs=said_digits,
                       args=[*TRL, f"trainer.backend={backend}", f"trainer.run_dir={tmp_path}"]).train()


def prompt_digit(sample) -> int:
    """The digit the episode's first observation asked for, read from the traced prompt ("Say t.")."""
    import re

    return int(re.findall(r"Say (\d)\.", sample["prompt"])[-1])


def check_rewards(summary, form: str) -> None:
    """The TRL form's reward: `get_reward` (env_reward) plus `said_digits`, which counts the same digits; its
    third call of `say` each episode answered {"error": "Game over."} (an invalid action, fed back)."""
    if form != "trl":
        return
    for rec in rl_records(summary):
        assert rec["reward"] == pytest.approx(2 * rec["env_reward"]) and rec["tool_calls"] == STEPS + 1
        assert rec["invalid_actions"] == 1.0


def check_env_job(summary, tokenizer, form: str) -> None:
    """2 steps trained on episodes of exactly `turns` turns, none failed; each traced row's turns token by token
    (`replies_of`), and its reward recomputed from its replies: the environment's (`step_reward` of each answer
    against the digit asked, the first asked in the row's prompt) and, in the TRL form, `said_digits` (the same sum)
    added to it."""
    turns = STEPS if form == "openenv" else STEPS + 1
    role = "user" if form == "openenv" else "tool"
    rl = rl_records(summary)
    assert summary["steps"] == 2 and len(rl) == 2 and summary["failed_episodes"] == 0
    for rec in rl:
        assert rec["num_turns"] == turns and rec["seqs"] == 2 * 4 and rec["env_done"] == float(form == "openenv")
        assert rec.get("env_steps", STEPS) == STEPS and ("env_steps" in rec) == (form == "openenv")  # state.step_count
    samples = trace_samples(summary)
    assert len(samples) == 2 * 4  # 4 traced rows a step (learner/trace_rows.py)
    rewards = []
    for sample in samples:
        target = prompt_digit(sample)
        replies = replies_of(sample, tokenizer, turns,
                             lambda k, _reply: [{"role": role, "content": ask(target + k + 1)}])
        env_reward = sum(step_reward(reply, target + k) for k, reply in enumerate(replies[:STEPS]))
        assert sample["components"]["env_reward"] == pytest.approx(env_reward, abs=1e-5)
        assert sample["reward"] == pytest.approx(env_reward * (2 if form == "trl" else 1), abs=1e-5)
        rewards.append(env_reward)
    assert len(set(rewards)) > 1  # dense: the replies scored apart
    if form == "openenv":  # the held-out seeds 64-66 (after the 64 training rows), each one greedy episode of 2 turns
        for held in (summary["eval_before"], summary["eval_after"]):
            assert (held["eval_n"], held["eval_failed"], held["eval_num_turns"], held["eval_env_done"]) == (
                3.0, 0.0, float(STEPS), 1.0)
            assert 0.0 <= held["eval_reward"] == held["eval_env_reward"] <= STEPS


@pytest.mark.slow
@pytest.mark.parametrize("form", ["openenv", "trl"])
def test_an_environment_trains_on_the_local_backend_token_by_token(form, tmp_path, tokenizer, tools_model):
    summary = (openenv_job if form == "openenv" else trl_job)(tmp_path, "local", tools_model)
    assert summary["backend"] == "local"
    check_env_job(summary, tokenizer, form)
    check_rewards(summary, form)


class Flaky(CountEnv):
    """CountEnv whose every 3rd instance's step raises and every 4th's hangs past `data.openenv.call_timeout_s`
    (instances count in this process: the local backend's)."""

    made = 0

    def __init__(self):
        super().__init__()
        Flaky.made += 1
        self.nth = Flaky.made

    def step(self, action, timeout_s=None, **kwargs):
        if self.nth % 3 == 0:
            raise RuntimeError("the simulator crashed")
        if self.nth % 4 == 0:
            time.sleep(1.0)  # past call_timeout_s=0.3; the thread ends on its own after the sample failed
        return super().step(action)


@pytest.mark.slow
def test_a_job_whose_environment_raises_or_hangs_finishes_training_on_the_finished_episodes(tmp_path, tools_model):
    """The local backend, 2 steps, `rollout.on_failure=drop`: episodes whose environment raised or hung are failed
    samples counted by cause; each step trains on its groups' finished episodes only (4-8 of 2 x 4, at least
    `min_finished`=2 a group, a group with fewer dropped and replaced), every one of them scored by the environment
    (its step reward is never 0, so a failure scored 0 would show), and the run ends."""
    from rayllm_rl import train

    Flaky.made = 0
    summary = train(overrides=[*JOB, "task=openenv", "data.openenv.env=test_openenv:Flaky",
                               "data.openenv.action_parser=test_openenv:parse_answer",
                               "data.openenv.call_timeout_s=0.3", "rollout.on_failure=drop",
                               f"model.path={tools_model}", "trainer.backend=local", f"trainer.run_dir={tmp_path}"])
    rl = rl_records(summary)
    assert summary["steps"] == 2 and len(rl) == 2
    failures = summary["episode_failures"]
    assert failures["failed_episodes/raised"] > 0 and failures["failed_episodes/timeout"] > 0
    assert summary["failed_episodes"] == failures["failed_episodes/raised"] + failures["failed_episodes/timeout"]
    assert all(4 <= rec["seqs"] <= 8 for rec in rl) and sum(rec["seqs"] for rec in rl) < 16, [r["seqs"] for r in rl]
    samples = trace_samples(summary)
    assert samples and all(sample["reward"] > 0 for sample in samples)


@pytest.fixture(scope="module")
def ray_runs(tmp_path_factory, tools_model):
    """One local Ray, one job per form in it (the environment classes reach the workers through PYTHONPATH)."""
    import os

    tests_dir = os.path.dirname(os.path.abspath(__file__))
    env = {**JOB_ENV, "PYTHONPATH": os.pathsep.join(filter(None, [tests_dir, os.environ.get("PYTHONPATH")]))}
    with local_ray_session("test_openenv", num_cpus=2, runtime_env={"env_vars": env}):
        yield {form: job(tmp_path_factory.mktemp(form), "ray", tools_model) for form, job in (("openenv", openenv_job),
                                                                                             ("trl", trl_job))}


@pytest.mark.slow
@pytest.mark.ray
@pytest.mark.fixture_owned("processes", "shm segments", "named actors")
@pytest.mark.parametrize("form", ["openenv", "trl"])
def test_an_environment_trains_in_ray_env_workers_token_by_token(form, ray_runs, tokenizer):
    summary = ray_runs[form]
    assert summary["backend"] == "ray"
    check_env_job(summary, tokenizer, form)
    check_rewards(summary, form)


# ---------------------------------------------------------------------------- examples/openenv_calculator
CALCULATOR = Path(__file__).resolve().parents[1] / "examples" / "openenv_calculator"


@pytest.fixture(scope="module")
def calculator():
    """The example's modules (its folder on sys.path, as its train.py puts it): the OpenEnv environment, the TRL
    twin and train.py (loaded under a name of its own)."""
    import importlib.util
    import sys

    sys.path.insert(0, str(CALCULATOR))
    sys.modules.pop("calculator_env", None)  # the other example has a calculator_env.py too
    import calculator_env
    import calculator_trl

    spec = importlib.util.spec_from_file_location("openenv_calculator_train", CALCULATOR / "train.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    return calculator_env, calculator_trl, script


def test_the_calculator_environment_poses_evaluates_and_scores(calculator):
    env_mod, _, _ = calculator
    env, act = env_mod.CalculatorEnv(), env_mod.CalculatorAction
    first = env.reset(seed=3)
    assert first.text == "What is 343 * 86? Use the calculator, then answer." and env.reset(seed=3).text == first.text
    for expression, value in (("343 * 86", "29498"), ("(1 + 2) ** 3 - 7 // 2", "24"), ("7 / 2", "3.5"),
                              ("-4", "-4")):
        obs = env.step(act(tool="calculator", argument=expression))
        assert (obs.text, obs.reward, obs.done) == (value, 0.0, False), expression
    for bad, why in (("__import__('os')", "is not allowed"), ("1 +", "is not arithmetic"), ("1/0", "division by zero"),
                     ("2 ** 999", "exponent 999 is over 100"), ("", "empty")):
        obs = env.step(act(tool="calculator", argument=bad))
        assert obs.text.startswith("Error: ") and why in obs.text and not obs.done, (bad, obs.text)
    obs = env.step(act(tool="answer", argument="about 29000"))
    assert obs.text == "Error: the answer must be a number, got 'about 29000'" and not obs.done
    assert env.step(act(tool="answer", argument="29,498")).model_dump(include={"reward", "done"}) == \
        {"reward": 1.0, "done": True}
    env.reset(seed=3)
    assert env.step(act(tool="answer", argument="29497")).model_dump(include={"reward", "done"}) == \
        {"reward": 0.0, "done": True}
    assert env.state.step_count == 1
    with pytest.raises(ValueError, match="tool"):  # the Action refuses another tool: the adapter's invalid action
        act(tool="search", argument="x")


def test_the_calculators_trl_twin_does_the_same_as_trls_environment_factory(calculator):
    from rayllm_rl.environments.source import resolve_source

    _, trl_mod, _ = calculator
    env = trl_mod.CalculatorToolEnv()
    assert env.reset(seed=3, messages=[]) == "What is 343 * 86? Use the calculator, then answer."
    assert env.calculator("343 * 86") == "29498" and env.get_reward() == 0.0
    with pytest.raises(ValueError, match="is not allowed"):  # TRL answers the model {"error": ...}
        env.calculator("open('x')")
    with pytest.raises(ValueError, match="must be a number"):
        env.answer("five")
    assert env.answer("29498") == "Correct." and env.get_reward() == 1.0
    with pytest.raises(ValueError, match="already given"):
        env.answer("29498")
    env.reset(seed=3)
    assert env.answer("1") == "Wrong." and env.get_reward() == 0.0
    tools = resolve_source(cfg_of(), trl_mod.CalculatorToolEnv).tools
    assert [t["function"]["name"] for t in tools] == ["answer", "calculator"]


def calculate_everything(text: str) -> list:
    """A tool parser for the tiny model (which writes no tool call): every reply is a `calculator` call of it."""
    return [("calculator", {"expression": text})]


@pytest.mark.parametrize("form", ["openenv", "trl"])
def test_the_calculator_example_trains_two_local_steps(calculator, form, tmp_path):
    """The example's train.py in process at its small size, 2 steps: the OpenEnv form's replies are no tool calls
    (invalid actions, fed back, 3 turns); the TRL form's are made calculator calls, each answered."""
    _, _, script = calculator
    keys = (["data.openenv.tool_parser=test_openenv:calculate_everything"] if form == "trl" else
            ["sft.steps=2", "sft.batch_size=2", "sft.lr=1e-3", "data.eval_size=2",
             "data.openenv.demonstration=calculator_env:demonstration"])  # 2 x 2 demonstrated episodes, 2 held out
    out = script.main(["--form", form, "--steps", "2", "--backend", "local", "--out", str(tmp_path), *keys])
    assert (out["steps"], out["backend"], out["failed_episodes"], out["turns"]) == (2, "local", 0, 3.0)
    if form == "openenv":
        records = [json.loads(x) for x in (Path(out["run_dir"]) / "metrics.jsonl").read_text().splitlines()]
        sft = [r for r in records if r.get("phase") == "sft"]
        assert [r["sft_step"] for r in sft] == [1, 2] and all(r["loss"] > 0 and r["mismatch_tokens"] == 0 for r in sft)
        assert out["eval_before"]["eval_n"] == out["eval_after"]["eval_n"] == 2.0
    assert out["tool_calls"] == (3.0 if form == "trl" else 0.0) and out["env_done"] == 0.0
    rl = rl_records({"run_dir": out["run_dir"]})
    assert len(rl) == 2 and all(r["seqs"] == 2 * 4 and r["num_turns"] >= 1 for r in rl)
    samples = trace_samples({"run_dir": out["run_dir"]})
    assert samples and all(s["reward"] in (0.0, 1.0) for s in samples)
    assert all("What is " in s["prompt"] and "Tools: " in s["prompt"] for s in samples)


# ---------------------------------------------------------------------------- demonstrations and held-out episodes
QUESTION = __import__("re").compile(r"What is \d+ \* \d+\?")


def calculator_task(calculator, form: str, eval_size: int = 0):
    from types import SimpleNamespace

    from rayllm_rl.environments.task import make_task
    from rayllm_rl.job.config import DataConfig

    env_mod, trl_mod, _ = calculator
    module, env = ("calculator_trl", trl_mod.CalculatorToolEnv) if form == "trl" else ("calculator_env",
                                                                                       env_mod.CalculatorEnv)
    data = DataConfig(eval_size=eval_size)
    data.openenv.train_size, data.openenv.demonstration = 8, f"{module}:demonstration"
    from arithmetic import calculated_answer

    return make_task(data, 0, SimpleNamespace(environment=env, reward_fns=(calculated_answer,),
                                              reward_weights=(0.0,))), getattr(trl_mod if form == "trl" else env_mod,
                                                                              "demonstration")


@pytest.mark.parametrize("form", ["openenv", "trl"])
def test_a_demonstration_is_its_episode_played_through_the_environment_and_only_its_replies_are_trained(
        calculator, form, tmp_path):
    """The SFT batch of 3 rows: each row's trained tokens (loss_mask) are exactly the scripted replies' tokens, each
    closed by the end-of-turn token; the untrained ones hold the environment's observations (the calculator's
    product); the environment rewarded every demonstration (reward 1, its calculator computed the answer)."""
    from transformers import AutoTokenizer

    _, _, script = calculator
    tokenizer = AutoTokenizer.from_pretrained(script.tiny_model_with_tools(tmp_path))
    task, demonstration = calculator_task(calculator, form)
    rows = [task.train[i] for i in range(3)]
    batch = task.demonstrate(tokenizer, rows)
    assert batch["input_ids"].shape[0] == 3 and float(batch["advantages"].abs().sum()) == 0.0
    assert batch["rewards"].tolist() == [1.0] * 3 and batch["reward_calculated_answer"].tolist() == [1.0] * 3
    for i, row in enumerate(rows):
        ids, mask = batch["input_ids"][i].tolist(), batch["loss_mask"][i].tolist()
        replies = demonstration(row)
        want = [t for r in replies for t in tokenizer.encode(r, add_special_tokens=False) + [tokenizer.eos_token_id]]
        assert [t for t, m in zip(ids, mask) if m] == want
        _, answer = __import__("arithmetic").question(row["seed"])
        context = tokenizer.decode([t for t, m, a in zip(ids, mask, batch["attention_mask"][i].tolist())
                                    if a and not m])
        assert "What is " in context and str(answer) in context  # the question and the calculator's product


def test_a_demonstration_that_is_no_solved_episode_is_refused_naming_the_key_and_the_row(calculator, tmp_path):
    """Each broken script fails the warm start naming `data.openenv.demonstration` and the row: one that stops short,
    one with replies left over, one whose reply the environment takes as an invalid action, one that is no list of
    strings, one that raises."""
    from transformers import AutoTokenizer

    from rayllm_rl.environments.task import demonstrations

    _, _, script = calculator
    tokenizer = AutoTokenizer.from_pretrained(script.tiny_model_with_tools(tmp_path))
    task, demonstration = calculator_task(calculator, "openenv")
    source = task.workflow.keywords["source"]
    tool_call = __import__("arithmetic").tool_call

    def batch(fn):
        return demonstrations(source, task.reward_fn, fn, tokenizer, [task.train[1]])

    key_row = r"data.openenv.demonstration of the row with seed=1"
    with pytest.raises(ValueError, match=key_row + " has 1 replies, but its episode asked for reply 2"):
        batch(lambda row: demonstration(row)[:1])
    with pytest.raises(ValueError, match=key_row + " has 3 replies, but its episode ended after 2"):
        batch(lambda row: [*demonstration(row), "and more"])
    with pytest.raises(ValueError, match=key_row + ": the environment took 1 of its replies as invalid actions"):
        batch(lambda row: [tool_call("calculator", {"expression": "1 + 1"}), *demonstration(row)])
    with pytest.raises(ValueError, match=r"data.openenv.demonstration returned 'x' for the row with seed=1: expected"):
        batch(lambda row: "x")
    with pytest.raises(ValueError, match=r"data.openenv.demonstration raised on the row with seed=1: KeyError"):
        batch(lambda row: {}["seed"])


@pytest.mark.parametrize("form", ["openenv", "trl"])
def test_the_held_out_evaluation_plays_one_greedy_episode_per_held_out_seed(calculator, form, tmp_path):
    """`build_evaluation` for task=openenv: 6 held-out rows, seeds after the 8 training rows, each one episode of the
    task's workflow; with a policy that plays the demonstration but answers wrong when the first factor is even,
    eval_reward is exactly the share of odd first factors, and the calculator computed every answer."""
    from transformers import AutoTokenizer

    from rayllm_rl.job.config import GRPOJobConfig
    from rayllm_rl.orchestration.factories import build_evaluation

    _, _, script = calculator
    tokenizer = AutoTokenizer.from_pretrained(script.tiny_model_with_tools(tmp_path))
    task, demonstration = calculator_task(calculator, form, eval_size=6)
    assert [r["seed"] for r in task.eval] == list(range(8, 14)) and len(task.train) == 8
    arithmetic = __import__("arithmetic")
    seeds = {arithmetic.question(s)[0]: s for s in range(8, 14)}

    def script(text: str) -> list[str]:  # the demonstration, with a wrong answer when the first factor is even
        seed = seeds[QUESTION.findall(text)[-1]]
        a, right = arithmetic.operands(seed)[0], arithmetic.question(seed)[1]
        return [r.replace(str(right), str(right + 1)) if a % 2 == 0 else r for r in demonstration({"seed": seed})]

    odd = sum(arithmetic.operands(s)[0] % 2 for s in range(8, 14))
    cfg = GRPOJobConfig()
    cfg.task, cfg.rollout.max_turns, cfg.rollout.max_new_tokens = "openenv", 4, 64
    ticks = []
    out = asyncio.run(build_evaluation(cfg, task, tokenizer)(ScriptPolicy(tokenizer, script), ticks.append))
    turns = 3.0 if form == "trl" else 2.0
    assert out["eval_n"] == 6.0 and out["eval_failed"] == 0.0 and len(ticks) == 6
    assert out["eval_reward"] == pytest.approx(odd / 6) and 0 < odd < 6
    assert out["eval_reward_calculated_answer"] == 1.0 and out["eval_num_turns"] == turns
    assert out["eval_invalid_actions"] == 0.0


def test_a_held_out_episode_that_fails_is_counted_by_cause_never_scored_and_all_failing_is_no_score(calculator,
                                                                                                   tmp_path):
    """The policy raises on the questions whose first factor is even: those episodes are `eval_failed` (cause
    `raised`) and the score is over the others (each right: 1.0, not diluted by zeros); when every episode fails the
    evaluation raises, naming the cause, instead of a score of 0."""
    from transformers import AutoTokenizer

    from rayllm_rl.job.config import GRPOJobConfig
    from rayllm_rl.orchestration.factories import build_evaluation

    _, _, script = calculator
    tokenizer = AutoTokenizer.from_pretrained(script.tiny_model_with_tools(tmp_path))
    task, demonstration = calculator_task(calculator, "openenv", eval_size=6)
    arithmetic = __import__("arithmetic")
    seeds = {arithmetic.question(s)[0]: s for s in range(8, 14)}
    even = sum(1 - arithmetic.operands(s)[0] % 2 for s in range(8, 14))

    def script_or_raise(everywhere: bool):
        def play(text: str) -> list[str]:
            seed = seeds[QUESTION.findall(text)[-1]]
            if everywhere or arithmetic.operands(seed)[0] % 2 == 0:
                raise RuntimeError("the policy's server broke")
            return demonstration({"seed": seed})
        return play

    cfg = GRPOJobConfig()
    cfg.task, cfg.rollout.max_turns, cfg.rollout.max_new_tokens = "openenv", 4, 64
    evaluation = build_evaluation(cfg, task, tokenizer)
    out = asyncio.run(evaluation(ScriptPolicy(tokenizer, script_or_raise(False))))
    assert 0 < even < 6 and out["eval_failed"] == out["eval_failed/raised"] == float(even)
    assert out["eval_reward"] == 1.0 and out["eval_n"] == 6.0
    with pytest.raises(RuntimeError, match=r"every one of the 6 held-out episodes failed \(\{'raised': 6\}\)"):
        asyncio.run(evaluation(ScriptPolicy(tokenizer, script_or_raise(True))))
