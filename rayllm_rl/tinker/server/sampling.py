"""The sampling endpoints of `rayllm-rl serve`: Tinker sampling sessions on our SamplingClients.

* `create_sampling_session` (`ServiceClient.create_sampling_client`, `TrainingClient.create_sampling_client`):
  a `tinker://RUN/sampler_weights/NAME` path saved by `save_weights_for_sampler` -> `{"sampling_session_id"}`,
  answered directly. Sampling the bare base model is refused: our replicas serve saved policy versions only.
* `asample` (`SamplingClient.sample`, and `compute_logprobs`, which is a one-token sample with prompt logprobs):
  a future that carries `sample_sequence_ids`, one per sample, which the 0.38 SDK asserts on
  (`sampling_client.py: _attach_sequence_ids`); its result is the protobuf `SampleResponse` with our extension.
* `GET samplers/{id}` (the SDK's `_fetch_base_model`) and our side endpoint `GET rayllm/samples/{request_id}`:
  a finished sample's per-token policy versions and sampling mask as JSON.
"""
from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse
from tinker import types

from rayllm_rl.tinker.server import wire
from rayllm_rl.tinker.server.futures import error_category
from rayllm_rl.tinker.server.state import ProtoResult, Refused, Sampler, State, parse

_UNSUPPORTED = (("topk_prompt_logprobs", "top-k prompt logprobs"), ("topk_sample_logprobs", "top-k sample logprobs"),
                ("target_prompt_logprobs", "target prompt logprobs"), ("prompt_alt_tokens_k", "prompt alt tokens"),
                ("record_stability_info", "stability info (StableReinforce)"))
"""SampleRequest options our SamplingClient does not compute: a request that sets one is refused, naming it."""


async def create_sampling_session(request: Request) -> JSONResponse:
    state: State = request.app.state.tinker
    req = await parse(request, types.CreateSamplingSessionRequest)
    state.session(req.session_id)
    sampler_id = f"{req.session_id}:sample:{req.sampling_session_seq_id}"
    if sampler_id in state.samplers:
        return JSONResponse({"sampling_session_id": sampler_id, "type": "create_sampling_session"})
    if req.model_path is None:
        raise Refused(400, f"sampling the base model ({req.base_model or state.base_model}) is not supported: this "
                      "server samples saved weights; save them first (training_client.save_weights_for_sampler or "
                      "save_weights_and_get_sampling_client) and pass model_path")
    try:
        state.registry.check_usable(req.model_path)
        client = await state.call("create_sampling_client", state.service.create_sampling_client, req.model_path)
    except Exception as error:  # noqa: BLE001 - said to the SDK: 400 for a bad path, 424 for a failed role
        status = 400 if error_category(error) == "user" else 424
        raise Refused(status, f"cannot sample {req.model_path}: {error}") from None
    state.samplers[sampler_id] = Sampler(sampler_id, client, req.model_path, state.base_model)
    return JSONResponse({"sampling_session_id": sampler_id, "type": "create_sampling_session"})


def _check_sample_request(req: types.SampleRequest) -> list[int]:
    """The prompt's tokens; 400 naming the option for what this server does not do."""
    for field, what in _UNSUPPORTED:
        if getattr(req, field):
            raise Refused(400, f"{field} ({what}) is not supported by rayllm-rl serve")
    if req.num_samples < 1:
        raise Refused(400, f"num_samples must be 1 or more, got {req.num_samples}")
    if not all(isinstance(c, types.EncodedTextChunk) for c in req.prompt.chunks):
        kinds = sorted({type(c).__name__ for c in req.prompt.chunks})
        raise Refused(400, f"the prompt has {kinds} chunks; this server samples from token chunks only")
    tokens = req.prompt.to_ints()
    if not tokens:
        raise Refused(400, "the prompt has no tokens")
    last_n = req.prompt_logprobs_last_n
    if last_n is not None and not (req.prompt_logprobs and 1 <= last_n <= len(tokens) - 1):
        raise Refused(400, f"prompt_logprobs_last_n={last_n} needs prompt_logprobs and a value from 1 to "
                      f"len(prompt) - 1 = {len(tokens) - 1}")
    return tokens


async def asample(request: Request) -> JSONResponse:
    state: State = request.app.state.tinker
    req = await parse(request, types.SampleRequest)
    if req.sampling_session_id is None:
        raise Refused(400, "asample needs a sampling_session_id (create_sampling_session first)")
    sampler = state.sampler(req.sampling_session_id)
    tokens = _check_sample_request(req)
    request_id = state.store.new("sample")
    sequence_ids = [f"{request_id}:{i}" for i in range(req.num_samples)]
    last_n = req.prompt_logprobs_last_n

    async def work():
        fut = sampler.client.sample(types.ModelInput.from_ints(tokens), req.num_samples, req.sampling_params,
                                    include_prompt_logprobs=bool(req.prompt_logprobs))
        return await state.settle(fut, "sample")

    def finish(response: types.SampleResponse):
        if len(response.sequences) != req.num_samples:
            raise RuntimeError(f"the sampler returned {len(response.sequences)} sequences for num_samples="
                               f"{req.num_samples}")
        extra = {"request_id": request_id, "sampling_session_id": sampler.sampler_id,
                 "model_path": sampler.model_path, "sequence_ids": sequence_ids,
                 **wire.sample_extension(response)}
        with state.timings.coding("encode sample"):
            encoded = wire.encode_sample_response(response, prompt_logprobs_last_n=last_n)
        return ProtoResult(encoded, lambda: wire.sample_response_json(response, prompt_logprobs_last_n=last_n)), extra
    state.store.run(request_id, work, finish)
    return JSONResponse({"request_id": request_id, "sample_sequence_ids": sequence_ids})


async def get_sampler(request: Request) -> JSONResponse:
    state: State = request.app.state.tinker
    sampler = state.sampler(request.path_params["sampler_id"])
    return JSONResponse({"sampler_id": sampler.sampler_id, "base_model": sampler.base_model,
                         "model_path": sampler.model_path})


async def sample_extension(request: Request) -> JSONResponse:
    """`GET /api/v1/rayllm/samples/{request_id}`: our extension of a finished sample, as JSON."""
    state: State = request.app.state.tinker
    request_id = request.path_params["request_id"]
    outcome = state.store.get(request_id)
    if outcome is None or outcome.kind != "sample":
        raise Refused(404, f"no sample request {request_id!r} on this server (or it finished long ago)")
    if not outcome.done.is_set():
        return JSONResponse({"request_id": request_id, "status": "pending"}, status_code=202)
    if outcome.error is not None:
        return JSONResponse({"request_id": request_id, "error": outcome.error, "category": outcome.category})
    return JSONResponse(outcome.extra)


ROUTES = [("/api/v1/create_sampling_session", create_sampling_session, "POST"), ("/api/v1/asample", asample, "POST"),
          ("/api/v1/samplers/{sampler_id}", get_sampler, "GET"),
          ("/api/v1/rayllm/samples/{request_id}", sample_extension, "GET")]
"""(path, handler, method) of the endpoints this module serves."""
