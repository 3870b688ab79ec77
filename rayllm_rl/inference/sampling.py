"""Vectorised per-row sampling for a decode step: temperature, top-k, top-p, greedy.

Returned logprobs are those of the distribution the token was drawn from, as vLLM's
`processed_logprobs`: log-softmax of `logits / temperature` (temperature 1 for greedy rows) over
the kept set of top-k / top-p (vLLM's rule, `rayllm_rl.sampling_mask`), which the learner rebuilds
when it scores the token (sampling-mask replay, docs/algorithms.md).
"""
from __future__ import annotations

import torch

from rayllm_rl.sampling_mask import kept_set, kept_weights


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
            return tokens, logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
        draw_from = logp
        if self.needs_filter:  # the kept set's renormalised distribution (-inf outside), vLLM's rule
            n, v, log_kept = kept_set(scaled, self.top_k.squeeze(-1), self.top_p.squeeze(-1))
            draw_from = torch.log_softmax(scaled + kept_weights(scaled, n, v).log(), dim=-1)
        # Gumbel-max draws one token per row from softmax(draw_from) in one vectorised op.
        u = torch.rand(draw_from.shape, generator=generator).clamp_(min=1e-20)
        tokens = (draw_from - torch.log(-torch.log(u))).argmax(dim=-1)
        if self.needs_filter:  # z_t - logsumexp of the n largest: a drawn token is kept (tied at the edge too)
            logprobs = scaled.gather(-1, tokens.unsqueeze(-1)).squeeze(-1) - log_kept
        else:
            logprobs = logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
        if self.any_greedy:
            greedy_tokens = logp.argmax(dim=-1)
            tokens = torch.where(self.greedy, greedy_tokens, tokens)
            logprobs = torch.where(self.greedy, logp.gather(-1, greedy_tokens.unsqueeze(-1)).squeeze(-1), logprobs)
        return tokens, logprobs
