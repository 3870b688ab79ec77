"""The training endpoints of `rayllm-rl serve`: a Tinker training model on our TrainingClient.

Each answers at once with a future (`{"request_id", "model_id"}`, the SDK's `UntypedAPIFuture`) whose outcome the
SDK fetches from `/api/v1/retrieve_future`. Requests carrying a `seq_id` wait their turn in the model's `SeqOrder`
before they reach the client. The wire shapes, as the 0.38 SDK sends and reads them:

* `create_model`: `CreateModelRequest` (`lora_config.rank` 0 = full fine-tuning) -> `{"model_id"}`;
* `get_info`: answered directly (not a future) with a `GetInfoResponse` whose `model_data.tokenizer_id` is the
  local tokenizer directory, so `TrainingClient.get_tokenizer()` loads it offline;
* `forward_backward`: a protobuf body (`wire.py`), `forward_only` for `TrainingClient.forward`;
* `optim_step`: JSON, Adam's parameters under `adam_params` (`OptimStepRequest`'s wire alias);
* `save_weights` (save_state), `save_weights_for_sampler` (a named save, or the ephemeral one of
  `save_weights_and_get_sampling_client`, which sends `sampling_session_seq_id` and gets a `sampling_session_id`);
* `load_weights`: the create-via-load the SDK always uses for `create_training_client_from_state*` (`session_id` +
  `model_seq_id`, no `model_id`; the LoRA rank comes from the checkpoint's run in the registry), or the deprecated
  `TrainingClient.load_state*` on an existing model (`model_id` + `seq_id`).
"""
from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse
from tinker import types

from rayllm_rl.tinker.server import wire
from rayllm_rl.tinker.server.futures import describe
from rayllm_rl.tinker.server.order import SeqOrder
from rayllm_rl.tinker.server.registry import parse_path
from rayllm_rl.tinker.server.state import Model, ProtoResult, Refused, Sampler, State, parse, to_json


def _future(request_id: str, model_id: str | None = None) -> JSONResponse:
    return JSONResponse({"request_id": request_id, "model_id": model_id} if model_id else {"request_id": request_id})


def _check_optimizer(config: Any) -> None:
    if config is not None and getattr(config, "type", "adamw") != "adamw":
        raise Refused(400, f"optimizer {config.type!r} is not supported: this server trains with AdamW only")


def _check_name(name: str | None, what: str) -> str:
    if not name:
        raise Refused(400, f"{what} needs a name (path=...)")
    if "/" in name or name.strip() != name:
        raise Refused(400, f"{what} name {name!r} must not contain '/' or surrounding spaces (it becomes the last "
                      "part of a tinker:// path)")
    return name


def _new_model(state: State, session_id: str, model_seq_id: int, lora_rank: int, kind: str) -> Model:
    model_id = f"{session_id}:train:{model_seq_id}"
    if model_id in state.models:
        raise Refused(400, f"model {model_id} already exists (model_seq_id {model_seq_id} was used in this session)")
    live = [m.model_id for m in state.models.values() if not m.failed]
    if live:
        raise Refused(400, f"this server runs one training client per server (model {live[0]}); start another "
                      "`rayllm-rl serve` for another training client")
    order = SeqOrder(model_id, state.store, gap_timeout_s=state.options.gap_timeout_s)
    model = Model(model_id=model_id, session_id=session_id, base_model=state.base_model, lora_rank=lora_rank,
                  order=order, create_request_id=state.store.new(kind))
    state.models[model_id] = model
    return model


async def _open_client(state: State, model: Model, seed: int | None, user_metadata: dict | None) -> None:
    """Our TrainingClient for `model` (one per service: a second raises ValueError naming the first)."""
    model.client = await state.call("create_training_client", state.service.create_training_client,
                                    lora_rank=model.lora_rank, seed=seed)
    model.run_id = model.client.run_id
    state.registry.add_run(model.run_id, model_id=model.model_id, base_model=model.base_model,
                           lora_rank=model.lora_rank, user_metadata=user_metadata)


def _creation(state: State, model: Model, work) -> None:
    """Run the model's creation as its create request's outcome; its order opens (or fails) when it ends."""
    async def _create():
        try:
            result = await work()
        except BaseException as error:
            model.failed = True
            model.order.set_ready(f"model {model.model_id} was not created: {describe(error)}")
            raise
        model.order.set_ready()
        return result
    state.store.run(model.create_request_id, _create)


async def create_model(request: Request) -> JSONResponse:
    state: State = request.app.state.tinker
    req = await parse(request, types.CreateModelRequest)
    state.session(req.session_id)
    if req.base_model != state.base_model:
        raise Refused(400, f"this server serves base model {state.base_model!r}; create_model asked for "
                      f"{req.base_model!r} (pass base_model={state.base_model!r})")
    _check_optimizer(req.optimizer_config)
    lora = req.lora_config
    if lora is not None and not (lora.train_mlp and lora.train_attn and lora.train_unembed):
        raise Refused(400, "train_mlp/train_attn/train_unembed=False are not supported: the LoRA adapter covers "
                      "the layers rayllm_rl's learner adapts")
    rank = lora.rank if lora is not None else 0
    if rank < 0:
        raise Refused(400, f"LoRA rank {rank} is negative (0 = full fine-tuning)")
    model = _new_model(state, req.session_id, req.model_seq_id, rank, "create_model")

    async def work():
        await _open_client(state, model, lora.seed if lora is not None else None, req.user_metadata)
        return {"model_id": model.model_id, "type": "create_model"}
    _creation(state, model, work)
    return _future(model.create_request_id, model.model_id)


async def get_info(request: Request) -> JSONResponse:
    state: State = request.app.state.tinker
    req = await parse(request, types.GetInfoRequest)
    model = state.model(req.model_id)
    if model.client is None:
        raise Refused(400, f"model {model.model_id} is not created yet (or its creation failed: see its "
                      "create_model/load_weights future)")
    info = to_json(await state.settle(model.client.get_info(), "get_info"))
    data = dict(info.get("model_data") or {})
    data.update(model_name=model.base_model, tokenizer_id=state.service.tokenizer_path)
    info.update(model_id=model.model_id, model_data=data, is_lora=model.lora_rank > 0,
                lora_rank=model.lora_rank or None, model_name=model.base_model, type="get_info")
    return JSONResponse(info)


def _fwdbwd_result(state: State, out: types.ForwardBackwardOutput):
    with state.timings.coding("encode forward_backward"):
        proto = wire.encode_forward_backward_output(out)
    return ProtoResult(proto, lambda: wire.forward_backward_output_json(out)), None


async def forward_backward(request: Request) -> JSONResponse:
    state: State = request.app.state.tinker
    raw = await request.body()
    with state.timings.coding("decode forward_backward"):
        try:
            msg = wire.parse_forward_backward(wire.read_body(raw, request.headers.get("content-encoding")))
        except ValueError as error:
            raise Refused(400, str(error)) from None
        model = state.model(msg.model_id)
        try:
            call: wire.ForwardBackwardCall | None = wire.decode_forward_backward(msg)
            bad = None
        except ValueError as error:  # still takes its turn, so the requests after it are not held up
            call, bad = None, error
    kind = "forward" if msg.forward_only else "forward_backward"

    async def start():
        if bad is not None:
            raise bad
        fn = model.client.forward if call.forward_only else model.client.forward_backward
        fut = fn(call.data, call.loss_fn, call.loss_fn_config)
        return lambda: state.settle(fut, kind)
    return _future(model.order.submit(msg.seq_id, kind, start, lambda out: _fwdbwd_result(state, out)),
                   model.model_id)


def _path_of(saved: Any) -> str:
    """The tinker:// path a save returned: a `Save*Response` (its `path`) or the path itself."""
    path = getattr(saved, "path", saved)
    if not isinstance(path, str):
        raise TypeError(f"the save returned {type(saved).__name__}, not a path")
    return path


def _load_state(client: Any, path: str, optimizer: bool) -> Any:
    """Our TrainingClient's load: `load_state_with_optimizer(path)` / `load_state(path)`, as Tinker names them."""
    return client.load_state_with_optimizer(path) if optimizer else client.load_state(path)


def _seq(seq_id: int | None, endpoint: str) -> int:
    if seq_id is None:
        raise Refused(400, f"{endpoint} needs a seq_id (the SDK's TrainingClient sends one)")
    return seq_id


async def optim_step(request: Request) -> JSONResponse:
    state: State = request.app.state.tinker
    req = await parse(request, types.OptimStepRequest)
    model = state.model(req.model_id)
    if not isinstance(req.optim_params, types.AdamParams):
        raise Refused(400, f"optimizer parameters {type(req.optim_params).__name__} are not supported: this server "
                      "steps AdamW (send adam_params)")

    async def start():
        fut = model.client.optim_step(req.optim_params)

        async def wait():
            return to_json(await state.settle(fut, "optim_step")) or {}
        return wait
    return _future(model.order.submit(_seq(req.seq_id, "optim_step"), "optim_step", start), model.model_id)


async def save_weights(request: Request) -> JSONResponse:
    state: State = request.app.state.tinker
    req = await parse(request, types.SaveWeightsRequest)
    model = state.model(req.model_id)
    name = _check_name(req.path, "save_state")

    async def start():
        path = f"tinker://{model.run_id}/weights/{name}"
        old = state.registry.checkpoint(path)
        if old is not None and not old.get("deleted") and not req.overwrite:
            raise ValueError(f"checkpoint {path} already exists (saved {old['time']}); pass overwrite=True to "
                             "replace it")
        fut = model.client.save_state(name)

        async def wait():
            saved = _path_of(await state.settle(fut, "save_state"))
            state.registry.add_checkpoint(saved, user_metadata=req.user_metadata, ttl_seconds=req.ttl_seconds)
            return {"path": saved, "type": "save_weights"}
        return wait
    return _future(model.order.submit(_seq(req.seq_id, "save_weights"), "save_weights", start), model.model_id)


async def save_weights_for_sampler(request: Request) -> JSONResponse:
    state: State = request.app.state.tinker
    req = await parse(request, types.SaveWeightsForSamplerRequest)
    model = state.model(req.model_id)
    if req.path is None and req.sampling_session_seq_id is None:
        raise Refused(400, "save_weights_for_sampler needs a name (path) or a sampling_session_seq_id")
    if req.path is not None:
        name = _check_name(req.path, "save_weights_for_sampler")

        async def start():
            fut = model.client.save_weights_for_sampler(name)

            async def wait():
                saved = _path_of(await state.settle(fut, "save_weights_for_sampler"))
                state.registry.add_checkpoint(saved, user_metadata=req.user_metadata, ttl_seconds=req.ttl_seconds)
                return {"path": saved, "type": "save_weights_for_sampler"}
            return wait
    else:
        sampler_id = f"{model.session_id}:sample:{req.sampling_session_seq_id}"
        if sampler_id in state.samplers:
            raise Refused(400, f"sampling session {sampler_id} already exists")

        async def start():  # blocking: the weights reach the replicas before the next request starts
            client = await state.call("save_weights_and_get_sampling_client",
                                      model.client.save_weights_and_get_sampling_client)
            state.samplers[sampler_id] = Sampler(sampler_id, client, getattr(client, "model_path", None),
                                                 model.base_model)

            async def done():
                return {"path": state.samplers[sampler_id].model_path, "sampling_session_id": sampler_id,
                        "type": "save_weights_for_sampler"}
            return done
    return _future(model.order.submit(_seq(req.seq_id, "save_weights_for_sampler"), "save_weights_for_sampler",
                                      start), model.model_id)


def _training_checkpoint(state: State, path: str) -> dict | None:
    parsed = parse_path(path)
    if parsed.checkpoint_type != "training":
        raise Refused(400, f"load_weights takes a training checkpoint (tinker://RUN/weights/NAME, from save_state); "
                      f"{path} is a {parsed.checkpoint_type} checkpoint")
    return state.registry.check_usable(path)


async def load_weights(request: Request) -> JSONResponse:
    state: State = request.app.state.tinker
    req = await parse(request, types.LoadWeightsRequest)
    try:
        entry = _training_checkpoint(state, req.path)
    except ValueError as error:
        raise Refused(400, str(error)) from None
    if req.model_id is not None:
        return _load_into(state, state.model(req.model_id), req)
    if req.session_id is None or req.model_seq_id is None:
        raise Refused(400, "load_weights needs model_id + seq_id, or session_id + model_seq_id (create-via-load)")
    state.session(req.session_id)
    if req.base_model is not None and req.base_model != state.base_model:
        raise Refused(400, f"this server serves base model {state.base_model!r}; load_weights asked for "
                      f"{req.base_model!r}")
    if not req.optimizer:
        _check_optimizer(req.optimizer_config)
    run = state.registry.run(parse_path(req.path).training_run_id)
    if entry is None or run is None:
        raise Refused(404, f"checkpoint {req.path} is not in this server's registry ({state.registry.file}): "
                      "save it with save_state on a server using the same --state-dir")
    if run["base_model"] != state.base_model:
        raise Refused(400, f"checkpoint {req.path} was trained from {run['base_model']!r}; this server serves "
                      f"{state.base_model!r}")
    model = _new_model(state, req.session_id, req.model_seq_id, run["lora_rank"] or 0, "load_weights")

    async def work():
        await _open_client(state, model, None, req.user_metadata)
        await state.settle(_load_state(model.client, req.path, req.optimizer), "load_state")
        return {"path": req.path, "model_id": model.model_id, "type": "load_weights"}
    _creation(state, model, work)
    return _future(model.create_request_id, model.model_id)


def _load_into(state: State, model: Model, req: types.LoadWeightsRequest) -> JSONResponse:
    """The deprecated `TrainingClient.load_state*`: a load in turn on an existing model."""
    async def start():
        fut = _load_state(model.client, req.path, req.optimizer)

        async def wait():
            await state.settle(fut, "load_state")
            return {"path": req.path, "model_id": model.model_id, "type": "load_weights"}
        return wait
    return _future(model.order.submit(_seq(req.seq_id, "load_weights"), "load_weights", start), model.model_id)


ROUTES = [("/api/v1/create_model", create_model), ("/api/v1/get_info", get_info),
          ("/api/v1/forward_backward", forward_backward), ("/api/v1/optim_step", optim_step),
          ("/api/v1/save_weights", save_weights), ("/api/v1/save_weights_for_sampler", save_weights_for_sampler),
          ("/api/v1/load_weights", load_weights)]
"""(path, handler) of the POST endpoints this module serves."""
