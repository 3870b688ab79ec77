"""The pieces of a batched decode loop (`TransformersEngine`'s): per-row sampling (`RowSampler`), the lock between
decode steps and weight writers (`DecodeLock`), one batch's decoding state (`DecodeBatch`) and the counters.

`RowSampler` samples each row with its own temperature, top-k, top-p or greedy. Its returned logprobs are those
of the distribution the token was drawn from, as vLLM's `processed_logprobs`: log-softmax of `logits / temperature`
(temperature 1 for greedy rows) over the kept set of top-k / top-p (vLLM's rule, `rayllm_rl.sampling_mask`), which
the learner rebuilds when it scores the token (sampling-mask replay, docs/algorithms.md).
"""
from __future__ import annotations

import dataclasses
import threading
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Iterator

import torch

from rayllm_rl.sampling_mask import kept_set, kept_weights

if TYPE_CHECKING:
    from rayllm_rl.inference.protocol import LLMRequest


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


@dataclasses.dataclass
class EngineStats:
    """Counters for throughput reporting."""

    requests: int = 0
    batches: int = 0
    generated_tokens: int = 0
    decode_steps: int = 0
    busy_seconds: float = 0.0
    cache_rebuilds: int = 0
    sleeps: int = 0
    last_sleep_s: float = 0.0
    """Seconds the last `sleep` took (waiting for the running step, weights off the GPU, cache freed)."""
    last_wake_s: float = 0.0
    """Seconds the last `wake_up` that brought weights back took."""


class DecodeLock:
    """The lock between decode steps and weight writers, fair to the writers.

    The decode loop takes the lock again microseconds after releasing it, and a plain Lock
    is not fair, so a writer could wait out a whole generation. Here a waiting writer holds
    the gate, and the next decode step waits at the gate until the writer is done."""

    def __init__(self):
        self._lock = threading.Lock()
        self._gate = threading.Lock()

    @contextmanager
    def decode_step(self) -> Iterator[None]:
        with self._gate:  # a writer holding the gate goes first
            pass
        with self._lock:
            yield

    def acquire_for_writer(self) -> None:
        """Block until the running decode step ends; the next one waits for `release`."""
        with self._gate:
            self._lock.acquire()

    def release(self) -> None:
        self._lock.release()

    @contextmanager
    def writer(self) -> Iterator[None]:
        self.acquire_for_writer()
        try:
            yield
        finally:
            self.release()


@dataclasses.dataclass
class DecodeBatch:
    """One batch's decoding state; it outlives a sleep (the KV cache is dropped, then re-prefilled)."""

    requests: list[LLMRequest]
    sampler: RowSampler
    stops: list[frozenset]
    budget: list[int]
    attn: torch.Tensor
    """`[rows, T]` 1 at real tokens (0 at left padding), T = tokens fed so far + the one about to be fed."""
    full_ids: torch.Tensor
    """`[rows, T]` every token fed so far plus the one about to be fed."""
    t0: float
    active: list[int] = dataclasses.field(default_factory=list)
    """Original row index of each row still in the batch."""
    out_tok: list[list[int]] = dataclasses.field(default_factory=list)
    out_lp: list[list[float]] = dataclasses.field(default_factory=list)
    out_ver: list[list[int]] = dataclasses.field(default_factory=list)
    reason: list[str] = dataclasses.field(default_factory=list)
    cache: Any = None
    """The KV cache, or None: the next step prefills `full_ids` into a new one."""
    cache_version: int | None = None
    step_ids: torch.Tensor | None = None
    step_pos: torch.Tensor | None = None
