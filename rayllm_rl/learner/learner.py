"""The training worker: recompute logprobs, apply any `Loss`, step AdamW. No Ray, no algorithm names.

A batch is a trajectory TensorDict (`rayllm_rl.data.trajectory`) plus `advantages` (`[N]` or
`[N, T]`) and optionally `ref_logprobs` / `prox_logprobs`. The same worker runs the SFT warm
start and every RL loss: it only calls `loss(logp, behav_logp, prox_logp, advantages, mask, ref_logp)`.
"""
from __future__ import annotations

import dataclasses
import math
import os
from pathlib import Path
from typing import Any

import torch
from tensordict import TensorDict

from rayllm_rl.objectives.base import Loss


@dataclasses.dataclass
class OptimConfig:
    """AdamW and batching settings of the learner."""

    lr: float = 1e-3
    """Peak learning rate."""
    weight_decay: float = 0.0
    """AdamW decoupled weight decay."""
    beta1: float = 0.9
    """AdamW beta1."""
    beta2: float = 0.99
    """AdamW beta2."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this value (<= 0 disables)."""
    micro_batch_size: int = 256
    """Sequences per forward/backward; gradients accumulate over micro-batches."""
    num_minibatches: int = 1
    """Optimizer steps per epoch over a rollout batch (1 = fully on-policy)."""
    epochs: int = 1
    """Passes over each rollout batch."""
    warmup_steps: int = 0
    """Linear warm-up of the learning rate over this many optimizer steps."""


def token_logprobs(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                   temperature: float = 1.0) -> torch.Tensor:
    """Token-aligned log pi(x_t | x_<t) `[B, T]` for right-padded input; column 0 is 0."""
    logits = model(input_ids=input_ids, attention_mask=attention_mask.long()).logits[:, :-1].float()
    if temperature != 1.0:
        logits = logits / temperature
    logp = torch.log_softmax(logits, dim=-1).gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    return torch.nn.functional.pad(logp, (1, 0), value=0.0)


def _micro_batches(td: TensorDict, size: int):
    for i in range(0, td.batch_size[0], size):
        mb = td[i:i + size]
        width = int(mb["attention_mask"].sum(-1).max())  # trim shared right padding
        yield mb[:, :width] if width < mb["input_ids"].shape[-1] else mb


class Learner:
    """Owns the trainable model and its optimizer; usable directly or inside a Ray actor."""

    def __init__(self, model_path: str, optim: OptimConfig, *, temperature: float = 1.0,
                 seed: int = 0, dtype: torch.dtype = torch.float32, model: torch.nn.Module | None = None):
        from transformers import AutoModelForCausalLM

        torch.manual_seed(seed)
        self.model = model if model is not None else AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype)
        self.model.train()
        self.temperature = temperature
        self.reset_optimizer(optim)
        self.version = 0

    def reset_optimizer(self, optim: OptimConfig) -> None:
        """Fresh AdamW state and step count (e.g. between the SFT warm start and RL)."""
        self.cfg = optim
        self.optimizer = torch.optim.AdamW(
            [p for p in self.model.parameters() if p.requires_grad], lr=optim.lr,
            betas=(optim.beta1, optim.beta2), weight_decay=optim.weight_decay,
        )
        self.optim_steps = 0

    # ------------------------------------------------------------------ forward
    @torch.no_grad()
    def compute_logprobs(self, td: TensorDict) -> torch.Tensor:
        """Logprobs of the current weights `[N, T]` (e.g. pi_prox before an update)."""
        out = torch.zeros(td["input_ids"].shape, dtype=torch.float32)
        for i in range(0, td.batch_size[0], self.cfg.micro_batch_size):
            mb = td[i:i + self.cfg.micro_batch_size]
            width = int(mb["attention_mask"].sum(-1).max())
            out[i:i + mb.batch_size[0], :width] = token_logprobs(
                self.model, mb["input_ids"][:, :width], mb["attention_mask"][:, :width], self.temperature)
        return out

    # ------------------------------------------------------------------ update
    def _lr_scale(self) -> float:
        w = self.cfg.warmup_steps
        return 1.0 if w <= 0 else min(1.0, (self.optim_steps + 1) / w)

    def train_step(self, td: TensorDict, loss_fn: Loss) -> dict[str, float]:
        """Epochs x minibatches optimizer steps over `td`; returns averaged metrics."""
        if "advantages" not in td.keys():
            raise ValueError("train_step needs an 'advantages' entry ([N] or [N, T]) in the batch")
        if getattr(loss_fn, "needs_ref_logp", False) and "ref_logprobs" not in td.keys():
            raise ValueError(f"{type(loss_fn).__name__} needs 'ref_logprobs' in the batch (KL to reference is on)")
        if getattr(loss_fn, "needs_prox_logp", False) and "prox_logprobs" not in td.keys():
            td = td.clone(False)
            td["prox_logprobs"] = self.compute_logprobs(td)
        n = td.batch_size[0]
        mb_count = max(1, min(self.cfg.num_minibatches, n))
        sums: dict[str, float] = {}
        count = 0
        for _ in range(self.cfg.epochs):
            perm = torch.randperm(n)
            for chunk in perm.chunk(mb_count):
                metrics = self._optimizer_step(td[chunk], loss_fn)
                for k, v in metrics.items():
                    sums[k] = sums.get(k, 0.0) + v
                count += 1
        self.version += 1
        return {k: v / count for k, v in sums.items()}

    def _optimizer_step(self, td: TensorDict, loss_fn: Loss) -> dict[str, float]:
        aggregation = getattr(loss_fn, "aggregation", "token-mean")
        total_tokens = float(td["loss_mask"].sum().clamp(min=1))
        total_seqs = float(td.batch_size[0])
        self.optimizer.zero_grad(set_to_none=True)
        metrics: dict[str, float] = {}
        for mb in _micro_batches(td, self.cfg.micro_batch_size):
            mask = mb["loss_mask"]
            logp = token_logprobs(self.model, mb["input_ids"], mb["attention_mask"], self.temperature)
            adv = mb["advantages"]
            out = loss_fn(
                logp, mb["logprobs"], mb.get("prox_logprobs", None), adv, mask, mb.get("ref_logprobs", None),
            )
            weight = float(mask.sum()) / total_tokens if aggregation == "token-mean" else mb.batch_size[0] / total_seqs
            (out.loss * weight).backward()
            for k, v in out.metrics.items():
                metrics[k] = metrics.get(k, 0.0) + float(v) * weight
        if self.cfg.grad_clip > 0:
            norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip)
            metrics["grad_norm"] = float(norm)
        if not math.isfinite(metrics.get("grad_norm", 0.0)):
            self.optimizer.zero_grad(set_to_none=True)  # skip a non-finite step instead of corrupting weights
            metrics["skipped_step"] = 1.0
            return metrics
        for g in self.optimizer.param_groups:
            g["lr"] = self.cfg.lr * self._lr_scale()
        self.optimizer.step()
        self.optim_steps += 1
        metrics["lr"] = self.optimizer.param_groups[0]["lr"]
        return metrics

    # ------------------------------------------------------------------ state
    def named_tensors(self) -> dict[str, torch.Tensor]:
        """Full, detached weights by name (what weight sync sends to inference)."""
        return {k: v.detach() for k, v in self.model.named_parameters()}

    def save_pretrained(self, path: str | os.PathLike, tokenizer=None) -> str:
        """HF-format checkpoint (loadable with from_pretrained) plus optimizer state."""
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        self.model.save_pretrained(path)
        if tokenizer is not None:
            tokenizer.save_pretrained(path)
        torch.save({"optimizer": self.optimizer.state_dict(), "optim_steps": self.optim_steps,
                    "version": self.version}, path / "learner_state.pt")
        return str(path)

    def state(self) -> dict[str, Any]:
        return {"optim_steps": self.optim_steps, "version": self.version}
