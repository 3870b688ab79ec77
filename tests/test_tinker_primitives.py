"""Tinker's primitives on our roles (rayllm_rl.tinker, issue X): the losses against their documented formulas, the
learner's scores against a full forward, accumulation and Adam's per-step parameters against torch's AdamW by
hand, the custom loss's gradient against the built-in one, a save/load that continues as an uninterrupted run,
versions and the sampling mask on every sampled token, the clear errors, and the same calls on Ray."""
from __future__ import annotations

import copy
import math

import pytest
import torch

import tinker  # noqa: F401  (the `tinker` extra; `make test` installs it: a missing one fails, never skips)
from tinker import types as tt

from rayllm_rl.objectives.token_sum import CISPO, PPO, CrossEntropy, ImportanceSampling, make_token_loss  # noqa: E402
from rayllm_rl.sampling_mask import SamplingMask  # noqa: E402
from rayllm_rl.tinker.data import sampling_mask_inputs, to_batch  # noqa: E402

EPS32 = torch.finfo(torch.float32).eps


def datum(prompt, tokens, **per_token):
    full, pad = list(prompt) + list(tokens), [0.0] * (len(prompt) - 1)
    return tt.Datum(model_input=tt.ModelInput.from_ints(full[:-1]),
                    loss_fn_inputs={"target_tokens": full[1:], **{k: pad + list(v) for k, v in per_token.items()}})


# ---------------------------------------------------------------- the losses, by their formulas


def test_each_tinker_loss_is_its_documented_sum():
    """Tinker's docs (/losses): per token, summed over the datum's positions (padding never counts)."""
    g = torch.Generator().manual_seed(0)
    logp = -torch.rand(3, 5, generator=g) * 3
    behav = logp + 0.3 * torch.randn(3, 5, generator=g)
    adv, w = torch.randn(3, 5, generator=g), torch.rand(3, 5, generator=g)
    mask = torch.ones(3, 5)
    mask[1, 3:] = 0
    inputs = {"logprobs": behav, "advantages": adv, "weights": w}
    ratio, m = torch.exp(logp - behav), mask.bool()
    want = {
        "cross_entropy": (-logp * w)[m].sum(),
        "importance_sampling": (-ratio * adv)[m].sum(),
        "ppo": (-torch.minimum(ratio * adv, ratio.clamp(0.8, 1.2) * adv))[m].sum(),
        "cispo": (-ratio.clamp(0.8, 1.2) * logp * adv)[m].sum(),
    }
    for cls in (CrossEntropy, ImportanceSampling, PPO, CISPO):
        out = cls()(logp, inputs, mask)
        assert torch.allclose(out.loss, want[cls.name], rtol=1e-6), cls.name
        assert out.metrics["loss:sum"] == pytest.approx(float(want[cls.name]), rel=1e-6)
    # the config's bounds, and per-token bounds the data carries, replace Tinker's 0.8 / 1.2
    narrow = PPO({"clip_low_threshold": 0.95, "clip_high_threshold": 1.05})(logp, inputs, mask).loss
    assert torch.allclose(narrow, (-torch.minimum(ratio * adv, ratio.clamp(0.95, 1.05) * adv))[m].sum())
    lo, hi = torch.full_like(logp, 0.9), torch.full_like(logp, 1.1)
    per = CISPO()(logp, {**inputs, "clip_low_threshold": lo, "clip_high_threshold": hi}, mask).loss
    assert torch.allclose(per, (-ratio.clamp(0.9, 1.1) * logp * adv)[m].sum())
    # CISPO's weight carries no gradient: d loss / d logp = -clip(r) * A exactly
    lp = logp.clone().requires_grad_(True)
    CISPO()(lp, inputs, mask).loss.backward()
    assert torch.allclose(lp.grad, torch.where(m, -ratio.clamp(0.8, 1.2) * adv, torch.zeros_like(adv)))


def test_loss_names_and_configs_are_checked():
    assert type(make_token_loss("rayllm_rl:cispo").loss).__name__ == "CISPOLoss"  # ours, where Tinker has the name
    assert make_token_loss("cispo").name == "cispo"  # Tinker's wins the plain name
    assert type(make_token_loss("grpo").loss).__name__ == "GRPOLoss"
    with pytest.raises(ValueError, match="unknown loss_fn 'dro'"):
        make_token_loss("dro")
    with pytest.raises(ValueError, match="unknown keys \\['clip_ratio'\\]"):
        make_token_loss("ppo", {"clip_ratio": 0.2})
    with pytest.raises(ValueError, match="needs loss_fn_inputs \\['logprobs', 'advantages'\\]"):
        ImportanceSampling()(torch.zeros(1, 2), {"logprobs": torch.zeros(1, 2)}, torch.ones(1, 2))


def test_a_malformed_datum_is_refused_naming_it():
    good = datum([1, 2], [3, 4], weights=[1, 1])
    short = tt.Datum(model_input=tt.ModelInput.from_ints([1, 2, 3]), loss_fn_inputs={"target_tokens": [2, 3]})
    with pytest.raises(ValueError, match="datum 1: loss_fn_inputs\\['target_tokens'\\] has shape \\[2\\]"):
        to_batch([good, short], 100)
    with pytest.raises(ValueError, match="datum 0: model_input has token ids outside the vocabulary \\[0, 3\\)"):
        to_batch([good], 3)
    with pytest.raises(ValueError, match="datum 1 has loss_fn_inputs \\[\\]"):
        to_batch([good, datum([1, 2], [3])], 100)
    with pytest.raises(ValueError, match="non-empty list"):
        to_batch([], 100)
    def masked(k):
        d = datum([1, 2], [3])
        return tt.Datum(model_input=d.model_input, loss_fn_inputs={
            **d.loss_fn_inputs, **sampling_mask_inputs({"top_k": k, "top_p": 0.9})})

    assert to_batch([masked(5), masked(5)], 100)[1] == SamplingMask(5, 0.9)
    with pytest.raises(ValueError, match="different sampling masks"):
        to_batch([masked(5), masked(7)], 100)


# ---------------------------------------------------------------- the learner's primitives


@pytest.fixture(scope="module")
def learner(tiny_model_path):
    from rayllm_rl.learner.learner import Learner
    from rayllm_rl.learner.optim import OptimConfig

    return Learner(tiny_model_path, OptimConfig(lr=1e-3, max_tokens_per_micro_batch=16))


def test_scores_are_a_full_forwards_logprobs_of_any_target(learner):
    """Tinker's targets need not be the next input: each position's score is log_softmax(logits)[target] of the
    model's own forward, micro-batched (a 16-token budget splits the rows) or not."""
    from rayllm_rl.learner.primitives import forward_backward

    data = [datum([5, 6, 7], [8, 9]), tt.Datum(model_input=tt.ModelInput.from_ints([11, 12, 13, 14]),
                                               loss_fn_inputs={"target_tokens": [40, 3, 3, 200]}),
            datum(list(range(20, 31)), [31, 32, 33])]
    batch, mask = to_batch(data, learner.model.config.vocab_size)
    logp, metrics = forward_backward(learner, batch, CrossEntropy(), backward=False, sampling_mask=mask)
    with torch.no_grad():
        for i, d in enumerate(data):
            ids = torch.tensor([d.model_input.to_ints()])
            want = torch.log_softmax(learner.model(input_ids=ids).logits[0].float(), -1)
            want = want.gather(-1, torch.tensor(d.loss_fn_inputs["target_tokens"].tolist())[:, None])[:, 0]
            n = want.shape[0]
            assert torch.allclose(logp[i, :n], want, atol=1e-5), i
            assert (logp[i, n:] == 0).all()
    assert metrics["loss:sum"] == pytest.approx(-float(logp.sum()), rel=1e-5)
    assert all(p.grad is None for p in learner.model.parameters())  # forward only


def test_gradients_accumulate_and_adam_takes_its_parameters_each_step(learner):
    """Two forward_backward calls on halves give the gradient of one call on the whole (a sum), and optim_step
    is torch's AdamW at the AdamParams given, gradients cleared after it."""
    from rayllm_rl.learner.primitives import forward_backward, optim_step

    data = [datum([5, 6, 7], [8, 9], weights=[1.0, 0.5]), datum([3, 4], [10, 11, 12], weights=[1.0, 1.0, 2.0])]
    vocab = learner.model.config.vocab_size
    whole, _ = to_batch(data, vocab)
    forward_backward(learner, whole, CrossEntropy())
    g_whole = [p.grad.clone() for p in learner.model.parameters()]
    learner.optimizer.zero_grad(set_to_none=True)
    for d in data:
        forward_backward(learner, to_batch([d], vocab)[0], CrossEntropy())
    for g, p in zip(g_whole, learner.model.parameters()):
        assert torch.allclose(p.grad, g, atol=1e-6, rtol=1e-5)
    adam = {"learning_rate": 3e-3, "beta1": 0.8, "beta2": 0.9, "eps": 1e-8, "weight_decay": 0.1,
            "grad_clip_norm": 0.0}
    ref = copy.deepcopy(learner.model)
    for rp, g in zip(ref.parameters(), g_whole):
        rp.grad = g.clone()
    torch.optim.AdamW(ref.parameters(), lr=3e-3, betas=(0.8, 0.9), eps=1e-8, weight_decay=0.1).step()
    learner.reset_optimizer(learner.cfg)  # fresh state, as `ref`'s
    for p, g in zip(learner.model.parameters(), g_whole):
        p.grad = g.clone()
    metrics = optim_step(learner, adam)
    assert metrics["lr"] == 3e-3 and metrics["skipped_nonfinite_steps"] == 0.0
    for rp, p in zip(ref.parameters(), learner.model.parameters()):
        assert torch.equal(rp, p)
        assert p.grad is None
    with pytest.raises(ValueError, match="missing \\['grad_clip_norm'\\]"):
        optim_step(learner, {k: v for k, v in adam.items() if k != "grad_clip_norm"})


def test_rows_of_different_lengths_with_per_token_inputs_split_into_micro_batches_as_one(learner):
    """A call whose rows differ in length and carry per-token inputs (behaviour logprobs and advantages, weights),
    split by the 16-token budget into micro-batches each cut to its own longest row, gives the scores and the
    gradient of the same call in one micro-batch. (The inputs once kept the call's width while the token keys were
    cut, and every such split call failed: a GRPO loop whose forward_backward result went unread lost those steps.)"""
    from rayllm_rl.learner.logprobs import micro_batches
    from rayllm_rl.learner.primitives import forward_backward

    data = [datum([5, 6, 7], [8, 9], logprobs=[-1.0, -2.0], advantages=[0.5, -1.0], weights=[1.0, 0.5]),
            datum(list(range(20, 31)), [31, 32, 33], logprobs=[-1.5, -0.5, -3.0], advantages=[1.0, 1.0, 1.0],
                  weights=[1.0, 1.0, 2.0]),
            datum([3, 4], [10, 11, 12], logprobs=[-2.0, -1.0, -0.5], advantages=[-0.5, 0.2, 0.3],
                  weights=[2.0, 1.0, 1.0])]
    batch, mask = to_batch(data, learner.model.config.vocab_size)
    widths = {int(mb["input_ids"].shape[1]) for _, mb in micro_batches(batch, 16)}
    assert len(widths) > 1, widths  # the budget splits the call, and cuts the micro-batches to different widths
    budget = learner.cfg.max_tokens_per_micro_batch
    for loss in (PPO(), ImportanceSampling(), CrossEntropy()):
        runs = []
        try:
            for learner.cfg.max_tokens_per_micro_batch in (16, 4096):
                learner.optimizer.zero_grad(set_to_none=True)
                logp, metrics = forward_backward(learner, batch, loss, sampling_mask=mask)
                runs.append((logp, metrics, [p.grad.clone() for p in learner.model.parameters()]))
        finally:
            learner.cfg.max_tokens_per_micro_batch = budget
            learner.optimizer.zero_grad(set_to_none=True)
        (split_lp, split_m, split_g), (one_lp, one_m, one_g) = runs
        assert torch.allclose(split_lp, one_lp, atol=1e-5), type(loss).__name__
        assert split_m["loss:sum"] == pytest.approx(one_m["loss:sum"], rel=1e-5, abs=1e-6)
        for a, b in zip(split_g, one_g):  # the same per-token terms, summed over micro-batches in another order
            assert torch.allclose(a, b, atol=1e-6, rtol=1e-5), type(loss).__name__


# ---------------------------------------------------------------- the clients on the local backend


@pytest.fixture(scope="module")
def service(tiny_model_path, tmp_path_factory):
    from rayllm_rl.tinker import TinkerService

    root = tmp_path_factory.mktemp("tinker")
    with TinkerService(tiny_model_path, "local", [f"trainer.run_dir={root}"]) as s:
        s.create_training_client()
        yield s


def rl_data(tok, prompts=("1+2=", "3+4="), n=3):
    """Fixed completions with made-up behaviour logprobs and advantages (the gradient test needs no sampler)."""
    g = torch.Generator().manual_seed(1)
    out = []
    for q in prompts:
        ids = tok(q)["input_ids"]
        for _ in range(n):
            comp = torch.randint(20, 300, (4,), generator=g).tolist()
            out.append(datum(ids, comp, logprobs=(-torch.rand(4, generator=g) * 5).tolist(),
                             advantages=torch.randn(4, generator=g).tolist()))
    return out


def test_forward_backward_custom_gives_the_built_in_losss_gradient(service):
    """The SDK's custom path (forward, the user's loss on the logprobs, cross_entropy with weights -dC/dlogp)
    against `importance_sampling` on the same data. Both sum the same per-token products in float32; the custom
    one rounds each weight exp(logp - s) * A once more, so the gradients agree to a few float32 ulps of their
    largest entry, times the tokens summed (24): bound 24 * 8 eps * max|g|."""
    learner, training = service.roles.learner, service.training_client
    data = rl_data(training.get_tokenizer())
    learner.optimizer.zero_grad(set_to_none=True)
    built_in = training.forward_backward(data, "importance_sampling").result()
    g_built = [p.grad.clone() for p in learner.model.parameters()]
    learner.optimizer.zero_grad(set_to_none=True)

    def is_loss(batch, logprobs):
        terms = [-(torch.exp(lp - torch.tensor(d.loss_fn_inputs["logprobs"].tolist()))
                   * torch.tensor(d.loss_fn_inputs["advantages"].tolist())).sum() for d, lp in zip(batch, logprobs)]
        return torch.stack(terms).sum(), {"custom:sum": 1.0}

    custom = training.forward_backward_custom(data, is_loss).result()
    scale = max(float(g.abs().max()) for g in g_built)
    for a, b in zip(g_built, (p.grad for p in learner.model.parameters())):
        assert float((a - b).abs().max()) <= 24 * 8 * EPS32 * scale
    assert custom.metrics["loss:sum"] == pytest.approx(built_in.metrics["loss:sum"], rel=1e-5)
    assert custom.metrics["custom:sum"] == 1.0 and "surrogate_loss:sum" in custom.metrics
    learner.optimizer.zero_grad(set_to_none=True)


def test_calls_run_in_submission_order_and_versions_reach_every_token(service):
    """Nothing is waited for between the calls: a forward submitted after an optim_step sees the new weights; the
    sampling client's tokens carry the version its save made, and the replica's weights equal the learner's."""
    training = service.training_client
    tok = training.get_tokenizer()
    answer = tok("<answer>4</answer>")["input_ids"]
    data = [datum(tok("2+2=")["input_ids"], answer, weights=[1.0] * len(answer))]
    v0 = service.version
    before = training.forward(data, "cross_entropy")
    step = training.forward_backward(data, "cross_entropy")
    opt = training.optim_step(tt.AdamParams(learning_rate=1e-2))
    after = training.forward(data, "cross_entropy")
    assert after.result(60).metrics["loss:sum"] < before.result().metrics["loss:sum"]
    assert step.done() and opt.done() and service.version == v0 + 1
    sampler = training.save_weights_and_get_sampling_client()
    assert sampler.version == v0 + 1 and sampler.result() is sampler
    assert service.roles.replica_checksums() == [service.roles.learner_checksum()]
    out = sampler.sample(tt.ModelInput.from_ints(tok("1+1=")["input_ids"]), 3,
                         tt.SamplingParams(max_tokens=6, top_k=20, top_p=0.9)).result()
    assert len(out.sequences) == 3
    for s in out.sequences:
        assert len(s.tokens) == len(s.logprobs) == len(s.versions) > 0 and set(s.versions) == {v0 + 1}
        assert s.sampling_mask == {"top_k": 20, "top_p": 0.9}
        assert all(lp <= 0 for lp in s.logprobs)
    # a snapshot client serves its own version only (rollout.max_staleness=0): after another step and save, no
    training.forward_backward(data, "cross_entropy")
    training.optim_step(tt.AdamParams(learning_rate=1e-2))
    newer = training.save_weights_and_get_sampling_client()
    with pytest.raises(ValueError, match=f"pinned to policy version {v0 + 1}; the replicas hold version {v0 + 2}"):
        sampler.sample(tt.ModelInput.from_ints([1, 2]), 1, tt.SamplingParams(max_tokens=2)).result()
    lps = newer.compute_logprobs(tt.ModelInput.from_ints(data[0].model_input.to_ints())).result()
    fwd = training.forward(data, "cross_entropy").result().loss_fn_outputs[0]["logprobs"].tolist()
    assert lps[0] is None and lps[1:] == pytest.approx(fwd[:-1], abs=1e-6)


def test_string_and_token_stops_cut_the_samples(service):
    training = service.training_client
    tok = training.get_tokenizer()
    sampler = training.save_weights_and_get_sampling_client()
    prompt = tt.ModelInput.from_ints(tok("1+1=")["input_ids"])
    free = sampler.sample(prompt, 4, tt.SamplingParams(max_tokens=12, stop=[])).result()
    assert all(len(s.tokens) == 12 and s.stop_reason == "length" for s in free.sequences)  # [] disables EOS
    texts = [tok.decode(s.tokens) for s in free.sequences]
    stop = next(t for t in texts if len(t) > 2)[1:3]  # a string a sample of this engine does produce
    cut = sampler.sample(prompt, 8, tt.SamplingParams(max_tokens=12, stop=[stop])).result()
    for s in cut.sequences:
        text = tok.decode(s.tokens)
        if s.stop_reason == "stop":
            assert stop in text and stop not in tok.decode(s.tokens[:-1])
        else:
            assert stop not in text and len(s.tokens) == 12
    first = free.sequences[0].tokens[0]
    by_id = sampler.sample(prompt, 4, tt.SamplingParams(max_tokens=12, stop=[first])).result()
    assert all(s.tokens[-1] == first or len(s.tokens) == 12 for s in by_id.sequences)
    assert all(first not in s.tokens[:-1] for s in by_id.sequences)


def test_errors_name_the_problem(service, tiny_model_path, tmp_path):
    from rayllm_rl.tinker import TinkerService

    training = service.training_client
    with pytest.raises(ValueError, match="unknown loss_fn 'gspo'"):
        training.forward_backward([datum([1, 2], [3])], "gspo").result()
    with pytest.raises(ValueError, match="datum 0: loss_fn_inputs has no 'target_tokens'"):
        training.forward([tt.Datum(model_input=tt.ModelInput.from_ints([1]), loss_fn_inputs={})],
                         "cross_entropy").result()
    with pytest.raises(ValueError, match="unknown sampler weights 'tinker://nope/sampler_weights/x'"):
        service.create_sampling_client("tinker://nope/sampler_weights/x")
    with pytest.raises(ValueError, match="one training client per service"):
        service.create_training_client()
    fresh = TinkerService(tiny_model_path, "local", [f"trainer.run_dir={tmp_path}"])
    try:
        with pytest.raises(ValueError, match="create_training_client / create_lora_training_client first"):
            fresh.publish("x", "snapshot")
    finally:
        fresh.close()
    with pytest.raises(Exception, match="no-such-model"):
        TinkerService(str(tmp_path / "no-such-model"), "local").create_training_client()
    with pytest.raises(ValueError, match="trainer.backend"):
        TinkerService(tiny_model_path, "kubernetes")


def test_a_forward_backward_that_fails_on_the_learner_makes_the_next_optim_step_fail_not_step(service):
    """A forward_backward that fails inside the learner (here: `ppo` without the behaviour logprobs it needs)
    drops the gradients accumulated since the last step, and the next optim_step fails naming that failure with the
    weights untouched, instead of stepping on a part of the gradient or on none; the step after works."""
    training, roles = service.training_client, service.roles
    ok = [datum([5, 6, 7], [8, 9], weights=[1.0, 1.0])]
    training.forward_backward(ok, "cross_entropy").result()
    before, version = roles.learner_checksum(), service.version
    with pytest.raises(Exception, match="logprobs"):
        training.forward_backward([datum([5, 6, 7], [8, 9], advantages=[1.0, -1.0])], "ppo").result()
    assert all(p.grad is None for p in roles.learner.model.parameters())
    with pytest.raises(RuntimeError, match="a forward_backward since the last optim_step failed .*logprobs.*no step "
                                           "was taken"):
        training.optim_step(tt.AdamParams(learning_rate=1e-2)).result()
    assert roles.learner_checksum() == before and service.version == version
    training.forward_backward(ok, "cross_entropy").result()
    training.optim_step(tt.AdamParams(learning_rate=1e-2)).result()
    assert roles.learner_checksum() != before and service.version == version + 1


def test_save_state_then_a_new_service_continues_as_an_uninterrupted_run(tiny_model_path, tmp_path):
    """Two steps, save_state (optimizer included), a third step's loss; a new service loads the state with its
    optimizer and takes the same third step: the same loss, and the same weights after it (one CPU process,
    the same kernels: bit for bit)."""
    from rayllm_rl.tinker import TinkerService

    data = [datum([5, 6, 7], [8, 9, 10], weights=[1.0, 1.0, 1.0])]
    adam = tt.AdamParams(learning_rate=1e-2)
    with TinkerService(tiny_model_path, "local", [f"trainer.run_dir={tmp_path}"]) as first:
        t = first.create_training_client()
        for _ in range(2):
            t.forward_backward(data, "cross_entropy")
            t.optim_step(adam)
        path = t.save_state("two").result().path
        third = t.forward_backward(data, "cross_entropy").result().metrics["loss:sum"]
        t.optim_step(adam).result()
        after = first.roles.learner_checksum()
    assert path.startswith("tinker://") and path.endswith("/weights/two")
    with TinkerService(tiny_model_path, "local", [f"trainer.run_dir={tmp_path}"]) as second:
        t = second.create_training_client()
        fresh = t.forward(data, "cross_entropy").result().metrics["loss:sum"]
        t.load_state_with_optimizer(path).result()
        assert second.version == 2
        assert t.forward_backward(data, "cross_entropy").result().metrics["loss:sum"] == third != fresh
        t.optim_step(adam).result()
        assert second.roles.learner_checksum() == after
        with pytest.raises(ValueError, match="is not a saved state here"):
            t.load_state("tinker://nothing/weights/here").result()
    assert math.isfinite(third)


def test_the_example_grpo_loop_learns(tmp_path):
    """examples/tinker_loop/grpo.py at its small size: a warm start, then GRPO on the primitives; the training
    reward's last quarter exceeds its first by more than the run's own step-to-step noise."""
    import sys

    from learning_bounds import assert_rises
    from test_examples import EXAMPLES, load_module

    sys.path.insert(0, str(EXAMPLES.parent))
    s = load_module(EXAMPLES / "tinker_loop" / "grpo.py").main([f"trainer.run_dir={tmp_path}"])
    k = len(s["rewards"]) // 4
    assert_rises(s["rewards"][:k], s["rewards"][-k:], what="tinker loop reward")
    assert s["sequences_per_s"] > 0


def test_a_lora_training_client_trains_and_samples_its_adapter(tiny_model_path, tmp_path):
    """create_lora_training_client: only the adapter trains (the base weights stay), cross-entropy falls, and the
    replica samples with the adapter the learner sent (its weights equal the learner's, merged)."""
    from rayllm_rl.tinker import TinkerService

    data = [datum([5, 6, 7], [8, 9, 10], weights=[1.0, 1.0, 1.0])]
    with TinkerService(tiny_model_path, "local", [f"trainer.run_dir={tmp_path}"]) as service:
        t = service.create_lora_training_client(rank=4)
        assert t.get_info().is_lora and t.get_info().lora_rank == 4
        model = service.roles.learner.model
        base = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
        losses = []
        for _ in range(4):
            losses.append(t.forward_backward(data, "cross_entropy").result().metrics["loss:sum"])
            t.optim_step(tt.AdamParams(learning_rate=5e-2))
        sampler = t.save_weights_and_get_sampling_client()
        assert losses[-1] < losses[0]
        assert base and all(torch.equal(p, base[n]) for n, p in model.named_parameters() if n in base)
        assert service.roles.replica_checksums() == [service.roles.learner_checksum()]
        out = sampler.sample(tt.ModelInput.from_ints([5, 6, 7]), 2, tt.SamplingParams(max_tokens=4)).result()
        assert all(s.versions == [4] * len(s.tokens) for s in out.sequences)
