"""Token logprobs and entropy of a causal LM without materialising `[B, T, V]` logits.

The model's own forward runs with its output head (`get_output_embeddings()`, a Linear) swapped,
for that call only, for a function that takes the final hidden states `[B, T, H]`, keeps the
positions whose logprob is wanted (`positions`: the loss mask in training, every real token
otherwise) and pushes them through the head `chunk_size` positions at a time
(`ChunkedHeadLogprobs`): forward and backward each hold one `[chunk, V]` float32 block (plus a
`[32, V]` scratch), and backward recomputes a chunk's logits instead of keeping them. Because the
swap happens inside the model's forward, an FSDP2-wrapped model all-gathers and reduce-scatters
the head (tied or not) exactly as in a plain forward; the decoder is reached through the model's
forward, whatever its attribute names. `check_chunked_head` refuses a model that post-processes
its logits (soft-capping), which this path would skip.

Micro-batches are bounded by padded tokens (`token_budget_micro_batches`): rows sorted longest
first and grouped greedily so that rows x longest row <= the budget, each cut to its longest row.
Packing rows into one sequence (transformers' position_ids detection in `masking_utils`) would
remove the remaining padding, but with sdpa/eager it builds a dense block-diagonal `[L, L]` mask
and attends over the whole packed row, more work than length-sorted padding leaves; it pays off
only with varlen kernels (flash-attention), so it is not used here.
"""
from __future__ import annotations

import contextlib
from typing import Callable

import torch
from tensordict import TensorDict

from rayllm_rl.sampling_mask import SamplingMask, kept_set, kept_weights, masked_logprobs

DEFAULT_CHUNK = 512
"""Positions per LM-head chunk (`OptimConfig.logprob_chunk_size`): a `[512, 151936]` float32 block is 0.31 GB."""

ENTROPY_CHUNK = 512
"""Positions per entropy chunk on the full-vocabulary path (`full_token_logprobs`)."""


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32, or float64 for a float64 model (logprobs are never computed below float32)."""
    return torch.promote_types(dtype, torch.float32)


def _chunk_logits(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, temperature: float,
                  out: torch.Tensor) -> torch.Tensor:
    """`[c, V]` logits / temperature of hidden states `h` `[c, H]`, written into `out` (`[c, V]`, float32
    or float64: one reused block, so a CPU run does not page-fault a fresh block per chunk)."""
    if weight.dtype == out.dtype:
        torch.mm(h, weight.t(), out=out)
        if bias is not None:
            out.add_(bias)
    else:  # low-precision head: the matmul in its dtype, then upcast
        out.copy_(torch.nn.functional.linear(h, weight, bias))
    return out.div_(temperature) if temperature != 1.0 else out


class ChunkedHeadLogprobs(torch.autograd.Function):
    """`log softmax(h W^T + b) / T)[target]` and the entropy of that distribution, `[N]` each,
    computed `chunk` rows at a time; backward recomputes each chunk's logits.

    With an active sampling mask (top_k > 0 or top_p < 1) the softmax is over each row's kept set
    (`sampling_mask`: the n largest logits, counted from these logits; the target always counts), as the
    rollout sampled; the entropy stays that of the full distribution. Forward gets the kept set's normaliser
    from its largest logits (`kept_set`); backward masks the recomputed softmax to `z >= v`.

    Inputs: hidden `[N, H]`, weight `[V, H]`, bias `[V]` or None, targets `[N]` (long).
    The entropy output is detached (a metric, no gradient). Each chunk's `[chunk, V]` block is
    worked on in place, with exponentials taken `SLICE` rows at a time, so one block (plus a
    `[SLICE, V]` scratch) lives at a time. Gradients of the weight accumulate over chunks in
    float32 (float64 for a float64 weight), then take the weight's dtype.
    """

    SLICE = 32
    """Rows per `[SLICE, V]` scratch exponential inside a chunk."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, temperature: float, chunk: int, with_entropy: bool,
                top_k: int = 0, top_p: float = 1.0):
        acc = _acc_dtype(hidden.dtype)
        n, step, vocab = hidden.shape[0], ChunkedHeadLogprobs.SLICE, weight.shape[0]
        masked = top_k > 0 or top_p < 1.0
        kept_n = hidden.new_zeros(n if masked else 0, dtype=torch.long)
        kept_v = hidden.new_zeros(n if masked else 0, dtype=acc)
        logp = hidden.new_empty(n, dtype=acc)
        lse = hidden.new_empty(n, dtype=acc)
        ent = hidden.new_zeros(n if with_entropy else 0, dtype=acc)
        block = hidden.new_empty(min(chunk, n), vocab, dtype=acc)
        scratch = hidden.new_empty(min(step, n), vocab, dtype=acc)
        sums = hidden.new_empty(min(chunk, n), dtype=acc)
        for s in range(0, n, chunk):
            c = min(chunk, n - s)
            z = _chunk_logits(hidden[s:s + c], weight, bias, temperature, block[:c])
            target_z = z.gather(1, targets[s:s + c, None]).squeeze(1)
            top = z.amax(dim=-1)
            if masked:  # the kept set's normaliser, from the logits before the in-place shift
                kept_n[s:s + c], kept_v[s:s + c], log_kept = kept_set(z, top_k, top_p)
                outside = target_z < kept_v[s:s + c]  # a drawn token these logits would not keep counts too
                lse[s:s + c] = torch.where(outside, torch.logaddexp(log_kept, target_z), log_kept)
            if not masked or with_entropy:  # the full softmax's normaliser: the logprob's, or the entropy's only
                z.sub_(top[:, None])
                for r in range(0, c, step):
                    e = torch.exp(z[r:r + step], out=scratch[:min(step, c - r)])
                    torch.sum(e, dim=-1, out=sums[r:r + e.shape[0]])
                log_sum = sums[:c].log()
                if not masked:
                    lse[s:s + c] = top + log_sum
            logp[s:s + c] = target_z - lse[s:s + c]
            if with_entropy:  # z becomes log p; H = -sum_v p_v log p_v
                z.sub_(log_sum[:, None])
                for r in range(0, c, step):
                    p = torch.exp(z[r:r + step], out=scratch[:min(step, c - r)])
                    ent[s + r:s + r + p.shape[0]] = -torch.bmm(p.unsqueeze(1), z[r:r + step].unsqueeze(2)).view(-1)
        del block, scratch
        ctx.save_for_backward(hidden, weight, bias, targets, lse, kept_n, kept_v)
        ctx.temperature, ctx.chunk, ctx.masked = temperature, chunk, masked
        ctx.mark_non_differentiable(ent)
        return logp, ent

    @staticmethod
    def backward(ctx, grad_logp, _grad_ent):
        hidden, weight, bias, targets, lse, kept_n, kept_v = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        acc = lse.dtype
        n, w_acc = hidden.shape[0], _acc_dtype(weight.dtype)
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=w_acc, device=weight.device) if need_w else None
        grad_b = torch.zeros(bias.shape, dtype=w_acc, device=bias.device) if need_b and bias is not None else None
        t, chunk = ctx.temperature, ctx.chunk
        block = hidden.new_empty(min(chunk, n), weight.shape[0], dtype=acc)
        for s in range(0, n, chunk):
            c = min(chunk, n - s)
            h = hidden[s:s + c]
            g = grad_logp[s:s + c].to(acc)
            # d logp / d z = onehot(target) - softmax(z) (over the kept set when masked); z = logits / T,
            # so d/d logits has a 1/T
            z = _chunk_logits(h, weight, bias, t, block[:c])
            if ctx.masked:  # softmax over the kept set: z >= v, except rows with ties at v or the target below it
                n_c, v_c, tg = kept_n[s:s + c], kept_v[s:s + c], targets[s:s + c]
                keep = z >= v_c[:, None]
                odd = ((keep.sum(-1) != n_c) | (z.gather(1, tg[:, None]).squeeze(1) < v_c)).nonzero().squeeze(1)
                w_odd = kept_weights(z[odd], n_c[odd], v_c[odd], tg[odd]) if odd.numel() else None
            dz = z.sub_(lse[s:s + c, None]).exp_()
            if ctx.masked:
                fixed = dz[odd] * w_odd if w_odd is not None else None
                dz.mul_(keep)
                if fixed is not None:
                    dz[odd] = fixed
                del keep
            dz.mul_(-g[:, None])
            dz.scatter_add_(1, targets[s:s + c, None], g[:, None])
            if t != 1.0:
                dz.div_(t)
            dz_w = dz.to(weight.dtype)  # the same block when the weight is float32 / float64
            if need_h:
                grad_h[s:s + c] = (dz_w @ weight).to(hidden.dtype)
            if need_w:
                if grad_w.dtype == dz_w.dtype == h.dtype:
                    grad_w.addmm_(dz_w.t(), h)
                else:
                    grad_w.add_(dz_w.t() @ h.to(weight.dtype))
            if grad_b is not None:
                grad_b.add_(dz_w.sum(0))
            del dz_w
        del block
        return (grad_h, grad_w.to(weight.dtype) if grad_w is not None else None,
                grad_b.to(bias.dtype) if grad_b is not None else None, None, None, None, None, None, None)


def chunked_head_logprobs(hidden: torch.Tensor, head: torch.nn.Linear, targets: torch.Tensor, temperature: float = 1.0,
                          chunk_size: int = DEFAULT_CHUNK, with_entropy: bool = False,
                          mask: SamplingMask = SamplingMask()):
    """`(logp [N], entropy [N] or empty)` of `targets` under `head(hidden) / temperature`, hidden `[N, H]`,
    over each row's kept set under an active sampling `mask`.

    Under autocast (the learner's float32 masters, learner/precision.py) the head runs as `F.linear` would
    there: hidden and weight cast to the autocast dtype, logits accumulated in float32; the weight's
    gradient flows back through the cast to the float32 master."""
    weight, bias, device = head.weight, head.bias, hidden.device.type
    context = contextlib.nullcontext()
    if torch.is_autocast_enabled(device):
        dt = torch.get_autocast_dtype(device)
        hidden, weight = hidden.to(dt), weight.to(dt)
        bias = bias.to(dt) if bias is not None else None
        context = torch.autocast(device, enabled=False)  # the function sets every dtype itself
    with context:
        return ChunkedHeadLogprobs.apply(hidden, weight, bias, targets, float(temperature), int(chunk_size),
                                         bool(with_entropy), int(mask.top_k), float(mask.top_p))


def linear_head(model: torch.nn.Module) -> torch.nn.Linear | None:
    """The model's output head if the chunked path can use it (a `Linear` from `get_output_embeddings()`)."""
    getter = getattr(model, "get_output_embeddings", None)
    head = getter() if callable(getter) else None
    return head if isinstance(head, torch.nn.Linear) else None


@contextlib.contextmanager
def _head_forward(head: torch.nn.Module, fn: Callable[[torch.Tensor], torch.Tensor]):
    """Within the block, `head(x)` calls `fn(x)` (an instance attribute shadowing the class forward)."""
    had = "forward" in head.__dict__
    saved = head.__dict__.get("forward")
    head.forward = fn
    try:
        yield
    finally:
        if had:
            head.forward = saved
        else:
            del head.forward


def full_token_logprobs(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                        temperature: float = 1.0, *, with_entropy: bool = False, mask: SamplingMask = SamplingMask(),
                        targets: torch.Tensor | None = None):
    """The full-vocabulary path: `[B, T, V]` logits, float32 log_softmax (the learner's path before
    chunking). For models without a Linear output head or with post-processed logits
    (`logprob_chunk_size=0`). Same outputs as `token_logprobs`, at every position (`targets`: as there)."""
    logits = model(input_ids=input_ids, attention_mask=attention_mask.long()).logits
    logits = logits[:, :-1] if targets is None else logits
    scored, pad = (input_ids[:, 1:], (1, 0)) if targets is None else (targets, (0, 0))
    logits = logits.to(_acc_dtype(logits.dtype))
    if temperature != 1.0:
        logits = logits / temperature
    log_probs = torch.log_softmax(logits, dim=-1)
    if mask.active:  # over each position's kept set (entropy below stays the full distribution's)
        b, t1, vocab = logits.shape
        logp = masked_logprobs(logits.reshape(-1, vocab), scored.reshape(-1), mask).view(b, t1)
    else:
        logp = log_probs.gather(-1, scored.unsqueeze(-1)).squeeze(-1)
    logp = torch.nn.functional.pad(logp, pad, value=0.0)
    if not with_entropy:
        return logp
    with torch.no_grad():  # chunked over positions: one [B, chunk, V] temporary at a time
        ent = torch.cat([-(lp.exp() * lp).sum(-1) for lp in log_probs.split(ENTROPY_CHUNK, dim=1)], dim=1)
    return logp, torch.nn.functional.pad(ent, pad, value=0.0)


def token_logprobs(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                   temperature: float = 1.0, *, with_entropy: bool = False, positions: torch.Tensor | None = None,
                   chunk_size: int = DEFAULT_CHUNK, mask: SamplingMask = SamplingMask(),
                   targets: torch.Tensor | None = None):
    """Token-aligned log pi(x_t | x_<t) `[B, T]` for right-padded input; column 0 is 0. With `targets` `[B, T]`
    (Tinker's datum: any token scored at any position), column t is log pi(targets_t | x_<=t) instead, unshifted.

    Only the tokens in `positions` (`[B, T]` bool; default `attention_mask`) are computed, chunk
    by chunk through the LM head; the others are 0 (the losses read logp on their mask only).
    float32, or float64 for a float64 model. With `with_entropy`, also the detached entropy of
    the full next-token distribution at the same positions: `(logp, entropy)`, both `[B, T]`.
    `chunk_size <= 0`, or a model without a Linear output head, takes `full_token_logprobs`. An active
    sampling `mask` scores each token over the kept set the rollout's top-k / top-p sampled from.
    """
    head = linear_head(model) if chunk_size > 0 else None
    if head is None:
        out = full_token_logprobs(model, input_ids, attention_mask, temperature, with_entropy=with_entropy, mask=mask,
                                  targets=targets)
        keep = (attention_mask if positions is None else positions).to(torch.bool)
        return tuple(torch.where(keep, x, torch.zeros_like(x)) for x in out) if with_entropy else \
            torch.where(keep, out, torch.zeros_like(out))
    b, t = input_ids.shape
    keep = (attention_mask if positions is None else positions).to(torch.bool)
    if targets is None:  # position t-1 predicts t
        sel, scored, cut, pad = keep[:, 1:], input_ids[:, 1:][keep[:, 1:]], slice(0, t - 1), (1, 0)
    else:  # position t predicts targets_t
        sel, scored, cut, pad = keep, targets[keep], slice(0, t), (0, 0)
    side: dict[str, torch.Tensor] = {}

    def head_logprobs(hidden: torch.Tensor) -> torch.Tensor:
        if hidden.shape[:2] != (b, t):
            raise RuntimeError(f"{type(model).__name__} called its output head on hidden states of shape "
                               f"{tuple(hidden.shape)}, not [B, T, H] = [{b}, {t}, H]; use logprob_chunk_size=0")
        logp, ent = chunked_head_logprobs(hidden[:, cut][sel], head, scored, temperature, chunk_size, with_entropy,
                                          mask)
        zeros = hidden.new_zeros(b, cut.stop, dtype=logp.dtype)
        side["entropy"] = torch.nn.functional.pad(zeros.masked_scatter(sel, ent), pad) if with_entropy else None
        return torch.nn.functional.pad(zeros.masked_scatter(sel, logp), pad)

    # a transformers model would otherwise build a KV cache it never reads
    extra = {"use_cache": False} if hasattr(getattr(model, "config", None), "use_cache") else {}
    with _head_forward(head, head_logprobs):
        # The returned "logits" are the [B, T] logprobs (FSDP2 hooks its backward on them).
        logp = model(input_ids=input_ids, attention_mask=attention_mask.long(), **extra).logits
    if logp.shape != (b, t):
        raise RuntimeError(f"{type(model).__name__} post-processed its head output (shape {tuple(logp.shape)}); "
                           "use logprob_chunk_size=0")
    return (logp, side["entropy"]) if with_entropy else logp


@torch.no_grad()
def check_chunked_head(model: torch.nn.Module, chunk_size: int = DEFAULT_CHUNK, tokens: int = 8) -> None:
    """Raise ValueError unless the chunked path reproduces the model's own logits on a short input.

    Catches heads whose output the model post-processes (logit soft-capping, scaling), which the
    chunked path would skip. One short forward of each path, in eval mode; collective under FSDP.
    """
    head = linear_head(model)
    if chunk_size <= 0 or head is None:
        return
    device = next(model.parameters()).device
    vocab = int(head.weight.shape[0])
    ids = (torch.arange(tokens, device=device) * 7919 + 11).remainder(vocab)[None]
    am = torch.ones_like(ids, dtype=torch.bool)
    was_training = model.training
    model.eval()
    try:
        want = full_token_logprobs(model, ids, am)
        got = token_logprobs(model, ids, am, chunk_size=max(1, min(chunk_size, 3)))
    finally:
        model.train(was_training)
    diff = float((want - got).abs().max())
    tol = 1e-3 if head.weight.dtype in (torch.float32, torch.float64) else 5e-2
    if not diff <= tol:
        raise ValueError(f"{type(model).__name__}: the chunked LM-head logprobs differ from the model's own by "
                         f"{diff:.3g} "
                         "(it post-processes its logits, e.g. soft-capping); set optim.logprob_chunk_size=0 for "
                         "the full-vocabulary path")


def token_budget_micro_batches(lengths: torch.Tensor, max_tokens: int, max_rows: int = 0) -> list[torch.Tensor]:
    """Row indices of each micro-batch for rows of `lengths` `[N]`: longest first, grouped greedily
    so that rows x longest row <= `max_tokens` (a row longer than the budget goes alone) and, if
    `max_rows` > 0, at most `max_rows` rows. Deterministic (a stable sort)."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    order = torch.argsort(lengths.cpu(), descending=True, stable=True).tolist()
    lens = lengths.cpu().tolist()
    groups: list[list[int]] = []
    width = 0
    for i in order:
        cur = groups[-1] if groups else None
        if cur is None or (len(cur) + 1) * width > max_tokens or 0 < max_rows <= len(cur):
            groups.append([i])
            width = max(int(lens[i]), 1)
        else:
            cur.append(i)
    return [torch.tensor(g, dtype=torch.long) for g in groups]


def row_lengths(td: TensorDict) -> torch.Tensor:
    """Tokens per right-padded row `[N]` (the attention mask's row sums)."""
    return td["attention_mask"].sum(-1)


def trim(td: TensorDict, width: int) -> TensorDict:
    """Cut the token keys (`[B, T, ...]`) of a batch to their first `width` columns."""
    full = td["input_ids"].shape[-1]
    if width >= full:
        return td
    if td.batch_dims >= 2:
        return td[:, :width]
    return td.apply(lambda x: x[:, :width] if x.dim() >= 2 and x.shape[1] == full else x)


def micro_batches(td: TensorDict, max_tokens: int, max_rows: int = 0) -> list[tuple[torch.Tensor, TensorDict]]:
    """`(row indices, rows cut to their longest)` per token-budget micro-batch of `td`."""
    lengths = row_lengths(td)
    return [(idx, trim(td[idx], max(1, int(lengths[idx].max())))) for idx in
            token_budget_micro_batches(lengths, max_tokens, max_rows)]


@torch.no_grad()
def batched_token_logprobs(model: torch.nn.Module, td: TensorDict, max_tokens: int, temperature: float = 1.0,
                           device: torch.device | str = "cpu", *, chunk_size: int = DEFAULT_CHUNK,
                           max_rows: int = 0, mask: SamplingMask = SamplingMask()) -> torch.Tensor:
    """`token_logprobs` at every real token of `td`, in token-budget micro-batches: `[N, T]` on CPU
    in the original row order, float32 (float64 for a float64 model), 0 at padding."""
    n, t = td["input_ids"].shape
    out: torch.Tensor | None = None
    for idx, mb in micro_batches(td, max_tokens, max_rows):
        lp = token_logprobs(model, mb["input_ids"].to(device), mb["attention_mask"].to(device), temperature,
                            chunk_size=chunk_size, mask=mask).cpu()
        if out is None:
            out = torch.zeros(n, t, dtype=lp.dtype)
        out[idx, :lp.shape[1]] = lp
    return out if out is not None else torch.zeros(n, t)
