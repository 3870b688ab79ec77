"""One RL step on the real SmolLM2-135M-Instruct with each engine: reasoning-gym rows through the RLVR
workflow, the engine's sampled-token logprobs against the learner's full forward, one GRPO update, the new
weights through the engine's own sink, and the engine's logprobs against the updated learner again.

The bound. Both sides compute in float32 but not the same sums: the engine decodes with a KV cache (one
token at a time; vLLM with its own CPU attention kernels), the learner runs one padded forward with SDPA.
Each sum of the 30 layers rounds at float32's eps (6e-8) relative, in an order that depends on the kernel
and the CPU's vector width; with residual norms of ~10-100 and logits up to ~30, that puts per-token
logprob differences near 1e-5. Measured here (AVX-512): max 2.0e-5 (Transformers engine) and 4.7e-5
(vLLM) over ~70 tokens (3 prompts x 4 samples of up to 24 tokens; now 2 x 4 of up to 16: 1.7e-5 and
5.7e-5), means 2-6e-6. The bound, 1e-3, leaves 20x for other CPUs and samples, and stays far below what
one update moves a sampled token's logprob (>0.1 here): the test checks that the update moves it
by more than BOUND and 100x the gap it measured before the update (the rounding noise on the CPU it runs on).
"""
from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict

from rayllm_rl.inference.protocol import SamplingParams

BOUND = 1e-3
"""Max |engine logprob - learner logprob| over sampled tokens (module docstring)."""

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smollm2(smollm2_path):
    from transformers import AutoTokenizer

    return smollm2_path, AutoTokenizer.from_pretrained(smollm2_path)


def collect(loop, engine, tokenizer, rows, temperature):
    from rayllm_rl.data.trajectory import concat_padded
    from rayllm_rl.objectives import AdvantageConfig, compute_advantages
    from rayllm_rl.rewards.reasoning_gym import ReasoningGymReward
    from rayllm_rl.workflows.rlvr import RLVRWorkflow

    reward = ReasoningGymReward("chain_sum", {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2})
    workflow = RLVRWorkflow(reward, tokenizer, SamplingParams(max_new_tokens=16, temperature=temperature), group_size=4)
    batch = concat_padded([loop.run(workflow.arun_episode(engine, row)) for row in rows])
    batch["advantages"] = compute_advantages(batch["rewards"], batch["group_id"], AdvantageConfig())
    return batch


def logprob_gap(learner, batch: TensorDict) -> torch.Tensor:
    """|learner - engine| logprob of every generated token, `[n_tokens]`."""
    mask = batch["loss_mask"].bool()
    return (learner.compute_logprobs(batch) - batch["logprobs"])[mask].abs()


@pytest.mark.parametrize("kind", ["transformers", pytest.param("vllm", marks=pytest.mark.vllm)])
def test_one_rl_step_engine_and_learner_agree(kind, smollm2):
    from rayllm_rl.envs.reasoning_gym_task import ReasoningGymConfig, make_splits
    from rayllm_rl.learner.learner import Learner, OptimConfig
    from rayllm_rl.objectives import GRPOLoss
    from test_engine_contract import LoopThread, build_engine, update_over_group

    path, tokenizer = smollm2
    temperature = 0.7
    _, rows = make_splits(ReasoningGymConfig(dataset="chain_sum", options={"min_terms": 2, "max_terms": 2,
                                                                        "min_digits": 1, "max_digits": 2},
                                             train_size=100), 2)  # 2 prompts x 4 samples
    loop = LoopThread()
    engine = build_engine(kind, path)
    try:
        if hasattr(engine, "start"):
            loop.run(engine.start())
        learner = Learner(path, OptimConfig(lr=1e-4, warmup_steps=0, max_tokens_per_micro_batch=2048),
                          temperature=temperature)
        batch = collect(loop, engine, tokenizer, rows, temperature)
        assert int(batch["loss_mask"].sum()) >= 12 and set(batch["versions"][batch["loss_mask"].bool()].tolist()) == {0}
        before = logprob_gap(learner, batch)
        assert before.max().item() <= BOUND, (kind, before.max().item())

        stats = learner.train_step(batch, GRPOLoss())
        assert stats["skipped_nonfinite_steps"] == 0.0
        moved = logprob_gap(learner, batch)  # the updated learner against the version-0 engine
        # The update is visible far above this run's own rounding noise (the gap at equal weights, `before`: 100x),
        # and above BOUND, so that the check after the sync can tell a synced engine from one left at version 0.
        assert moved.max().item() > max(BOUND, 100 * before.max().item()), (kind, moved.max(), before.max())

        named = dict(learner.iter_named_tensors())
        result, sender = update_over_group(loop, engine, named, 1, "shm")
        try:
            assert result["version"] == 1 and engine.version == 1
            from rayllm_rl.inference.protocol import weights_checksum

            assert (abs(loop.run(engine.weights.weights_checksum()) - weights_checksum(named))
                    <= 1e-6 * abs(weights_checksum(named)))
            after = collect(loop, engine, tokenizer, rows, temperature)
            assert set(after["versions"][after["loss_mask"].bool()].tolist()) == {1}
            gap = logprob_gap(learner, after)
            assert gap.max().item() <= BOUND, (kind, gap.max().item())
            print(f"{kind}: max |dlogp| before {before.max():.2e} (mean {before.mean():.2e}), after the sync "
                  f"{gap.max():.2e} (mean {gap.mean():.2e}); update moved {moved.max():.2e}")
        finally:
            loop.run(engine.weights.close_update_group())
            sender.close()
    finally:
        if hasattr(engine, "aclose"):
            loop.run(engine.aclose())
        loop.close()
