"""LLMPolicy: the TorchRL-style wrapper (TorchRL's LLM API contract) over any `InferenceEngine`.

Reads the env's prompt in its `input_mode` and writes `prompt`, `response` AND `full`, so
`ChatEnv.step` can make `full` the next prompt. With `prefer_tokens=True` a pre-tokenized
`("tokens", "prompt")` (IncrementalTokenizer) is sent as is: the past is never re-tokenized.

Keys written per element (ragged, batch `[]`):
  ("tokens", "prompt"|"response"|"full")  int64 [L]   - always (the exact engine tokens)
  ("log_probs", "response")                float32 [R] - sampled-token logprobs
  ("versions", "response")                 int64 [R]   - policy version of each token
  "stop_reason"                            str         - "stop" | "length" | "abort" (the engine's)
  history mode: ("history",) ChatHistory with prompt, response (assistant History[1]), full
  text mode:    ("text", "prompt"|"response"|"full") str
`response_of(elem)` reads them back as the engine's `LLMResponse` (for `TrajectoryBuilder`).
"""
from __future__ import annotations

import asyncio
from typing import Sequence

import torch
from tensordict import TensorDictBase

from rayllm_rl.data.history import ChatHistory, History
from rayllm_rl.inference.protocol import InferenceEngine, LLMRequest, LLMResponse, SamplingParams

INPUT_MODES = ("history", "text", "tokens")


def _has(td: TensorDictBase, key) -> bool:
    try:
        return td.get(key, None) is not None
    except (KeyError, AttributeError):
        return False


class LLMPolicy:
    """Generate one assistant turn for every element of an env TensorDict."""

    def __init__(self, engine: InferenceEngine, tokenizer, *, input_mode: str = "history",
                 prefer_tokens: bool = True, sampling: SamplingParams | None = None):
        if input_mode not in INPUT_MODES:
            raise ValueError(f"input_mode must be one of {INPUT_MODES}, got {input_mode!r}")
        self.engine = engine
        self.tokenizer = tokenizer
        self.input_mode = input_mode
        self.prefer_tokens = prefer_tokens
        self.sampling = sampling or SamplingParams()

    def prompt_ids(self, elem: TensorDictBase) -> list[int]:
        """Token ids to send for one element, per input mode and `prefer_tokens`."""
        if self.input_mode == "tokens" or (self.prefer_tokens and _has(elem, ("tokens", "prompt"))):
            if not _has(elem, ("tokens", "prompt")):
                raise KeyError("LLMPolicy(input_mode='tokens') needs ('tokens', 'prompt') in the input")
            return [int(t) for t in elem["tokens", "prompt"].tolist()]
        if self.input_mode == "history":
            if not _has(elem, ("history", "prompt")):
                raise KeyError("LLMPolicy(input_mode='history') needs ('history', 'prompt') in the input")
            text = elem["history", "prompt"].apply_chat_template(self.tokenizer, add_generation_prompt=True)
        else:
            if not _has(elem, ("text", "prompt")):
                raise KeyError("LLMPolicy(input_mode='text') needs ('text', 'prompt') in the input")
            text = elem["text", "prompt"]
        return list(self.tokenizer.encode(str(text), add_special_tokens=False))

    async def __call__(self, td: TensorDictBase, rids: Sequence[str] | None = None) -> TensorDictBase:
        """Fill the policy outputs in place (all elements generated concurrently) and return `td`.

        `rids`: one request id per element; give every turn of a conversation the same id (a
        router sends it back to the same replica, for KV/prefix reuse). None: a fresh id per request.
        """
        elems = td.unbind(0)
        if rids is not None and len(rids) != len(elems):
            raise ValueError(f"LLMPolicy got {len(rids)} rids for {len(elems)} elements")
        requests = [LLMRequest(input_ids=self.prompt_ids(e), sampling=self.sampling) for e in elems]
        for req, rid in zip(requests, rids or ()):
            req.rid = rid
        responses = await asyncio.gather(*[self.engine.agenerate(req) for req in requests])
        for elem, resp in zip(elems, responses):
            self._write(elem, resp)
        return td

    def _write(self, elem: TensorDictBase, resp: LLMResponse) -> None:
        out = resp.output_tokens
        elem["tokens", "prompt"] = torch.tensor(resp.input_tokens, dtype=torch.long)
        elem["tokens", "response"] = torch.tensor(out, dtype=torch.long)
        elem["tokens", "full"] = torch.tensor(resp.input_tokens + out, dtype=torch.long)
        elem["log_probs", "response"] = torch.tensor(resp.output_logprobs, dtype=torch.float32)
        elem["versions", "response"] = torch.tensor(resp.output_versions, dtype=torch.long)
        elem["stop_reason"] = resp.stop_reason
        if self.input_mode == "text":
            response_text = self.tokenizer.decode(out)
            elem["text", "response"] = response_text
            elem["text", "full"] = elem["text", "prompt"] + response_text
        elif self.input_mode == "history":
            complete = resp.stop_reason == "stop"
            body = out[:-1] if complete and out and out[-1] in getattr(self.engine, "eos_token_ids", ()) else out
            content = self.tokenizer.decode(body, skip_special_tokens=True)
            response = History.from_messages(["assistant"], [content], [complete])
            prompt = elem["history", "prompt"]
            elem["history"] = ChatHistory(prompt=prompt, response=response, full=prompt.extend(response))


def response_of(elem: TensorDictBase) -> LLMResponse:
    """The engine's answer that `LLMPolicy` wrote into one element, as an `LLMResponse`.

    Tokens, logprobs (float32, as written) and versions are those of the engine call, so
    `TrajectoryBuilder.add_prompt(r.input_tokens)` + `add_generated(r)` records exactly what the
    engine saw and produced.
    """
    return LLMResponse(
        input_tokens=elem["tokens", "prompt"].tolist(),
        output_tokens=elem["tokens", "response"].tolist(),
        output_logprobs=elem["log_probs", "response"].tolist(),
        output_versions=elem["versions", "response"].tolist(),
        stop_reason=elem["stop_reason"],
    )
