"""What the `rayllm-rl serve` app holds between requests, and the helpers its endpoints share.

`State` keeps the service (our TinkerService: the job's learner and replicas for one base model), the sessions,
models and samplers the SDK created, the futures store and the on-disk registry. `Refused` is how an endpoint turns
a request away: a 4xx JSON body `{"error": ..., "endpoint": ...}` with `x-should-retry: false`; the SDK raises it
as an `APIStatusError` whose message carries the body (`_base_client.py: _make_status_error_from_response`), and
neither its HTTP client nor `execute_with_retries` retries a 4xx other than 408/409/429
(`internal_client_holder.py: _is_retryable_status_code`), so a refusal surfaces at once.
"""
from __future__ import annotations

import asyncio
import dataclasses
from typing import Any, Callable

from starlette.requests import Request
from starlette.responses import JSONResponse

from rayllm_rl.tinker.server.futures import FutureStore, settle
from rayllm_rl.tinker.server.order import SeqOrder
from rayllm_rl.tinker.server.registry import Registry
from rayllm_rl.tinker.server.timings import Timings

SUPPORTED_SDK = ">=0.38,<0.39"
"""The SDK versions whose wire protocol this server speaks (read from tinker 0.38.0's source)."""

ApiKeyCheck = Callable[[str | None], str | None]
"""The server's API key rule: given the request's `X-API-Key` (None when absent), why it is refused, or None."""


def accept_tml_keys(key: str | None) -> str | None:
    """Any key of the SDK's own form (`tml-...`): the default when the server was given no key."""
    if not key:
        return "no X-API-Key header; send a key that starts with 'tml-' (api_key= or TINKER_API_KEY)"
    if not key.startswith("tml-"):
        return "the X-API-Key does not start with 'tml-'"
    return None


def expect_key(expected: str) -> ApiKeyCheck:
    """Exactly `expected` (given with --api-key or TINKER_API_KEY when the server started)."""
    if not expected.startswith("tml-"):
        raise ValueError("the server's API key must start with 'tml-' (the SDK sends no other kind)")

    def check(key: str | None) -> str | None:
        if key == expected:
            return None
        return "no X-API-Key header" if not key else "the X-API-Key is not the key this server was started with"
    return check


class Refused(Exception):
    """An endpoint's refusal: `status` (4xx) and a message that names what was wrong."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status
        self.message = message


def refusal(status: int, message: str, endpoint: str) -> JSONResponse:
    return JSONResponse({"error": message, "endpoint": endpoint}, status_code=status,
                        headers={"x-should-retry": "false"})


async def parse(request: Request, model: type) -> Any:
    """The JSON body as the SDK's own request type (`tinker.types.*Request`, pydantic models); 400 naming the
    field otherwise."""
    try:
        body = await request.json()
    except ValueError as error:
        raise Refused(400, f"the body of {request.url.path} is not JSON: {error}") from None
    try:
        return model.model_validate(body)
    except ValueError as error:  # pydantic's ValidationError
        problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'body'}: {e['msg']}" for e in error.errors()) \
            if hasattr(error, "errors") else str(error)
        raise Refused(400, f"the body of {request.url.path} is not a {model.__name__}: {problems}") from None


def to_json(value: Any) -> Any:
    """A result of the service as JSON: pydantic models dumped as the SDK dumps them, dataclasses as dicts."""
    if hasattr(value, "model_dump"):  # a pydantic model (tinker's response types)
        return value.model_dump(mode="json", exclude_none=True)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    return value


@dataclasses.dataclass
class ProtoResult:
    """A finished result the SDK reads as protobuf (`proto`), and as JSON for anyone who does not ask for it."""

    proto: bytes
    to_json: Callable[[], dict]


@dataclasses.dataclass
class Model:
    """A training model the SDK created (`{session_id}:train:{model_seq_id}`): our TrainingClient once made."""

    model_id: str
    session_id: str
    base_model: str
    lora_rank: int
    order: SeqOrder
    create_request_id: str
    client: Any = None
    run_id: str | None = None
    failed: bool = False


@dataclasses.dataclass
class Sampler:
    """A sampling session (`{session_id}:sample:{seq}`): our SamplingClient for one saved set of weights."""

    sampler_id: str
    client: Any
    model_path: str | None
    base_model: str


@dataclasses.dataclass
class Options:
    """The server's bounds. `poll_s`: the retrieve_future long poll (under the SDK's 45 s read timeout);
    `op_timeout_s`: one service call; `gap_timeout_s`: how long requests wait for a missing seq_id;
    `fwdbwd_max_chunk_len`: datums per forward_backward request the SDK is told to send."""

    poll_s: float = 25.0
    op_timeout_s: float = 900.0
    gap_timeout_s: float = 60.0
    fwdbwd_max_chunk_len: int = 1024


class State:
    """Everything the endpoints share; one per app."""

    def __init__(self, service: Any, registry: Registry, api_key_check: ApiKeyCheck, options: Options):
        self.service = service
        self.registry = registry
        self.api_key_check = api_key_check
        self.options = options
        self.store = FutureStore()
        self.sessions: dict[str, dict] = {}
        self.models: dict[str, Model] = {}
        self.samplers: dict[str, Sampler] = {}
        self.timings = Timings()

    @property
    def base_model(self) -> str:
        return self.service.base_model

    def session(self, session_id: str) -> dict:
        """A live session of this server; 404 for one it never made (it restarted?), 400 once finished."""
        session = self.sessions.get(session_id)
        if session is None:
            raise Refused(404, f"unknown session {session_id!r}: this server did not create it (was the server "
                          "restarted? create a new ServiceClient)")
        if session.get("finished"):
            raise Refused(400, f"session {session_id!r} was finished ({session['finished']}); create a new "
                          "ServiceClient")
        return session

    def model(self, model_id: str) -> Model:
        model = self.models.get(model_id)
        if model is None:
            known = ", ".join(self.models) or "none"
            raise Refused(404, f"unknown model_id {model_id!r} (this server's models: {known})")
        return model

    def sampler(self, sampler_id: str) -> Sampler:
        sampler = self.samplers.get(sampler_id)
        if sampler is None:
            raise Refused(404, f"unknown sampling_session_id {sampler_id!r}: create it with "
                          "create_sampling_client(model_path=...) or save_weights_and_get_sampling_client()")
        return sampler

    async def call(self, what: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """A blocking service call in a worker thread, bounded by `op_timeout_s`; timed as service time `what`."""
        with self.timings.in_service(what):
            return await settle(asyncio.to_thread(fn, *args, **kwargs), self.options.op_timeout_s, what)

    async def settle(self, value: Any, what: str) -> Any:
        """The result of a service call that was already started (a future), bounded by `op_timeout_s`; timed as
        service time `what` from here on."""
        with self.timings.in_service(what):
            return await settle(value, self.options.op_timeout_s, what)
