"""Workflows: multi-turn keeps exact tokens, group sampling, reward failures, collector batching."""
from __future__ import annotations

import asyncio

import pytest
from datasets import Dataset

from rayllm_rl.data.failures import code_of
from rayllm_rl.data.loader import PromptLoader
from rayllm_rl.inference.protocol import SamplingParams
from rollout_helpers import collect_batch
from rayllm_rl.workflows.grouped import GroupedWorkflow
from rayllm_rl.workflows.multi_turn import MultiTurnWorkflow, feedback_suffix_ids
from rayllm_rl.workflows.rlvr import RLVRWorkflow


class RecordingEngine:
    """Passes every call to a real engine and records what it received and returned."""

    def __init__(self, engine):
        self.engine = engine
        self.calls = []

    @property
    def version(self):
        return self.engine.version

    async def agenerate(self, req):
        resp = await self.engine.agenerate(req)
        self.calls.append((list(req.input_ids), resp))
        return resp

    def load_weights_sync(self, named, version=None):
        return self.engine.weights.load_weights_sync(named, version)


ROW = {"messages": [{"role": "user", "content": "What is 2+3?"}], "answer": "5"}


def test_multi_turn_tokens_are_exactly_what_the_engine_saw(engine, tokenizer):
    rec = RecordingEngine(engine)
    wf = MultiTurnWorkflow(lambda *a, **k: 0.0, tokenizer, SamplingParams(max_new_tokens=8), max_turns=3)
    td = asyncio.run(wf.arun_episode(rec, dict(ROW)))
    assert len(rec.calls) == 3
    seq = td["input_ids"][0].tolist()
    loss_mask = td["loss_mask"][0].tolist()
    logprobs = td["logprobs"][0].tolist()
    versions = td["versions"][0].tolist()
    expected_mask = []
    for t, (inp, resp) in enumerate(rec.calls):
        # Turn t's input is a prefix of the final trajectory ...
        assert seq[:len(inp)] == inp
        # ... and equals the previous input + previous output + the feedback tokens, verbatim.
        if t > 0:
            prev_inp, prev = rec.calls[t - 1]
            suffix = feedback_suffix_ids(tokenizer, prev_inp + prev.output_tokens, wf.feedback)
            assert inp == prev_inp + prev.output_tokens + suffix
        assert seq[len(inp):len(inp) + resp.output_len] == resp.output_tokens
        assert logprobs[len(inp):len(inp) + resp.output_len] == pytest.approx(resp.output_logprobs, abs=1e-6)
        assert versions[len(inp):len(inp) + resp.output_len] == resp.output_versions
        expected_mask += [0] * (len(inp) - len(expected_mask)) + [1] * resp.output_len
    assert seq == rec.calls[-1][0] + rec.calls[-1][1].output_tokens
    assert loss_mask == expected_mask
    assert all(lp == 0.0 for lp, m in zip(logprobs, loss_mask) if not m)
    assert all(v == -1 for v, m in zip(versions, loss_mask) if not m)
    assert td["rewards"].item() == 0.0 and td["num_turns"].item() == 3.0
    assert ROW["messages"] == [{"role": "user", "content": "What is 2+3?"}]  # row not mutated


def test_concurrent_multi_turn_episodes_each_keep_their_own_tokens(engine, tokenizer):
    """GroupedWorkflow runs episodes concurrently on one workflow object: each trajectory must be
    its own conversation (by rid), the last request's input plus that request's output."""
    rec = RecordingEngine(engine)
    wf = GroupedWorkflow(MultiTurnWorkflow(lambda *a, **k: 0.0, tokenizer, SamplingParams(max_new_tokens=5),
                                           max_turns=2), group_size=3)
    td = asyncio.run(wf.arun_episode(rec, dict(ROW)))
    assert td.batch_size[0] == 3 and len(rec.calls) == 6
    by_rid: dict[str, list] = {}
    for inp, resp in rec.calls:
        by_rid.setdefault(resp.rid, []).append((inp, resp))
    assert len(by_rid) == 3 and all(len(turns) == 2 for turns in by_rid.values())
    expected = sorted(turns[-1][0] + turns[-1][1].output_tokens for turns in by_rid.values())
    got = sorted(ids[m].tolist() for ids, m in zip(td["input_ids"], td["attention_mask"]))
    assert got == expected
    for (first_inp, first), (second_inp, _) in by_rid.values():
        assert second_inp[:len(first_inp) + first.output_len] == first_inp + first.output_tokens


def test_multi_turn_discount_counts_extra_turns(engine, tokenizer):
    calls = []

    def second_try_right(prompt, completions, prompt_ids, completion_ids, **row):
        calls.append(1)
        return 1.0 if len(calls) == 2 else 0.0

    wf = MultiTurnWorkflow(second_try_right, tokenizer, SamplingParams(max_new_tokens=4), max_turns=5,
                           turn_discount=0.9)
    td = asyncio.run(wf.arun_episode(engine, dict(ROW)))
    assert td["num_turns"].item() == 2.0
    assert td["rewards"].item() == pytest.approx(0.9)
    first = MultiTurnWorkflow(lambda *a, **k: 1.0, tokenizer, SamplingParams(max_new_tokens=4), turn_discount=0.9)
    assert asyncio.run(first.arun_episode(engine, dict(ROW)))["rewards"].item() == 1.0


def test_group_sampling_shares_group_and_scores_each(engine, tokenizer):
    def by_length(prompt, completions, prompt_ids, completion_ids, answer, **row):
        assert answer == "5" and prompt.endswith("assistant\n")
        return float(len(completion_ids))

    wf = RLVRWorkflow(by_length, tokenizer, SamplingParams(max_new_tokens=6), group_size=4)
    td = asyncio.run(wf.arun_episode(engine, {**ROW, "group_id": 42}))
    assert td.batch_size[0] == 4
    assert td["group_id"].tolist() == [42] * 4
    assert td["rewards"].tolist() == td["loss_mask"].sum(-1).float().tolist()


def test_raising_and_slow_rewards_give_zero_and_count(engine, tokenizer):
    def broken(*a, **k):
        raise RuntimeError("parser exploded")

    wf = RLVRWorkflow(broken, tokenizer, SamplingParams(max_new_tokens=3), group_size=2)
    td = asyncio.run(wf.arun_episode(engine, dict(ROW)))
    assert td["rewards"].tolist() == [0.0, 0.0] and wf.reward.num_errors == 2
    assert td["failed"].tolist() == [code_of("reward_raised")] * 2  # failed samples, for rollout.on_failure

    async def slow(*a, **k):
        await asyncio.sleep(5)
        return 1.0

    wf = RLVRWorkflow(slow, tokenizer, SamplingParams(max_new_tokens=3), group_size=2, reward_timeout_s=0.05)
    td = asyncio.run(wf.arun_episode(engine, dict(ROW)))
    assert td["rewards"].tolist() == [0.0, 0.0] and wf.reward.num_timeouts == 2
    assert td["failed"].tolist() == [code_of("reward_timeout")] * 2


def test_collector_fills_batch_and_drops_malformed_rows(engine, tokenizer):
    rows = [dict(ROW), {"answer": "1"}, dict(ROW), dict(ROW)]  # row 1 has no messages (None)
    wf = RLVRWorkflow(lambda *a, **k: 1.0, tokenizer, SamplingParams(max_new_tokens=4), group_size=2)
    batch, stats = asyncio.run(collect_batch(engine, wf, PromptLoader(Dataset.from_list(rows), shuffle=False), 3))
    assert batch.batch_size[0] == 6
    # the malformed row's group of 2 failed as a whole (cause raised) on its run and on the default policy's 2
    # re-runs (rollout.on_failure=resample, budget 2), then was dropped; failed_episodes counts samples
    assert (stats["failed_episodes"], stats["failed_episodes/raised"], stats["dropped_groups"]) == (6, 6, 1)
    assert stats["resampled_episodes"] == 4
    assert "must be a string or a list" in stats["last_error"]
    assert len(set(batch["group_id"].tolist())) == 3
    assert bool((batch["loss_mask"].sum(-1) > 0).all())
