"""examples/: each script run as a user runs it (a subprocess, small size), its printed JSON summary checked; and the
pieces each example is about, driven directly (the tutor's token-level episode, the agent's calculator tool path)."""
from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"


def run_script(script: Path, *args: str, cwd: Path, pythonpath: tuple[Path, ...] = (), timeout: int = 500) -> dict:
    """`python <script> <args>` in `cwd` with this checkout first on PYTHONPATH; the last stdout line, as JSON."""
    paths = [str(p) for p in (*pythonpath, ROOT)] + [p for p in [os.environ.get("PYTHONPATH")] if p]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths), "OMP_NUM_THREADS": "1",
           "TOKENIZERS_PARALLELISM": "false"}
    env.pop("RAY_ADDRESS", None)
    out = subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, timeout=timeout,
                         env=env, cwd=cwd)
    assert out.returncode == 0, out.stderr[-4000:]
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    print(json.dumps(summary, indent=1))
    return summary


def load_module(path: Path):
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"example_{path.parent.name}_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(path.parent))  # the example's own imports (tutor, calc_agent) beside it
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(path.parent))
    return module


def test_every_example_has_a_readme_with_its_commands():
    for name, script in (("user_reward", "train.py"), ("multi_turn_env", "train.py"),
                         ("openai_agent_tool", "train.py")):
        readme = (EXAMPLES / name / "README.md").read_text()
        assert f"python examples/{name}/{script}" in readme and "--full" in readme, name


# ---------------------------------------------------------------- (a) your reward on your JSONL


def test_the_scripts_reward_and_myreward_score_alike():
    script, module = (load_module(EXAMPLES / "user_reward" / "train.py"),
                      load_module(EXAMPLES / "user_reward" / "myreward.py"))
    for text in ("<answer>12</answer>", "12", "the sum is 12.", "<answer>11</answer> no, 12", "", "1,2"):
        assert script.score("p", text, [], [], answer="12") == module.score("p", text, [], [], answer="12"), text
    assert module.score("p", "<answer>12</answer>", [], [], answer="12") == {"reward": 1.0, "tagged": 1.0, "right": 1.0}
    assert module.score("p", "I think 12", [], [], answer="12") == {"reward": 0.5, "tagged": 0.0, "right": 1.0}


@pytest.mark.slow
def test_user_reward_example_trains_from_python_and_the_held_out_reward_rises(tmp_path):
    """`python examples/user_reward/train.py trainer.backend=local` (the README's one-process command): the tiny
    model on the script's JSONL rows, the reward defined in the script. The held-out greedy reward rises, its share
    of answers in tags by more items than chance flips explain (GRPO teaches the tags, which carry over to unseen
    sums), and the training reward by more than the run's own noise (tests/learning_bounds.py). This is the suite's
    run of a user's reward learning; test_user_task_jobs shows the same kind of reward and rows reaching the job as
    objects, on both backends, in short runs (until 2026-12-07 they learnt there too: +0.23..+0.32 on both)."""
    from learning_bounds import assert_greedy_gain, assert_rises
    from test_user_task_jobs import HELD_OUT

    s = run_script(EXAMPLES / "user_reward" / "train.py", "--out", str(tmp_path / "out"), "trainer.backend=local",
                   cwd=tmp_path)
    assert (s["preset"], s["backend"], s["steps"], s["held_out_rows"]) == ("small", "local", 60, 30)
    assert Path(s["rows"]).is_file() and len(Path(s["rows"]).read_text().splitlines()) == 70
    assert s["failed_episodes"] == 0 and s["reward_errors"] == 0 and s["reward_calls"] >= 60 * 8 * 8
    assert_greedy_gain(*s["held_out_tagged"], n=s["held_out_rows"], what=HELD_OUT)
    assert s["held_out_reward_after"] > s["held_out_reward_before"], s
    rl = [r["reward"] for r in map(json.loads, (Path(s["run_dir"]) / "metrics.jsonl").read_text().splitlines())
          if r.get("phase") == "rl"]
    assert_rises(rl[:15], rl[-15:], what="training reward, first 15 -> last 15 steps")


@pytest.mark.slow
def test_user_reward_by_import_path_runs_from_jobs_grpo(tmp_path):
    """The README's second command as written: the same reward as `myreward:score` (importable from PYTHONPATH),
    the rows as data.path, task unset (the prompt task); local backend, 2 steps: it finishes and prints the
    summary; its run_dir is absolute, under the directory it started in. (On Ray, through `ray job submit`, the
    same reward by import path: test_ray_job_submit.)"""
    script = load_module(EXAMPLES / "user_reward" / "train.py")
    rows, held = script.write_rows(tmp_path, full=False)
    s = run_script(ROOT / "jobs" / "grpo.py", "reward.fn=myreward:score", f"data.path={rows}", f"data.eval_path={held}",
                   "trainer.backend=local", "trainer.steps=2", "rollout.prompts_per_step=2", "rollout.group_size=2",
                   "rollout.max_new_tokens=6", "data.eval_size=30", "trainer.run_dir=runs", cwd=tmp_path,
                   pythonpath=(EXAMPLES / "user_reward",))
    assert (s["backend"], s["steps"], s["eval_prompts"]) == ("local", 2, 30)
    assert Path(s["run_dir"]).parent == tmp_path / "runs"  # a relative run_dir: under the directory it started from
    config = json.loads((Path(s["run_dir"]) / "config.json").read_text())
    assert config["task"] == "prompts" and config["reward"]["fn"] == ["myreward:score"]
    assert set(s["eval_after"]) == {"eval_reward", "eval_tagged", "eval_right", "eval_n"}
    assert s["reward_failures"]["reward_calls"] >= 2 * 2 * 2 and s["reward_failures"]["reward_errors"] == 0


# ---------------------------------------------------------------- (b) a multi-turn environment, a workflow of your own


def test_the_tutor_appends_its_feedback_as_masked_tokens(engine, tokenizer):
    """One conversation with the real tiny engine (untrained: it never solves, so it gets every try): each try's
    prompt is the trajectory so far (the workflow checks the engine's input), the tutor's words are in the masked
    tokens with logprob 0 and version -1, and what the model wrote is exactly the engine's tokens, trained on."""
    from rayllm_rl.inference.protocol import SamplingParams
    from rayllm_rl.workflows.grouped import GroupedWorkflow

    tutor = load_module(EXAMPLES / "multi_turn_env" / "tutor.py")
    seen: dict[str, list] = {}
    generate = engine.agenerate

    async def spy(req):
        resp = await generate(req)
        seen.setdefault(req.rid, []).append(resp)  # one conversation's tries share a request id
        return resp

    engine.agenerate = spy
    wf = tutor.make_workflow(tutor.answered_right, tokenizer, SamplingParams(max_new_tokens=6), group_size=2,
                             max_turns=3, turn_discount=0.5)
    assert isinstance(wf, GroupedWorkflow)
    # an answer no 6-token try can hold (digits are one token each): every conversation takes all three tries
    out = asyncio.run(wf.arun_episode(engine, {"messages": [{"role": "user", "content": "3+4="}],
                                               "answer": "123456789", "group_id": 5}))
    assert (out["group_id"].tolist() == [5, 5] and out["turns"].tolist() == [3.0, 3.0]
            and out["rewards"].tolist() == [0, 0])
    assert sorted(len(tries) for tries in seen.values()) == [3, 3]
    for i in range(2):
        n = int(out["attention_mask"][i].sum())
        ids, mask = out["input_ids"][i, :n].tolist(), out["loss_mask"][i, :n].tolist()
        mine = next(tries for tries in seen.values() if tries[-1].input_tokens + tries[-1].output_tokens == ids)
        for before, after in zip(mine, mine[1:]):  # each try's prompt continues the one before token for token
            assert (after.input_tokens[:before.input_len + before.output_len]
                    == before.input_tokens + before.output_tokens)
        trained = sum(r.output_len for r in mine)
        assert sum(mask) == trained
        for r in mine:
            s, k = r.input_len, r.output_len
            assert all(mask[s:s + k]) and out["versions"][i, s:s + k].tolist() == r.output_versions
            assert torch.allclose(out["logprobs"][i, s:s + k], torch.tensor(r.output_logprobs))
        masked = [j for j in range(mine[0].input_len, n) if not mask[j]]  # after the prompt: the tutor's turns
        assert masked and all(out["versions"][i, j] == -1 and out["logprobs"][i, j] == 0 for j in masked)
        feedback = tokenizer.decode([ids[j] for j in masked])
        assert feedback.count("Try again") + feedback.count("I see no number") == 2, feedback


def test_the_tutors_feedback_and_discount(tokenizer):
    """A scripted policy answering 5, then 7, to 3+4: the tutor says "too low", the second try solves it and earns
    turn_discount ** 1."""
    from rayllm_rl.inference.protocol import LLMResponse, SamplingParams

    tutor = load_module(EXAMPLES / "multi_turn_env" / "tutor.py")
    t = tutor.Tutor(7)
    assert t.feedback("<answer>9</answer>") == "9 is too high. Try again."
    assert t.feedback("it is 5") == "5 is too low. Try again."
    assert t.feedback("seven") == "I see no number. Answer with a number."
    assert tutor.answered_right("p", "<answer>7</answer>", [], [], answer="7") == 1.0
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")

    class Scripted:
        tries = 0

        async def agenerate(self, req):
            self.tries += 1
            ids = tokenizer(f"<answer>{5 if self.tries == 1 else 7}</answer>",
                            add_special_tokens=False)["input_ids"] + [end]
            return LLMResponse(input_tokens=list(req.input_ids), output_tokens=ids, output_logprobs=[-0.5] * len(ids),
                               output_versions=[0] * len(ids), stop_reason="stop", rid=req.rid)

    agent = tutor.TutorAgent(tutor.answered_right, tokenizer, SamplingParams(max_new_tokens=8), max_turns=3,
                             turn_discount=0.6)
    out = asyncio.run(agent.arun_episode(Scripted(), {"messages": [{"role": "user", "content": "3+4="}], "answer": "7",
                                                      "group_id": 1}))
    assert (out["turns"].tolist() == [2.0] and out["solved"].tolist() == [1.0]
            and out["solved_first_try"].tolist() == [0.0])
    assert out["rewards"].tolist() == [pytest.approx(0.6)]
    masked = tokenizer.decode(out["input_ids"][0][~out["loss_mask"][0] & out["attention_mask"][0]].tolist())
    assert masked.endswith("5 is too low. Try again.<|im_end|>\n<|im_start|>assistant\n"), masked


@pytest.mark.slow
def test_multi_turn_example_trains_through_a_workflow_of_ones_own(tmp_path):
    """`python examples/multi_turn_env/train.py trainer.backend=local`: the tutor's conversations
    (train(workflow=make_workflow)) train the tiny model; the learner saw the tutor's tokens masked, with no policy
    version. (A workflow defined in a script reaching the Ray env workers by value: test_custom_workflow.)"""
    s = run_script(EXAMPLES / "multi_turn_env" / "train.py", "--out", str(tmp_path / "out"), "trainer.backend=local",
                   cwd=tmp_path)
    assert (s["workflow"], s["max_turns"], s["backend"], s["steps"], s["version"]) == ("python:make_workflow", 3,
                                                                                        "local", 20, 20)
    assert s["failed_episodes"] == 0 and s["max_version_lag"] <= 1
    assert 1.0 < s["tries_per_conversation"] <= 3.0  # wrong first tries got feedback and tried again
    fb = s["feedback"]
    assert fb["traced_rows_with_feedback"] > 0 and fb["tutor_tokens"] > 0 and fb["tutor_tokens_with_a_version"] == 0
    assert fb["tutor_words_masked"] and not fb["tutor_words_trained"], fb


@pytest.mark.slow
def test_multi_turn_example_runs_by_import_path_from_jobs_grpo(tmp_path):
    """The README's command line: rollout.workflow=tutor:make_workflow (local backend, 2 steps)."""
    script = load_module(EXAMPLES / "multi_turn_env" / "train.py")
    rows, held = script.write_rows(tmp_path, full=False)
    s = run_script(ROOT / "jobs" / "grpo.py", "reward.fn=tutor:answered_right", "rollout.workflow=tutor:make_workflow",
                   "rollout.max_turns=3", "rollout.turn_discount=0.5", f"data.path={rows}",
                   f"data.eval_path={held}", "trainer.backend=local", "trainer.steps=2", "rollout.prompts_per_step=2",
                   "rollout.group_size=2", "rollout.max_new_tokens=6", "data.eval_size=30", "trainer.run_dir=runs",
                   cwd=tmp_path, pythonpath=(EXAMPLES / "multi_turn_env",))
    assert (s["steps"], s["failed_episodes"]) == (2, 0)
    records = [json.loads(x) for x in (tmp_path / s["run_dir"] / "metrics.jsonl").read_text().splitlines()]
    assert all(1.0 <= r["turns"] <= 3.0 for r in records if r["phase"] == "rl")


# ---------------------------------------------------------------- (c) an OpenAI-SDK agent with a tool


def test_calculator_evaluates_arithmetic_only():
    agent = load_module(EXAMPLES / "openai_agent_tool" / "calc_agent.py")
    assert ([agent.calculator(e) for e in ("17*25", "(2+3)*4", "7/2", "-3 - 4", "2**10")]
            == ["425", "20", "3.5", "-7", "1024"])
    for bad in ("__import__('os')", "x + 1", "2**1000000", "1/0", "2 +"):
        assert agent.calculator(bad).startswith("error:"), bad


def test_the_agent_runs_the_calculator_when_the_model_calls_it(tokenizer):
    """The agent against the real endpoint (ChatCompletionsSession via the openai SDK) and a scripted policy that
    first asks for the calculator, then answers: the tool runs with the model's expression, its result comes back
    as a `tool` message (masked tokens), and the final answer is scored by the example's reward."""
    from rayllm_rl.agents.openai_workflow import OpenAIAgentWorkflow
    from rayllm_rl.inference.protocol import LLMResponse

    agent = load_module(EXAMPLES / "openai_agent_tool" / "calc_agent.py")
    calls = []
    run_tool = agent.calculator
    agent.calculator = lambda expression: calls.append(expression) or run_tool(expression)
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")

    class Scripted:  # the policy: a tool call, then an answer that uses the tool's result
        def __init__(self):
            self.requests, self.outputs = [], []

        async def agenerate(self, req):
            self.requests.append(req)
            text = ('<tool_call>{"name": "calculator", "arguments": {"expression": "17*25"}}</tool_call>'
                    if len(self.requests) == 1 else "<answer>425</answer>")
            ids = tokenizer(text, add_special_tokens=False)["input_ids"] + [end]
            self.outputs.append(ids)
            return LLMResponse(input_tokens=list(req.input_ids), output_tokens=ids, output_logprobs=[-0.25] * len(ids),
                               output_versions=[3] * len(ids), stop_reason="stop", rid=req.rid)

    engine = Scripted()
    wf = OpenAIAgentWorkflow(agent.solve, tokenizer, group_size=1, reward_fn=agent.score, max_tokens=32)
    out = asyncio.run(wf.arun_episode(engine, {"messages": [{"role": "user", "content": "17*25="}], "answer": "425",
                                               "group_id": 9}))
    assert calls == ["17*25"] and len(engine.requests) == 2
    assert (out["num_completions"].tolist() == [2.0] and out["rewards"].tolist() == [1.0]
            and out["right"].tolist() == [1.0])
    n = int(out["attention_mask"][0].sum())
    ids, mask = out["input_ids"][0, :n].tolist(), out["loss_mask"][0, :n].tolist()
    (first, first_out), (second, second_out) = [(r.input_ids, o) for r, o in zip(engine.requests, engine.outputs)]
    assert ids == second + second_out and second[:len(first) + len(first_out)] == first + first_out  # appended only
    assert mask == [0] * len(first) + [1] * len(first_out) + [0] * (len(second) - len(first) - len(first_out)) \
        + [1] * len(second_out)
    tool_turn = tokenizer.decode(second[len(first) + len(first_out):])  # what came back between the two completions
    assert "tool" in tool_turn and "425" in tool_turn, tool_turn  # the calculator's result, as a tool message, masked
    assert "<tool_call>" in tokenizer.decode(first_out) and "<answer>425</answer>" in tokenizer.decode(second_out)
    assert set(out["versions"][0][out["loss_mask"][0]].tolist()) == {3}


@pytest.mark.slow
@pytest.mark.ray
def test_openai_agent_example_trains(tmp_path):
    """`python examples/openai_agent_tool/train.py`: the SDK agent (rollout.agent=calc_agent:solve) runs in the Ray
    env workers and the tiny model trains on its completions (it rarely calls the tool; the test above drives that)."""
    steps = 4  # the script's small preset runs 10; overrides after the flags win, as its docstring says
    s = run_script(EXAMPLES / "openai_agent_tool" / "train.py", "--out", str(tmp_path / "out"), "ray.dashboard=false",
                   f"trainer.steps={steps}", "sft.steps=10", "data.eval_size=8", cwd=tmp_path)
    assert ((s["backend"], s["steps"], s["version"], s["failed_episodes"], s["reward_errors"])
            == ("ray", steps, steps, 0, 0))
    assert s["trajectories"] >= steps * 4 * 4 and s["generated_tokens"] > s["trajectories"]
    assert s["token_versions"] and set(s["token_versions"]) <= set(range(steps))  # sampled by policies 0..3, trained
    assert s["completions_per_conversation"] >= 1.0
