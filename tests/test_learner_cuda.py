"""The single-GPU learner in bf16 (float32 masters): training on the GPU, and the colocated offload/onload round trip.

Skipped without a GPU (docs/inference-engines.md, "What ran on a GPU", says where and when it ran). On a
CPU learner offload/onload move nothing; `tests/test_colocated.py` checks their turn order.
"""
from __future__ import annotations

import math

import pytest
import torch

from rayllm_rl.learner.distributed import DistConfig
from rayllm_rl.learner.learner import Learner, OptimConfig
from rayllm_rl.objectives import GRPOLoss
from test_learner_precision import make_batch  # tokenised chats with advantages and behaviour logprobs

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")


def host_state(learner: Learner) -> tuple[dict, dict]:
    params = {k: v.detach().cpu().clone() for k, v in learner.model.named_parameters()}
    optim = {(i, k): v.detach().cpu().clone() for i, s in enumerate(learner.optimizer.state.values())
             for k, v in s.items() if isinstance(v, torch.Tensor)}
    return params, optim


def test_bf16_training_on_the_gpu_and_the_offload_round_trip(tiny_model_path):
    learner = Learner(tiny_model_path, OptimConfig(lr=1e-3), dtype=torch.bfloat16, dist=DistConfig(backend="nccl"))
    assert learner.device.type == "cuda"  # float32 masters, bf16 compute and sync (learner/precision.py)
    assert {p.dtype for p in learner.model.parameters()} == {torch.float32}
    assert {m.dtype for m in learner.weight_metas()} == {torch.bfloat16}
    batch, loss = make_batch(tiny_model_path), GRPOLoss()
    before = {k: v.detach().clone() for k, v in learner.model.named_parameters()}
    metrics = learner.train_step(batch, loss)
    assert math.isfinite(metrics["loss"]) and not metrics.get("skipped_nonfinite_steps")
    changed = sum(not torch.equal(before[k], v) for k, v in learner.model.named_parameters())
    assert changed == len(before)  # every weight took the step
    del before

    params, optim = host_state(learner)
    param_bytes = sum(v.numel() * v.element_size() for v in params.values())
    optim_bytes = sum(v.numel() * v.element_size() for (_, k), v in optim.items() if k != "step")
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated()
    moved = learner.offload()
    assert moved >= param_bytes + optim_bytes  # parameters, AdamW moments, and the dropped gradients
    assert all(p.device.type == "cpu" and p.grad is None for p in learner.model.parameters())
    assert torch.cuda.memory_allocated() <= held - param_bytes - optim_bytes  # the GPU got them back

    assert learner.onload() >= param_bytes + optim_bytes
    assert all(p.device == learner.device for p in learner.model.parameters())
    again, optim_again = host_state(learner)
    assert all(torch.equal(params[k], again[k]) for k in params)  # bit for bit
    assert optim.keys() == optim_again.keys() and all(torch.equal(optim[k], optim_again[k]) for k in optim)
    for state in learner.optimizer.state.values():
        assert all(v.device == learner.device for k, v in state.items() if k != "step")

    # the optimizer still updates the model's own parameters (module.to kept them), from the moments it had
    metrics = learner.train_step(batch, loss)
    assert math.isfinite(metrics["loss"]) and not metrics.get("skipped_nonfinite_steps")
    after = {k: v.detach().cpu() for k, v in learner.model.named_parameters()}
    assert sum(not torch.equal(params[k], after[k]) for k in params) == len(params)
    assert int(learner.optimizer.state[next(iter(learner.model.parameters()))]["step"]) == 2
