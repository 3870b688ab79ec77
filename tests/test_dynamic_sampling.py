"""DAPO dynamic sampling: an all-equal-reward group never reaches the learner and the batch stays full."""
from __future__ import annotations

import asyncio

from datasets import Dataset

from rayllm_rl.data.loader import PromptLoader
from rayllm_rl.rollout.replay_buffer import ReplayBuffer
from rayllm_rl.inference.protocol import SamplingParams
from rayllm_rl.orchestration.factories import has_reward_variance
from rayllm_rl.rollout.collector import LLMCollector, run_and_store
from rollout_helpers import collect_batch
from rayllm_rl.rollout.staleness import StalenessController
from rayllm_rl.workflows.rlvr import RLVRWorkflow

ROWS = [{"messages": [{"role": "user", "content": f"{kind} {i}"}], "kind": kind}
        for i in range(6) for kind in ("same", "vary")]


def reward(prompt, completions, prompt_ids, completion_ids, kind, **row):
    return 1.0 if kind == "same" else float(sum(completion_ids) % 2)


def groups_of(batch):
    return {g: batch["rewards"][batch["group_id"] == g] for g in set(batch["group_id"].tolist())}


def prompt_text(tokenizer, batch, gid):
    i = int((batch["group_id"] == gid).nonzero()[0])
    first = int(batch["loss_mask"][i].float().argmax())
    return tokenizer.decode(batch["input_ids"][i][:first])


def test_local_collector_drops_uniform_groups_and_refills(engine, tokenizer):
    wf = RLVRWorkflow(reward, tokenizer, SamplingParams(max_new_tokens=6, temperature=1.5), group_size=4)
    batch, stats = asyncio.run(collect_batch(engine, wf, PromptLoader(Dataset.from_list(ROWS), seed=3), 4,
                                             episode_filter=has_reward_variance))
    assert batch.batch_size[0] == 16  # still full
    for gid, r in groups_of(batch).items():
        assert len(r) == 4 and bool((r != r[0]).any())
        assert "same" not in prompt_text(tokenizer, batch, gid)
    assert stats["filtered_episodes"] >= 1


def test_async_collector_filtered_groups_free_their_slot(engine, tokenizer):
    wf = RLVRWorkflow(reward, tokenizer, SamplingParams(max_new_tokens=6, temperature=1.5), group_size=4)
    buffer, ctl = ReplayBuffer(capacity_episodes=8, max_staleness=0), StalenessController(batch_size=4, max_staleness=0)

    async def put(td):
        assert buffer.put(td), "capacity 8 > the 4 episodes admitted at eta=0"

    col = LLMCollector(PromptLoader(Dataset.from_list(ROWS), seed=5),
                       lambda row: run_and_store(wf, engine, row, put, has_reward_variance), ctl)

    async def run():
        loop = asyncio.ensure_future(col.run())
        for _ in range(600):
            if len(buffer) >= 4:
                break
            await asyncio.sleep(0.05)
        col.stop()
        await asyncio.wait_for(loop, 10)

    asyncio.run(run())
    batch = buffer.sample(4, current_version=0)
    assert batch is not None and batch.batch_size[0] == 16  # a full batch of 4 groups despite the drops
    assert all(bool((r != r[0]).any()) for r in groups_of(batch).values())
    assert col.filtered >= 1 and ctl.stats()["rejected"] == col.filtered
    assert ctl.accepted == 4  # rejected groups did not use up the bound
