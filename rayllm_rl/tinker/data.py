"""Tinker's data types <-> our batches and requests: the contract of `rayllm_rl.tinker` is Tinker's own types
(`Datum`, `ModelInput`, `TensorData`, `SamplingParams`, `AdamParams`, `SampleResponse`), so a loop moves between
the two unchanged.

- `to_batch(data)`: a list of `Datum` -> the learner's padded TensorDict `[N, T]` (learner/primitives.py), each
  datum checked (a malformed one raises ValueError naming its index and what is wrong), and the sampling mask the
  data carries (our extension: `sampling_top_k` / `sampling_top_p` inputs, what `sample` returns).
- `to_output(...)`: the per-datum logprobs back as Tinker's `ForwardBackwardOutput`.
- `to_requests` / `to_response`: a `sample` call as engine requests, and the engine's answers as Tinker's
  `SampleResponse` whose sequences also carry each token's policy version and the sampling mask.
"""
from __future__ import annotations

import dataclasses
import uuid
from typing import Any, Sequence

import numpy as np
import torch
from tensordict import TensorDict
from tinker import types as tt

from rayllm_rl.inference.protocol import LLMRequest, LLMResponse, SamplingParams
from rayllm_rl.sampling_mask import SamplingMask

MASK_KEYS = ("sampling_top_k", "sampling_top_p")
"""Our extension's loss inputs: the top-k / top-p a datum's tokens were sampled under (one value per datum, the
same for the whole batch), which the learner replays when it scores them (`rayllm_rl.sampling_mask`)."""


@dataclasses.dataclass(frozen=True)
class VersionedSequence(tt.SampledSequence):
    """Tinker's `SampledSequence` with our extension: the policy version that generated each token, and the
    sampling mask (`{"top_k", "top_p"}`) the learner replays when it trains on these tokens."""

    versions: list[int] = dataclasses.field(default_factory=list)
    sampling_mask: dict[str, Any] = dataclasses.field(default_factory=dict)


def sampling_mask_inputs(mask: dict[str, Any]) -> dict[str, tt.TensorData]:
    """The loss inputs that carry a sampled sequence's `sampling_mask` (`VersionedSequence.sampling_mask`) into
    `forward_backward`: `loss_fn_inputs={..., **sampling_mask_inputs(seq.sampling_mask)}`. Tinker's `Datum`
    takes keys it does not know as `TensorData` only."""
    return {"sampling_top_k": tt.TensorData(data=[int(mask["top_k"])], dtype="int64"),
            "sampling_top_p": tt.TensorData(data=[float(mask["top_p"])], dtype="float32")}


def _vector(datum_index: int, key: str, value: tt.TensorData, length: int) -> torch.Tensor:
    array = value.to_numpy() if isinstance(value, tt.TensorData) else np.asarray(value)
    if array.ndim != 1 or array.shape[0] != length:
        raise ValueError(f"datum {datum_index}: loss_fn_inputs[{key!r}] has shape {list(array.shape)}; it must be "
                         f"[{length}], one value per model_input token")
    if not np.isfinite(array).all():
        raise ValueError(f"datum {datum_index}: loss_fn_inputs[{key!r}] has non-finite values")
    return torch.from_numpy(np.ascontiguousarray(array))


def _sampling_mask(data: Sequence[tt.Datum]) -> SamplingMask:
    found = set()
    for d in data:
        k, p = (d.loss_fn_inputs.get(key) for key in MASK_KEYS)
        found.add((int(k.to_numpy().reshape(-1)[0]) if k is not None else 0,
                   float(f"{p.to_numpy().reshape(-1)[0]:.7g}") if p is not None else 1.0))  # float32 -> as sent
    if len(found) > 1:
        raise ValueError(f"the data carries different sampling masks {sorted(found)} (sampling_top_k, "
                         "sampling_top_p); send the data of each sampling setting in its own forward_backward")
    k, p = found.pop()
    return SamplingMask(max(k, 0), p)


def to_batch(data: Sequence[tt.Datum], vocab_size: int) -> tuple[TensorDict, SamplingMask]:
    """The learner's batch of `data` (right-padded to the longest datum) and the sampling mask it carries."""
    if not isinstance(data, (list, tuple)) or not data:
        raise ValueError(f"forward_backward needs a non-empty list of tinker.Datum, got {type(data).__name__}")
    rows, inputs = [], []
    for i, d in enumerate(data):
        if not isinstance(d, tt.Datum):
            raise ValueError(f"datum {i}: a {type(d).__name__}, not a tinker.Datum")
        try:
            tokens = d.model_input.to_ints()
        except ValueError as exc:
            raise ValueError(f"datum {i}: only token chunks are supported (no images here): {exc}") from None
        if not tokens:
            raise ValueError(f"datum {i}: empty model_input")
        if "target_tokens" not in d.loss_fn_inputs:
            raise ValueError(f"datum {i}: loss_fn_inputs has no 'target_tokens' (it has {sorted(d.loss_fn_inputs)})")
        targets = _vector(i, "target_tokens", d.loss_fn_inputs["target_tokens"], len(tokens)).long()
        for name, ids in (("model_input", torch.tensor(tokens)), ("target_tokens", targets)):
            if int(ids.min()) < 0 or int(ids.max()) >= vocab_size:
                raise ValueError(f"datum {i}: {name} has token ids outside the vocabulary [0, {vocab_size})")
        rows.append((torch.tensor(tokens, dtype=torch.long), targets))
        inputs.append({k: _vector(i, k, v, len(tokens)).float() for k, v in d.loss_fn_inputs.items()
                       if k != "target_tokens" and k not in MASK_KEYS})
    keys = set(inputs[0])
    if odd := next((i for i, x in enumerate(inputs) if set(x) != keys), None):
        raise ValueError(f"datum {odd} has loss_fn_inputs {sorted(inputs[odd])}, datum 0 has {sorted(keys)}: every "
                         "datum of a call must carry the same inputs")
    n, width = len(rows), max(len(t) for t, _ in rows)
    ids, targets = torch.zeros(n, width, dtype=torch.long), torch.zeros(n, width, dtype=torch.long)
    attention = torch.zeros(n, width, dtype=torch.long)
    extra = {k: torch.zeros(n, width) for k in keys}
    for i, ((tok, tgt), x) in enumerate(zip(rows, inputs)):
        ids[i, :len(tok)], targets[i, :len(tok)], attention[i, :len(tok)] = tok, tgt, 1
        for k, v in x.items():
            extra[k][i, :len(tok)] = v
    # `inputs` is batched over rows only, like the token keys beside it: the learner's micro-batches cut every
    # `[n, width]` leaf to their own longest row (`learner.logprobs.trim`), and a nested batch size of
    # [n, width] would refuse the shorter leaves.
    batch = TensorDict({"input_ids": ids, "attention_mask": attention, "target_tokens": targets,
                        "inputs": TensorDict(extra, batch_size=[n])}, batch_size=[n])
    return batch, _sampling_mask(data)


def to_output(logp: torch.Tensor, batch: TensorDict, metrics: dict[str, float]) -> tt.ForwardBackwardOutput:
    """Each datum's target logprobs (its own length) and the call's metrics, as Tinker returns them."""
    lengths = batch["attention_mask"].sum(-1).tolist()
    outputs = [{"logprobs": tt.TensorData.from_numpy(logp[i, :n].numpy().astype(np.float32))}
               for i, n in enumerate(lengths)]
    return tt.ForwardBackwardOutput(loss_fn_output_type="TensorData", loss_fn_outputs=outputs, metrics=dict(metrics))


def _stops(stop) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """Tinker's `stop` (None: EOS only; a string or strings; token ids) as (token ids, strings)."""
    if stop is None:
        return (), ()
    items = [stop] if isinstance(stop, str) else list(stop)
    if all(isinstance(s, int) and not isinstance(s, bool) for s in items):
        return tuple(items), ()
    if all(isinstance(s, str) for s in items):
        return (), tuple(items)
    raise ValueError(f"SamplingParams.stop must be strings or token ids, not a mix: {stop!r}")


def to_requests(prompt: tt.ModelInput, num_samples: int, params: tt.SamplingParams,
                max_new_tokens: int) -> tuple[list[LLMRequest], tuple[str, ...]]:
    """`num_samples` engine requests for `prompt` (one per sample: the engine batches them) and the string stops
    to cut the outputs at (`cut_at_stop`). Tinker's top_k -1 and our 0 both mean off; temperature 0 is greedy.
    `params.seed` is not honoured per request: each replica's sampler is seeded once (the job's seed + its
    index)."""
    if not isinstance(num_samples, int) or num_samples < 1:
        raise ValueError(f"num_samples must be an int >= 1, got {num_samples!r}")
    tokens = prompt.to_ints()
    if not tokens:
        raise ValueError("sample: empty prompt")
    ids, strings = _stops(params.stop)
    if params.temperature < 0 or not 0 < params.top_p <= 1:
        raise ValueError(f"sample: temperature must be >= 0 and top_p in (0, 1], got {params.temperature}, "
                         f"{params.top_p}")
    sampling = SamplingParams(max_new_tokens=params.max_tokens or max_new_tokens,
                              temperature=params.temperature if params.temperature > 0 else 1.0,
                              greedy=params.temperature == 0, top_p=params.top_p, top_k=max(params.top_k, 0),
                              stop_token_ids=ids, ignore_eos=params.stop is not None and not params.stop)
    rid = uuid.uuid4().hex
    return [LLMRequest(list(tokens), sampling, rid=f"{rid}-{i}") for i in range(num_samples)], strings


def cut_at_stop(response: LLMResponse, strings: tuple[str, ...], tokenizer) -> tuple[int, bool]:
    """How many of `response`'s tokens to keep so that the text stops right after the first stop string (all of
    them if none occurs), and whether one occurred. Generation ran on; the kept prefix is distributed exactly as if
    the engine had stopped there."""
    if not strings:
        return len(response.output_tokens), False
    tokens = response.output_tokens
    for n in range(1, len(tokens) + 1):  # the prefix decoded whole: a character may span tokens
        if any(s in tokenizer.decode(tokens[:n]) for s in strings):
            return n, True
    return len(response.output_tokens), False


def to_response(responses: list[LLMResponse], strings: tuple[str, ...], tokenizer,
                mask: SamplingMask) -> tt.SampleResponse:
    """Tinker's `SampleResponse` of the engine's answers (each cut after a string stop), every sequence a
    `VersionedSequence`."""
    out = []
    for r in responses:
        keep, stopped = cut_at_stop(r, strings, tokenizer)
        reason = "stop" if stopped or r.stop_reason == "stop" else "length"
        out.append(VersionedSequence(stop_reason=reason, sequence_id=r.rid,
                                     tokens_np=np.asarray(r.output_tokens[:keep], dtype=np.int32),
                                     logprobs_np=np.asarray(r.output_logprobs[:keep], dtype=np.float32),
                                     versions=list(r.output_versions[:keep]),
                                     sampling_mask={"top_k": mask.top_k, "top_p": mask.top_p}))
    return tt.SampleResponse(sequences=out)
