"""Chunked LM-head logprobs: equal to the full-vocabulary computation (float64, to rounding), for
tied and untied heads, with temperature, with activation checkpointing, on a second architecture;
no `[B, T, V]` tensor is kept for backward; token-budget micro-batches; clear errors.

The float64 models use SDPA, which computes in float64: eager attention takes its softmax in float32,
whose rounding depends on a row's padded length and the CPU's vector width, so micro-batched and
full-batch results could differ by ~1e-8 on some CPUs (tests/test_learning_correctness.py)."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rayllm_rl.learner.learner import Learner, OptimConfig
from rayllm_rl.learner.logprobs import (
    check_chunked_head,
    full_token_logprobs,
    token_budget_micro_batches,
    token_logprobs,
)

F64 = torch.float64
TOL = 1e-12


pytestmark = pytest.mark.usefixtures("one_torch_thread")



def qwen2(vocab: int = 50, tie: bool = False, hidden: int = 16, dtype: torch.dtype = F64) -> torch.nn.Module:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=32, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                      tie_word_embeddings=tie, attn_implementation="sdpa")
    return Qwen2ForCausalLM(cfg).to(dtype).train()


def batch(vocab: int = 50, rows: int = 3, t: int = 9, seed: int = 0):
    """Right-padded `(input_ids, attention_mask, loss_mask)`: rows of t, t-3 and t-5 tokens, the
    last 4 real tokens of each trained."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (rows, t), generator=g)
    lengths = torch.tensor([t - 3 * (i > 0) - 2 * (i > 1) for i in range(rows)])
    am = torch.arange(t)[None] < lengths[:, None]
    loss = am & (torch.arange(t)[None] >= (lengths[:, None] - 4))
    return ids * am, am, loss


def logp_grads(model, ids, am, temperature, chunk, positions=None):
    """logp, entropy and the gradient of sum(w * logp) over `positions` (random fixed weights w)."""
    w = torch.randn(ids.shape, generator=torch.Generator().manual_seed(5), dtype=F64)
    keep = am if positions is None else positions
    if chunk == 0:
        logp, ent = full_token_logprobs(model, ids, am, temperature, with_entropy=True)
    else:
        logp, ent = token_logprobs(model, ids, am, temperature, with_entropy=True, positions=positions,
                                   chunk_size=chunk)
    params = [p for p in model.parameters()]
    grads = torch.autograd.grad((torch.where(keep, logp, 0.0) * w).sum(), params)
    return logp.detach() * keep, ent * keep, torch.cat([g.flatten() for g in grads])


@pytest.mark.parametrize("checkpointing", [False, True])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("tie", [False, True])
def test_chunked_logprobs_entropy_and_gradient_equal_the_full_vocabulary(tie, temperature, checkpointing):
    model = qwen2(tie=tie)
    assert (model.get_output_embeddings().weight is model.get_input_embeddings().weight) == tie
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ids, am, loss = batch()
    want_lp, want_ent, want_g = logp_grads(model, ids, am, temperature, chunk=0)
    assert want_g.abs().max() > 1e-3 and float(want_ent[:, 1:][am[:, 1:]].min()) > 1.0  # a real distribution
    for chunk in (1, 4, 1024):  # one position per chunk, uneven chunks, one chunk
        lp, ent, g = logp_grads(model, ids, am, temperature, chunk)
        assert float((lp - want_lp).abs().max()) <= TOL, chunk
        assert float((ent - want_ent).abs().max()) <= TOL, chunk
        assert float((g - want_g).abs().max() / want_g.abs().max()) <= TOL, chunk
    # the LM head only at the trained tokens: the same values there, 0 elsewhere, and the same gradient
    lp, ent, g = logp_grads(model, ids, am, temperature, 3, positions=loss)
    _, _, want_g = logp_grads(model, ids, am, temperature, 0, positions=loss)
    assert float((lp - want_lp * loss).abs().max()) <= TOL and float((ent - want_ent * loss).abs().max()) <= TOL
    assert float((g - want_g).abs().max() / want_g.abs().max()) <= TOL


def saved_sizes(fn) -> list[tuple[tuple[int, ...], int]]:
    """Shapes and element counts of every tensor autograd saves for backward while `fn` runs."""
    seen: list[tuple[tuple[int, ...], int]] = []

    def pack(t):
        seen.append((tuple(t.shape), t.numel()))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return seen


def test_no_vocabulary_sized_activation_is_kept_for_backward():
    """The full path keeps `[B, T-1, V]` logits and log-probs for backward; the chunked one keeps
    nothing with a vocabulary dimension but the head's own `[V, H]` weight."""
    vocab, hidden = 1000, 16
    model = qwen2(vocab=vocab, hidden=hidden, dtype=torch.float32)
    ids, am, loss = batch(vocab=vocab, rows=3, t=40)
    full = saved_sizes(lambda: full_token_logprobs(model, ids, am))
    assert max(n for s, n in full if vocab in s) >= 3 * 39 * vocab
    chunked = saved_sizes(lambda: token_logprobs(model, ids, am, positions=loss, chunk_size=8))
    assert max(n for s, n in chunked if vocab in s) == vocab * hidden


def test_activation_checkpointing_keeps_fewer_activations_and_the_same_gradient():
    vocab = 50
    ids, am, loss = batch(vocab=vocab, t=30)
    sizes, grads = [], []
    for on in (False, True):
        learner = Learner("", OptimConfig(lr=0.0, grad_clip=0.0, activation_checkpointing=on, logprob_chunk_size=4),
                          model=qwen2(vocab=vocab))
        assert learner.model.is_gradient_checkpointing == on
        model = learner.model
        sizes.append(sum(n for _, n in saved_sizes(
            lambda: token_logprobs(model, ids, am, positions=loss, chunk_size=4))))
        lp = token_logprobs(model, ids, am, positions=loss, chunk_size=4)
        grads.append(torch.cat([g.flatten() for g in torch.autograd.grad(lp.sum(), list(model.parameters()))]))
    assert sizes[1] < 0.6 * sizes[0], sizes
    assert float((grads[1] - grads[0]).abs().max() / grads[0].abs().max()) <= TOL
    off = Learner("", OptimConfig(activation_checkpointing=True), model=qwen2())
    off.reset_optimizer(OptimConfig(activation_checkpointing=False))  # the option follows the optimizer config
    assert not off.model.is_gradient_checkpointing


def test_another_architecture_with_other_attribute_names():
    """GPT-2 (transformer.h, tied lm_head) goes through the same accessor-based path."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=60, n_positions=32, n_embd=16, n_layer=2, n_head=2,
                                       attn_pdrop=0.0, embd_pdrop=0.0, resid_pdrop=0.0)).to(F64)
    ids, am, _ = batch(vocab=60)
    want_lp, want_ent, want_g = logp_grads(model, ids, am, 0.9, chunk=0)
    lp, ent, g = logp_grads(model, ids, am, 0.9, chunk=5)
    assert float((lp - want_lp).abs().max()) <= TOL and float((ent - want_ent).abs().max()) <= TOL
    assert float((g - want_g).abs().max() / want_g.abs().max()) <= TOL


def test_bfloat16_model_matches_the_full_vocabulary_path():
    """bf16 logits are upcast to float32 in both paths; only the matmul's blocking differs."""
    model = qwen2(vocab=200, dtype=torch.bfloat16)
    ids, am, _ = batch(vocab=200)
    with torch.no_grad():
        want, want_ent = full_token_logprobs(model, ids, am, with_entropy=True)
        got, ent = token_logprobs(model, ids, am, with_entropy=True, chunk_size=4)
    assert got.dtype == torch.float32
    assert float(((got - want) * am).abs().max()) <= 1e-4  # observed 5e-7
    assert float(((ent - want_ent) * am).abs().max()) <= 1e-4  # observed 1.4e-6
    grads = []
    for chunk in (0, 4):  # the weight's gradient accumulates over chunks in float32, then becomes bf16
        lp = full_token_logprobs(model, ids, am) if chunk == 0 else token_logprobs(model, ids, am, chunk_size=chunk)
        grads.append(torch.cat([g.float().flatten() for g in torch.autograd.grad((lp * am).sum(),
                                                                                  list(model.parameters()))]))
    assert float((grads[1] - grads[0]).norm() / grads[0].norm()) <= 1e-2  # observed 1.9e-3 (bf16 eps: 7.8e-3)


def test_soft_capped_logits_are_refused_with_a_clear_error():
    """Gemma-2 soft-caps its logits after the head: the chunked path would skip that, so the
    learner refuses it and names the switch; the full-vocabulary path (chunk 0) trains it."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    torch.manual_seed(0)
    model = Gemma2ForCausalLM(Gemma2Config(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                           num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                                           final_logit_softcapping=0.5, attn_implementation="eager"))
    with pytest.raises(ValueError, match=r"logprob_chunk_size=0"):
        check_chunked_head(model)
    with pytest.raises(ValueError, match=r"soft-capping"):
        Learner("", OptimConfig(), model=model)
    learner = Learner("", OptimConfig(logprob_chunk_size=0), model=model)
    ids, am, loss = batch(vocab=64)
    assert torch.allclose(learner.compute_logprobs(_td(ids, am, loss)), full_token_logprobs(model, ids, am) * am)


def _td(ids, am, loss):
    from tensordict import TensorDict

    return TensorDict({"input_ids": ids, "attention_mask": am, "loss_mask": loss}, batch_size=[ids.shape[0]])


def test_compute_logprobs_and_reference_batch_by_tokens_in_the_original_row_order(tiny_model_path):
    from rayllm_rl.learner.frozen import FrozenModel

    g = torch.Generator().manual_seed(3)
    lengths = torch.tensor([5, 17, 9, 30, 2, 12, 30, 8])
    am = torch.arange(30)[None] < lengths[:, None]
    ids = torch.randint(0, 384, am.shape, generator=g) * am
    td = _td(ids, am, am)
    want = Learner(tiny_model_path, OptimConfig(max_tokens_per_micro_batch=10**6, logprob_chunk_size=0)) \
        .compute_logprobs(td)
    for budget, chunk in ((30, 7), (64, 1024)):  # 1 row per micro-batch; 2-5 rows per micro-batch
        got = Learner(tiny_model_path, OptimConfig(max_tokens_per_micro_batch=budget, logprob_chunk_size=chunk)) \
            .compute_logprobs(td)
        torch.testing.assert_close(got * am, want * am, atol=2e-5, rtol=0)
        ref = FrozenModel(tiny_model_path, max_tokens_per_micro_batch=budget, logprob_chunk_size=chunk)
        torch.testing.assert_close(ref.compute_logprobs(td) * am, want * am, atol=2e-5, rtol=0)
    assert (want[:, 1:][am[:, 1:]] < 0).all()  # every real token has a computed logprob


@settings(max_examples=200, deadline=None)
@given(lengths=st.lists(st.integers(0, 40), max_size=30), budget=st.integers(1, 120), rows=st.integers(0, 5))
def test_token_budget_micro_batches_cover_every_row_once_within_the_budget(lengths, budget, rows):
    lens = torch.tensor(lengths, dtype=torch.long)
    groups = token_budget_micro_batches(lens, budget, rows)
    flat = [int(i) for g in groups for i in g]
    assert sorted(flat) == list(range(len(lengths)))
    widths = [int(lens[g].max().clamp(min=1)) for g in groups]
    for g, w in zip(groups, widths):
        assert len(g) * w <= budget or len(g) == 1  # a row longer than the budget goes alone
        assert rows == 0 or len(g) <= rows
    assert [lengths[i] for i in flat] == sorted(lengths, reverse=True)  # longest first
    assert widths == sorted(widths, reverse=True)


def test_token_budget_groups_by_length_not_by_position():
    lens = torch.tensor([3, 8, 2, 7, 5, 6])
    assert [g.tolist() for g in token_budget_micro_batches(lens, 14)] == [[1], [3, 5], [4, 0], [2]]  # 8 | 14 | 10 | 2
    assert [g.tolist() for g in token_budget_micro_batches(lens, 14, max_rows=1)] == [[1], [3], [5], [4], [0], [2]]
    assert token_budget_micro_batches(torch.tensor([], dtype=torch.long), 8) == []


@pytest.mark.parametrize("field, value", [("max_tokens_per_micro_batch", 0), ("micro_batch_size", -1),
                                          ("logprob_chunk_size", -2)])
def test_bad_batching_options_name_the_key(field, value):
    with pytest.raises(ValueError, match=rf"optim\.{field}={value}"):
        OptimConfig(**{field: value})


@pytest.mark.slow
def test_learner_memory_benchmark_smoke(tmp_path):
    """benchmarks/learner_memory.py in a small form: both paths run, the JSON has its schema, and the
    two paths' gradients agree (the full run's figures are in docs/performance.md)."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    out = tmp_path / "learner_memory.json"
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "learner_memory.py"
    subprocess.run([sys.executable, str(script), "--rows", "4", "--max-len", "128", "--vocab", "3000", "--steps", "1",
                    "--warmup", "0", "--out", str(out)], check=True, timeout=300, capture_output=True)
    report = json.loads(out.read_text())
    assert report["config"]["rows"] == 4 and report["config"]["max_tokens"] == 128  # 1 row x 128 tokens
    for path in ("today", "chunked"):
        r = report[path]
        assert r["peak_bytes"] > 0 and r["tokens_per_s"] > 0 and len(r["step_seconds"]) == 1
        assert r["real_tokens"] <= r["padded_tokens"] and r["largest_micro_batch_padded_tokens"] <= 128
        assert 0 < r["trained_tokens"] < r["real_tokens"]  # prompts are not trained
    assert report["today"]["micro_batches"] == 4  # one row each
    assert report["today"]["real_tokens"] == report["chunked"]["real_tokens"]
    assert report["today"]["entropy"] == pytest.approx(report["chunked"]["entropy"], rel=1e-5)
    summary = report["summary"]
    assert summary["grad_rel_diff"] <= 1e-5 and summary["targets_met"]["grad_rel_diff"]
    assert set(summary["targets_met"]) == {"peak_memory", "tokens_per_s", "grad_rel_diff"}
    assert summary["peak_memory_ratio"] > 0 and summary["tokens_per_s_ratio"] > 0
