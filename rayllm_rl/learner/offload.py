"""Move a learner's training state (parameters, gradients, optimizer state) off its GPU and back.

The colocated placement (`ray.placement=colocated`) shares one GPU between learner rank i and
replica i: while the replica generates, the learner's state waits in host memory. Parameters move
with `module.to` (FSDP2 re-registers its sharded parameters in `_apply`); gradients are dropped
(every train step zeroes them first); optimizer state tensors that lived on the GPU move and come
back. On a CPU learner nothing moves.
"""
from __future__ import annotations

import torch


def offload_training_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None,
                           device: torch.device) -> int:
    """Move `model`'s parameters and buffers and `optimizer`'s state from `device` to host memory and
    free the gradients; returns the bytes that left `device` (0 when `device` is the CPU)."""
    if device.type == "cpu":
        return 0
    moved = 0
    for p in model.parameters():
        if p.grad is not None:
            moved += p.grad.numel() * p.grad.element_size()
            p.grad = None
    moved += sum(t.numel() * t.element_size() for t in _on(model, device))
    model.to("cpu")
    if optimizer is not None:
        for state in optimizer.state.values():
            for key, value in state.items():
                if isinstance(value, torch.Tensor) and value.device == device:
                    moved += value.numel() * value.element_size()
                    state[key] = value.to("cpu", non_blocking=True)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
    return moved


def onload_training_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None,
                          device: torch.device) -> int:
    """Undo `offload_training_state`: parameters, buffers and optimizer state back on `device` (the
    optimizer's per-step counters stay where the optimizer keeps them); returns the bytes moved."""
    if device.type == "cpu":
        return 0
    model.to(device)
    moved = sum(t.numel() * t.element_size() for t in _on(model, device))
    if optimizer is not None:
        for state in optimizer.state.values():
            for key, value in state.items():
                if isinstance(value, torch.Tensor) and value.device.type == "cpu" and key != "step":
                    moved += value.numel() * value.element_size()
                    state[key] = value.to(device, non_blocking=True)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return moved


def _on(model: torch.nn.Module, device: torch.device) -> list[torch.Tensor]:
    """The model's parameters and buffers that live on `device` (their local shards under FSDP)."""
    out = []
    for t in list(model.parameters()) + list(model.buffers()):
        local = t.to_local() if hasattr(t, "to_local") else t
        if local.device == device:
            out.append(local)
    return out
