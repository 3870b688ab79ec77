"""Agents written with `openai.AsyncOpenAI`: the trajectory is exactly what the engine generated."""
from __future__ import annotations

import asyncio

import openai
import pytest
import torch

from rayllm_rl.agents.openai_proxy import ChatCompletionsSession, openai_client, parse_tool_calls
from rayllm_rl.agents.openai_workflow import OpenAIAgentWorkflow
from rayllm_rl.data.failures import code_of


def spy_engine(engine):
    seen = []
    orig = engine.agenerate

    async def agenerate(req):
        resp = await orig(req)
        seen.append(resp)
        return resp

    engine.agenerate = agenerate
    return seen


async def two_turn_agent(client: openai.AsyncOpenAI, data):
    """Ordinary agent code: ask, then follow up in the same conversation."""
    messages = [{"role": "user", "content": data["question"]}]
    first = await client.chat.completions.create(model="policy", messages=messages, max_tokens=6, temperature=1.0)
    messages += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": "Are you sure?"}]
    second = await client.chat.completions.create(model="policy", messages=messages, max_tokens=6, logprobs=True)
    assert second.choices[0].logprobs is not None
    return float(len(second.choices[0].message.content) % 2)


def test_openai_agent_trajectory_equals_engine_output(engine, tokenizer):
    seen = spy_engine(engine)
    wf = OpenAIAgentWorkflow(two_turn_agent, tokenizer, group_size=2)
    out = asyncio.run(wf.arun_episode(engine, {"question": "What is 2+2?", "group_id": 3}))
    assert out.batch_size[0] == 2 and out["group_id"].tolist() == [3, 3]
    assert len(seen) == 4 and out["num_completions"].tolist() == [2.0, 2.0]
    for i in range(2):
        n = int(out["attention_mask"][i].sum())
        ids, mask = out["input_ids"][i, :n].tolist(), out["loss_mask"][i, :n].tolist()
        # the last completion's prompt is the first's exact tokens + the new turn: nothing re-tokenized
        last = [r for r in seen if r.input_tokens + r.output_tokens == ids]
        assert len(last) == 1
        first = [r for r in seen
                 if last[0].input_tokens[: r.input_len + r.output_len] == r.input_tokens + r.output_tokens
                 and r is not last[0]]
        assert len(first) == 1
        for resp in (first[0], last[0]):
            s, k = resp.input_len, resp.output_len
            assert ids[s:s + k] == resp.output_tokens and all(mask[s:s + k])
            assert torch.equal(out["logprobs"][i, s:s + k], torch.tensor(resp.output_logprobs, dtype=torch.float32))
            assert out["versions"][i, s:s + k].tolist() == resp.output_versions
        assert sum(mask) == first[0].output_len + last[0].output_len  # user turns and prompts masked
        assert "Are you sure?" in tokenizer.decode([t for t, m in zip(ids, mask) if not m])
    # the reward is what the agent returned for that conversation
    for i in range(2):
        assert out["rewards"][i].item() in (0.0, 1.0)


def test_endpoint_features_and_errors(engine, tokenizer):
    async def run():
        session = ChatCompletionsSession(engine, tokenizer, default_max_tokens=8)
        client = openai_client(session)
        try:
            many = await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], n=3)
            assert len(many.choices) == 3 and many.usage.completion_tokens == sum(
                len(r.output_ids) for r in session.records)
            greedy = [await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "1+1="}],
                                                           temperature=0, max_tokens=5) for _ in range(2)]
            assert greedy[0].choices[0].message.content == greedy[1].choices[0].message.content
            with pytest.raises(openai.BadRequestError, match="stream"):
                await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}],
                                                     stream=True)
            with pytest.raises(openai.BadRequestError, match="non-empty"):
                await client.chat.completions.create(model="m", messages=[])
            models = await client.models.list()
            assert [m.id for m in models.data] == ["rayllm-policy"]
        finally:
            await client.close()

    asyncio.run(run())
    # stop: the output is cut right after the token that completes the stop string
    from rayllm_rl.inference.protocol import LLMResponse

    ids = tokenizer("abc STOP def", add_special_tokens=False)["input_ids"]
    resp = LLMResponse(input_tokens=[1], output_tokens=ids, output_logprobs=[-0.5] * len(ids),
                       output_versions=[7] * len(ids), stop_reason="length")
    cut, lps, vers, finish = ChatCompletionsSession(engine, tokenizer).apply_stop(resp, ["STOP"])
    assert tokenizer.decode(cut).endswith("STOP") and "STOP" not in tokenizer.decode(cut[:-1])
    assert cut == ids[:len(cut)] and lps == [-0.5] * len(cut) and vers == [7] * len(cut) and finish == "stop"
    assert ChatCompletionsSession(engine, tokenizer).apply_stop(resp, [])[3] == "length"
    calls = parse_tool_calls('x <tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call> '
                             '<tool_call>{bad</tool_call>')
    assert len(calls) == 1 and calls[0]["function"]["name"] == "add" and calls[0]["function"]["arguments"] == '{"a": 1}'


def test_agent_failures_are_clear(engine, tokenizer, caplog):
    async def silent(client, data):
        return 1.0

    # a failed agent is a failed sample of its group (a placeholder row, cause raised), named in the warning
    td = asyncio.run(OpenAIAgentWorkflow(silent, tokenizer, group_size=2).arun_episode(engine, {"q": 1, "group_id": 3}))
    assert td["failed"].tolist() == [code_of("raised")] * 2 and not bool(td["loss_mask"].any())
    assert "agent silent failed (raised): RuntimeError: agent silent made no chat completion" in caplog.text
    with pytest.raises(TypeError, match="async"):
        OpenAIAgentWorkflow(lambda c, d: 1.0, tokenizer)


def test_requests_sample_at_the_jobs_settings_the_learner_scores_at(engine, tokenizer):
    """With the job's sampling, a request leaving temperature / top_p out gets the job's; another value is
    refused (its logprobs would not be the learner's); temperature 0 stays greedy."""
    from rayllm_rl.inference.protocol import SamplingParams
    from rayllm_rl.sampling_mask import SamplingMask, masked_logprobs

    seen = spy_engine(engine)
    job = SamplingParams(temperature=0.7, top_p=0.8, top_k=0)

    async def run():
        client = openai_client(ChatCompletionsSession(engine, tokenizer, default_max_tokens=8, sampling=job))
        try:
            await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "2+3="}])
            for key, value in (("temperature", 1.0), ("top_p", 0.95)):
                with pytest.raises(openai.BadRequestError, match=f"{key}=.* rollout.{key}="):
                    await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}],
                                                         **{key: value})
            await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}],
                                                 temperature=0, max_tokens=3)
        finally:
            await client.close()

    asyncio.run(run())
    assert len(seen) == 2 and seen[0].output_len > 0
    with torch.no_grad():  # the engine drew at T 0.7 from the top-p 0.8 kept set: its logprobs say so
        r = seen[0]
        logits = engine.model(torch.tensor([r.input_tokens + r.output_tokens])).logits[0].float() / 0.7
        want = masked_logprobs(logits[len(r.input_tokens) - 1:-1], torch.tensor(r.output_tokens), SamplingMask(0, 0.8))
    assert (want - torch.tensor(r.output_logprobs)).abs().max() <= 1e-4
