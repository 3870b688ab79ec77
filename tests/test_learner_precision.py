"""A bfloat16 learner keeps float32 master weights (learner/precision.py), on CPU through torch's CPU autocast.

Before: the model lived in bfloat16 and AdamW stepped it there, so at the recipes' lr 1e-6 one step
changed 1.9% of the tiny model's weight elements (below half a bf16 spacing the update rounds away).
"""
from __future__ import annotations

import math

import pytest
import torch

from rayllm_rl.learner.distributed import DistConfig, launch_local
from rayllm_rl.learner.learner import Learner, OptimConfig
from rayllm_rl.learner.precision import Precision
from rayllm_rl.objectives import GRPOLoss

pytestmark = pytest.mark.usefixtures("one_torch_thread")
BF16 = torch.bfloat16


def make_batch(path: str, rows: int = 6, seed: int = 3):
    from transformers import AutoTokenizer

    from rayllm_rl.data.sft import make_sft_batch

    tok = AutoTokenizer.from_pretrained(path)
    g = torch.Generator().manual_seed(seed)
    chats = [[{"role": "user", "content": f"What is {i}+{i}?"},
              {"role": "assistant", "content": f"<answer>{2 * i}</answer>" + " so" * (i % 3)}] for i in range(rows)]
    batch = make_sft_batch(tok, chats)
    batch["advantages"] = torch.randn(rows, generator=g)
    batch["logprobs"] = -torch.rand(batch["loss_mask"].shape, generator=g) * batch["loss_mask"]
    return batch


def changed_fraction(before: dict, model: torch.nn.Module) -> float:
    n = sum(v.numel() for v in before.values())
    return sum(int((before[k] != v.detach()).sum()) for k, v in model.named_parameters()) / n


def test_precision_decides_masters_autocast_fsdp_and_sync():
    p = Precision.of(BF16, sharded=False)
    assert (p.compute, p.master, p.mixed) == (BF16, torch.float32, True)
    assert isinstance(p.autocast(torch.device("cpu")), torch.autocast) and p.fsdp_policy().param_dtype == BF16
    assert p.fsdp_policy().reduce_dtype == torch.float32 and p.sync_dtype(torch.float32) == BF16
    assert not isinstance(Precision.of(BF16, sharded=True).autocast(torch.device("cpu")), torch.autocast)
    f32 = Precision.of(torch.float32, sharded=True)
    assert not f32.mixed and f32.fsdp_policy() is None and f32.sync_dtype(torch.float64) == torch.float64
    with pytest.raises(ValueError, match="floating"):
        Precision.of(torch.int64, sharded=False)


def test_a_bf16_learner_takes_lr_1e6_steps_on_float32_masters(tiny_model_path):
    batch = make_batch(tiny_model_path)
    learner = Learner(tiny_model_path, OptimConfig(lr=1e-6), dtype=BF16)
    assert {p.dtype for p in learner.model.parameters()} == {torch.float32}
    before = {k: v.detach().clone() for k, v in learner.model.named_parameters()}
    metrics = learner.train_step(batch, GRPOLoss())
    assert math.isfinite(metrics["loss"]) and math.isfinite(metrics["grad_norm"])
    assert changed_fraction(before, learner.model) > 0.99
    # the same AdamW step on the weights in bfloat16 (the learner before) mostly rounds away
    pure = {k: v.to(BF16) for k, v in before.items()}
    moved = {k: (v - before[k]) for k, v in learner.model.named_parameters()}
    kept = sum(int(((pure[k].float() + moved[k]).to(BF16) != pure[k]).sum()) for k in pure)
    assert kept / sum(v.numel() for v in pure.values()) < 0.1


def test_sync_sends_the_compute_dtype_and_logprobs_run_in_it(tiny_model_path):
    batch = make_batch(tiny_model_path)
    learner = Learner(tiny_model_path, OptimConfig(), dtype=BF16)
    metas = learner.weight_metas()
    named = dict(learner.iter_named_tensors())
    assert [m.name for m in metas] == list(named) and {m.dtype for m in metas} == {BF16}
    masters = dict(learner.model.named_parameters())
    assert all(t.dtype == BF16 and torch.equal(t, masters[k].detach().to(BF16)) for k, t in named.items())

    fp32 = Learner(tiny_model_path, OptimConfig()).compute_logprobs(batch)
    mask = batch["loss_mask"]
    chunked = learner.compute_logprobs(batch)
    learner.cfg = OptimConfig(logprob_chunk_size=0)  # the full-vocabulary path, also under autocast
    full = learner.compute_logprobs(batch)
    assert chunked.dtype == torch.float32
    assert 0 < float((chunked - fp32).abs()[mask].max()) < 5e-2  # bf16 matmuls: close to, not equal to fp32
    assert float((chunked - full).abs()[mask].max()) < 2e-2


def test_lora_base_stays_in_the_compute_dtype_and_the_adapter_in_float32(tiny_model_path):
    from rayllm_rl.lora import LoraOptions

    learner = Learner(tiny_model_path, OptimConfig(lr=1e-6), dtype=BF16, lora=LoraOptions(rank=4, alpha=8))
    trainable = {p.dtype for p in learner.model.parameters() if p.requires_grad}
    frozen = {p.dtype for p in learner.model.parameters() if not p.requires_grad}
    assert trainable == {torch.float32} and frozen == {BF16}
    assert {m.dtype for m in learner.weight_metas()} == {BF16}
    before = {k: v.detach().clone() for k, v in learner.model.named_parameters() if v.requires_grad}
    learner.train_step(make_batch(tiny_model_path), GRPOLoss())
    lora_b = [k for k in before if "lora_B" in k]
    moved = [k for k in lora_b if not torch.equal(before[k], dict(learner.model.named_parameters())[k])]
    assert lora_b and moved == lora_b  # lora_B starts at zero; every one took the 1e-6 step


def _rank_main(dist_cfg: DistConfig, queue, path: str, batch) -> None:
    torch.set_num_threads(1)
    from torch.distributed.tensor import DTensor

    from rayllm_rl.learner.distributed import destroy_distributed

    learner = Learner(path, OptimConfig(lr=1e-6), dist=dist_cfg, dtype=BF16)
    local = {k: (v.to_local() if isinstance(v, DTensor) else v).detach().clone()
             for k, v in learner.model.named_parameters()}
    metrics = learner.train_step(batch, GRPOLoss())
    after = {k: (v.to_local() if isinstance(v, DTensor) else v).detach() for k, v in learner.model.named_parameters()}
    n = sum(v.numel() for v in local.values())
    queue.put((dist_cfg.rank, {"dtypes": sorted({str(v.dtype) for v in local.values()}),
                      "changed": sum(int((local[k] != after[k]).sum()) for k in local) / n,
                      "loss": metrics["loss"], "weights": learner.named_tensors()}))
    destroy_distributed()


@pytest.mark.slow
def test_fsdp_bf16_gathers_in_bf16_and_steps_float32_shards(tiny_model_path):
    batch = make_batch(tiny_model_path, rows=8)
    res = launch_local(_rank_main, 2, tiny_model_path, batch, timeout_s=180)
    single = Learner(tiny_model_path, OptimConfig(lr=1e-6), dtype=BF16)
    single_loss = single.train_step(batch, GRPOLoss())["loss"]
    for r in (0, 1):
        assert res[r]["dtypes"] == ["torch.float32"] and res[r]["changed"] > 0.99
        assert res[r]["loss"] == pytest.approx(single_loss, abs=2e-2)  # bf16 compute in both, other groupings
    want = single.named_tensors()
    for k, t in res[0]["weights"].items():
        assert t.dtype == BF16 and torch.equal(t, res[1]["weights"][k])
        assert float((t.float() - want[k].float()).abs().max()) <= 2 ** -7 * max(1.0, float(want[k].abs().max()))
