"""Rows packed behind their shared prompt (learner/shared_prompt.py) score and train as the padded rows do.

The models are float64 on SDPA (which computes in float64), with weights drawn at std 0.5 so that attention
moves the logits (at HF's 0.02 a tiny random model is nearly blind to context, and a wrong mask would hardly
show): a wrong mask, position or index moves a logprob by ~0.1 or more. Logprobs and entropies agree to float64
rounding (1e-12). Gradients carry float32 rounding: Qwen2's RMSNorm computes in float32 whatever the model's
dtype, and the packed path sums a prompt position's gradient over the G rows before the norm's backward, the
padded path after it. Each norm's backward rounds to u = 2^-24 relative; through the 5 norms of a 2-layer model
and the sums between them we allow 32 u (1.9e-6) of each tensor's largest entry."""
from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict

from rayllm_rl.learner.learner import Learner, OptimConfig
from rayllm_rl.learner.logprobs import token_logprobs
from rayllm_rl.learner.shared_prompt import (
    check_shared_prompt,
    packed_micro_batches,
    packed_token_logprobs,
    supports_shared_prompt,
)

F64 = torch.float64
TOL = 1e-12
GRAD_TOL = 32 * 2.0 ** -24

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def qwen2(vocab: int = 60, dtype: torch.dtype = F64, attn: str = "sdpa", **over) -> torch.nn.Module:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=vocab, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128,
                      tie_word_embeddings=False, attn_implementation=attn, initializer_range=0.5, **over)
    return Qwen2ForCausalLM(cfg).to(dtype).train()


def grpo_batch(vocab: int = 60, prompts=(5, 9, 7), group: int = 4, seed: int = 0) -> TensorDict:
    """Right-padded rows: `group` rows per prompt (prompt lengths `prompts`), rests of 2..14 tokens; row 1 has
    an untrained token inside its rest (a tool output's place), row 5 no trained token at all."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for k, p in enumerate(prompts):
        prompt = torch.randint(1, vocab, (p,), generator=g)
        rows += [(prompt, torch.randint(1, vocab, (2 + 3 * j + k,), generator=g)) for j in range(group)]
    t = max(len(p) + len(c) for p, c in rows)
    ids, am, lm = (torch.zeros(len(rows), t, dtype=torch.long) for _ in range(3))
    for i, (p, c) in enumerate(rows):
        n = len(p) + len(c)
        ids[i, :n], am[i, :n], lm[i, len(p):n] = torch.cat([p, c]), 1, 1
    if len(rows) > 5:
        lm[1, len(rows[1][0]) + 2] = 0
        lm[5] = 0
    return TensorDict({"input_ids": ids, "attention_mask": am, "loss_mask": lm.float()}, batch_size=[len(rows)])


def packed_logp(model, td, budget: int, temperature: float = 1.0, with_entropy: bool = False):
    out = torch.zeros(td["input_ids"].shape, dtype=next(model.parameters()).dtype)
    ent = torch.zeros_like(out)
    for packed in packed_micro_batches(td, budget):
        rows = packed.rows
        got = packed_token_logprobs(model, packed, temperature, chunk_size=7, with_entropy=with_entropy)
        lp, e = got if with_entropy else (got, None)
        out[rows, :lp.shape[1]] = lp
        if e is not None:
            ent[rows, :e.shape[1]] = e
    return (out, ent) if with_entropy else out


@pytest.mark.parametrize("budget", [400, 40])
def test_packed_logprobs_entropy_and_gradient_equal_the_padded_rows(budget):
    model, td = qwen2(), grpo_batch()
    pos = td["loss_mask"] != 0
    weights = torch.randn(td["input_ids"].shape, generator=torch.Generator().manual_seed(3), dtype=F64)
    want, want_ent = token_logprobs(model, td["input_ids"], td["attention_mask"], 0.7, with_entropy=True,
                                    positions=pos, chunk_size=7)
    (want * weights).sum().backward()
    want_g = {k: p.grad.clone() for k, p in model.named_parameters()}
    model.zero_grad()
    got, got_ent = packed_logp(model, td, budget, 0.7, with_entropy=True)
    (got * weights).sum().backward()
    assert float(want.detach().abs().max()) > 1.0  # real values, not zeros on both sides
    assert torch.equal(got != 0, pos) and torch.equal(want != 0, pos)
    assert float((got - want).abs().max()) < TOL
    assert float((got_ent - want_ent).abs().max()) < TOL
    for k, p in model.named_parameters():
        assert float((p.grad - want_g[k]).abs().max()) <= GRAD_TOL * float(want_g[k].abs().max()), k


def test_each_prompt_is_packed_once_and_a_group_over_the_budget_is_split():
    td = grpo_batch()  # prompts of 5, 9, 7 tokens; rests 2-11, 3-12, 4-13 tokens
    lengths = td["attention_mask"].sum(-1)
    one = packed_micro_batches(td, 400)
    assert len(one) == 1
    packed = one[0]
    rows = packed.rows
    # one packed row per prompt, and row 5 (nothing trained: all prompt) on its own
    assert sorted(rows.tolist()) == list(range(12)) and packed.input_ids.shape[0] == 4
    # tokens run: each prompt once plus every rest, against every row in full
    assert int((packed.segment >= 0).sum()) == int(lengths.sum()) - 3 * 5 - 2 * 9 - 3 * 7
    split = packed_micro_batches(td, 30)  # prompt + rests over 30 tokens: the group is cut, the prompt repeated
    prompts_run = sum(int((pk.segment == 0).any(-1).sum()) for pk in split)
    assert prompts_run > 3
    assert all(int((pk.segment >= 0).sum(-1).max()) <= 30 for pk in split)
    assert sorted(r for pk in split for r in pk.rows.tolist()) == list(range(12))


def test_learner_step_packed_equals_padded():
    """The whole train step (loss weights, micro-batches, gradient) from the same weights and batch."""
    from rayllm_rl.objectives.grpo import GRPOLoss

    td = grpo_batch()
    td["advantages"] = torch.randn(12, generator=torch.Generator().manual_seed(1), dtype=torch.float32)
    td["logprobs"] = torch.zeros(td["input_ids"].shape)
    td["versions"] = torch.zeros(td["input_ids"].shape, dtype=torch.long)
    grads = {}
    for share in (False, True):
        model = qwen2()
        learner = Learner("unused", OptimConfig(lr=0.0, grad_clip=0.0, max_tokens_per_micro_batch=60,
                                                share_prompts=share, logprob_chunk_size=7), model=model)
        assert learner.can_share_prompts
        metrics = learner.train_step(td, GRPOLoss())
        grads[share] = ({k: p.grad.clone() for k, p in model.named_parameters()}, metrics)
    (g0, m0), (g1, m1) = grads[False], grads[True]
    assert abs(m0["loss"] - m1["loss"]) < TOL and abs(m0["entropy"] - m1["entropy"]) < TOL
    for k in g0:
        assert float((g0[k] - g1[k]).abs().max()) <= GRAD_TOL * float(g0[k].abs().max()), k


def test_float32_eager_within_the_rounding_of_its_sums():
    """Eager attention (an additive float mask) in float32: the two paths sum in different orders. Each
    logprob is a log-softmax over V=60 of logits that are sums over H=16..32 products through 2 layers;
    rounding of order R*u (R = 60, u = 2^-24) times the logits' scale (~10 here) is ~4e-5: allow 1e-4."""
    model, td = qwen2(dtype=torch.float32, attn="eager"), grpo_batch()
    want = token_logprobs(model, td["input_ids"], td["attention_mask"], positions=td["loss_mask"] != 0)
    got = packed_logp(model, td, 400)
    assert float(want.abs().max()) > 1.0
    assert float((got - want).abs().max()) < 1e-4


def test_models_the_packed_path_cannot_serve_are_scored_padded():
    sliding = qwen2(use_sliding_window=True, sliding_window=4, max_window_layers=0)
    assert not supports_shared_prompt(sliding)
    learner = Learner("unused", OptimConfig(share_prompts=True), model=sliding)
    assert not learner.can_share_prompts and all(p is None for _, p in learner.micro_batches_of(grpo_batch()))
    assert supports_shared_prompt(qwen2()) and supports_shared_prompt(qwen2(attn="eager"))


def test_a_model_that_ignores_the_4d_mask_is_refused_naming_the_key():
    """A fault injected to reach the refusal: the model drops the mask it is given."""
    model = qwen2()
    forward = model.forward
    model.forward = lambda *a, attention_mask=None, **kw: forward(*a, **kw)
    with pytest.raises(ValueError, match="optim.share_prompts=false"):
        check_shared_prompt(model, 7)


@pytest.mark.parametrize("budget", [400, 40])
def test_a_frozen_scorer_gives_the_padded_logprobs_at_the_sampled_tokens(budget):
    """The teacher's path (`shared_prompt_logprobs`): each group's prompt run once, the batch in the original row
    order, the loss-mask tokens scored as the padded rows score them (top-k replayed), 0 at every other place."""
    from rayllm_rl.learner.logprobs import batched_token_logprobs
    from rayllm_rl.learner.shared_prompt import shared_prompt_logprobs
    from rayllm_rl.sampling_mask import SamplingMask

    model, td = qwen2().eval(), grpo_batch()
    pos = td["loss_mask"] != 0
    top_k = SamplingMask(top_k=5)
    with torch.no_grad():
        want = batched_token_logprobs(model, td, budget, 0.7, chunk_size=7, mask=top_k)
    got = shared_prompt_logprobs(model, td, budget, 0.7, chunk_size=7, mask=top_k)
    assert got.shape == want.shape and torch.equal(got != 0, pos)
    assert float(want[pos].abs().max()) > 1.0
    assert float((got[pos] - want[pos]).abs().max()) < TOL
    assert not torch.equal(want, batched_token_logprobs(model, td, budget, 0.7, chunk_size=7))  # top-k mattered


def test_the_teacher_shares_prompts_where_the_model_allows_and_scores_as_the_padded_path(tiny_model_path):
    """A `FrozenModel` built with share_prompts (the teacher) takes the packed path and agrees with the padded
    one on the sampled tokens within float32 rounding (sums over hidden 128, logits of a few units: 1e-4)."""
    from rayllm_rl.learner.frozen import FrozenModel

    td = grpo_batch(vocab=300)
    padded = FrozenModel(tiny_model_path, share_prompts=False)
    packed = FrozenModel(tiny_model_path, share_prompts=True)
    assert packed.share_prompts and not padded.share_prompts
    pos = td["loss_mask"] != 0
    want, got = padded.compute_logprobs(td), packed.compute_logprobs(td)
    assert torch.equal(got != 0, pos)
    assert float((got[pos] - want[pos]).abs().max()) < 1e-4
