"""Sampling-mask replay: the kept set of top-k / top-p by vLLM's rule, the masked logprobs of the learner's
chunked LM head (forward and gradient), the Transformers engine's sampler drawing from that set, and the
plan that turns the replay on."""
from __future__ import annotations

import math

import pytest
import torch

from rayllm_rl.inference.decoding import RowSampler
from rayllm_rl.learner.logprobs import chunked_head_logprobs
from rayllm_rl.sampling_mask import SamplingMask, kept_set, kept_weights, masked_logprobs


def kept_by_hand(z: torch.Tensor, top_k: int, top_p: float) -> list[set[int]]:
    """Each row's kept token ids, written out from the rule's words with a full sort (float64)."""
    out = []
    for row in z.double():
        order = row.argsort(descending=True).tolist()
        keep = [i for i in order if top_k == 0 or row[i] >= row[order[top_k - 1]]]
        probs = torch.softmax(row[keep], 0).tolist()
        kept, before = [], 0.0
        for i, pr in zip(keep, probs):
            if kept and before >= top_p:
                break
            kept.append(i)
            before += pr
        out.append(set(kept))
    return out


@pytest.mark.parametrize("top_k, top_p", [(0, 0.9), (7, 1.0), (30, 0.8), (0, 0.3)])
def test_kept_set_and_masked_logprobs_follow_the_rule(top_k, top_p):
    torch.manual_seed(0)
    z = torch.randn(40, 200, dtype=torch.float64) * 2.5
    n, v, log_kept = kept_set(z, top_k, top_p)
    targets = torch.randint(0, 200, (40,))
    got = masked_logprobs(z, targets, SamplingMask(top_k, top_p))
    for r, kept in enumerate(kept_by_hand(z, top_k, top_p)):
        assert int(n[r]) == len(kept) and float(v[r]) == min(float(z[r, i]) for i in kept)
        assert abs(float(log_kept[r]) - float(torch.logsumexp(z[r, sorted(kept)], 0))) <= 1e-12
        ids = sorted(kept | {int(targets[r])})  # the target always counts
        want = float(z[r, targets[r]] - torch.logsumexp(z[r, ids], 0))
        assert abs(float(got[r]) - want) <= 1e-12


def test_ties_at_the_boundary_count_exactly():
    # top-k keeps every tie of the k-th largest (vLLM: `logits < k-th` is masked)
    z = torch.tensor([[3.0, 2.0, 2.0, 2.0, 1.0, 0.0]])
    n, v, _ = kept_set(z, 2, 1.0)
    assert n.tolist() == [4] and v.tolist() == [2.0]
    # top-p cutting inside a tie: n - #above places shared among the tied tokens
    z = torch.tensor([[1.0, 1.0, 1.0, 1.0]])
    n, v, log_kept = kept_set(z, 0, 0.6)  # masses before: 0, .25, .5, .75: three kept
    w = kept_weights(z, n, v)
    assert n.tolist() == [3] and torch.allclose(w, torch.full((1, 4), 0.75))
    assert abs(float(log_kept) - (1 + math.log(3))) <= 1e-6
    lp = masked_logprobs(z, torch.tensor([0]), SamplingMask(0, 0.6))
    assert abs(float(lp) - math.log(1 / 3)) <= 1e-6  # Z = 3 e^1, as any three of the four would give


@pytest.mark.vllm
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])  # bf16-rounded logits: many exact ties
def test_kept_set_equals_vllm_samplers_mask(dtype):
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p_pytorch

    torch.manual_seed(1)
    rows = 256
    for scale in (0.5, 2.0, 6.0):
        z = (torch.randn(rows, 3000) * scale).to(dtype).float()
        for k, p in ((0, 0.9), (20, 1.0), (20, 0.9), (200, 0.95)):
            vllm_kept = torch.isfinite(apply_top_k_top_p_pytorch(
                z.clone(), torch.full((rows,), k) if k else None, torch.full((rows,), p) if p < 1 else None,
                allow_cpu_sync=True)).sum(-1)
            n, _, _ = kept_set(z, k, p)
            differ = (n - vllm_kept).abs()
            # the two sum the nucleus in opposite orders in float32: a count may differ by one where a
            # token's mass-before lands within rounding of p (1 row in 7,680 measured here)
            assert int(differ.max()) <= 1 and int((differ > 0).sum()) <= 2, (scale, dtype, k, p)


@pytest.mark.parametrize("mask", [SamplingMask(0, 0.9), SamplingMask(5, 1.0), SamplingMask(40, 0.7)])
def test_chunked_head_masked_logprobs_and_gradients_equal_autograd(mask):
    torch.manual_seed(2)
    hidden = torch.randn(37, 16, dtype=torch.float64, requires_grad=True)
    head = torch.nn.Linear(16, 300).double()
    head.weight.data.mul_(3)
    targets = torch.randint(0, 300, (37,))
    got, _ = chunked_head_logprobs(hidden, head, targets, 0.7, 8, False, mask)
    want = masked_logprobs(head(hidden) / 0.7, targets, mask)
    assert (got - want).abs().max() <= 1e-12
    weights = torch.rand(37, dtype=torch.float64)  # a non-uniform upstream gradient
    g_got = torch.autograd.grad((got * weights).sum(), [hidden, head.weight, head.bias])
    g_want = torch.autograd.grad((want * weights).sum(), [hidden, head.weight, head.bias])
    for a, b in zip(g_got, g_want):
        assert (a - b).abs().max() <= 1e-12
    full, _ = chunked_head_logprobs(hidden, head, targets, 0.7, 8, False)
    assert bool((full <= got + 1e-12).all()) and float((got - full).detach().max()) > 0.05  # the dropped mass


def test_engine_sampler_draws_from_the_kept_set_and_reports_its_logprob():
    torch.manual_seed(3)
    logits = torch.randn(1, 50) * 2
    sampler = RowSampler([1.0] * 4000, [0] * 4000, [0.8] * 4000, [False] * 4000)
    tokens, logprobs = sampler(logits.expand(4000, 50), torch.Generator().manual_seed(0))
    n, _, _ = kept_set(logits, 0, 0.8)
    kept = set(logits[0].topk(int(n)).indices.tolist())
    assert set(tokens.tolist()) <= kept and len(set(tokens.tolist())) > 1
    want = masked_logprobs(logits.expand(4000, 50), tokens, SamplingMask(0, 0.8))
    assert (logprobs - want).abs().max() <= 1e-6
    freq = torch.bincount(tokens, minlength=50).double() / 4000
    probs = want.exp()
    for tok in kept:  # empirical frequencies match the renormalised kept distribution (4 sigma)
        p = float(probs[tokens == tok][0]) if bool((tokens == tok).any()) else 0.0
        assert abs(float(freq[tok]) - p) <= 4 * math.sqrt(max(p, 1e-3) / 4000) + 1e-3


def test_plan_replays_the_rollouts_mask_unless_turned_off():
    from rayllm_rl.config import load_config
    from rayllm_rl.job.config import GRPOJobConfig
    from rayllm_rl.job.plan import make_plan

    def plan(*argv):
        return make_plan(load_config(GRPOJobConfig, ["trainer.backend=local", *argv]).validate(environment=False))

    assert plan("rollout.top_p=0.9", "rollout.top_k=20").sampling_mask == SamplingMask(20, 0.9)
    assert not plan().sampling_mask.active
    assert not plan("rollout.top_p=0.9", "rollout.replay_sampling_mask=false").sampling_mask.active
    with pytest.raises(ValueError, match=r"rollout.top_p must be in \(0, 1\]"):
        plan("rollout.top_p=1.2")


def test_the_dry_run_says_whether_the_learner_replays_the_mask():
    from rayllm_rl.config import load_config
    from rayllm_rl.job.config import GRPOJobConfig
    from rayllm_rl.job.describe import describe_job
    from rayllm_rl.job.plan_text import format_plan

    def decisions(*argv):  # what `python jobs/grpo.py --dry-run` prints, as a dict
        return describe_job(load_config(GRPOJobConfig, ["trainer.backend=local", *argv]))

    assert "truncation" not in decisions()["rollout"]  # top_p 1, top_k 0: nothing to say
    on = decisions("rollout.top_p=0.9")
    assert on["rollout"]["truncation"] == {"top_p": 0.9, "top_k": 0, "learner_replays_mask": True}
    assert "top_p=0.9, top_k=0: the learner replays the sampling mask" in format_plan(on)
    off = decisions("rollout.top_k=20", "rollout.replay_sampling_mask=false")
    assert off["rollout"]["truncation"]["learner_replays_mask"] is False
    assert "top_p=1, top_k=20: the learner scores the full distribution" in format_plan(off)
