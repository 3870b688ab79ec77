"""The engine contract every rollout talks to: AReaL-style request/response plus versioning.

Workflows, envs and the algorithm only see these types, never which backend generated
the tokens (Transformers on CPU, vLLM on GPU).
"""
from __future__ import annotations

import dataclasses
import uuid
from typing import Any, Mapping, Protocol, runtime_checkable


@dataclasses.dataclass
class SamplingParams:
    """Per-request sampling settings (AReaL's GenerationHyperparameters)."""

    max_new_tokens: int = 64
    """Upper bound on generated tokens for this request."""
    temperature: float = 1.0
    """Softmax temperature; returned logprobs are of the tempered distribution."""
    top_p: float = 1.0
    """Nucleus sampling mass; 1.0 disables it."""
    top_k: int = 0
    """Keep only the k most likely tokens; 0 disables it."""
    greedy: bool = False
    """Argmax decoding (logprobs then refer to temperature 1)."""
    stop_token_ids: tuple[int, ...] = ()
    """Extra token ids that end generation (the engine also stops on its eos ids)."""
    ignore_eos: bool = False
    """Keep generating past eos until max_new_tokens (benchmarks, exact-length tests)."""

    def new(self, **kw: Any) -> "SamplingParams":
        """A copy with some fields replaced."""
        return dataclasses.replace(self, **kw)


@dataclasses.dataclass
class LLMRequest:
    """One generation request: a prompt as token ids. Same `rid` => same conversation."""

    input_ids: list[int]
    sampling: SamplingParams = dataclasses.field(default_factory=SamplingParams)
    rid: str = dataclasses.field(default_factory=lambda: uuid.uuid4().hex)
    metadata: dict[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class LLMResponse:
    """What the engine generated for one request.

    `output_logprobs[i]` is log pi(output_tokens[i] | prefix) under the engine's weights at
    version `output_versions[i]` (tempered by the request's temperature unless greedy).
    """

    input_tokens: list[int]
    output_tokens: list[int]
    output_logprobs: list[float]
    output_versions: list[int]
    stop_reason: str  # "stop" (eos / stop token) | "length" (max_new_tokens) | "abort"
    rid: str = ""
    latency_s: float = 0.0

    @property
    def output_len(self) -> int:
        return len(self.output_tokens)

    @property
    def input_len(self) -> int:
        return len(self.input_tokens)


@runtime_checkable
class InferenceEngine(Protocol):
    """What an inference replica offers to rollouts and to weight sync."""

    @property
    def version(self) -> int:
        """Policy version of the weights that generate the next token."""
        ...

    async def agenerate(self, request: LLMRequest) -> LLMResponse:
        """Generate a completion for one request (many may run concurrently)."""
        ...

    def update_weights(self, named_tensors: Mapping[str, Any], version: int | None = None) -> int:
        """Load new weights between decode steps; returns the new version."""
        ...
