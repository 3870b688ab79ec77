"""`rayllm-rl serve`'s ASGI app: Tinker's HTTP API in front of a TinkerService, for the unmodified SDK 0.38.

`make_app(service, api_key_check=...)` builds a plain Starlette app (no Ray Serve: it runs on the driver beside the
job's roles; `main.py` runs it under uvicorn). The endpoints are every one the 0.38 SDK calls on its default
paths (docs/tinker-api.md lists them with the SDK lines they follow):

* handshake and session: `client/config` (the feature flags, chosen so the SDK takes its plainest paths, see
  `CLIENT_CONFIG`), `client/dynamic_config`, `create_session`, `session_heartbeat`, `sessions/{id}/finish`,
  `telemetry` (accepted and dropped);
* futures: `retrieve_future`, a long poll bounded by `Options.poll_s`;
* training (`training.py`) and sampling (`sampling.py`);
* REST: `training_runs/{id}`, its `checkpoints` and their DELETE, `weights_info`, `get_server_capabilities`,
  `healthz` (the registry, `registry.py`, answers them);
* ours: `GET rayllm/timings`, where the server's time went (HTTP handling and encoding against the time inside
  the service, `timings.py`).

Anything else answers 404 with a JSON body naming the method and path; a 404 is not retried by the SDK, which
raises it with the body in its message. Every request under /api/ except `healthz` must carry an accepted
`X-API-Key` (401 otherwise) and, when it says its SDK version (`X-Stainless-Package-Version`, set on every request
by the SDK's `_base_client.platform_headers`), one in `SUPPORTED_SDK` (400 otherwise, naming the range).
"""
from __future__ import annotations

import contextlib
import logging
import re
import uuid
from pathlib import Path
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from tinker import types

from rayllm_rl.tinker.server import sampling as server_sampling, training as server_training, wire
from rayllm_rl.tinker.server.registry import Registry, parse_path, public_checkpoint
from rayllm_rl.tinker.server.state import (SUPPORTED_SDK, ApiKeyCheck, Options, ProtoResult, Refused, State,
                                           accept_tml_keys, parse, refusal, to_json)
from rayllm_rl.tinker.server.timings import TimingMiddleware

logger = logging.getLogger(__name__)

CLIENT_CONFIG: dict[str, Any] = {
    "pjwt_auth_enabled": False,  # API keys only: no JWT exchange (/api/v1/auth/token)
    "credential_default_source": "api_key",
    "use_pyqwest_transport": False,  # httpx's own transport: no Rust client between the SDK and a local server
    "proto_compress_fwdbwd": False,  # plain protobuf bodies on loopback (zstd is still decoded when sent)
    "parallel_fwdbwd_chunks": True,  # the SDK's default; SeqOrder puts the chunks back in seq_id order
    "sample_use_retrieve_futures": False,  # one retrieve_future long poll per request, no session-wide poller
    "custom_loss_server_side": False,  # forward_backward_custom runs its loss in the client (cross_entropy here)
    "sample_join_sampling_session": False,  # no join_sampling_session round trip for unpickled clients
    "sample_no_retries": False,
    "sample_enable_stuck_detection": True,
}
"""`ClientConfigResponse` flags for every client (`tinker/types/client_config_response.py`); create-via-load_weights
is unconditional in 0.38, so there is no flag for it. `fwdbwd_max_chunk_len` comes from `Options`."""

DYNAMIC_CONFIG = {"refresh_interval_sec": 300, "sample_cancel_enabled": False, "sample_cancel_max_batch_size": 64}
"""`ClientDynamicConfigResponse`: no cancel_future requests (a sample runs to its end)."""


def sdk_version_problem(version: str | None) -> str | None:
    """Why this SDK version cannot talk to the server, or None (also for a client that does not say)."""
    if not version:
        return None
    if re.fullmatch(r"0\.38(\.\d+)?((a|b|rc|\.?post|\.?dev)\d*)*(\+[0-9A-Za-z.]+)?", version.strip()):  # PEP 440
        return None
    return (f"rayllm-rl serve speaks the wire protocol of tinker{SUPPORTED_SDK}; this client is tinker {version} "
            f"(pip install 'tinker{SUPPORTED_SDK}')")


def refuse_unsupported_sdk(version: str | None) -> None:
    """`Refused` (400) naming the supported range for a version a request body gives (the header is `_Gate`'s)."""
    problem = sdk_version_problem(version)
    if problem is not None:
        raise Refused(400, problem)


class _Gate:
    """ASGI middleware: the API key and SDK version of every /api/ request but healthz, checked before routing."""

    def __init__(self, app, state: State):
        self.app = app
        self.state = state

    async def __call__(self, scope, receive, send):
        path = scope.get("path", "")
        if scope["type"] == "http" and path.startswith("/api/") and path != "/api/v1/healthz":
            headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
            problem = sdk_version_problem(headers.get("x-stainless-package-version"))
            status = 400
            if problem is None:
                problem, status = self.state.api_key_check(headers.get("x-api-key")), 401
            if problem is not None:
                await refusal(status, problem, f"{scope.get('method')} {path}")(scope, receive, send)
                return
        await self.app(scope, receive, send)


async def client_config(request: Request) -> JSONResponse:
    state: State = request.app.state.tinker
    req = await parse(request, types.ClientConfigRequest)
    refuse_unsupported_sdk(req.sdk_version)
    return JSONResponse(CLIENT_CONFIG | {"fwdbwd_max_chunk_len": state.options.fwdbwd_max_chunk_len})


async def client_dynamic_config(request: Request) -> JSONResponse:
    return JSONResponse(DYNAMIC_CONFIG)


async def create_session(request: Request) -> JSONResponse:
    state: State = request.app.state.tinker
    req = await parse(request, types.CreateSessionRequest)
    refuse_unsupported_sdk(req.sdk_version)
    session_id = f"sess-{uuid.uuid4().hex[:16]}"
    state.sessions[session_id] = {"sdk_version": req.sdk_version, "tags": list(req.tags), "finished": None}
    return JSONResponse({"session_id": session_id, "type": "create_session",
                         "info_message": f"rayllm-rl serve: session {session_id} on {state.base_model}"})


async def session_heartbeat(request: Request) -> JSONResponse:
    state: State = request.app.state.tinker
    req = await parse(request, types.SessionHeartbeatRequest)
    session = state.sessions.get(req.session_id)
    if session is None:
        raise Refused(404, f"unknown session {req.session_id!r}")
    if session["finished"]:  # 410: the SDK stops its heartbeat loop (internal_client_holder.py)
        raise Refused(410, f"session {req.session_id!r} was finished")
    return JSONResponse({"type": "session_heartbeat"})


async def finish_session(request: Request) -> JSONResponse:
    state: State = request.app.state.tinker
    session_id = request.path_params["session_id"]
    if session_id not in state.sessions:
        raise Refused(404, f"unknown session {session_id!r}")
    try:
        body = await request.json()
    except ValueError:
        body = {}
    reason = (body.get("reason") or {}).get("type", "success") if isinstance(body, dict) else "success"
    state.sessions[session_id]["finished"] = state.sessions[session_id]["finished"] or reason  # first wins
    return JSONResponse({})


async def telemetry(request: Request) -> JSONResponse:
    await request.body()
    return JSONResponse({"status": "accepted"})


async def retrieve_future(request: Request) -> Response:
    state: State = request.app.state.tinker
    req = await parse(request, types.FutureRetrieveRequest)
    t0 = state.timings.clock()
    try:
        outcome = await state.store.wait(req.request_id, state.options.poll_s)
    except KeyError:
        raise Refused(404, f"unknown request_id {req.request_id!r}: this server did not issue it, or it finished "
                      "over 30 minutes ago (was the server restarted?)") from None
    finally:
        state.timings.wait("POST /api/v1/retrieve_future", state.timings.clock() - t0)
    if outcome is None:
        return JSONResponse({"type": "try_again", "request_id": req.request_id, "queue_state": "active"})
    if outcome.error is not None:
        return JSONResponse({"error": outcome.error, "category": outcome.category})
    value = outcome.value
    if isinstance(value, ProtoResult):
        if wire.PROTOBUF in request.headers.get("accept", ""):
            return Response(value.proto, media_type=wire.PROTOBUF)
        return JSONResponse(value.to_json())
    return JSONResponse(to_json(value))


async def get_training_run(request: Request) -> JSONResponse:
    state: State = request.app.state.tinker
    run = _run(state, request.path_params["run_id"])
    return JSONResponse(state.registry.training_run(run))


def _run(state: State, run_or_model_id: str) -> dict:
    run = state.registry.run(run_or_model_id)
    if run is None:
        raise Refused(404, f"unknown training run {run_or_model_id!r} (not in {state.registry.file})")
    return run


async def list_checkpoints(request: Request) -> JSONResponse:
    state: State = request.app.state.tinker
    run = _run(state, request.path_params["run_id"])
    checkpoints = state.registry.checkpoints(run["training_run_id"])
    return JSONResponse({"checkpoints": [public_checkpoint(c) for c in sorted(checkpoints, key=lambda c: c["time"])]})


async def delete_checkpoint(request: Request) -> JSONResponse:
    state: State = request.app.state.tinker
    run = _run(state, request.path_params["run_id"])
    checkpoint_id = request.path_params["checkpoint_id"]
    if state.registry.delete(run["training_run_id"], checkpoint_id) is None:
        raise Refused(404, f"run {run['training_run_id']} has no checkpoint {checkpoint_id!r}")
    return JSONResponse({})


async def weights_info(request: Request) -> JSONResponse:
    state: State = request.app.state.tinker
    try:
        body = await request.json()
        path = body["tinker_path"]
        run_id = parse_path(path).training_run_id
    except (ValueError, KeyError, TypeError) as error:
        raise Refused(400, f"weights_info needs {{'tinker_path': 'tinker://RUN/weights/NAME'}}: {error}") from None
    if state.registry.checkpoint(path) is None:
        raise Refused(404, f"checkpoint {path} is not in this server's registry ({state.registry.file})")
    run = _run(state, run_id)
    return JSONResponse({"base_model": run["base_model"], "is_lora": run["is_lora"], "lora_rank": run["lora_rank"]})


async def server_capabilities(request: Request) -> JSONResponse:
    state: State = request.app.state.tinker
    return JSONResponse({"supported_models": [{"model_name": state.base_model, "trainable": True,
                                               "sampleable": True}]})


async def timings(request: Request) -> JSONResponse:
    """`GET /api/v1/rayllm/timings`: where the server's time went since it started (`timings.py`)."""
    state: State = request.app.state.tinker
    return JSONResponse(state.timings.snapshot())


async def healthz(request: Request) -> JSONResponse:
    return JSONResponse({"status": "ok"})


async def not_implemented(request: Request) -> JSONResponse:
    endpoint = f"{request.method} {request.url.path}"
    return refusal(404, f"rayllm-rl serve does not implement {endpoint}", endpoint)


async def _refused(request: Request, error: Exception) -> JSONResponse:
    assert isinstance(error, Refused)
    return refusal(error.status, error.message, f"{request.method} {request.url.path}")


def make_app(service: Any, api_key_check: ApiKeyCheck = accept_tml_keys, *,
             state_dir: str | Path = "runs/tinker-serve", options: Options | None = None) -> Any:
    """The ASGI app serving `service` (a `rayllm_rl.tinker.service.TinkerService`, or anything with its surface).
    `api_key_check` is the key rule (`accept_tml_keys`, `expect_key(key)`); `state_dir` holds the run and
    checkpoint registry, which a later server on the same directory resumes from."""
    state = State(service, Registry(state_dir), api_key_check, options or Options())
    post = {"/api/v1/client/config": client_config, "/api/v1/client/dynamic_config": client_dynamic_config,
            "/api/v1/create_session": create_session, "/api/v1/session_heartbeat": session_heartbeat,
            "/api/v1/sessions/{session_id}/finish": finish_session, "/api/v1/telemetry": telemetry,
            "/api/v1/retrieve_future": retrieve_future, "/api/v1/weights_info": weights_info,
            **dict(server_training.ROUTES)}
    routes = [Route(path, handler, methods=["POST"]) for path, handler in post.items()]
    routes += [Route(path, handler, methods=[method]) for path, handler, method in server_sampling.ROUTES]
    routes += [Route("/api/v1/training_runs/{run_id}", get_training_run, methods=["GET"]),
               Route("/api/v1/training_runs/{run_id}/checkpoints", list_checkpoints, methods=["GET"]),
               Route("/api/v1/training_runs/{run_id}/checkpoints/{checkpoint_id:path}", delete_checkpoint,
                     methods=["DELETE"]),
               Route("/api/v1/get_server_capabilities", server_capabilities, methods=["GET"]),
               Route("/api/v1/healthz", healthz, methods=["GET"]),
               Route("/api/v1/rayllm/timings", timings, methods=["GET"]),
               Route("/{path:path}", not_implemented, methods=["GET", "POST", "PUT", "PATCH", "DELETE"])]

    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        for model in state.models.values():
            model.order.close()
        await state.store.cancel_all()

    app = Starlette(routes=routes, exception_handlers={Refused: _refused}, lifespan=lifespan,
                    max_body_size=wire.MAX_BODY_BYTES)
    app.state.tinker = state
    return _Gate(TimingMiddleware(app, state.timings), state)
