"""LLMPolicy: the TorchRL-style wrapper (TorchRL's LLM API contract) over any `InferenceEngine`.

Reads the env's prompt in its `input_mode` and writes `prompt`, `response` AND `full`, so
`ChatEnv.step` can make `full` the next prompt. With `prefer_tokens=True` a pre-tokenized
`("tokens", "prompt")` (IncrementalTokenizer) is sent as is: the past is never re-tokenized.

Keys written per element (ragged, batch `[]`):
  ("tokens", "prompt"|"response"|"full")  int64 [L]   - always (the exact engine tokens)
  ("log_probs", "response")                float32 [R] - sampled-token logprobs
  ("versions", "response")                 int64 [R]   - policy version of each token
  history mode: ("history",) ChatHistory with prompt, response (assistant History[1]), full
  text mode:    ("text", "prompt"|"response"|"full") str
"""
from __future__ import annotations

import asyncio

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

    async def __call__(self, td: TensorDictBase) -> TensorDictBase:
        """Fill the policy outputs in place (all elements generated concurrently) and return `td`."""
        elems = td.unbind(0)
        ids = [self.prompt_ids(e) for e in elems]
        responses = await asyncio.gather(*[
            self.engine.agenerate(LLMRequest(input_ids=p, sampling=self.sampling)) for p in ids
        ])
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
