"""The training worker: recompute logprobs, apply any `Loss`, step AdamW. No Ray, no algorithm names.

A batch is a trajectory TensorDict (`rayllm_rl.data.trajectory`) plus `advantages` (`[N]` or
`[N, T]`) and optionally `ref_logprobs` / `prox_logprobs` / `prox_version`. The same worker runs
the SFT warm start and every RL loss: it only calls
`loss(logp, behav_logp, prox_logp, advantages, mask, ref_logp)`.

A loss with `needs_prox_logp` gets pi_prox (the weights before this update) in one of two ways,
chosen by its `prox_logp_method`: "recompute" runs one forward pass over the batch before the
first optimizer step (`compute_logprobs`); "loglinear" skips it and approximates each
micro-batch's prox from its behaviour logprobs, token `versions` and training forward with
`loglinear_prox_logp`, which needs `prox_version` `[N]` (the policy version of the weights the
batch is trained from; the driver owns it and stamps it on the batch).

Data parallel (FSDP2, `dist=DistConfig(rank, world_size, ...)` with world_size > 1): every rank
gets the FULL batch and the same seeded minibatch permutation; within each optimizer step rank r
trains on rows `[r*n//W, (r+1)*n//W)` of the minibatch, with loss weights normalised by the
minibatch's GLOBAL `loss.normalizer` (the tokens or non-empty rows the loss averages over) and
gradients SUMmed over ranks, so the update equals the single-process one on the same batch (up
to float summation order).

Micro-batches are bounded by padded tokens (`OptimConfig.max_tokens_per_micro_batch`): rows sorted
longest first, grouped greedily, each group cut to its longest row (`logprobs.micro_batches`).
Logprobs go through the LM head in chunks of positions (`logprobs.token_logprobs`), and only at the
trained tokens (`loss_mask`), so no `[B, T, V]` tensor exists. Micro-batch k's loss is weighted by
`loss.normalizer(mask_k) / loss.normalizer(mask)`, so the accumulated gradient equals the
full-batch gradient for every aggregation and every grouping, rows with no trained token included.
A step whose loss or gradient is not finite is skipped (weights and optimizer state untouched)
and counted in `skipped_nonfinite_steps`. Every public method that touches the model
(`compute_logprobs`, `train_step`, `named_tensors`, `iter_named_tensors`, checkpointing) is a
collective: all ranks must call it, in the same order, with the same batch.

LoRA (`lora=LoraOptions(rank > 0)`, rayllm_rl/lora.py): the adapter is injected with peft before
sharding, only it requires grad and only it is in AdamW; weight sync and checkpoints carry the adapter
alone (PEFT names); the reference policy is the same model with the adapter off
(`reference_logprobs`), computed inside `train_step` when the loss needs it, so no second copy.
"""
from __future__ import annotations

import dataclasses
import math
import os
from typing import Any

import torch
from tensordict import TensorDict

from rayllm_rl.learner.distributed import (
    DistConfig,
    all_gather_objects,
    destroy_distributed,
    init_distributed,
    iter_full_tensors,
    shard_model,
    to_local_scalar,
)
from rayllm_rl.learner.logprobs import (
    batched_token_logprobs,
    check_chunked_head,
    micro_batches,
    token_logprobs,
    trim,
)
from rayllm_rl.learner.mismatch import MismatchMeter
from rayllm_rl.learner.optim import OptimConfig, lr_scale
from rayllm_rl.learner.precision import Precision
from rayllm_rl.learner.shared_prompt import (
    check_shared_prompt,
    packed_micro_batches,
    packed_token_logprobs,
    supports_shared_prompt,
)
from rayllm_rl.learner.trace_rows import trace_rows
from rayllm_rl.lora import LoraOptions
from rayllm_rl.objectives.base import Loss
from rayllm_rl.objectives.ppo_decoupled import loglinear_prox_logp
from rayllm_rl.sampling_mask import SamplingMask


COUNTED_METRICS = frozenset({"skipped_nonfinite_steps"})
"""train_step metrics summed over its optimizer steps (counts), not averaged."""


def set_activation_checkpointing(model: torch.nn.Module, on: bool) -> None:
    """Turn HF gradient checkpointing (non-reentrant) of the decoder layers on or off; a no-op if
    already so. Works on an FSDP2-sharded model (the recompute re-runs the layer's all-gather)."""
    if bool(getattr(model, "is_gradient_checkpointing", False)) == on:
        return
    if on:
        if not getattr(model, "supports_gradient_checkpointing", False):
            raise ValueError(f"optim.activation_checkpointing=true: {type(model).__name__} does not support "
                             "gradient checkpointing (transformers models built of GradientCheckpointingLayer do)")
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_disable()


def reshard(model: torch.nn.Module) -> None:
    """Free the unsharded parameters every FSDP2 module still holds (a no-op without FSDP).

    The root module keeps its parameters (embeddings, final norm, LM head) gathered after a
    forward without backward (`torch.no_grad`): that wastes their full size, and an optimizer
    built then would hold the gathered tensors instead of the sharded parameters.
    """
    from torch.distributed.fsdp import FSDPModule

    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.reshard()


@dataclasses.dataclass(frozen=True)
class LearnerSpec:
    """What every rank of a learner is built from (picklable: the driver hands it to each learner actor)."""

    model_path: str
    optim: OptimConfig
    temperature: float = 1.0
    sampling_mask: SamplingMask = SamplingMask()
    """The rollout's top-k / top-p the learner replays when it scores tokens (`job.plan`: off when replay is off)."""
    seed: int = 0
    dtype: str = "float32"
    """Compute dtype name (torch attribute): float32 or bfloat16 (learner/precision.py)."""
    use_gpu: bool = False
    lora: LoraOptions | None = None
    """The policy's adapter (rank > 0: the learner trains and sends the adapter only)."""

    def build(self, dist: DistConfig | None = None) -> "Learner":
        """This rank's `Learner` (`dist`: its FSDP group; None: one process), the model path resolved here."""
        from rayllm_rl.hub import resolve_model_path

        return Learner(resolve_model_path(self.model_path), self.optim, temperature=self.temperature,
                       sampling_mask=self.sampling_mask, seed=self.seed, dist=dist, dtype=getattr(torch, self.dtype),
                       lora=self.lora)


class Learner:
    """Owns the trainable model and its optimizer; usable directly or inside a Ray actor."""

    def __init__(self, model_path: str, optim: OptimConfig, *, temperature: float = 1.0,
                 sampling_mask: SamplingMask = SamplingMask(), seed: int = 0, dtype: torch.dtype = torch.float32,
                 model: torch.nn.Module | None = None,
                 dist: DistConfig | None = None, lora: LoraOptions | None = None):
        from transformers import AutoModelForCausalLM

        torch.manual_seed(seed)
        self.dist = dist if dist is not None else DistConfig()
        self.rank, self.world_size = self.dist.rank, self.dist.world_size
        self.precision = Precision.of(dtype, sharded=self.world_size > 1)
        """float32 master weights, compute in `dtype` (learner/precision.py)."""
        self.model = model if model is not None else AutoModelForCausalLM.from_pretrained(
            model_path, dtype=self.precision.master)
        self.model_path = model_path
        self.lora = lora if lora is not None and lora.enabled else None
        """The policy's LoRA adapter (None: every weight trains)."""
        if self.lora is not None:  # before sharding, seeded alike on every rank: the same lora_A everywhere
            from rayllm_rl.lora import inject

            inject(self.model, self.lora, model_path)
        self.precision.place(self.model)  # trainable: master dtype; a LoRA base: the compute dtype
        self.model.train()
        if optim.activation_checkpointing:  # before sharding: the layers' __call__ wraps FSDP's hooks
            set_activation_checkpointing(self.model, True)
        self.mesh = None
        if self.world_size > 1:
            self.mesh = init_distributed(self.dist)
            if len(set(all_gather_objects(seed))) != 1:
                raise ValueError("every FSDP rank must use the same seed (minibatch permutations must agree)")
            # moves the shards to the mesh device (cuda for nccl); bf16 gathers over float32 masters when mixed
            shard_model(self.model, self.mesh, self.precision.fsdp_policy())
        elif self.dist.backend == "nccl":  # one GPU learner: no process group, the model on this rank's GPU
            self.model.to(torch.device("cuda", torch.cuda.current_device()))
        self.device = next(self.model.parameters()).device
        self.temperature = temperature
        self.sampling_mask = sampling_mask
        """Tokens are scored over the kept set of the rollout's top-k / top-p (`rayllm_rl.sampling_mask`)."""
        self.seed = seed
        # Minibatch permutations come from this generator only: identical on every rank, checkpointable.
        self.generator = torch.Generator().manual_seed(seed)
        self.trace: list[dict] = []
        """A few rows of the last train step, token by token (learner/trace_rows.py; rank 0 only)."""
        check_chunked_head(self.model, optim.logprob_chunk_size)
        self.can_share_prompts = optim.logprob_chunk_size > 0 and supports_shared_prompt(self.model)
        """Whether `optim.share_prompts` applies to this model (otherwise rows are scored padded)."""
        if optim.share_prompts and self.can_share_prompts:
            check_shared_prompt(self.model, optim.logprob_chunk_size)
        self.reset_optimizer(optim)

    def offload(self) -> int:
        """Parameters, gradients and optimizer state off this rank's GPU (colocated placement, while the
        replica sharing it generates); returns the bytes that left it (0 on a CPU learner)."""
        from rayllm_rl.learner.offload import offload_training_state

        return offload_training_state(self.model, self.optimizer, self.device)

    def onload(self) -> int:
        """Back on this rank's GPU before a train step; returns the bytes moved (0 on a CPU learner)."""
        from rayllm_rl.learner.offload import onload_training_state

        return onload_training_state(self.model, self.optimizer, self.device)

    def reset_optimizer(self, optim: OptimConfig) -> None:
        """Fresh AdamW state and step count (e.g. between the SFT warm start and RL)."""
        self.cfg = optim
        set_activation_checkpointing(self.model, optim.activation_checkpointing)
        reshard(self.model)  # AdamW must get the sharded parameters
        self.optimizer = torch.optim.AdamW(
            [p for p in self.model.parameters() if p.requires_grad], lr=optim.lr,
            betas=(optim.beta1, optim.beta2), weight_decay=optim.weight_decay,
        )
        self.optim_steps = 0

    # ------------------------------------------------------------------ forward
    @torch.no_grad()
    def compute_logprobs(self, td: TensorDict) -> torch.Tensor:
        """Logprobs of the current weights `[N, T]` on CPU (e.g. pi_prox before an update).

        With FSDP every rank runs the forward on ALL rows (a forward-only pass, cheap next to the
        update) and returns the full `[N, T]`; the call is collective (parameter all-gathers).
        """
        training = self.model.training
        if self.lora is not None:
            self.model.eval()  # no LoRA dropout in a logprob recomputation
        try:
            with self.precision.autocast(self.device):
                out = batched_token_logprobs(self.model, td, self.cfg.max_tokens_per_micro_batch, self.temperature,
                                             self.device, chunk_size=self.cfg.logprob_chunk_size,
                                             max_rows=self.cfg.micro_batch_size, mask=self.sampling_mask)
        finally:
            self.model.train(training)
        reshard(self.model)
        return out

    @torch.no_grad()
    def reference_logprobs(self, td: TensorDict) -> torch.Tensor:
        """LoRA: logprobs `[N, T]` of the reference policy, the base model (this model with the adapter
        off); collective under FSDP, like `compute_logprobs`."""
        from rayllm_rl.lora import adapter_off

        if self.lora is None:
            raise RuntimeError("reference_logprobs: this learner has no LoRA adapter; its reference is a separate "
                               "frozen model (learner/frozen.py)")
        with adapter_off(self.model):
            return self.compute_logprobs(td)

    # ------------------------------------------------------------------ update
    def train_step(self, td: TensorDict, loss_fn: Loss) -> dict[str, float]:
        """Epochs x minibatches optimizer steps over `td`; returns the metrics averaged over the
        steps that report them, except the counters in `COUNTED_METRICS`, which are summed
        (`skipped_nonfinite_steps`: steps whose loss or gradient was not finite, skipped without
        touching the weights or the optimizer state). A batch with no row takes no step and
        returns `{"empty_batch": 1.0}`."""
        if "advantages" not in td.keys():
            raise ValueError("train_step needs an 'advantages' entry ([N] or [N, T]) in the batch")
        needs_ref = getattr(loss_fn, "needs_ref_logp", False) and "ref_logprobs" not in td.keys()
        if needs_ref and self.lora is None:
            raise ValueError(f"{type(loss_fn).__name__} needs 'ref_logprobs' in the batch (KL to reference is on)")
        self.trace = []
        n = td.batch_size[0]
        if n == 0:  # e.g. every group dropped by a selector: nothing to learn from (the same on every rank)
            return {"empty_batch": 1.0}
        if needs_ref:  # LoRA: the reference is this model with the adapter off, before the update
            td = td.clone(False)
            td["ref_logprobs"] = self.reference_logprobs(td)
        if getattr(loss_fn, "needs_prox_logp", False) and "prox_logprobs" not in td.keys():
            method = getattr(loss_fn, "prox_logp_method", "recompute")
            if method == "recompute":
                td = td.clone(False)
                td["prox_logprobs"] = self.compute_logprobs(td)
            elif "prox_version" not in td.keys():
                raise ValueError(f"{type(loss_fn).__name__} with prox_logp_method={method!r} needs 'prox_version' "
                                 "[N] in the batch (the policy version it is trained from)")
        if self.world_size > 1:
            self._check_same_batch(td)
        mb_count = max(1, min(self.cfg.num_minibatches, n))
        sums: dict[str, float] = {}
        counts: dict[str, int] = {}
        first = True  # the rollout/learner mismatch is measured on the first minibatch, before any update
        for _ in range(self.cfg.epochs):
            perm = torch.randperm(n, generator=self.generator)
            for chunk in perm.chunk(mb_count):
                for k, v in self._optimizer_step(td[chunk], loss_fn, measure_mismatch=first).items():
                    sums[k] = sums.get(k, 0.0) + v
                    counts[k] = counts.get(k, 0) + 1
                first = False
        return {k: v if k in COUNTED_METRICS else v / counts[k] for k, v in sums.items()}

    def _check_same_batch(self, td: TensorDict) -> None:
        """FSDP ranks must all get the full, identical batch: compare a cheap fingerprint."""
        if td.batch_size[0] < 1:
            raise ValueError("train_step got an empty batch")
        adv = td["advantages"].double()
        prints = all_gather_objects(repr((tuple(td["input_ids"].shape), int(td["input_ids"].sum()),
                                          int(td["loss_mask"].sum()), float(adv.sum()), float((adv * adv).sum()))))
        if len(set(prints)) != 1:
            raise ValueError(f"FSDP ranks got different batches (fingerprints {prints}); pass the full batch to all")

    def micro_batches_of(self, td: TensorDict) -> list[tuple[TensorDict, Any]]:
        """How a training step splits `td`: `(rows cut to their longest, PackedRows or None)` per micro-batch,
        packed behind shared prompts when `optim.share_prompts` applies to this model, else padded
        (`micro_batches`)."""
        budget, rows = self.cfg.max_tokens_per_micro_batch, self.cfg.micro_batch_size
        if self.cfg.share_prompts and self.can_share_prompts:
            return [(trim(td[packed.rows], packed.width), packed) for packed in packed_micro_batches(td, budget, rows)]
        return [(mb, None) for _, mb in micro_batches(td, budget, rows)]

    def _optimizer_step(self, td: TensorDict, loss_fn: Loss, measure_mismatch: bool = False) -> dict[str, float]:
        """One optimizer step on minibatch `td`: the gradients of its loss accumulated over micro-batches, then
        applied (`_accumulate`, `_apply`); with `measure_mismatch`, also the rollout/learner mismatch figures of its
        trained tokens (learner/mismatch.py) from the forward the loss needs anyway."""
        metrics, nonfinite_loss = self._accumulate(td, loss_fn, measure_mismatch)
        return self._apply(metrics, nonfinite_loss)

    def _accumulate(self, td: TensorDict, loss_fn: Loss, measure_mismatch: bool) -> tuple[dict[str, float], bool]:
        """Zero the gradients, then run forward and backward over this rank's micro-batches of `td`, each loss
        weighted so that the sum is the full minibatch's loss: (the loss's metrics and the entropy, averaged over
        every rank; whether any rank's loss was not finite). Under FSDP every rank runs as many passes as the
        rank with the most micro-batches (zero-weight passes join the collectives)."""
        n = td.batch_size[0]  # the whole minibatch: the weights below use GLOBAL counts on every rank
        total_tokens = float(td["loss_mask"].sum().clamp(min=1))
        # Micro-batch k's loss averages over normalizer(mask_k) units (tokens, non-empty rows, rows):
        # weighting it by normalizer(mask_k) / normalizer(mask) makes the sum the full-batch loss.
        total_units = float(loss_fn.normalizer(td["loss_mask"]))
        budget = self.cfg.max_tokens_per_micro_batch
        chunk = self.cfg.logprob_chunk_size
        bounds = [(r * n // self.world_size, (r + 1) * n // self.world_size) for r in range(self.world_size)]
        shard = td[bounds[self.rank][0]:bounds[self.rank][1]]
        mbs = self.micro_batches_of(shard)
        # FSDP: every rank must run as many forward/backward passes as the rank with the most micro-batches;
        # every rank holds the full minibatch, so each plans every rank's micro-batches without a collective.
        passes = max(len(self.micro_batches_of(td[lo:hi])) for lo, hi in bounds) if self.world_size > 1 else len(mbs)
        self.optimizer.zero_grad(set_to_none=True)
        metrics: dict[str, float] = {}
        nonfinite_loss = False
        meter = MismatchMeter() if measure_mismatch else None
        scoring = self.sampling_mask if getattr(loss_fn, "scores_sampled_tokens", True) else SamplingMask()
        for mb, packed in mbs:
            mask = mb["loss_mask"]
            # logprobs only where the loss reads them: the gradient is the same, the LM head does less
            with self.precision.autocast(self.device):
                if packed is not None:  # the group's prompt once, each row's rest behind it
                    logp, entropy = packed_token_logprobs(self.model, packed, self.temperature, device=self.device,
                                                          chunk_size=chunk, with_entropy=True, mask=scoring)
                else:
                    logp, entropy = token_logprobs(self.model, mb["input_ids"].to(self.device),
                                                   mb["attention_mask"].to(self.device), self.temperature,
                                                   with_entropy=True, positions=(mask != 0).to(self.device),
                                                   chunk_size=chunk, mask=scoring)
            if meter is not None:
                meter.add(logp, mb)
                if self.rank == 0 and not self.trace:
                    self.trace = trace_rows(mb, logp)
            if self.device.type != "cpu":
                mb = mb.to(self.device)
            # true policy entropy over the trained tokens (the loss only sees sampled-token logprobs)
            ent = float(torch.where(mb["loss_mask"] != 0, entropy, torch.zeros_like(entropy)).sum()) / total_tokens
            metrics["entropy"] = metrics.get("entropy", 0.0) + ent
            adv = mb["advantages"]
            prox = mb.get("prox_logprobs", None)
            if prox is None and getattr(loss_fn, "needs_prox_logp", False):  # loglinear: no recompute pass
                prox = loglinear_prox_logp(mb["logprobs"], mb["versions"], mb["prox_version"] + 1, logp)
            out = loss_fn(logp, mb["logprobs"], prox, adv, mb["loss_mask"], mb.get("ref_logprobs", None))
            weight = float(loss_fn.normalizer(mask)) / total_units if total_units > 0 else 0.0
            nonfinite_loss |= not bool(torch.isfinite(out.loss.detach()).all())
            (out.loss * weight).backward()  # every rank runs every backward (FSDP collectives), even a bad one
            if weight > 0:
                for k, v in out.metrics.items():
                    metrics[k] = metrics.get(k, 0.0) + float(v) * weight
        if self.world_size > 1:
            for _ in range(passes - len(mbs)):  # zero-weight pass: joins the all-gathers / reduce-scatters
                dummy = micro_batches(td[:1], budget)[0][1]
                token_logprobs(self.model, dummy["input_ids"].to(self.device), dummy["attention_mask"].to(self.device),
                               self.temperature, chunk_size=chunk, mask=scoring).sum().mul(0.0).backward()
            summed: dict[str, float] = {}  # weights are global fractions, so the rank sum is the global mean
            parts = all_gather_objects((metrics, nonfinite_loss))
            for part, bad in parts:
                nonfinite_loss |= bad  # one rank's non-finite loss skips the step on every rank
                for k, v in part.items():
                    summed[k] = summed.get(k, 0.0) + v
            metrics = summed
        if meter is not None:  # every rank joins the gather (all ranks measure the same step)
            metrics.update(meter.figures(all_gather_objects if self.world_size > 1 else None))
        return metrics, nonfinite_loss

    def _apply(self, metrics: dict[str, float], nonfinite_loss: bool) -> dict[str, float]:
        """Clip the accumulated gradients and step the optimizer at this step's learning rate, or, when a loss or
        the gradient norm is not finite on any rank, drop the gradients (weights and AdamW state stay): `metrics`
        with `grad_norm`, `lr` and `skipped_nonfinite_steps`."""
        # FSDP2 grads are DTensors: clip_grad_norm_ computes the GLOBAL norm (Replicate DTensor).
        # With clipping off, max_norm=inf only measures the norm (the grads are scaled by exactly 1).
        max_norm = self.cfg.grad_clip if self.cfg.grad_clip > 0 else math.inf
        grad_norm = to_local_scalar(torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm))
        if nonfinite_loss or not math.isfinite(grad_norm):  # global: every rank skips together
            self.optimizer.zero_grad(set_to_none=True)  # weights and AdamW state stay as they were
            return {"skipped_nonfinite_steps": 1.0, **{k: v for k, v in metrics.items() if k.startswith("mismatch_")}}
        metrics["grad_norm"] = grad_norm
        metrics["skipped_nonfinite_steps"] = 0.0
        for g in self.optimizer.param_groups:
            g["lr"] = self.cfg.lr * lr_scale(self.cfg, self.optim_steps)
        self.optimizer.step()
        self.optim_steps += 1
        metrics["lr"] = self.optimizer.param_groups[0]["lr"]
        return metrics

    # ------------------------------------------------------------------ state
    def iter_named_tensors(self):
        """Stream `(name, full detached tensor)` per parameter (weight sync); collective under FSDP.

        Names are the unsharded model's `named_parameters()` names (LoRA: the adapter's parameters
        only, by PEFT name), tensors in the compute dtype (float32 masters: a copy, what replicas hold).
        Every rank must exhaust the iterator in lockstep (each item is a `full_tensor()` all-gather);
        non-zero ranks may discard.
        """
        return ((name, self.precision.for_sync(t)) for name, t in iter_full_tensors(self.model,
                                                                                     self._synced_parameters()))

    def _synced_parameters(self) -> dict[str, torch.nn.Parameter]:
        """What weight sync carries, by the name it carries: every parameter, or the LoRA adapter."""
        if self.lora is None:
            return dict(self.model.named_parameters())
        from rayllm_rl.lora import adapter_parameters

        return adapter_parameters(self.model)

    def weight_metas(self):
        """TensorMeta of every tensor `iter_named_tensors` yields, from global shapes (no gather)."""
        from rayllm_rl.weight_sync.buckets import TensorMeta

        return [TensorMeta(name, tuple(p.shape), self.precision.sync_dtype(p.dtype))
                for name, p in self._synced_parameters().items()]

    def named_tensors(self) -> dict[str, torch.Tensor]:
        """Full, detached weights by name (what weight sync sends to inference); on every rank.

        Under FSDP every rank must call it and each holds a full copy afterwards: prefer
        `iter_named_tensors()` for large models.
        """
        return dict(self.iter_named_tensors())

    def save_pretrained(self, path: str | os.PathLike, tokenizer=None) -> str:
        """HF-format checkpoint (loadable with from_pretrained) plus optimizer/learner state.

        Same as `rayllm_rl.learner.checkpoint.save_checkpoint` (collective under FSDP; rank 0 writes).
        """
        from rayllm_rl.learner.checkpoint import save_checkpoint

        return save_checkpoint(self, path, tokenizer=tokenizer)

    def state(self) -> dict[str, Any]:
        return {"optim_steps": self.optim_steps}

    def close(self) -> None:
        """Leave the FSDP process group (no-op for a single-process learner)."""
        if self.world_size > 1:
            destroy_distributed()
