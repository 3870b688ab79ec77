"""The binary half of Tinker's wire protocol, as the unmodified SDK (`tinker>=0.38,<0.39`) speaks it.

Since SDK 0.25 two payloads travel as protobuf, with the schema the SDK ships (`tinker.proto.tinker_public_pb2`,
imported here, never copied):

* the `/api/v1/forward_backward` request body (`tinker/resources/training.py`: `Content-Type:
  application/x-protobuf`, and `Content-Encoding: zstd` when the server's client config sets
  `proto_compress_fwdbwd`; built by `tinker/proto/request_conv.py: forward_backward_request_to_proto`);
* the results of `ForwardBackwardOutput` and `SampleResponse` futures, which the SDK asks for with
  `Accept: application/x-protobuf` and refuses as JSON (`tinker/lib/api_future_impl.py: _fetch_via_rest`,
  `_handle_outcome`; decoded by `tinker/proto/response_conv.py`).

Our extension of a sample (each token's policy version and the sampling mask the learner replays) goes into one
top-level field the public schema does not define, `EXTENSION_FIELD`: protobuf parsers keep unknown fields and the
SDK reads only the fields it knows, so a stock client decodes the response unchanged (tests/test_tinker_wire.py
checks it with the SDK's own decoder). The same data is served as JSON by `GET /api/v1/rayllm/samples/{request_id}`.
"""
from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import zstandard
from tinker import types
from tinker.proto import tinker_public_pb2 as pb

PROTOBUF = "application/x-protobuf"
MAX_BODY_BYTES = 1 << 30
"""The largest forward_backward body (after zstd) the server decodes: the SDK cuts its chunks at ~5 MB
(`ClientConfigResponse.fwdbwd_max_chunk_bytes_count`), so 1 GiB only stops a decompression bomb."""

EXTENSION_FIELD = (1 << 29) - 1
"""Field number of our extension on a `SampleResponse`: the largest protobuf allows, so no field a later public
schema adds (they are numbered upwards from 1) can take it. Wire type 2 (bytes): UTF-8 JSON,
`{"sequences": [{"versions": [int, ...], "sampling_mask": {...}}, ...]}` in the order of `sequences`."""

_DTYPES = {pb.DTYPE_FLOAT32: ("float32", np.float32), pb.DTYPE_INT64: ("int64", np.int64),
           pb.DTYPE_INT32: ("int64", np.int32)}
_PROTO_DTYPE = {"float32": (pb.DTYPE_FLOAT32, np.float32), "int64": (pb.DTYPE_INT64, np.int64)}
_STOP_REASONS = {"stop": pb.STOP_REASON_STOP, "length": pb.STOP_REASON_LENGTH}


@dataclasses.dataclass(frozen=True)
class ForwardBackwardCall:
    """One `/api/v1/forward_backward` request, decoded: what `TrainingClient.forward[_backward]` takes."""

    model_id: str
    seq_id: int
    data: list[types.Datum]
    loss_fn: str
    loss_fn_config: dict[str, float | str] | None
    forward_only: bool


def read_body(body: bytes, content_encoding: str | None) -> bytes:
    """The request body with its `Content-Encoding` undone: none/identity, or zstd (what the SDK sends)."""
    encoding = (content_encoding or "identity").strip().lower()
    if encoding in ("", "identity"):
        return body
    if encoding != "zstd":
        raise ValueError(f"Content-Encoding {content_encoding!r} is not supported (only zstd or none)")
    reader = zstandard.ZstdDecompressor().stream_reader(body)
    out = reader.read(MAX_BODY_BYTES + 1)
    if len(out) > MAX_BODY_BYTES:
        raise ValueError(f"the zstd body decompresses to over {MAX_BODY_BYTES} bytes")
    return out


def parse_forward_backward(body: bytes) -> pb.ForwardBackwardRequest:
    """The protobuf message of a forward_backward body; a body that does not parse raises ValueError."""
    msg = pb.ForwardBackwardRequest()
    try:
        msg.ParseFromString(body)
    except Exception as error:  # noqa: BLE001 - protobuf raises DecodeError or RuntimeError by backend
        raise ValueError(f"the forward_backward body is not a tinker ForwardBackwardRequest protobuf: {error}")
    return msg


def decode_forward_backward(msg: pb.ForwardBackwardRequest) -> ForwardBackwardCall:
    """The SDK's datums, loss and config from the parsed message (`request_conv.py` inverted). Loss config:
    `loss_fn_config_v2` (numbers and strings) wins over the legacy float map, as the SDK's comment asks."""
    if msg.loss_fn_config_v2:
        config: dict[str, float | str] | None = {
            k: (v.text if v.WhichOneof("value") == "text" else float(v.number))
            for k, v in msg.loss_fn_config_v2.items()}
    elif msg.loss_fn_config:
        config = {k: float(v) for k, v in msg.loss_fn_config.items()}
    else:
        config = None
    data = [_datum(i, d) for i, d in enumerate(msg.data)]
    return ForwardBackwardCall(model_id=msg.model_id, seq_id=msg.seq_id, data=data, loss_fn=msg.loss_fn,
                               loss_fn_config=config, forward_only=msg.forward_only)


def _datum(index: int, msg: pb.Datum) -> types.Datum:
    tokens: list[int] = []
    for j, chunk in enumerate(msg.model_input):
        kind = chunk.WhichOneof("chunk")
        if kind != "encoded_text":
            raise ValueError(f"datum {index}: model_input chunk {j} is {kind or 'empty'}; this server takes "
                             "token chunks (EncodedTextChunk) only")
        raw = chunk.encoded_text.tokens
        if len(raw) % 4:
            raise ValueError(f"datum {index}: chunk {j} token bytes ({len(raw)}) are not whole int32s")
        tokens.extend(np.frombuffer(raw, dtype=np.int32).tolist())
    if not tokens:
        raise ValueError(f"datum {index}: model_input has no tokens")
    inputs = {name: _tensor(f"datum {index}: loss_fn_inputs[{name!r}]", t) for name, t in msg.loss_fn_inputs.items()}
    for name, td in inputs.items():
        first = td.shape[0] if td.shape else len(td._numpy)
        if first != len(tokens):
            raise ValueError(f"datum {index}: loss_fn_inputs[{name!r}] has {first} positions but model_input has "
                             f"{len(tokens)} tokens; each loss input has one row per input position")
    if bool(msg.model_input_spans) != bool(msg.loss_fn_input_spans):
        raise ValueError(f"datum {index}: provenance spans come as a pair (model_input_spans and "
                         "loss_fn_input_spans), one was sent without the other")
    spans = (_spans(msg.model_input_spans), _spans(msg.loss_fn_input_spans)) if msg.model_input_spans else (None, None)
    return types.Datum(model_input=types.ModelInput.from_ints(tokens), loss_fn_inputs=inputs,
                       model_input_spans=spans[0], loss_fn_input_spans=spans[1])


def _spans(msgs) -> list[types.PromptProvenanceSpan | types.SampledProvenanceSpan]:
    out: list[types.PromptProvenanceSpan | types.SampledProvenanceSpan] = []
    for span in msgs:
        if span.WhichOneof("span") == "sampled_tokens":
            s = span.sampled_tokens
            out.append(types.SampledProvenanceSpan(sequence_id=s.sequence_id, offset=s.offset, length=s.length))
        else:
            s = span.prompt_tokens
            out.append(types.PromptProvenanceSpan(sequence_id=s.sequence_id, offset=s.offset, length=s.length))
    return out


def _tensor(what: str, msg: pb.Tensor) -> types.TensorData:
    """A proto `Tensor` as `TensorData`, its byte counts checked against its dtype and shape."""
    if msg.dtype not in _DTYPES:
        raise ValueError(f"{what}: dtype {pb.DType.Name(msg.dtype) if msg.dtype in pb.DType.values() else msg.dtype}"
                         " is not supported (float32 or int64)")
    dtype, np_dtype = _DTYPES[msg.dtype]
    shape = list(msg.shape) or None
    itemsize = np.dtype(np_dtype).itemsize
    if msg.HasField("sparse_csr"):
        csr = msg.sparse_csr
        if not shape or len(shape) != 2:
            raise ValueError(f"{what}: a sparse CSR tensor needs a 2-D shape, got {shape}")
        for part, raw, size in (("values", csr.values, itemsize), ("crow_indices", csr.crow_indices, 8),
                                ("col_indices", csr.col_indices, 8)):
            if len(raw) % size:
                raise ValueError(f"{what}: sparse {part} has {len(raw)} bytes, not a whole number of elements")
        crow = np.frombuffer(csr.crow_indices, dtype=np.int64).tolist()
        col = np.frombuffer(csr.col_indices, dtype=np.int64).tolist()
        values = np.frombuffer(csr.values, dtype=np_dtype).copy()
        if len(crow) != shape[0] + 1 or len(col) != len(values) or (crow and crow[-1] != len(values)):
            raise ValueError(f"{what}: sparse CSR indices do not fit shape {shape} and {len(values)} values")
        return types.TensorData(data=values, dtype=dtype, shape=shape, sparse_crow_indices=crow,
                                sparse_col_indices=col)
    if len(msg.dense) % itemsize:
        raise ValueError(f"{what}: {len(msg.dense)} bytes are not a whole number of {dtype} elements")
    values = np.frombuffer(msg.dense, dtype=np_dtype).copy()
    if shape is not None and math.prod(shape) != values.size:
        raise ValueError(f"{what}: shape {shape} needs {math.prod(shape)} elements, the tensor has {values.size}")
    return types.TensorData(data=values, dtype=dtype, shape=shape or [values.size])


def encode_forward_backward_output(out: types.ForwardBackwardOutput) -> bytes:
    """A `ForwardBackwardOutput` as the proto `response_conv.deserialize_forward_backward_output` reads: the
    per-datum fields packed into `ArrayRecord`s of `BatchedTensor`s (one record per run of datums whose fields
    share dtypes and trailing shapes), metrics as they are but each key given the `name:reduction` form the SDK's
    chunk merge splits on (a bare key is sent as `key:mean`)."""
    msg = pb.ForwardBackwardOutput(loss_fn_output_type=out.loss_fn_output_type or "ArrayRecord")
    for key, value in (out.metrics or {}).items():
        msg.metrics[key if key.count(":") == 1 else f"{key.replace(':', '_')}:mean"] = float(value)
    outputs = [{name: _as_tensor_data(f"loss_fn_outputs[{i}][{name!r}]", v) for name, v in d.items()}
               for i, d in enumerate(out.loss_fn_outputs)]
    names = sorted(outputs[0]) if outputs else []
    for i, d in enumerate(outputs):
        if sorted(d) != names:
            raise ValueError(f"loss_fn_outputs[{i}] has fields {sorted(d)}, datum 0 has {names}; every datum of one "
                             "response carries the same fields")
    group: list[dict[str, tuple[np.ndarray, list[int], str]]] = []
    signature = None
    for d in outputs:
        arrays = {name: _flat(td) for name, td in d.items()}
        sig = tuple((name, a[1][1:], a[2]) for name, a in sorted(arrays.items()))
        if group and sig != signature:
            _add_record(msg, group)
            group = []
        group.append(arrays)
        signature = sig
    if group:
        _add_record(msg, group)
    return msg.SerializeToString()


def _as_tensor_data(what: str, value) -> types.TensorData:
    if isinstance(value, types.TensorData):
        return value
    if isinstance(value, np.ndarray):
        return types.TensorData.from_numpy(value)
    if hasattr(value, "detach"):  # a torch tensor
        return types.TensorData.from_torch(value.detach().cpu())
    raise TypeError(f"{what} is a {type(value).__name__}, not TensorData, numpy or torch")


def _flat(td: types.TensorData) -> tuple[np.ndarray, list[int], str]:
    """(dense values in the wire dtype, full shape, dtype name) of a per-datum output."""
    if td.sparse_crow_indices is not None:
        td = types.TensorData.from_torch(td.to_torch())
    dtype = td.dtype if td.dtype in _PROTO_DTYPE else "float32"
    arr = np.ascontiguousarray(td._numpy, dtype=_PROTO_DTYPE[dtype][1])
    shape = list(td.shape) if td.shape else list(arr.shape)
    return arr.reshape(-1), shape or [arr.size], dtype


def _add_record(msg: pb.ForwardBackwardOutput, group: list[dict[str, tuple[np.ndarray, list[int], str]]]) -> None:
    record = msg.loss_fn_outputs.add(type_tag="ArrayRecord", num_datums=len(group))
    for name in group[0]:
        dtype = group[0][name][2]
        parts = [d[name][0] for d in group]
        offsets = np.zeros(len(parts) + 1, dtype=np.int64)
        offsets[1:] = np.cumsum([p.nbytes for p in parts])
        record.fields[name].CopyFrom(pb.BatchedTensor(
            data=b"".join(p.tobytes() for p in parts), offsets=offsets.tobytes(), dtype=_PROTO_DTYPE[dtype][0],
            trailing_shape=group[0][name][1][1:]))


def sample_extension(response: types.SampleResponse) -> dict:
    """Our per-sequence fields of a sample (`versions`, `sampling_mask`), in the order of its sequences; a
    sequence without them (a plain `SampledSequence`) gets `null`s."""
    return {"sequences": [{"versions": _json_ready(getattr(s, "versions", None)),
                           "sampling_mask": _json_ready(getattr(s, "sampling_mask", None))}
                          for s in response.sequences]}


def _json_ready(value):
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    if isinstance(value, dict):
        return {str(k): _json_ready(v) for k, v in value.items()}
    if hasattr(value, "tolist"):
        return value.tolist()
    return [_json_ready(v) for v in value]


def encode_sample_response(response: types.SampleResponse, *, prompt_logprobs_last_n: int | None = None) -> bytes:
    """A `SampleResponse` as the proto `response_conv.deserialize_sample_response` reads, with
    `sample_extension` appended as field `EXTENSION_FIELD`. `prompt_logprobs_last_n` blanks (NaN) the prompt
    logprobs before the last N, which the SDK checks when it asked for it."""
    msg = pb.SampleResponse()
    for seq in response.sequences:
        if seq.stop_reason not in _STOP_REASONS:
            raise ValueError(f"stop_reason {seq.stop_reason!r} is not one the wire carries (stop, length)")
        out = msg.sequences.add(stop_reason=_STOP_REASONS[seq.stop_reason],
                                tokens=np.asarray(seq.tokens, dtype=np.int32).tobytes())
        if seq.logprobs is not None:
            if len(seq.logprobs) != len(seq.tokens):
                raise ValueError(f"a sequence has {len(seq.tokens)} tokens but {len(seq.logprobs)} logprobs")
            out.logprobs = np.asarray(seq.logprobs, dtype=np.float32).tobytes()
    prompt = response.prompt_logprobs
    if prompt is not None:
        values = np.array([np.nan if v is None else v for v in prompt], dtype=np.float32)
        if prompt_logprobs_last_n is not None:
            values[: max(0, len(values) - prompt_logprobs_last_n)] = np.nan
        msg.prompt_logprobs = values.tobytes()
    body = msg.SerializeToString()
    payload = json.dumps(sample_extension(response), separators=(",", ":")).encode()
    return body + _varint((EXTENSION_FIELD << 3) | 2) + _varint(len(payload)) + payload


def sample_response_json(response: types.SampleResponse, *, prompt_logprobs_last_n: int | None = None) -> dict:
    """The same sample as JSON, for a caller that did not ask for protobuf (curl): the SDK never reads this."""
    ext = sample_extension(response)["sequences"]
    prompt = response.prompt_logprobs
    if prompt is not None and prompt_logprobs_last_n is not None:
        prompt = [None] * max(0, len(prompt) - prompt_logprobs_last_n) + list(prompt[-prompt_logprobs_last_n:])
    return {"type": "sample", "prompt_logprobs": prompt,
            "sequences": [{"stop_reason": s.stop_reason, "tokens": list(s.tokens), "logprobs": s.logprobs, **e}
                          for s, e in zip(response.sequences, ext, strict=True)]}


def forward_backward_output_json(out: types.ForwardBackwardOutput) -> dict:
    """A `ForwardBackwardOutput` as JSON, for a caller that did not ask for protobuf: the SDK never reads this."""
    def field(name: str, value) -> dict:
        values, shape, dtype = _flat(_as_tensor_data(name, value))
        return {"data": values.tolist(), "dtype": dtype, "shape": shape}

    return {"loss_fn_output_type": out.loss_fn_output_type, "metrics": dict(out.metrics or {}),
            "loss_fn_outputs": [{k: field(k, v) for k, v in d.items()} for d in out.loss_fn_outputs]}


def read_sample_extension(proto_bytes: bytes) -> dict | None:
    """Our extension from an encoded `SampleResponse` (None when absent): what a client of ours reads where the
    stock SDK drops it. Walks the top-level fields of the protobuf wire format."""
    pos, found = 0, None
    while pos < len(proto_bytes):
        key, pos = _read_varint(proto_bytes, pos)
        field, wire = key >> 3, key & 7
        if wire == 0:
            _, pos = _read_varint(proto_bytes, pos)
        elif wire == 1:
            pos += 8
        elif wire == 5:
            pos += 4
        elif wire == 2:
            size, pos = _read_varint(proto_bytes, pos)
            if field == EXTENSION_FIELD:
                found = json.loads(proto_bytes[pos:pos + size])
            pos += size
        else:
            raise ValueError(f"wire type {wire} at byte {pos} is not one a SampleResponse uses")
    if pos != len(proto_bytes):
        raise ValueError("the SampleResponse bytes end inside a field")
    return found


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def _read_varint(data: bytes, pos: int) -> tuple[int, int]:
    shift = value = 0
    while True:
        if pos >= len(data):
            raise ValueError("the SampleResponse bytes end inside a varint")
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, pos
        shift += 7
