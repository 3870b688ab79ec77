"""PythonInterpreter in a ChatEnv, tool-using agent episodes (token-exact, tool tokens masked), executor service."""
from __future__ import annotations

import asyncio

import pytest
import torch
from tensordict import TensorDict

from rayllm_rl.agents.tool_agent import ToolAgentWorkflow
from rayllm_rl.envs.chat_env import ChatEnv
from rayllm_rl.inference.protocol import LLMRequest, LLMResponse, SamplingParams
from rayllm_rl.tools.python_interpreter import PythonInterpreter, extract_code_blocks
from rayllm_rl.tools.sandbox import PythonSandbox
from ray_sessions import local_ray_session

CODE_TURN = "Let me compute.\n```python\nx = 6 * 7\nprint(x)\n```"


def step_with(env, td, text):
    elem = td.unbind(0)[0]
    elem["history"].full = elem["history"].prompt.append({"role": "assistant", "content": text})
    return env.step(td)


def last_message(td):
    return td[0]["history"].prompt.to_chat()[-1]


@pytest.mark.slow
def test_python_interpreter_runs_blocks_in_the_sandbox(tokenizer):
    assert extract_code_blocks("a\n```python\nprint(1)\n```\n```py\nprint(2)\n```\n```\nnot python\n```") == [
        "print(1)\n", "print(2)\n"]
    env = ChatEnv(tokenizer, batch_size=1).append_transform(PythonInterpreter(PythonSandbox(), timeout_s=10))
    td = env.reset(TensorDict(query=["What is 6*7?"], batch_size=[1]))
    nxt = env.step_mdp(step_with(env, td, CODE_TURN))
    msg = last_message(nxt)
    assert msg == {"role": "tool",
                   "content": "<tool_response>\nCode block 1 executed successfully:\n42\n\n</tool_response>"}
    # an error: the traceback comes back to the model, the rollout goes on
    nxt = env.step_mdp(step_with(env, nxt, "```python\n1/0\n```"))
    content = last_message(nxt)["content"]
    assert "Code block 1 failed (exit code 1)" in content and "ZeroDivisionError" in content
    # no code: nothing added
    before = nxt[0]["history"].prompt.batch_size[0]
    nxt = env.step_mdp(step_with(env, nxt, "The answer is 42."))
    assert nxt[0]["history"].prompt.batch_size[0] == before + 1


@pytest.mark.slow
def test_persistent_session_and_broken_executor(tokenizer):
    env = ChatEnv(tokenizer, batch_size=1).append_transform(PythonInterpreter(persistent=True, tool_role="user"))
    td = env.reset(TensorDict(query=["q"], batch_size=[1]))
    td = env.step_mdp(step_with(env, td, "```python\nx = 5\nprint('set')\n```"))
    td = env.step_mdp(step_with(env, td, "```python\nprint(x * 2)\n```"))
    msg = last_message(td)
    assert msg["role"] == "user" and "executed successfully:\n10\n" in msg["content"] and "set" not in msg["content"]

    class Broken:
        def run(self, code, timeout):
            raise ConnectionError("executor down")

    interp = PythonInterpreter(Broken())
    env = ChatEnv(tokenizer, batch_size=1).append_transform(interp)
    td = env.step_mdp(step_with(env, env.reset(TensorDict(query=["q"], batch_size=[1])), CODE_TURN))
    assert "could not be run: ConnectionError: executor down" in last_message(td)["content"]
    assert interp.num_errors == 1


class ScriptedEngine:
    """Plays the policy with fixed replies (the tiny model cannot write code): an InferenceEngine
    whose outputs are the tokens of the next scripted text plus <|im_end|>."""

    def __init__(self, tokenizer, replies):
        self.tokenizer, self.replies, self.calls = tokenizer, list(replies), []

    async def agenerate(self, req: LLMRequest) -> LLMResponse:
        text = self.replies[len([c for c in self.calls if c.rid == req.rid])]
        out = (self.tokenizer(text, add_special_tokens=False)["input_ids"]
               + [self.tokenizer.convert_tokens_to_ids("<|im_end|>")])
        resp = LLMResponse(input_tokens=list(req.input_ids), output_tokens=out,
                           output_logprobs=[-0.25 - 0.01 * i for i in range(len(out))],
                           output_versions=[3] * len(out), stop_reason="stop", rid=req.rid)
        self.calls.append(resp)
        return resp


@pytest.mark.slow
def test_tool_agent_episode_is_token_exact_and_masks_tool_output(tokenizer):
    def reward(prompt, completions, prompt_ids, completion_ids, answer=None, **row):
        return {"reward": float(str(answer) in completions), "answered": 1.0}

    reward.component_keys = ("answered",)
    engine = ScriptedEngine(tokenizer, [CODE_TURN, "<answer>42</answer>"])
    wf = ToolAgentWorkflow(tokenizer, lambda: [PythonInterpreter(PythonSandbox(), done_when_no_code=True)],
                           SamplingParams(max_new_tokens=64), reward_fn=reward, group_size=1, max_turns=4)
    out = asyncio.run(wf.arun_episode(engine, {"messages": [{"role": "user", "content": "6*7?"}], "answer": "42"}))
    first, second = engine.calls
    n = int(out["attention_mask"][0].sum())
    ids, mask = out["input_ids"][0, :n].tolist(), out["loss_mask"][0, :n].tolist()
    assert ids == second.input_tokens + second.output_tokens
    assert second.input_tokens[: first.input_len + first.output_len] == first.input_tokens + first.output_tokens
    tool_ids = second.input_tokens[first.input_len + first.output_len:]
    tool_text = tokenizer.decode(tool_ids)
    assert "<tool_response>\nCode block 1 executed successfully:\n42\n" in tool_text
    for resp in (first, second):
        s = resp.input_len
        assert all(mask[s:s + resp.output_len])
        assert torch.allclose(out["logprobs"][0, s:s + resp.output_len], torch.tensor(resp.output_logprobs))
        assert out["versions"][0, s:s + resp.output_len].tolist() == [3] * resp.output_len
    assert sum(mask) == first.output_len + second.output_len  # the tool's tokens are not trained on
    assert out["rewards"].tolist() == [1.0] and out["answered"].tolist() == [1.0] and out["num_turns"].tolist() == [2.0]


@pytest.mark.ray
@pytest.mark.slow
def test_python_tool_job_workflow_runs_the_model_code_in_the_sandbox(tokenizer):
    """rollout.workflow=python_tool: the job builds a tool agent on the task; its final turn gets the task reward."""
    from rayllm_rl.config import load_config
    from rayllm_rl.orchestration.factories import PYTHON_TOOL_PROMPT, build_task, build_workflow
    from rayllm_rl.job.config import GRPOJobConfig

    cfg = load_config(GRPOJobConfig, ["rollout.workflow=python_tool", "rollout.max_turns=3",
                                      "rollout.group_size=2"]).validate()
    task = build_task(cfg)
    wf = build_workflow(cfg, task, tokenizer)
    assert isinstance(wf, ToolAgentWorkflow)
    row = task.train[0]
    a, b = row["a"], row["b"]
    engine = ScriptedEngine(tokenizer, [f"```python\nprint({a} + {b})\n```", f"<answer>{a + b}</answer>"])
    out = asyncio.run(wf.arun_episode(engine, {**row, "group_id": 1}))
    assert out.batch_size[0] == 2 and out["num_turns"].tolist() == [2.0, 2.0]
    assert out["rewards"].tolist() == [1.0, 1.0]  # the arithmetic reward, scored on the final turn
    text = tokenizer.decode(out["input_ids"][0][out["attention_mask"][0].bool()])
    assert PYTHON_TOOL_PROMPT in text and f"executed successfully:\n{a + b}\n" in text
    assert "executed successfully" not in tokenizer.decode(out["input_ids"][0][out["loss_mask"][0]])


@pytest.fixture(scope="module")
def local_ray():
    import ray  # a core dependency: missing ray is a failure, not a skip

    with local_ray_session("test_tool_agents", num_cpus=2):
        yield ray


@pytest.mark.ray
@pytest.mark.slow
def test_python_executor_service_is_shared(local_ray):
    from rayllm_rl.orchestration.ray.tool_services import RemoteExecutor, python_executor_service

    a = python_executor_service(max_parallel=2)
    b = python_executor_service()  # the same named actor
    results = [RemoteExecutor(h).run(f"print({i} * 3)", timeout=10) for i, h in enumerate([a, b, a])]
    assert [r.stdout for r in results] == ["0\n", "3\n", "6\n"]
    assert local_ray.get(b.stats.remote())["runs"] == 3
    slow = RemoteExecutor(a).run("while True: pass", timeout=1)
    assert slow.timed_out or slow.exit_code != 0
    # the Ray backend hands this tool factory to the python_tool workflow: it uses this same service
    from rayllm_rl.orchestration.ray.tool_services import ray_python_tools

    (interp,) = ray_python_tools()
    assert isinstance(interp.executor, RemoteExecutor) and interp.executor.run("print(1)").stdout == "1\n"
    assert local_ray.get(b.stats.remote())["runs"] == 5
