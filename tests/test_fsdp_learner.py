"""FSDP2 learner (W=2 ranks over gloo on CPU) gives the same weights as the single-process learner.

Both ranks receive the full batch; rank r trains on its contiguous half of every minibatch with
loss weights normalised by the global token / sequence count and SUM-reduced gradients, so W=2
must reproduce W=1 up to float summation order. The model runs in float64, so that order costs
~1e-14: observed max |dW| after 2 train_steps = 1.3e-15 ("aligned"), 1.0e-14 ("uneven": 7 rows,
3/4-row shards, a zero-weight padding pass on rank 0, seq-mean, 2 epochs), 2.7e-16 ("one_row"),
5.5e-15 ("tokens_ckpt": token-budget micro-batches, a chunked LM head, activation checkpointing).
The bound 1e-10 is far above that and far below the effect of a real bug (measured by planting
each one, lr = 1e-3; the first three in float32): FSDP's default gradient averaging gives 7.5e-4,
a different minibatch permutation 7.9e-3, rank-local token normalisation 7.5e-3, and an AdamW
built while the root's parameters were still gathered after a no-grad forward (it never zeroes
the sharded gradients, so they accumulate across steps) 5.1e-3.
"""
from __future__ import annotations

import math
import time

import pytest
import torch

from rayllm_rl.learner.distributed import DistConfig, launch_local
from rayllm_rl.learner.learner import Learner, OptimConfig
from rayllm_rl.objectives import GRPOLoss

TOL = 1e-10
DTYPE = torch.float64
EXACT_METRICS = frozenset({"loss", "entropy", "grad_norm", "lr", "skipped_nonfinite_steps", "mismatch_tokens",
                           "mismatch_abs_logp_diff", "mismatch_k3"})
"""Global sums, equal for W=1 and W=2 (the mismatch figures: over the trained tokens every rank gathers). The ratio
statistics (clip fractions, ess, approx_kl, ...) are per-micro-batch values averaged with the loss's weights, so they
depend on how rows are grouped (W=1 sorts a minibatch's rows by length, W=2 each rank's half): only their presence
is compared."""
CASES = {
    # 8 rows, 2 minibatches of 4: each rank gets 2 rows, one micro-batch (W=1: two of 2 rows, by length).
    "aligned": dict(optim=dict(lr=1e-3, micro_batch_size=2, num_minibatches=2), rows=8, loss=dict()),
    # 7 rows: rank 0 gets 3 rows (1 micro-batch + 1 zero-weight pass), rank 1 gets 4 (2 micro-batches).
    "uneven": dict(optim=dict(lr=1e-3, micro_batch_size=3, num_minibatches=1, epochs=2), rows=7,
                   loss=dict(aggregation="seq-mean", clip_eps_high=0.28)),
    # 1 row: rank 0 has nothing to train on and only runs the zero-weight pass.
    "one_row": dict(optim=dict(lr=1e-3, micro_batch_size=4), rows=1, loss=dict()),
    # Rows of 28-36 tokens, a 66-token budget: 1-2 rows per micro-batch by length, so the ranks' 3 and 4
    # rows make different numbers of passes; the LM head in chunks of 4 positions; layers recomputed
    # in backward (activation checkpointing re-runs each layer's all-gather).
    "tokens_ckpt": dict(optim=dict(lr=1e-3, max_tokens_per_micro_batch=66, logprob_chunk_size=4,
                                   activation_checkpointing=True, epochs=2), rows=7,
                        loss=dict(aggregation="seq-mean")),
}


pytestmark = pytest.mark.usefixtures("one_torch_thread")



def make_batches(path: str, rows: int = 8):
    """Two deterministic GRPO batches: SFT-tokenised chats, random advantages, noisy behaviour logprobs."""
    from transformers import AutoTokenizer

    from rayllm_rl.data.sft import make_sft_batch

    tok = AutoTokenizer.from_pretrained(path)
    g = torch.Generator().manual_seed(1234)
    ref = Learner(path, OptimConfig())
    batches = []
    for b in range(2):
        chats = []
        for i in range(rows):
            a, c = int(torch.randint(0, 99, (1,), generator=g)), int(torch.randint(0, 99, (1,), generator=g))
            chats.append([{"role": "user", "content": f"What is {a}+{c}?"},
                          {"role": "assistant", "content": f"<answer>{a + c}</answer>" + " ok" * ((i + b) % 4)}])
        batch = make_sft_batch(tok, chats)
        mask = batch["loss_mask"]
        batch["advantages"] = torch.randn(rows, generator=g)
        batch["logprobs"] = (ref.compute_logprobs(batch) + 0.1 * torch.randn(mask.shape, generator=g)) * mask
        batches.append(batch)
    return batches


def run_case(learner: Learner, case: dict, batches) -> list[dict[str, float]]:
    rows = case["rows"]
    return [learner.train_step(b[:rows], GRPOLoss(**case["loss"])) for b in batches]


def _rank_main(dist_cfg: DistConfig, queue, path: str, batches) -> None:
    torch.set_num_threads(1)
    from transformers import AutoModelForCausalLM

    from rayllm_rl.learner.distributed import destroy_distributed, iter_full_tensors

    out: dict = {}
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=DTYPE)
    for name, case in CASES.items():
        learner = Learner(path, OptimConfig(**case["optim"]), dist=dist_cfg,
                          dtype=DTYPE)
        if name == "aligned":
            out["names"] = [k for k, _ in iter_full_tensors(learner.model)]
            out["tied"] = learner.model.lm_head.weight is learner.model.model.embed_tokens.weight
            ids, am = batches[0]["input_ids"], batches[0]["attention_mask"].long()
            with torch.no_grad():
                out["logit_diff"] = float((learner.model(input_ids=ids, attention_mask=am).logits
                                           - ref(input_ids=ids, attention_mask=am).logits).abs().max())
            out["logprobs"] = learner.compute_logprobs(batches[0])
        if name == "tokens_ckpt":  # an optimizer built right after a no-grad forward must get the sharded params
            learner.compute_logprobs(batches[1])
            learner.reset_optimizer(learner.cfg)
        out[name] = {"metrics": run_case(learner, case, batches), "weights": learner.named_tensors(),
                     "steps": learner.optim_steps}
    try:  # ranks fed different batches must fail loudly, together, before any update
        learner.train_step(batches[dist_cfg.rank], GRPOLoss())
        out["mismatch"] = None
    except ValueError as exc:
        out["mismatch"] = str(exc)
    destroy_distributed()
    queue.put((dist_cfg.rank, out))


@pytest.mark.slow
def test_fsdp_two_ranks_match_single_process(tiny_model_path):
    from transformers import AutoModelForCausalLM

    t0 = time.perf_counter()
    batches = make_batches(tiny_model_path)
    res = launch_local(_rank_main, 2, tiny_model_path, batches, timeout_s=120)
    spawn_s = time.perf_counter() - t0
    assert sorted(res) == [0, 1]
    r0, r1 = res[0], res[1]

    plain = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=DTYPE)
    assert r0["names"] == [k for k, _ in plain.named_parameters()]
    assert r0["tied"] and r1["tied"]
    assert r0["logit_diff"] <= 1e-6 and r1["logit_diff"] <= 1e-6
    single = Learner(tiny_model_path, OptimConfig(), dtype=DTYPE)
    valid = batches[0]["attention_mask"]  # padding columns are undefined (micro-batches trim them)
    torch.testing.assert_close(r0["logprobs"] * valid, single.compute_logprobs(batches[0]) * valid, atol=1e-6, rtol=0)
    torch.testing.assert_close(r1["logprobs"], r0["logprobs"], atol=0, rtol=0)

    assert "different batches" in r0["mismatch"] and "different batches" in r1["mismatch"]

    report = {}
    for name, case in CASES.items():
        single = Learner(tiny_model_path, OptimConfig(**case["optim"]), dtype=DTYPE)
        metrics = run_case(single, case, batches)
        want = single.named_tensors()
        w0, w1 = r0[name]["weights"], r1[name]["weights"]
        assert list(w0) == list(want)
        init = dict(plain.named_parameters())
        assert max(float((want[k] - init[k].detach()).abs().max()) for k in want) > 1e-4  # training moved weights
        diff = max(float((w0[k] - want[k]).abs().max()) for k in want)
        report[name] = diff
        assert diff <= TOL, (name, diff)
        for k in w0:  # both ranks gather the same full weights
            assert torch.equal(w0[k], w1[k]), k
        assert r0[name]["steps"] == r1[name]["steps"] == single.optim_steps
        for got, ref_m in zip(r0[name]["metrics"], metrics):  # metrics are global (all ranks agree)
            assert got.keys() == ref_m.keys()
            for k in EXACT_METRICS & ref_m.keys():
                assert abs(got[k] - ref_m[k]) <= 1e-9 * max(1.0, abs(ref_m[k])), (name, k, got[k], ref_m[k])
            assert all(math.isfinite(v) for v in got.values()), got
        assert r0[name]["metrics"] == r1[name]["metrics"]
    print(f"W=2 vs W=1 max |dW|: {report}; spawn+train {spawn_s:.1f}s")
