"""Rollout/learner mismatch figures: hand-derived values, and from a real engine and learner: zero (to the
float error of two forwards) when both hold the same weights, the measured gap when they do not."""
from __future__ import annotations

import asyncio
import math

import pytest
import torch
from datasets import Dataset

from rayllm_rl.data.loader import PromptLoader
from rayllm_rl.inference.protocol import SamplingParams
from rayllm_rl.learner.learner import Learner, OptimConfig
from rayllm_rl.learner.mismatch import mismatch_figures
from rayllm_rl.objectives import AdvantageConfig, GRPOLoss, compute_advantages
from rayllm_rl.workflows.rlvr import RLVRWorkflow
from rollout_helpers import collect_batch

ROWS = [{"messages": [{"role": "user", "content": f"{a}+{a + 1}="}], "answer": str(2 * a + 1)} for a in range(8)]


def test_figures_equal_hand_derived_values():
    # ratios 1, 3/2, 1/4, 3 (none on the band's edges, which float32 could put on either side); lags 0, 0, 1, 6
    rollout = torch.tensor([-1.0, -2.0, -0.5, -3.0])
    learner = rollout + torch.tensor([0.0, math.log(1.5), math.log(0.25), math.log(3)])
    f = mismatch_figures(learner, rollout, torch.tensor([0, 0, 1, 6]))
    k3 = [0.0, 0.5 - math.log(1.5), -0.75 + math.log(4), 2 - math.log(3)]
    assert f["mismatch_tokens"] == 4
    assert f["mismatch_abs_logp_diff"] == pytest.approx((math.log(1.5) + math.log(4) + math.log(3)) / 4, rel=1e-6)
    assert f["mismatch_k3"] == pytest.approx(sum(k3) / 4, rel=1e-6)
    assert (f["mismatch_ratio_min"], f["mismatch_ratio_max"]) == pytest.approx((0.25, 3.0), rel=1e-6)
    assert f["mismatch_ratio_p50"] == pytest.approx(1.25, rel=1e-6)  # torch.quantile interpolates: (1 + 1.5) / 2
    assert f["mismatch_frac_outside"] == 0.5  # 1/4 and 3 leave [0.5, 2]
    assert f["mismatch_tokens_lag0"] == 2 and f["mismatch_tokens_lag1"] == 1 and f["mismatch_tokens_lag4+"] == 1
    assert f["mismatch_k3_lag0"] == pytest.approx(k3[1] / 2, rel=1e-6)
    assert f["mismatch_abs_logp_diff_lag4+"] == pytest.approx(math.log(3), rel=1e-6)
    assert mismatch_figures(torch.zeros(0), torch.zeros(0)) == {"mismatch_tokens": 0.0}
    with pytest.raises(ValueError, match=r"two \[K\] tensors"):
        mismatch_figures(torch.zeros(2, 3), torch.zeros(2, 3))


def by_length(prompt, completions, prompt_ids, completion_ids, **row):
    return float(len(completion_ids))


def _batch(engine, tokenizer):
    wf = RLVRWorkflow(by_length, tokenizer, SamplingParams(max_new_tokens=8, temperature=1.0), group_size=4)
    batch, _ = asyncio.run(collect_batch(engine, wf, PromptLoader(Dataset.from_list(ROWS), seed=1), 4))
    batch["advantages"] = compute_advantages(batch["rewards"], batch["group_id"], AdvantageConfig())
    batch["prox_version"] = torch.zeros(batch.batch_size[0], dtype=torch.long)  # trained from version 0
    return batch


def test_same_weights_give_no_mismatch_and_other_weights_the_measured_one(engine, tokenizer, tiny_model_path):
    learner = Learner(tiny_model_path, OptimConfig(lr=0.0))
    batch = _batch(engine, tokenizer)
    mask = batch["loss_mask"].bool()
    same = learner.train_step(batch, GRPOLoss())
    # two float32 forwards of one model (KV-cached decode vs one full pass): test_learner bounds |Δ| by 1e-4
    assert same["mismatch_tokens"] == mask.sum() == same["mismatch_tokens_lag0"]
    assert same["mismatch_abs_logp_diff"] <= 1e-4 and 0 <= same["mismatch_k3"] <= 1e-8
    assert abs(same["mismatch_ratio_max"] - 1) <= 2e-4 and same["mismatch_frac_outside"] == 0

    with torch.no_grad():  # the engine samples from other weights: the learner's view of its tokens moves
        other = {k: v + 0.05 * torch.randn(v.shape, generator=torch.Generator().manual_seed(0))
                 for k, v in engine.weights.named_parameters().items()}
    engine.weights.load_weights_sync(other, version=0)
    batch = _batch(engine, tokenizer)
    mask = batch["loss_mask"].bool()
    moved = learner.train_step(batch, GRPOLoss())
    d = (learner.compute_logprobs(batch)[mask] - batch["logprobs"][mask]).double()
    assert moved["mismatch_abs_logp_diff"] > 100 * same["mismatch_abs_logp_diff"]
    assert moved["mismatch_abs_logp_diff"] == pytest.approx(float(d.abs().mean()), rel=1e-4)
    assert moved["mismatch_k3"] == pytest.approx(float((d.exp() - 1 - d).mean()), rel=1e-3)
    assert moved["mismatch_ratio_max"] == pytest.approx(float(d.exp().max()), rel=1e-4)


def test_sft_demonstrations_have_no_rollout_logprobs_to_compare(tokenizer, tiny_model_path):
    from rayllm_rl.data.sft import make_sft_batch
    from rayllm_rl.objectives import SFTLoss

    batch = make_sft_batch(tokenizer, [[{"role": "user", "content": "1+1="}, {"role": "assistant", "content": "2"}]])
    batch["advantages"] = torch.zeros(1)
    mask = batch["loss_mask"].clone()
    metrics = Learner(tiny_model_path, OptimConfig(lr=0.0)).train_step(batch, SFTLoss())
    assert metrics["mismatch_tokens"] == 0 and "mismatch_k3" not in metrics
    assert torch.equal(batch["loss_mask"], mask) and metrics["nll"] > 0  # the demonstrations still train



def test_top_p_rollouts_trained_with_the_mask_replayed_show_no_mismatch(engine, tokenizer, tiny_model_path):
    """A top-p 0.9 rollout trained by a learner replaying the mask: the step's mismatch is float error; the
    same batch scored over the full softmax shows the bias, |log M| in [0, -log 0.9]. SFT demonstrations are
    scored over the full softmax whatever the mask (their tokens were not drawn by the sampler)."""
    from rayllm_rl.data.sft import make_sft_batch
    from rayllm_rl.learner.logprobs import batched_token_logprobs
    from rayllm_rl.objectives import SFTLoss
    from rayllm_rl.sampling_mask import SamplingMask

    wf = RLVRWorkflow(by_length, tokenizer, SamplingParams(max_new_tokens=8, temperature=1.0, top_p=0.9), group_size=4)
    batch, _ = asyncio.run(collect_batch(engine, wf, PromptLoader(Dataset.from_list(ROWS), seed=1), 4))
    batch["advantages"] = compute_advantages(batch["rewards"], batch["group_id"], AdvantageConfig())
    batch["prox_version"] = torch.zeros(batch.batch_size[0], dtype=torch.long)
    replayed = Learner(tiny_model_path, OptimConfig(lr=0.0), sampling_mask=SamplingMask(0, 0.9))
    full = Learner(tiny_model_path, OptimConfig(lr=0.0))
    got, biased = replayed.train_step(batch.clone(), GRPOLoss()), full.train_step(batch.clone(), GRPOLoss())
    assert got["mismatch_abs_logp_diff"] <= 1e-4 and got["mismatch_k3"] <= 1e-8
    assert (0.02 <= biased["mismatch_abs_logp_diff"] <= -math.log(0.9) + 1e-4
            and biased["mismatch_ratio_max"] <= 1 + 1e-4)

    sft = make_sft_batch(tokenizer, [[{"role": "user", "content": "1+1="},
                                      {"role": "assistant", "content": "2 and 2"}]])
    sft["advantages"] = torch.zeros(1)
    logp = batched_token_logprobs(full.model, sft, 4096)
    want = float(-(logp * sft["loss_mask"]).sum() / sft["loss_mask"].sum())
    assert replayed.train_step(sft, SFTLoss())["nll"] == pytest.approx(want, rel=1e-5)
