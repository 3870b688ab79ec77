"""The engine contract every rollout talks to: AReaL-style request/response plus versioning.

Workflows, envs and the algorithm only see these types, never which backend generated
the tokens (Transformers on CPU, vLLM on GPU).
"""
from __future__ import annotations

import dataclasses
import uuid
from typing import TYPE_CHECKING, Any, Mapping, Protocol, Sequence, runtime_checkable

if TYPE_CHECKING:
    from rayllm_rl.weight_sync.registry import SyncSpec


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


class PromptTooLongError(ValueError):
    """The prompt plus max_new_tokens does not fit the model's context window."""


def check_request(req: LLMRequest, max_positions: int) -> None:
    """Reject a malformed or over-long request with an error that names the problem."""
    if not req.input_ids:
        raise ValueError(f"request {req.rid}: empty input_ids")
    if not all(isinstance(t, int) for t in req.input_ids):
        bad = next(t for t in req.input_ids if not isinstance(t, int))
        raise TypeError(f"request {req.rid}: input_ids must be a list of int token ids, "
                        f"found {type(bad).__name__} {bad!r}")
    if req.sampling.max_new_tokens < 1:
        raise ValueError(f"request {req.rid}: max_new_tokens must be >= 1, got {req.sampling.max_new_tokens}")
    need = len(req.input_ids) + req.sampling.max_new_tokens
    if need > max_positions:
        raise PromptTooLongError(
            f"request {req.rid}: prompt of {len(req.input_ids)} tokens + max_new_tokens="
            f"{req.sampling.max_new_tokens} exceeds the model context of {max_positions}"
        )


@runtime_checkable
class InferenceEngine(Protocol):
    """The generation side an inference replica offers to rollouts. An engine holds its other parts:
    `weights` (its `WeightSink`) and `turns` (its `GenerationTurns`)."""

    weights: "WeightSink"
    turns: "GenerationTurns"

    @property
    def version(self) -> int:
        """Policy version of the weights that generate the next token."""
        ...

    async def start(self) -> "InferenceEngine":
        """Start serving, on the event loop that will serve requests (vLLM spawns its engine core)."""
        ...

    async def aclose(self) -> None:
        """Stop serving and release what the engine started (idempotent)."""
        ...

    async def agenerate(self, request: LLMRequest) -> LLMResponse:
        """Generate a completion for one request (many may run concurrently)."""
        ...


@runtime_checkable
class WeightSink(Protocol):
    """The weight side each engine owns, as `engine.weights` (TorchRL's RLvLLMEngine shape).

    Transports only move bytes; the sink decides where they land and how they become weights
    (a zero-copy swap for Transformers, `model.load_weights` inside vLLM's worker). Every update
    lands between two decode steps, and a token stamped v was sampled from exactly policy v.
    """

    def weight_metadata(self) -> list[tuple[str, tuple[int, ...], str]]:
        """`(HF name, full shape, dtype name)` of every weight an update may carry."""
        ...

    def receiving_processes(self, transport: str) -> int:
        """How many of this engine's processes receive over `transport` (each takes a rank)."""
        ...

    async def init_update_group(self, spec: SyncSpec) -> None:
        """Build this engine's receiving end(s) through the transport registry
        (`weight_sync.registry.build_receiver`); checks `spec.metas` against `weight_metadata`."""
        ...

    async def receive_weights(self, handoff: Any = None) -> dict[str, float]:
        """Receive the next version while generating (`handoff`: what the sender published, for a
        transport that pulls), then swap it in between decode steps; returns `{"version", "receive_s",
        "stall_s"}` (stall: time generation was held). The verbs of a hand-over: docs/weight-sync.md."""
        ...

    async def load_weights(self, named_tensors: Mapping[str, Any], version: int) -> int:
        """Load weights handed over directly, outside the double-buffered path (initial load, fallback);
        returns the new version."""
        ...

    async def weights_checksum(self) -> float:
        """Order-independent checksum of the engine's weights under their HF names."""
        ...

    async def close_update_group(self) -> None:
        """Leave the update group (idempotent)."""
        ...


@runtime_checkable
class GenerationTurns(Protocol):
    """`engine.turns`: when an engine generates: held for a moment (`pause`/`resume`), or put to sleep while a colocated
    learner trains on its GPU (`sleep`/`wake_up`, orchestration/ray/turns.py)."""

    @property
    def sleeping(self) -> bool:
        """Whether `sleep` put anything down that `wake_up` has not brought back (no generation then)."""
        ...

    async def pause(self) -> None:
        """Hold generation (running requests are kept and continue on resume)."""
        ...

    async def resume(self) -> None:
        """Let generation continue after `pause`."""
        ...

    async def sleep(self, level: int = 1) -> None:
        """Colocated placement, while the learner sharing the GPU trains: stop generating (requests wait)
        and free the GPU memory, keeping the weights in host memory (level 1) or dropping them (level 2:
        the next weight sync refills them). Idempotent; on a CPU engine it only holds generation."""
        ...

    async def wake_up(self, tags: Sequence[str] | None = None) -> None:
        """Undo `sleep` for `tags`: "weights" (before a weight sync writes them), "kv_cache" (generation
        resumes once both are up); None = both. Idempotent."""
        ...


def weights_checksum(named: Mapping[str, Any]) -> float:
    """Order-independent float64 checksum of a set of weights."""
    return float(sum(t.double().sum().item() + 1e-3 * t.double().abs().sum().item() for t in named.values()))
