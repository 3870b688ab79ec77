"""Learner memory and speed with a real vocabulary: today's path vs the chunked, token-budget one.

A Qwen2 built from its config (vocabulary 151,936 like Qwen2.5, hidden 64, 2 layers, tied head)
and 64 seeded rows of mixed lengths up to 2,048 tokens, each a prompt part and a completion part
with only the completion trained (an RL batch). Two paths run one after the other, each in its own
subprocess so each peak is its own:

- "today": the learner before chunking (`TodayLearner._optimizer_step` kept here verbatim, its
  logprobs the library's unchanged full-vocabulary path `full_token_logprobs`): `[B, T, V]`
  logits cast to float32, a full log_softmax, the
  entropy at every position, micro-batches of `--today-micro-batch-size` rows in batch order.
- "chunked": `rayllm_rl.learner.Learner`: the LM head in chunks of `--chunk` positions at the
  trained tokens only, micro-batches of at most `--max-tokens` padded tokens with rows sorted by
  length. By default its budget equals today's padded tokens per micro-batch (rows x longest row).

Per path: peak memory of a train step above the memory held before it (CPU: the child's VmHWM,
reset through /proc/self/clear_refs, minus its VmRSS after building model, learner and batch; GPU:
torch.cuda.max_memory_allocated minus memory_allocated), tokens/s (real, non-pad tokens per
second of a train step, median of `--steps` steps after `--warmup`), and the gradient of the first
step on the same weights and batch (lr 0, no clipping), compared as ||g_new - g_old|| / ||g_old||.

    .venv/bin/python benchmarks/learner_memory.py [--rows 64 --max-len 2048] [--dtype bfloat16 --device cuda]
"""
from __future__ import annotations

import argparse
import gc
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from rayllm_rl.learner.learner import Learner, OptimConfig  # noqa: E402
from rayllm_rl.learner.optim import lr_scale  # noqa: E402
from rayllm_rl.learner.logprobs import full_token_logprobs  # noqa: E402
from rayllm_rl.objectives import GRPOLoss  # noqa: E402
from rayllm_rl.objectives.base import Loss  # noqa: E402

TARGETS = {"peak_memory_ratio_max": 0.25, "tokens_per_s_ratio_min": 1.3, "grad_rel_diff_max": 1e-5}
"""Issue J, deliverable 3: chunked peak <= 1/4 of today's, tokens/s >= 1.3x, gradients equal to 1e-5."""


# ---------------------------------------------------------------- today's path
# The learner's logprobs before chunking are kept, line for line, as the full-vocabulary path
# (`optim.logprob_chunk_size=0`): `[B, T, V]` logits in float32, full log_softmax.
today_token_logprobs = full_token_logprobs


def _today_micro_batches(td, size: int):
    for i in range(0, td.batch_size[0], size):
        mb = td[i:i + size]
        width = int(mb["attention_mask"].sum(-1).max())
        full = mb["input_ids"].shape[-1]
        yield mb if width >= full else mb.apply(lambda x: x[:, :width] if x.dim() >= 2 and x.shape[1] == full else x)


class TodayLearner(Learner):
    """`Learner` with the single-process `_optimizer_step` of before chunking (rows per micro-batch =
    `optim.micro_batch_size`); AdamW, clipping and the loss weighting are the same."""

    def _optimizer_step(self, td, loss_fn: Loss, measure_mismatch: bool = False) -> dict[str, float]:
        # the library's step takes measure_mismatch too; the "before chunking" path never measured it
        total_tokens = float(td["loss_mask"].sum().clamp(min=1))
        total_units = float(loss_fn.normalizer(td["loss_mask"]))
        self.optimizer.zero_grad(set_to_none=True)
        metrics: dict[str, float] = {}
        for mb in _today_micro_batches(td, self.cfg.micro_batch_size):
            mask = mb["loss_mask"]
            with self.precision.autocast(self.device):  # both paths: float32 masters, bf16 compute when asked
                logp, entropy = today_token_logprobs(self.model, mb["input_ids"].to(self.device),
                                                     mb["attention_mask"].to(self.device), self.temperature,
                                                     with_entropy=True)
            if self.device.type != "cpu":
                mb = mb.to(self.device)
            ent = float(torch.where(mb["loss_mask"] != 0, entropy, torch.zeros_like(entropy)).sum()) / total_tokens
            metrics["entropy"] = metrics.get("entropy", 0.0) + ent
            out = loss_fn(logp, mb["logprobs"], mb.get("prox_logprobs", None), mb["advantages"], mb["loss_mask"],
                          mb.get("ref_logprobs", None))
            weight = float(loss_fn.normalizer(mask)) / total_units if total_units > 0 else 0.0
            (out.loss * weight).backward()
            if weight > 0:
                for k, v in out.metrics.items():
                    metrics[k] = metrics.get(k, 0.0) + float(v) * weight
        max_norm = self.cfg.grad_clip if self.cfg.grad_clip > 0 else math.inf
        metrics["grad_norm"] = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm))
        metrics["skipped_nonfinite_steps"] = 0.0
        for g in self.optimizer.param_groups:
            g["lr"] = self.cfg.lr * lr_scale(self.cfg, self.optim_steps)
        self.optimizer.step()
        self.optim_steps += 1
        return metrics


# ---------------------------------------------------------------- model, batch, memory
def build_model(args) -> torch.nn.Module:
    """A seeded Qwen2 with Qwen2.5's vocabulary and a small body (every child builds the same one)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(args.seed)
    cfg = Qwen2Config(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=4 * args.hidden,
                      num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=max(args.max_len, 32), tie_word_embeddings=True,
                      attn_implementation="sdpa")
    return Qwen2ForCausalLM(cfg).to(getattr(torch, args.dtype)).to(args.device).train()


def build_batch(args, model: torch.nn.Module):
    """Rows of total length ~U[max_len/16, max_len] (the first is max_len long), a prompt of
    ~U[1/8, 1/2] of it, the rest a trained completion; behaviour logprobs = the model's own plus
    small noise (ratios near 1, as on-policy), advantages ~N(0, 1)."""
    from tensordict import TensorDict

    g = torch.Generator().manual_seed(args.seed + 1)
    n, t = args.rows, args.max_len
    lengths = torch.randint(max(4, t // 16), t + 1, (n,), generator=g)
    lengths[0] = t
    prompts = (lengths.double() * (0.125 + 0.375 * torch.rand(n, generator=g, dtype=torch.float64))).long().clamp(min=1)
    pos = torch.arange(t)[None]
    am = pos < lengths[:, None]
    loss_mask = am & (pos >= prompts[:, None])
    ids = torch.randint(0, args.vocab, (n, t), generator=g) * am
    td = TensorDict({"input_ids": ids, "attention_mask": am, "loss_mask": loss_mask,
                     "advantages": torch.randn(n, generator=g)}, batch_size=[n])
    own = Learner("", OptimConfig(max_tokens_per_micro_batch=4 * t), model=model).compute_logprobs(td)
    td["logprobs"] = torch.where(loss_mask, own.float() + 0.02 * torch.randn(n, t, generator=g), 0.0)
    return td


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


class PeakMemory:
    """Peak bytes above the level at `reset()`: CUDA allocator stats, or the process's RSS high-water mark."""

    def __init__(self, device: str):
        self.cuda = device.startswith("cuda")

    def reset(self) -> None:
        gc.collect()
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.base = torch.cuda.memory_allocated()
        else:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # VmHWM := VmRSS (Linux >= 4.0)
            self.base = _status_kib("VmRSS") * 1024

    def peak(self) -> int:
        if self.cuda:
            torch.cuda.synchronize()
            return torch.cuda.max_memory_allocated() - self.base
        return _status_kib("VmHWM") * 1024 - self.base


def run_path(args) -> dict:
    """One path in this process: returns its figures and writes the first step's gradient to args.grad_out."""
    torch.set_num_threads(args.threads)
    batch = torch.load(args.batch_file, weights_only=False)
    model = build_model(args)
    today = args.child == "today"
    optim = OptimConfig(lr=0.0, grad_clip=0.0, micro_batch_size=args.today_micro_batch_size if today else 0,
                        max_tokens_per_micro_batch=args.max_tokens, logprob_chunk_size=args.chunk,
                        activation_checkpointing=args.activation_checkpointing and not today)
    learner = (TodayLearner if today else Learner)("", optim, model=model, dtype=getattr(torch, args.dtype))
    loss = GRPOLoss()
    mem = PeakMemory(args.device)
    real_tokens = int(batch["attention_mask"].sum())
    peaks, seconds = [], []
    for step in range(args.warmup + args.steps):
        mem.reset()
        t0 = time.perf_counter()
        metrics = learner.train_step(batch, loss)
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()
        seconds.append(time.perf_counter() - t0)
        peaks.append(mem.peak())
        if step == 0:
            grad = torch.cat([p.grad.detach().flatten().double().cpu() for p in learner.model.parameters()])
            torch.save(grad, args.grad_out)
            first_metrics = metrics
    timed = seconds[args.warmup:]
    if today:
        from rayllm_rl.learner.logprobs import row_lengths

        lens = row_lengths(batch)
        widths = [int(lens[i:i + args.today_micro_batch_size].max()) * len(lens[i:i + args.today_micro_batch_size])
                  for i in range(0, len(lens), args.today_micro_batch_size)]
    else:
        from rayllm_rl.learner.logprobs import micro_batches

        widths = [mb["input_ids"].numel() for _, mb in micro_batches(batch, args.max_tokens)]
    return {
        "path": args.child,
        "peak_bytes": max(peaks),
        "peak_gib": round(max(peaks) / 2**30, 3),
        "peak_bytes_per_step": peaks,
        "step_seconds": [round(s, 3) for s in seconds],
        "median_step_s": statistics.median(timed),
        "tokens_per_s": real_tokens / statistics.median(timed),
        "micro_batches": len(widths),
        "padded_tokens": sum(widths),
        "largest_micro_batch_padded_tokens": max(widths),
        "real_tokens": real_tokens,
        "trained_tokens": int(batch["loss_mask"].sum()),
        "entropy": first_metrics["entropy"],
        "loss": first_metrics["loss"],
        "grad_norm": first_metrics["grad_norm"],
    }


# ---------------------------------------------------------------- driver
def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--max-len", type=int, default=2048)
    p.add_argument("--vocab", type=int, default=151_936)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--today-micro-batch-size", type=int, default=1,
                   help="rows per micro-batch on today's path (256, its default, needs ~80 GB here)")
    p.add_argument("--max-tokens", type=int, default=0,
                   help="token budget of the chunked path (0: today's micro-batch rows x --max-len)")
    p.add_argument("--chunk", type=int, default=OptimConfig.logprob_chunk_size, help="optim.logprob_chunk_size")
    p.add_argument("--activation-checkpointing", action="store_true", help="on the chunked path")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--threads", type=int, default=1, help="torch threads per path (1: steadier on a shared box)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--device", default="cpu", help="cpu or cuda[:i]")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="benchmarks/results/learner_memory.json")
    p.add_argument("--child", choices=["today", "chunked"], help=argparse.SUPPRESS)
    p.add_argument("--batch-file", help=argparse.SUPPRESS)
    p.add_argument("--grad-out", help=argparse.SUPPRESS)
    p.add_argument("--result-out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.max_tokens <= 0:
        args.max_tokens = args.today_micro_batch_size * args.max_len
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device is visible")
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.child:
        Path(args.result_out).write_text(json.dumps(run_path(args)))
        return {}
    with tempfile.TemporaryDirectory(prefix="learner-memory-") as tmp:
        torch.set_num_threads(args.threads)
        batch_file = os.path.join(tmp, "batch.pt")
        torch.save(build_batch(args, build_model(args)), batch_file)
        results, grads = {}, {}
        passthrough = list(argv if argv is not None else sys.argv[1:])
        for path in ("today", "chunked"):
            files = {k: os.path.join(tmp, f"{path}.{k}") for k in ("grad", "json")}
            cmd = [sys.executable, __file__, *passthrough, "--max-tokens", str(args.max_tokens), "--child", path,
                   "--batch-file", batch_file, "--grad-out", files["grad"], "--result-out", files["json"]]
            subprocess.run(cmd, check=True, timeout=3600)
            results[path] = json.loads(Path(files["json"]).read_text())
            grads[path] = torch.load(files["grad"])
    today, new = results["today"], results["chunked"]
    rel = float((grads["chunked"] - grads["today"]).norm() / grads["today"].norm())
    summary = {
        "peak_memory_ratio": new["peak_bytes"] / today["peak_bytes"],
        "tokens_per_s_ratio": new["tokens_per_s"] / today["tokens_per_s"],
        "grad_rel_diff": rel,
    }
    summary["targets_met"] = {
        "peak_memory": summary["peak_memory_ratio"] <= TARGETS["peak_memory_ratio_max"],
        "tokens_per_s": summary["tokens_per_s_ratio"] >= TARGETS["tokens_per_s_ratio_min"],
        "grad_rel_diff": rel <= TARGETS["grad_rel_diff_max"],
    }
    report = {
        "config": {k: v for k, v in vars(args).items() if k not in ("child", "batch_file", "grad_out", "result_out")},
        "torch": torch.__version__,
        "memory_measure": "cuda max_memory_allocated" if args.device.startswith("cuda") else "VmHWM - VmRSS",
        "targets": TARGETS,
        "today": today,
        "chunked": new,
        "summary": summary,
    }
    print(json.dumps(report, indent=1))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    return report


if __name__ == "__main__":
    main()
