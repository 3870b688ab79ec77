"""The token set a top-k / top-p sampler keeps, by vLLM's rule, for the sampler and for the learner.

Sampling-mask replay (docs/algorithms.md): under top-k or top-p the rollout draws from the truncated,
renormalised distribution, so its logprob is `z_t - logsumexp(kept z)`; the learner must score the same
token under the same kept set or the importance ratio is biased by the dropped mass. vLLM's sampler
(`v1/sample/ops/topk_topp_sampler.py`, `apply_top_k_top_p_pytorch`), on logits `z` already divided by the
temperature: top-k keeps every token with `z >=` the k-th largest (ties kept); top-p then softmaxes over
those and keeps a token while the mass of the tokens ranked above it is `< p` (the most likely always).
The kept set is always the `n` largest logits of the row, so a count `n` (with the n-th largest value `v`
for ties) rebuilds it exactly. The Transformers engine samples with it; the learner recomputes `n` from its
own logits (vLLM 0.32's CPU build returns no count, see docs/algorithms.md) and scores under it.
Torch only: both `inference/` and `learner/` import it.
"""
from __future__ import annotations

import dataclasses

import torch

FIRST_TOPK = 64
"""Largest logits looked at first when counting a top-p nucleus; 16x more for the rows whose nucleus is wider."""


@dataclasses.dataclass(frozen=True)
class SamplingMask:
    """The rollout's top-k / top-p, which the learner replays when it scores tokens (all off: full softmax)."""

    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self) -> None:
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"sampling mask: top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"sampling mask: top_k must be >= 0 (0 = off), got {self.top_k}")

    @property
    def active(self) -> bool:
        return self.top_k > 0 or self.top_p < 1.0


def _per_row(value, rows: int, dtype: torch.dtype, device) -> torch.Tensor:
    return torch.as_tensor(value, dtype=dtype, device=device).reshape(-1).expand(rows)


@torch.no_grad()
def kept_set(z: torch.Tensor, top_k, top_p) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`(n [N] long, v [N], log_kept [N])`: how many tokens each row keeps, the n-th largest logit (-inf
    where nothing is cut) and the logsumexp of the kept logits (exact under ties: the n largest values).

    z `[N, V]` float: logits divided by the temperature. `top_k`, `top_p`: a number, or one per row `[N]`
    (top_k 0 and top_p 1 switch each off). Top-p looks at the `FIRST_TOPK` largest logits of a row first
    and 16x more only for the rows whose nucleus is wider (then a full sort): no sort of a peaked row.
    """
    rows, vocab = z.shape
    k = _per_row(top_k, rows, torch.long, z.device)
    p = _per_row(top_p, rows, z.dtype, z.device)
    n = torch.full((rows,), vocab, dtype=torch.long, device=z.device)
    v = torch.full((rows,), float("-inf"), dtype=z.dtype, device=z.device)
    with_k, with_p = k > 0, p < 1.0
    log_kept = torch.logsumexp(z, dim=-1)
    if bool(with_k.any()):
        k_lim = torch.where(with_k, k.clamp(max=vocab), torch.full_like(k, vocab))
        kth = z.topk(int(k_lim.max()), dim=-1).values.gather(1, (k_lim - 1)[:, None]).squeeze(1)
        in_k = z >= kth[:, None]  # ties with the k-th largest are kept, as vLLM does
        n = torch.where(with_k, in_k.sum(-1), n)
        v = torch.where(with_k, kth, v)
        log_kept = torch.where(with_k, torch.logsumexp(z.masked_fill(~in_k, float("-inf")), dim=-1), log_kept)
    todo, width = with_p.nonzero().squeeze(1), FIRST_TOPK
    while todo.numel():  # top-p over the probabilities renormalised on the top-k set (log_kept)
        w = vocab if 4 * width > vocab else width  # past a quarter of the row, a sort costs no more than topk
        vals = z[todo].topk(w, dim=-1).values if w < vocab else z[todo].sort(dim=-1, descending=True).values
        limit = n[todo]
        ranks = torch.arange(w, device=z.device)[None]
        probs = (vals - log_kept[todo, None]).exp().masked_fill(ranks >= limit[:, None], 0.0)
        keep = (probs.cumsum(-1) - probs) < p[todo, None]  # the mass ranked above each token < p
        keep[:, 0] = True
        count = keep.sum(-1)
        done = (count < w) | (limit <= w) | (w == vocab)
        rows_done, kept_n = todo[done], torch.minimum(count, limit)[done]
        vals = vals[done]
        n[rows_done] = kept_n
        v[rows_done] = vals.gather(1, (kept_n - 1)[:, None]).squeeze(1)
        log_kept[rows_done] = torch.logsumexp(vals.masked_fill(ranks >= kept_n[:, None], float("-inf")), dim=-1)
        todo, width = todo[~done], 16 * width
    return n, v, log_kept


@torch.no_grad()
def kept_weights(z: torch.Tensor, n: torch.Tensor, v: torch.Tensor,
                 targets: torch.Tensor | None = None) -> torch.Tensor:
    """`[N, V]` weight of each token in the kept set: 1 above `v`, and the remaining `n - #(z > v)` places
    shared among the tokens tied at `v` (exact whichever tie a sort would keep). With `targets` `[N]`, each
    row's target counts fully: a tied target is one of the kept (it was drawn), and a target outside the set
    is added to it (a token the learner's own logits would not keep: its logprob stays finite; this happens
    only where the two sides' logits differ)."""
    above, tied = z > v[:, None], z == v[:, None]
    places, n_tied = (n - above.sum(-1)).to(z.dtype), tied.sum(-1).to(z.dtype)
    share = places / n_tied.clamp(min=1)
    if targets is not None:  # a tied target takes one of the places: the other tied tokens share the rest
        tied_target = tied.gather(1, targets[:, None]).squeeze(1) & (n_tied > 1)
        share = torch.where(tied_target, (places - 1) / (n_tied - 1).clamp(min=1), share)
    w = above.to(z.dtype).add_(tied.to(z.dtype).mul_(share[:, None]))
    if targets is not None:
        w.scatter_(1, targets[:, None], 1.0)
    return w


def masked_logprobs(z: torch.Tensor, targets: torch.Tensor, mask: SamplingMask) -> torch.Tensor:
    """`log softmax(z)[target]` over each row's kept set, `[N]`, differentiable in z `[N, V]` (the
    full-vocabulary path and the reference for the chunked one)."""
    if not mask.active:
        return torch.log_softmax(z, dim=-1).gather(1, targets[:, None]).squeeze(1)
    n, v, _ = kept_set(z.detach(), mask.top_k, mask.top_p)
    log_w = kept_weights(z.detach(), n, v, targets).log()
    return z.gather(1, targets[:, None]).squeeze(1) - torch.logsumexp(z + log_w, dim=-1)
