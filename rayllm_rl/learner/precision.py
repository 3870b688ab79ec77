"""The learner's precision: float32 master weights, forward and backward in the job's dtype.

`model.dtype=bfloat16` means what `bf16=True` means in TRL, and what verl and prime-rl do: AdamW
steps float32 weights, the matmuls run in bfloat16. A bfloat16 weight cannot take an update smaller
than half its spacing (2^-9 of its magnitude): at the recipes' lr 1e-6, one AdamW step on a bfloat16
tiny model changed 1.9% of its weight elements, on float32 masters all of them.

The one place that decides it (`Precision.of`):

- trainable parameters live in the master dtype (float32; float64 stays float64), frozen ones (a LoRA
  base) in the compute dtype, which they never leave;
- one process: the forward runs under `torch.autocast(compute dtype)`;
- FSDP2: `MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=float32)`, no autocast: each layer is
  gathered in the compute dtype and resharded after use (autocast's casts would be kept for backward, a
  full unsharded copy of the model per rank);
- weight sync sends the compute dtype, what the replicas hold (`for_sync`).
"""
from __future__ import annotations

import contextlib
import dataclasses

import torch

__all__ = ["Precision"]


@dataclasses.dataclass(frozen=True)
class Precision:
    compute: torch.dtype
    """The dtype of the matmuls and of the replicas' weights (the job's `model.dtype`)."""
    master: torch.dtype
    """The dtype trainable parameters and AdamW's state live in."""
    sharded: bool
    """FSDP2 (several learner ranks): mixed precision through FSDP's policy instead of autocast."""

    @classmethod
    def of(cls, dtype: torch.dtype, *, sharded: bool) -> "Precision":
        if not dtype.is_floating_point:
            raise ValueError(f"learner dtype must be a floating dtype, got {dtype}")
        return cls(compute=dtype, master=torch.promote_types(dtype, torch.float32), sharded=bool(sharded))

    @property
    def mixed(self) -> bool:
        return self.compute != self.master

    def place(self, model: torch.nn.Module) -> torch.nn.Module:
        """Trainable floating parameters to at least the master dtype (a float64 model stays float64),
        frozen ones to the compute dtype when mixed (in place: the Parameter objects stay, so a tie or an
        optimizer built before still holds them)."""
        for p in model.parameters():
            if not p.dtype.is_floating_point:
                continue
            want = torch.promote_types(p.dtype, self.master) if p.requires_grad else \
                (self.compute if self.mixed else p.dtype)
            if p.dtype != want:
                p.data = p.data.to(want)
        return model

    @property
    def uses_autocast(self) -> bool:
        """Mixed on one rank: forwards run under autocast (FSDP's policy casts instead)."""
        return self.mixed and not self.sharded

    def autocast(self, device: torch.device):
        """The context every forward of the learner runs in (a no-op unless `uses_autocast`)."""
        if not self.uses_autocast:
            return contextlib.nullcontext()
        return torch.autocast(device.type, dtype=self.compute)

    def fsdp_policy(self):
        """`fully_shard`'s `mp_policy` (None: parameters are gathered and reduced in their own dtype)."""
        if not self.mixed:
            return None
        from torch.distributed.fsdp import MixedPrecisionPolicy

        return MixedPrecisionPolicy(param_dtype=self.compute, reduce_dtype=torch.float32)

    def sync_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The dtype a parameter of `dtype` travels in to the replicas (its own unless mixed)."""
        return self.compute if self.mixed and dtype.is_floating_point else dtype

    def for_sync(self, t: torch.Tensor) -> torch.Tensor:
        """`t` as the replicas hold it (a compute-dtype copy of a master weight; `t` itself otherwise)."""
        want = self.sync_dtype(t.dtype)
        return t if t.dtype == want else t.to(want)
