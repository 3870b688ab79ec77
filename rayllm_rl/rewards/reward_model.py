"""A sequence-classification reward model that batches concurrent score requests into one forward.

`RewardModelScorer` loads any `AutoModelForSequenceClassification` with one output (num_labels=1)
through `from_pretrained` and scores (prompt, completion) pairs: the conversation is the row's
`messages` plus the completion as the assistant's turn, in the RM tokenizer's chat template (else
prompt text + completion). Requests from any thread or event loop queue up; one batching thread
takes up to `batch_size` of them (waiting at most `batch_wait_s` after the first) and runs one
right-padded forward, so a batched score equals an unbatched one. The `reward-model-<i>` Ray actor
is a thin shell over this class; the local backend uses it in process.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import queue
import threading
import time
from typing import Any, Mapping, Sequence

import torch

log = logging.getLogger(__name__)


class RewardModelOutputError(RuntimeError):
    """The reward model's forward gave something other than one logit per sequence (`[B, 1]`)."""


def rm_sample(prompt: str, completion: str, row: Mapping[str, Any]) -> dict[str, Any]:
    """What a reward model needs of one scored completion (small, sent to the actors as is)."""
    messages = row.get("messages")
    return {"prompt": prompt, "completion": completion,
            "messages": [dict(m) for m in messages] if isinstance(messages, list) else None}


@dataclasses.dataclass
class ScorerStats:
    forwards: int = 0
    """Forward passes run (each scores one batch)."""
    scored: int = 0
    """Sequences scored."""
    largest_batch: int = 0
    """Most sequences in one forward."""


@dataclasses.dataclass(frozen=True)
class RewardModelSpec:
    """What a reward model's scorer is built from, the same in both backends: the job plan makes it
    (`JobPlan.reward_model_spec`), a `reward-model-<i>` actor or the local backend calls `build()`."""

    path: str
    """A local directory or a hub id (resolved on the node that builds)."""
    batch_size: int = 32
    batch_wait_s: float = 0.005
    max_length: int = 0
    activation: str = "identity"
    dtype: str = "float32"

    def build(self, device: str = "cpu") -> "RewardModelScorer":
        from rayllm_rl.hub import resolve_model_path

        return RewardModelScorer(resolve_model_path(self.path), batch_size=self.batch_size,
                                 batch_wait_s=self.batch_wait_s, max_length=self.max_length,
                                 activation=self.activation, device=device, dtype=getattr(torch, self.dtype))


_STOP = object()


class RewardModelScorer:
    """Scores completions with a sequence-classification RM; concurrent requests share forwards."""

    def __init__(self, path: str, *, batch_size: int = 32, batch_wait_s: float = 0.005, max_length: int = 0,
                 activation: str = "identity", device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
                 model: torch.nn.Module | None = None):
        """`path`: a local model directory (tokenizer and, unless `model` is given, weights); `model`: a
        module to use instead of the one at `path` (a test's stand-in for a failing RM)."""
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        if activation not in ("identity", "sigmoid"):
            raise ValueError(f"reward.model.activation must be 'identity' or 'sigmoid', got {activation!r}")
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.tokenizer.padding_side = "right"  # positions as unbatched; the head pools the last non-pad token
        self.tokenizer.truncation_side = "left"  # a long conversation keeps its end: the completion
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        if model is None:
            model = AutoModelForSequenceClassification.from_pretrained(path, dtype=dtype)
            if model.config.num_labels != 1:
                raise ValueError(f"reward model {path}: num_labels={model.config.num_labels}; a reward model has one "
                                 "output per sequence (num_labels=1)")
        if getattr(model.config, "pad_token_id", None) is None:  # the head finds the last token through it
            model.config.pad_token_id = self.tokenizer.pad_token_id
        self.device = torch.device(device)
        self.model = model.to(self.device).eval().requires_grad_(False)
        self.max_length = max_length or int(getattr(model.config, "max_position_embeddings", 0) or 1 << 20)
        self.batch_size, self.batch_wait_s, self.activation = batch_size, batch_wait_s, activation
        self.stats = ScorerStats()
        self._queue: queue.Queue = queue.Queue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._closed = False

    # ------------------------------------------------------------------ one forward
    def text(self, sample: Mapping[str, Any]) -> str:
        """The conversation the RM reads: the row's messages + the completion as the assistant's turn
        (the RM tokenizer's chat template), else the prompt text followed by the completion."""
        if sample.get("messages") and self.tokenizer.chat_template:
            turns = [*sample["messages"], {"role": "assistant", "content": sample["completion"]}]
            return self.tokenizer.apply_chat_template(turns, tokenize=False)
        return f"{sample['prompt']}{sample['completion']}"

    def forward(self, texts: Sequence[str]) -> list[float]:
        """One forward over `texts` (right-padded `[B, T]`): the score of each, NaN passed through.
        RewardModelOutputError if the logits are not `[B, 1]`."""
        enc = self.tokenizer(list(texts), padding=True, truncation=True, max_length=self.max_length,
                             return_tensors="pt").to(self.device)
        with torch.inference_mode():
            logits = self.model(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"]).logits
        if not isinstance(logits, torch.Tensor) or tuple(logits.shape) != (len(texts), 1):
            shape = tuple(logits.shape) if isinstance(logits, torch.Tensor) else type(logits).__name__
            raise RewardModelOutputError(f"reward model gave logits of shape {shape} for {len(texts)} sequences; "
                                         f"expected ({len(texts)}, 1)")
        scores = logits[:, 0].float()
        if self.activation == "sigmoid":
            scores = torch.sigmoid(scores)
        with self._lock:
            self.stats.forwards += 1
            self.stats.scored += len(texts)
            self.stats.largest_batch = max(self.stats.largest_batch, len(texts))
        return scores.cpu().tolist()

    # ------------------------------------------------------------------ batched requests
    def submit(self, samples: Sequence[Mapping[str, Any]]) -> list[concurrent.futures.Future]:
        """Queue `samples`; each future gets its score (or the error of its batch's forward)."""
        with self._lock:
            if self._closed:
                raise RuntimeError("the reward model scorer is closed")
            if self._thread is None:
                self._thread = threading.Thread(target=self._serve, name="reward-model-batcher", daemon=True)
                self._thread.start()
        futures = []
        for sample in samples:
            fut: concurrent.futures.Future = concurrent.futures.Future()
            try:
                self._queue.put((self.text(sample), fut))
            except Exception as exc:  # noqa: BLE001 - a sample the template cannot render fails alone
                fut.set_exception(exc)
            futures.append(fut)
        return futures

    async def ascore(self, samples: Sequence[Mapping[str, Any]], timeout_s: float | None = None) -> list[float]:
        """The scores of `samples` (from any event loop), batched with whatever else is queued."""
        waits = [asyncio.wrap_future(f) for f in self.submit(samples)]
        return list(await asyncio.wait_for(asyncio.gather(*waits), timeout_s))

    async def score(self, prompt: str, completion: str, row: Mapping[str, Any]) -> float:
        """One completion's score (the part interface of `rewards.combined.CombinedReward`)."""
        return (await self.ascore([rm_sample(prompt, completion, row)]))[0]

    def _serve(self) -> None:
        while True:
            first = self._queue.get()  # idle until a request (or close) arrives
            if first is _STOP:
                return
            batch, deadline = [first], time.monotonic() + self.batch_wait_s
            while len(batch) < self.batch_size:
                left = deadline - time.monotonic()
                try:  # what arrives until batch_wait_s has passed, then what is queued already
                    item = self._queue.get(timeout=left) if left > 0 else self._queue.get_nowait()
                except queue.Empty:
                    break
                if item is _STOP:
                    self._queue.put(_STOP)  # served after this batch
                    break
                batch.append(item)
            self._run(batch)

    def _run(self, batch: list[tuple[str, concurrent.futures.Future]]) -> None:
        live = [(text, fut) for text, fut in batch if fut.set_running_or_notify_cancel()]
        if not live:
            return
        try:
            scores = self.forward([text for text, _ in live])
        except Exception as exc:  # noqa: BLE001 - one bad batch fails its callers, not the scorer
            log.warning("reward model forward of %d sequences failed: %s: %s", len(live), type(exc).__name__, exc)
            for _, fut in live:
                fut.set_exception(exc)
            return
        for (_, fut), value in zip(live, scores):
            fut.set_result(value)

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop the batching thread after the queued requests (bounded); idempotent."""
        with self._lock:
            self._closed, thread = True, self._thread
        if thread is not None:
            self._queue.put(_STOP)
            thread.join(timeout_s)
