"""Dataset sources, reward components and failures, ChatEnv-as-workflow, KL transforms, chat transforms."""
from __future__ import annotations

import asyncio
import json
import time

import datasets
import pytest
import torch
from tensordict import TensorDict

from rayllm_rl.data.failures import code_of
from rayllm_rl.data.sources import check_fields, load_rows, split_held_out
from rayllm_rl.data.trajectory import concat_padded, make_trajectory
from rayllm_rl.envs.chat_env import ChatEnv
from rayllm_rl.envs.chat_transforms import AddThinkingPrompt, TemplateTransform
from rayllm_rl.envs.dataset_envs import DatasetChatEnv
from rayllm_rl.inference.protocol import SamplingParams
from rayllm_rl.learner.learner import Learner, OptimConfig
from rayllm_rl.learner.frozen import FrozenModel
from rayllm_rl.objectives.kl_reward import KLRewardTransform, RetrieveKL
from rayllm_rl.workflows.chat_env_workflow import ChatEnvWorkflow
from rayllm_rl.workflows.rewards import RewardCaller

ROWS = [{"question": f"What is {a}+{a}?", "answer": str(2 * a)} for a in range(6)]


def components_reward(prompt, completions, prompt_ids, completion_ids, answer=None, **row):
    """A reward with components: 1 for the right number anywhere, plus a length component."""
    right = float(answer in completions)
    return {"reward": right, "reward_right": right, "length": float(len(completion_ids))}


components_reward.component_keys = ("reward_right", "length")


# ---------------------------------------------------------------- sources
@pytest.mark.parametrize("suffix", [".jsonl", ".parquet", ".csv", "disk"])
def test_load_rows_from_local_formats(tmp_path, suffix):
    ds = datasets.Dataset.from_list(ROWS)
    path = tmp_path / ("rows" + (suffix if suffix != "disk" else ""))
    if suffix == ".jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    elif suffix == ".parquet":
        ds.to_parquet(str(path))
    elif suffix == ".csv":
        ds.to_csv(str(path), index=False)
    else:
        ds.save_to_disk(str(path))
    got = load_rows(str(path))
    assert len(got) == 6 and [str(a) for a in got["answer"]] == [r["answer"] for r in ROWS]


def test_load_rows_errors_name_the_problem(tmp_path):
    with pytest.raises(FileNotFoundError, match="missing.jsonl"):
        load_rows(str(tmp_path / "missing.jsonl"))
    bad = tmp_path / "rows.txt"
    bad.write_text("x")
    with pytest.raises(ValueError, match="unknown file type"):
        load_rows(str(bad))
    ds = datasets.Dataset.from_list([{"question": "q", "answer": "1"}, {"question": "", "answer": "2"}])
    with pytest.raises(ValueError, match="rows.jsonl, row 2: required field 'question' is empty"):
        check_fields(ds, ("question", "answer"), "rows.jsonl")
    with pytest.raises(ValueError, match=r"no field\(s\) \['solution'\]"):
        check_fields(ds, ("solution",), "rows.jsonl")
    train, held = split_held_out(datasets.Dataset.from_list(ROWS), 2, seed=0)
    assert len(train) == 4 and len(held) == 2
    assert not set(train["question"]) & set(held["question"])
    train, held = split_held_out(datasets.Dataset.from_list(ROWS), 200)  # small file: a fifth held out
    assert len(train) == 5 and len(held) == 1
    with pytest.raises(ValueError, match="eval_size=6"):
        split_held_out(datasets.Dataset.from_list(ROWS[:1]), 6)


# ---------------------------------------------------------------- reward calling
def test_reward_caller_components_errors_and_timeouts(caplog):
    caller = RewardCaller(components_reward)
    out = asyncio.run(caller.score("p", "it is 4", [1], [5, 6, 7], answer="4"))
    assert out == {"reward": 1.0, "reward_right": 1.0, "length": 3.0}

    def raises(*a, **k):
        raise RuntimeError("boom")

    raises.component_keys = ("reward_right",)
    bad = RewardCaller(raises)
    assert asyncio.run(bad.score("p", "c", [], [])) == {"reward": 0.0, "reward_right": 0.0,
                                                        "failed": code_of("reward_raised")}
    assert bad.num_errors == 1 and "boom" in caplog.text

    def slow(*a, **k):
        time.sleep(3)
        return 1.0

    async def aslow(*a, **k):
        await asyncio.sleep(3)
        return 1.0

    async def timed(caller):
        t0 = time.perf_counter()  # timed inside the loop: a worker's loop goes on while the thread ends
        out = await caller.score("p", "c", [], [])
        return out, time.perf_counter() - t0

    for fn in (slow, aslow):
        c = RewardCaller(fn, timeout_s=0.2)
        out, seconds = asyncio.run(timed(c))
        assert out == {"reward": 0.0, "failed": code_of("reward_timeout")} and seconds < 2.0 and c.num_timeouts == 1
        t0 = time.perf_counter()
        assert c.score_sync("p", "c", [], []) == {"reward": 0.0, "failed": code_of("reward_timeout")}
        assert time.perf_counter() - t0 < 2.0 and c.num_timeouts == 2
    nan = RewardCaller(lambda *a, **k: float("nan"))
    assert asyncio.run(nan.score("p", "c", [], []))["reward"] == 0.0
    assert (nan.num_nonfinite, nan.num_errors) == (1, 0)
    nokey = RewardCaller(lambda *a, **k: {"score": 1.0})
    assert asyncio.run(nokey.score("p", "c", [], []))["reward"] == 0.0 and nokey.num_errors == 1


def test_concat_fills_missing_components_with_zero():
    a = make_trajectory([1, 2, 3], [0, -1.0, -2.0], [0, 1, 1], [-1, 0, 0], 1.0, 7, reward_right=1.0)
    b = make_trajectory([1, 2], [0, -1.0], [0, 1], [-1, 0], 0.0, 7)
    out = concat_padded([a, b])
    assert out["reward_right"].tolist() == [1.0, 0.0] and out["input_ids"].shape == (2, 3)


# ---------------------------------------------------------------- DatasetChatEnv + workflow
def test_dataset_chat_env_reset_step_components(tokenizer, tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    env = DatasetChatEnv(str(path), tokenizer, reward_fn=components_reward, prompt_key="question",
                         required_fields=("question", "answer"), repeats=2, batch_size=2, seed=0)
    td = env.reset()
    assert td[0]["row"]["question"] == td[1]["row"]["question"]  # repeats: one group
    assert int(td[0]["group_id"]) == int(td[1]["group_id"])
    answer = td[0]["row"]["answer"]
    for i, text in enumerate([f"It is {answer}", "no idea"]):
        elem = td.unbind(0)[i]
        elem["history"].full = elem["history"].prompt.append({"role": "assistant", "content": text})
    nxt = env.step(td)["next"]
    assert nxt[0]["reward"].tolist() == [[1.0]] and nxt[1]["reward"].tolist() == [[0.0]]
    assert nxt[0]["reward_right"].tolist() == [[1.0]] and nxt[1]["reward_right"].tolist() == [[0.0]]
    assert bool(nxt[0]["done"]) and bool(nxt[1]["done"])
    with pytest.raises(ValueError, match="no field"):
        DatasetChatEnv(datasets.Dataset.from_list(ROWS), tokenizer, required_fields=("problem",))


def test_chat_env_workflow_trajectory_is_what_the_engine_generated(engine, tokenizer):
    """Two turns (AddThinkingPrompt re-opens a wrong first answer): the trajectory holds exactly the
    engine's ids and logprobs on trained tokens, the env's added tokens are masked, versions stamped."""
    ds = datasets.Dataset.from_list(ROWS)

    def make_env():
        env = DatasetChatEnv(ds, tokenizer, reward_fn=components_reward, prompt_key="question")
        return env.append_transform(AddThinkingPrompt(prompt="Think again.", threshold=2.0, max_prompts=1))

    sampling = SamplingParams(max_new_tokens=6, temperature=1.0)
    wf = ChatEnvWorkflow(make_env, sampling, group_size=3, max_turns=2)
    seen = []
    orig = engine.agenerate

    async def spy(req):
        resp = await orig(req)
        seen.append(resp)
        return resp

    engine.agenerate = spy
    out = asyncio.run(wf.arun_episode(engine, {**ROWS[1], "group_id": 11}))
    assert out.batch_size[0] == 3 and set(out["group_id"].tolist()) == {11}
    assert out["num_turns"].tolist() == [2.0, 2.0, 2.0]  # threshold 2 > any reward: always re-opened once
    assert len(seen) == 6
    for i in range(3):
        n = int(out["attention_mask"][i].sum())
        ids = out["input_ids"][i, :n].tolist()
        mask = out["loss_mask"][i, :n].tolist()
        lps = out["logprobs"][i, :n]
        turn_starts = [j for j in range(1, n) if mask[j] and not mask[j - 1]]
        assert len(turn_starts) == 2
        for start in turn_starts:
            # a generation whose input is exactly the trajectory prefix and whose output follows it
            match = [r for r in seen
                     if r.input_tokens == ids[:start] and r.output_tokens == ids[start:start + r.output_len]]
            assert match, f"row {i}: no engine call saw this prefix"
            resp = match[0]
            k = resp.output_len
            assert torch.allclose(lps[start:start + k], torch.tensor(resp.output_logprobs), atol=0)
            assert out["versions"][i, start:start + k].tolist() == resp.output_versions
        added = tokenizer.decode([t for t, m in zip(ids, mask) if not m][len(seen[0].input_tokens):])
        assert "Think again." in added  # the thinking prompt is in the context, masked out of the loss
    assert out["rewards"].tolist() == out["reward_right"].tolist()  # first turn zeroed, second scored


def test_add_thinking_prompt_limits_and_template_transform(tokenizer):
    env = ChatEnv(tokenizer, batch_size=1).append_transform(
        AddThinkingPrompt(lambda e: True, prompt="More.", max_prompts=1))
    td = env.reset(TensorDict(query=["q"], batch_size=[1]))
    for n_messages in (3, 4):  # user, a, "More." ; then (max_prompts reached) user, a, More., a
        elem = td.unbind(0)[0]
        elem["history"].full = elem["history"].prompt.append({"role": "assistant", "content": "a"})
        td = env.step_mdp(env.step(td))
        assert td[0]["history"].prompt.batch_size[0] == n_messages
    chat = td[0]["history"].prompt.to_chat()
    assert chat[2] == {"role": "user", "content": "More."} and chat[3]["role"] == "assistant"
    assert int(td[0]["thinking_prompts"]) == 1

    template = ("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
                "{% if add_generation_prompt %}[assistant] {% endif %}")
    tenv = ChatEnv(tokenizer, batch_size=1).append_transform(TemplateTransform(tokenizer, template))
    td = tenv.reset(TensorDict(query=["hello"], batch_size=[1]))
    assert td[0]["text", "prompt"] == "[user] hello\n[assistant] "
    assert (td[0]["tokens", "prompt"].tolist()
            == tokenizer("[user] hello\n[assistant] ", add_special_tokens=False)["input_ids"])
    elem = td.unbind(0)[0]
    elem["history"].full = elem["history"].prompt.append({"role": "assistant", "content": "hi"})
    td = tenv.step_mdp(tenv.step(td))
    assert td[0]["text", "prompt"] == "[user] hello\n[assistant] hi\n[assistant] "
    with pytest.raises(ValueError, match="IncrementalTokenizer"):
        ChatEnv(tokenizer, batch_size=1, with_tokenizer=True).append_transform(TemplateTransform(tokenizer, template))


# ---------------------------------------------------------------- reference KL
def test_reference_model_and_kl_reward(tiny_model_path, engine, tokenizer):
    from rayllm_rl.data.loader import PromptLoader
    from rollout_helpers import collect_batch
    from rayllm_rl.workflows.rlvr import RLVRWorkflow

    rows = [{"messages": [{"role": "user", "content": r["question"]}], "answer": r["answer"]} for r in ROWS]
    wf = RLVRWorkflow(components_reward, tokenizer, SamplingParams(max_new_tokens=6), group_size=2)
    batch, _ = asyncio.run(collect_batch(engine, wf, PromptLoader(datasets.Dataset.from_list(rows)), 2))
    assert "reward_right" in batch.keys() and "length" in batch.keys()
    learner = Learner(tiny_model_path, OptimConfig(lr=1e-2))
    ref = FrozenModel(tiny_model_path, named_tensors=learner.named_tensors())
    mask = batch["loss_mask"]
    # same weights as the engine: reference logprobs equal the behaviour logprobs, KL = 0
    RetrieveKL(ref.compute_logprobs)(batch)
    assert ((batch["ref_logprobs"] - batch["logprobs"]) * mask).abs().max() < 1e-4
    # a different reference: KL and the reward penalty are exactly the hand formula
    ref.model.model.embed_tokens.weight.data.mul_(0.5)
    rewards0 = batch["rewards"].clone()
    RetrieveKL(ref.compute_logprobs)(batch)
    k1 = ((batch["logprobs"] - batch["ref_logprobs"]) * mask).sum(-1)
    assert k1.abs().max() > 1e-3
    KLRewardTransform(0.1)(batch)
    torch.testing.assert_close(batch["kl_penalty"], 0.1 * k1)
    torch.testing.assert_close(batch["rewards"], rewards0 - 0.1 * k1)
    with pytest.raises(ValueError, match="RetrieveKL first"):
        KLRewardTransform(0.1)(TensorDict({"rewards": torch.zeros(1)}, batch_size=[1]))


# ---------------------------------------------------------------- task envs on their fixtures
FIXTURES = __import__("pathlib").Path(__file__).parent / "fixtures"


def play(env, td, texts):
    """Play the policy: one assistant message per element."""
    for elem, text in zip(td.unbind(0), texts):
        elem["history"].full = elem["history"].prompt.append({"role": "assistant", "content": text})
    return env.step(td)["next"]


def test_gsm8k_and_math_envs_score_hand_written_answers(tokenizer):
    from rayllm_rl.envs.dataset_envs import GSM8KEnv, MATHEnv
    from rayllm_rl.rewards.gsm8k import gsm8k_final_answer
    from rayllm_rl.rewards.math_answer import math_reference_answer

    env = GSM8KEnv(str(FIXTURES / "gsm8k.jsonl"), tokenizer, batch_size=2, repeats=2, shuffle=False)
    td = env.reset()
    assert td[0]["history"].prompt.to_chat()[-1]["content"] == td[0]["row"]["question"]
    final = gsm8k_final_answer(td[0]["row"]["answer"])
    nxt = play(env, td, [f"<think>ok</think><answer>{final}</answer>", "<think>hm</think><answer>12345</answer>"])
    assert nxt[0]["reward"].item() == 1.0 and nxt[0]["success"].item() == 1.0
    assert nxt[1]["reward"].item() == pytest.approx(0.2) and nxt[1]["reward_right"].item() == 0.0

    menv = MATHEnv(str(FIXTURES / "math.jsonl"), tokenizer, batch_size=2, repeats=2, shuffle=False)
    try:
        td = menv.reset()
        gold = math_reference_answer(dict(td[0]["row"]))
        nxt = play(menv, td, [f"<answer>{gold}</answer>", "<answer>\\frac{123}{457}</answer>"])
        assert nxt[0]["reward"].item() == 1.0 and nxt[1]["reward"].item() == 0.0
        assert nxt[1]["reward_format"].item() == 1.0 and "timeout" not in nxt[1].keys()
    finally:
        menv.reward_transform.reward_fn.close()


def test_gsm8k_multi_turn_agent_is_a_ready_workflow(engine, tokenizer, tmp_path):
    """task=gsm8k rollout.workflow=multi_turn: AReaL's retry agent, grouped, with GSM8K components."""
    from rayllm_rl.config import load_config
    from rayllm_rl.orchestration.factories import build_task, build_workflow
    from rayllm_rl.job.config import GRPOJobConfig
    from rayllm_rl.workflows.grouped import GroupedWorkflow

    cfg = load_config(GRPOJobConfig, ["task=gsm8k", f"data.path={FIXTURES / 'gsm8k.jsonl'}", "data.eval_size=1",
                                      "rollout.workflow=multi_turn", "rollout.max_turns=3", "rollout.group_size=2",
                                      "rollout.max_new_tokens=5"])
    task = build_task(cfg)
    wf = build_workflow(cfg, task, tokenizer)
    assert isinstance(wf, GroupedWorkflow) and wf.workflow.max_turns == 3
    out = asyncio.run(wf.arun_episode(engine, {**task.train[0], "group_id": 5}))
    assert out.batch_size[0] == 2 and out["group_id"].tolist() == [5, 5]
    # an untrained model never answers right: every episode uses all three turns, feedback masked
    assert out["num_turns"].tolist() == [3.0, 3.0] and out["success"].tolist() == [0.0, 0.0]
    for i in range(2):
        n = int(out["attention_mask"][i].sum())
        mask = out["loss_mask"][i, :n].tolist()
        assert sum(1 for j in range(1, n) if mask[j] and not mask[j - 1]) == 3
    assert "Your answer is not correct" in tokenizer.decode(out["input_ids"][0][~out["loss_mask"][0]])
    cfg_env = load_config(GRPOJobConfig, ["task=gsm8k", f"data.path={FIXTURES / 'gsm8k.jsonl'}"]).validate()
    assert type(build_workflow(cfg_env, build_task(cfg_env), tokenizer)).__name__ == "ChatEnvWorkflow"


def test_ifeval_env_scores_and_is_done_only_with_an_answer_block(tokenizer):
    from rayllm_rl.envs.dataset_envs import IFEvalEnv

    env = IFEvalEnv(str(FIXTURES / "ifeval.jsonl"), tokenizer, batch_size=2, repeats=2, shuffle=False)
    td = env.reset()
    row = dict(td[0]["row"])
    assert td[0]["history"].prompt.to_chat()[-1]["content"] == row["prompt"]
    nxt = play(env, td, ["<think>plan</think>", "no tags at all"])
    # no answer block: not done (the episode may continue), structure/format scored anyway
    assert not bool(nxt[0]["done"]) and not bool(nxt[1]["done"])
    assert nxt[0]["structure_score"].item() == pytest.approx(0.5) and nxt[1]["structure_score"].item() == 0.0
    td = env.reset()
    nxt = play(env, td, ["<think>plan</think><answer>x</answer>", "<answer>y</answer>"])
    assert bool(nxt[0]["done"]) and bool(nxt[1]["done"])
    assert nxt[0]["completion_bonus"].item() == pytest.approx(0.2)
    parts = ("format_score", "structure_score", "completion_bonus")
    for i in range(2):
        assert nxt[i]["reward"].item() == pytest.approx(sum(nxt[i][k].item() for k in parts))
