"""`rayllm_rl/tinker/server/wire.py` against the SDK's own codec (tinker 0.38): a forward_backward request encoded the
way the SDK's `resources/training.py` encodes it (its `request_conv.forward_backward_request_to_proto`, then zstd
as it compresses) decodes to the same datums; our forward_backward outputs and samples decode, with the SDK's
`response_conv`, to the numbers we encoded, and our sample extension does not disturb that decoder."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import zstandard
from tinker import types
from tinker.proto import request_conv, response_conv
from tinker.proto import tinker_public_pb2 as pb

from rayllm_rl.tinker.server import wire


def _sdk_body(data, loss_fn="cross_entropy", config=None, forward_only=False, seq_id=3, zstd=False):
    """The bytes `AsyncTrainingResource.forward_backward` puts on the wire for these arguments."""
    request = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(data=data, loss_fn=loss_fn, loss_fn_config=config),
        model_id="sess:train:0", seq_id=seq_id)
    msg = request_conv.forward_backward_request_to_proto(request)
    msg.forward_only = forward_only
    body = msg.SerializeToString()
    return zstandard.ZstdCompressor().compress(body) if zstd else body


def _decode(body: bytes, encoding: str | None = None) -> wire.ForwardBackwardCall:
    return wire.decode_forward_backward(wire.parse_forward_backward(wire.read_body(body, encoding)))


def test_forward_backward_request_round_trip_through_the_sdk_encoder():
    datum = types.Datum(model_input=types.ModelInput.from_ints([5, 6, 7, 8]),
                        loss_fn_inputs={"target_tokens": [6, 7, 8, 9], "weights": [0.0, 1.0, 1.0, 0.5]})
    rl = types.Datum(model_input=types.ModelInput(chunks=[types.EncodedTextChunk(tokens=[1, 2]),
                                                          types.EncodedTextChunk(tokens=[3])]),
                     loss_fn_inputs={"target_tokens": np.array([2, 3, 4]),
                                     "logprobs": np.array([-0.5, -1.25, -2.0], dtype=np.float32),
                                     "advantages": np.array([0.0, 1.5, -1.5], dtype=np.float32)})
    for zstd in (False, True):
        call = _decode(_sdk_body([datum, rl], "importance_sampling", {"clip": 0.2, "mode": "token"},
                                 forward_only=True, seq_id=7, zstd=zstd), "zstd" if zstd else None)
        assert (call.model_id, call.seq_id, call.loss_fn, call.forward_only) == ("sess:train:0", 7,
                                                                               "importance_sampling", True)
        assert call.loss_fn_config == {"clip": pytest.approx(0.2), "mode": "token"}
        assert [d.model_input.to_ints() for d in call.data] == [[5, 6, 7, 8], [1, 2, 3]]
        first, second = call.data
        assert first.loss_fn_inputs["target_tokens"].dtype == "int64"
        assert first.loss_fn_inputs["target_tokens"].data == [6, 7, 8, 9]
        assert first.loss_fn_inputs["weights"].data == [0.0, 1.0, 1.0, 0.5]
        assert second.loss_fn_inputs["logprobs"].data == [-0.5, -1.25, -2.0]
        assert second.loss_fn_inputs["advantages"].shape == [3]
    plain = _decode(_sdk_body([datum]))
    assert plain.loss_fn_config is None and plain.forward_only is False


def test_sparse_loss_inputs_and_provenance_spans_survive():
    target = types.TensorData(data=np.array([4, 9], dtype=np.int64), dtype="int64", shape=[3, 2],
                              sparse_crow_indices=[0, 1, 1, 2], sparse_col_indices=[0, 1])
    datum = types.Datum(model_input=types.ModelInput.from_ints([1, 2, 3]), loss_fn_inputs={"target_tokens": target})
    datum = datum.with_provenance(model_input=[types.PromptProvenanceSpan(sequence_id="s0", length=3)],
                                  loss_fn_inputs=[types.SampledProvenanceSpan(sequence_id="s0", offset=1, length=3)])
    got = _decode(_sdk_body([datum])).data[0]
    td = got.loss_fn_inputs["target_tokens"]
    assert (td.shape, td.sparse_crow_indices, td.sparse_col_indices, td.data) == ([3, 2], [0, 1, 1, 2], [0, 1], [4, 9])
    assert got.model_input_spans == datum.model_input_spans
    assert got.loss_fn_input_spans == datum.loss_fn_input_spans


@pytest.mark.parametrize("mutate, message", [
    (lambda m: m.data[0].loss_fn_inputs["weights"].__setattr__("dense", b"\x00" * 6), "not a whole number"),
    (lambda m: m.data[0].loss_fn_inputs["weights"].__setattr__("dtype", pb.DTYPE_BFLOAT16), "not supported"),
    (lambda m: m.data[0].loss_fn_inputs["weights"].shape.__setitem__(0, 5), "shape [5] needs 5"),
    (lambda m: m.data[0].model_input[0].ClearField("encoded_text"), "token chunks"),
    (lambda m: m.data[0].model_input[0].image.__setattr__("data", b"png"), "image"),
])
def test_malformed_datums_name_the_problem(mutate, message):
    datum = types.Datum(model_input=types.ModelInput.from_ints([1, 2]),
                        loss_fn_inputs={"target_tokens": [2, 3], "weights": [1.0, 1.0]})
    msg = wire.parse_forward_backward(_sdk_body([datum]))
    mutate(msg)
    with pytest.raises(ValueError, match="datum 0") as info:
        wire.decode_forward_backward(msg)
    assert message in str(info.value)


def test_loss_inputs_must_cover_every_input_position():
    datum = types.Datum(model_input=types.ModelInput.from_ints([1, 2, 3]), loss_fn_inputs={"target_tokens": [2, 3]})
    with pytest.raises(ValueError, match=r"target_tokens'\] has 2 positions but model_input has 3 tokens"):
        _decode(_sdk_body([datum]))


def test_bad_bodies_say_what_is_wrong():
    with pytest.raises(ValueError, match="not a tinker ForwardBackwardRequest"):
        wire.parse_forward_backward(b"\xff\xff\xff")
    with pytest.raises(ValueError, match="gzip"):
        wire.read_body(b"x", "gzip")


def test_forward_backward_output_decodes_with_the_sdk():
    out = types.ForwardBackwardOutput(
        loss_fn_output_type="ArrayRecord",
        loss_fn_outputs=[{"logprobs": types.TensorData.from_numpy(np.array([-0.5, -1.0, -3.25], dtype=np.float32))},
                         {"logprobs": types.TensorData.from_numpy(np.array([-2.0], dtype=np.float32))},
                         {"logprobs": types.TensorData.from_numpy(np.array([[-1.0, -2.0]], dtype=np.float32))}],
        metrics={"loss:sum": 6.75, "tokens": 4.0})
    got = response_conv.deserialize_forward_backward_output(wire.encode_forward_backward_output(out))
    assert got.loss_fn_output_type == "ArrayRecord"
    assert got.metrics == {"loss:sum": 6.75, "tokens:mean": 4.0}
    assert [d["logprobs"].data for d in got.loss_fn_outputs] == [[-0.5, -1.0, -3.25], [-2.0], [-1.0, -2.0]]
    assert [d["logprobs"].shape for d in got.loss_fn_outputs] == [[3], [1], [1, 2]]  # two records: ragged trailing
    empty = response_conv.deserialize_forward_backward_output(wire.encode_forward_backward_output(
        types.ForwardBackwardOutput(loss_fn_output_type="", loss_fn_outputs=[], metrics={"loss:sum": 0.0})))
    assert empty.loss_fn_outputs == [] and empty.metrics == {"loss:sum": 0.0}


@dataclasses.dataclass(frozen=True)
class _VersionedSequence(types.SampledSequence):
    """What rayllm_rl's SamplingClient returns: a SampledSequence with two more fields."""

    versions: list[int] = dataclasses.field(default_factory=list)
    sampling_mask: dict = dataclasses.field(default_factory=dict)


def test_sample_response_decodes_with_the_sdk_and_keeps_our_extension():
    seqs = [_VersionedSequence(stop_reason="stop", sequence_id="r:0", _tokens_list=[11, 12, 13],
                               _logprobs_list=[-0.25, -1.5, -0.125], versions=[3, 3, 4],
                               sampling_mask={"top_k": 5, "top_p": 0.9}),
            _VersionedSequence(stop_reason="length", sequence_id="r:1", _tokens_list=[7],
                               _logprobs_list=[-2.0], versions=[4], sampling_mask={"top_k": -1, "top_p": 1.0})]
    response = types.SampleResponse(sequences=seqs, _prompt_logprobs_list=[None, -0.5, -1.0, -4.0])
    body = wire.encode_sample_response(response)
    got = response_conv.deserialize_sample_response(body)
    assert [s.tokens for s in got.sequences] == [[11, 12, 13], [7]]
    assert [s.logprobs for s in got.sequences] == [[-0.25, -1.5, -0.125], [-2.0]]
    assert [s.stop_reason for s in got.sequences] == ["stop", "length"]
    assert got.prompt_logprobs == [None, -0.5, -1.0, -4.0]
    assert wire.read_sample_extension(body) == {"sequences": [
        {"versions": [3, 3, 4], "sampling_mask": {"top_k": 5, "top_p": 0.9}},
        {"versions": [4], "sampling_mask": {"top_k": -1, "top_p": 1.0}}]}
    # the stock parser keeps the field as unknown, and drops nothing it knows
    msg = pb.SampleResponse()
    msg.ParseFromString(body)
    assert len(msg.sequences) == 2 and msg.SerializeToString() == body
    last_two = response_conv.deserialize_sample_response(wire.encode_sample_response(response,
                                                                                      prompt_logprobs_last_n=2))
    assert last_two.prompt_logprobs == [None, None, -1.0, -4.0]
    assert wire.sample_response_json(response)["sequences"][1] == {
        "stop_reason": "length", "tokens": [7], "logprobs": [-2.0], "versions": [4],
        "sampling_mask": {"top_k": -1, "top_p": 1.0}}


def test_a_plain_sampled_sequence_has_a_null_extension():
    plain = types.SampleResponse(sequences=[types.SampledSequence(stop_reason="stop", sequence_id="x",
                                                                  _tokens_list=[1], _logprobs_list=None)])
    body = wire.encode_sample_response(plain)
    assert response_conv.deserialize_sample_response(body).sequences[0].logprobs is None
    assert wire.read_sample_extension(body) == {"sequences": [{"versions": None, "sampling_mask": None}]}
