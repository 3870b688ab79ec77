"""Vectorised per-row sampling for a decode step: temperature, top-k, top-p, greedy.

Returned logprobs are log-softmax of `logits / temperature` at the chosen token (temperature
1 for greedy rows), i.e. the distribution the learner recomputes; top-k/top-p only restrict
which tokens can be drawn.
"""
from __future__ import annotations

import torch


class RowSampler:
    """Per-row sampling settings of one batch, as tensors `[B, 1]`, built once per batch."""

    def __init__(self, temperatures: list[float], top_ks: list[int], top_ps: list[float], greedy: list[bool]):
        self.greedy = torch.tensor(greedy, dtype=torch.bool)
        temps = [1.0 if g else float(t) for t, g in zip(temperatures, greedy)]
        if any(t <= 0 for t in temps):
            raise ValueError(f"temperature must be > 0 for non-greedy sampling, got {temperatures}")
        self.temperature = torch.tensor(temps, dtype=torch.float32).unsqueeze(-1)
        self.top_k = torch.tensor(top_ks, dtype=torch.long).unsqueeze(-1)
        self.top_p = torch.tensor(top_ps, dtype=torch.float32).unsqueeze(-1)
        self.all_greedy = bool(self.greedy.all())
        self.any_greedy = bool(self.greedy.any())
        self.needs_filter = bool((self.top_k > 0).any() or (self.top_p < 1.0).any())
        self.unit_temperature = bool((self.temperature == 1.0).all())

    def select(self, rows: torch.Tensor) -> "RowSampler":
        """Keep only `rows` (a LongTensor of indices) when finished rows are pruned."""
        out = object.__new__(RowSampler)
        out.greedy, out.temperature = self.greedy[rows], self.temperature[rows]
        out.top_k, out.top_p = self.top_k[rows], self.top_p[rows]
        out.all_greedy, out.any_greedy = bool(out.greedy.all()), bool(out.greedy.any())
        out.needs_filter = bool((out.top_k > 0).any() or (out.top_p < 1.0).any())
        out.unit_temperature = bool((out.temperature == 1.0).all())
        return out

    def __call__(self, logits: torch.Tensor, generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
        """logits `[B, V]` (float) -> (tokens `[B]` long, logprobs `[B]` float)."""
        logits = logits.float()
        scaled = logits if self.unit_temperature else logits / self.temperature
        logp = torch.log_softmax(scaled, dim=-1)
        if self.all_greedy:
            tokens = logp.argmax(dim=-1)
        else:
            draw_from = _filter_top_k_top_p(logp, self.top_k, self.top_p) if self.needs_filter else logp
            # Gumbel-max draws one token per row from softmax(draw_from) in one vectorised op.
            u = torch.rand(draw_from.shape, generator=generator).clamp_(min=1e-20)
            tokens = (draw_from - torch.log(-torch.log(u))).argmax(dim=-1)
            if self.any_greedy:
                tokens = torch.where(self.greedy, logp.argmax(dim=-1), tokens)
        return tokens, logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def _filter_top_k_top_p(logp: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Set to -inf every token outside each row's top-k and top-p nucleus. logp `[B, V]`."""
    sorted_logp, order = logp.sort(dim=-1, descending=True)
    vocab = logp.shape[-1]
    ranks = torch.arange(vocab).unsqueeze(0)
    k = torch.where(top_k > 0, top_k, torch.full_like(top_k, vocab))
    drop = ranks >= k
    probs = sorted_logp.exp()
    mass_before = probs.cumsum(dim=-1) - probs  # nucleus keeps a token while the mass before it < p
    drop |= mass_before >= top_p
    drop[:, 0] = False  # always keep the most likely token
    filtered_sorted = sorted_logp.masked_fill(drop, float("-inf"))
    return torch.full_like(logp, float("-inf")).scatter(-1, order, filtered_sorted)
