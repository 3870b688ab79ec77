"""Trajectory TensorDict: construction, padded concat, pack/unpack (cu_seqlens) and validation."""
import pytest
import torch
from tensordict import TensorDict

from rayllm_rl.data.trajectory import (
    PAD_VALUES,
    TOKEN_KEYS,
    TrajectoryBuilder,
    concat_padded,
    make_trajectory,
    pack_sequences,
    seq_lengths,
    validate_trajectory,
)


def unpack_sequences(packed: TensorDict, cu_seqlens: torch.Tensor) -> TensorDict:
    """The inverse of pack_sequences for the token keys (right-padded `[N, T]`), to check it loses nothing."""
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
    n, width = len(lengths), max(lengths, default=0)
    out = {}
    for k in packed.keys():
        dst = torch.full((n, width), PAD_VALUES.get(k, 0), dtype=packed[k].dtype)
        for i, (s, ln) in enumerate(zip(cu_seqlens[:-1].tolist(), lengths)):
            dst[i, :ln] = packed[k][s:s + ln]
        out[k] = dst
    return TensorDict(out, batch_size=[n])


def _three():
    """Three trajectories of lengths 3, 1 and 4 (max 4), with an extra per-sequence key."""
    a = make_trajectory([11, 12, 13], [0.0, -0.5, -0.25], [0, 1, 1], [-1, 3, 3], 1.0, group_id=2, truncated=1.0)
    b = make_trajectory([21], [0.0], [0], [-1], 0.0, group_id=5, truncated=0.0)
    c = make_trajectory([31, 32, 33, 34], [0.0, 0.0, -1.0, -2.0], [0, 0, 1, 1], [-1, -1, 7, 8], 0.5,
                        group_id=2, truncated=0.0)
    return a, b, c


# ---------------------------------------------------------------- make_trajectory


def test_make_trajectory_values_and_dtypes():
    td = make_trajectory([5, 6, 7], [0.0, -0.5, -1.5], [0, 1, 1], [-1, 4, 4], 2.5, group_id=9, truncated=1)
    assert td.batch_size == torch.Size([1])
    assert td["input_ids"].tolist() == [[5, 6, 7]]
    assert td["input_ids"].dtype == torch.long
    assert td["attention_mask"].tolist() == [[True, True, True]]
    assert td["attention_mask"].dtype == torch.bool
    assert td["loss_mask"].tolist() == [[False, True, True]]
    assert td["loss_mask"].dtype == torch.bool
    assert td["logprobs"].tolist() == [[0.0, -0.5, -1.5]]
    assert td["logprobs"].dtype == torch.float32
    assert td["versions"].tolist() == [[-1, 4, 4]]
    assert td["versions"].dtype == torch.long
    assert td["rewards"].tolist() == [2.5]
    assert td["rewards"].dtype == torch.float32
    assert td["group_id"].tolist() == [9]
    assert td["group_id"].dtype == torch.long
    assert td["truncated"].tolist() == [1.0]
    assert td["truncated"].dtype == torch.float32
    assert sorted(td.keys()) == sorted(TOKEN_KEYS + ("rewards", "group_id", "truncated"))


@pytest.mark.parametrize("bad", ["logprobs", "loss_mask", "versions"])
def test_make_trajectory_length_mismatch_names_the_key(bad):
    kwargs = {"logprobs": [0.0, 0.0, 0.0], "loss_mask": [0, 1, 1], "versions": [-1, 0, 0]}
    kwargs[bad] = kwargs[bad][:2]
    with pytest.raises(ValueError, match=rf"make_trajectory: {bad} has 2 entries, input_ids has 3"):
        make_trajectory([1, 2, 3], reward=0.0, **kwargs)


# ---------------------------------------------------------------- TrajectoryBuilder


class _Resp:
    def __init__(self, tokens, logprobs, versions):
        self.output_tokens, self.output_logprobs, self.output_versions = tokens, logprobs, versions


def test_builder_masks_context_and_keeps_generated_logprobs_versions():
    b = TrajectoryBuilder()
    b.add_prompt([1, 2])
    b.add_generated(_Resp([3, 4], [-0.5, -0.25], [7, 7]))
    b.add_context([5])  # feedback between turns
    b.add_prompt([1, 2, 3, 4, 5, 6])  # the next turn's prompt: only its new tail (6) is appended
    b.add_generated(_Resp([8], [-1.0], [9]))
    td = b.build(0.5, group_id=3, num_turns=2.0)
    expected = make_trajectory([1, 2, 3, 4, 5, 6, 8], [0, 0, -0.5, -0.25, 0, 0, -1.0], [0, 0, 1, 1, 0, 0, 1],
                               [-1, -1, 7, 7, -1, -1, 9], 0.5, group_id=3, num_turns=2.0)
    assert sorted(td.keys()) == sorted(expected.keys())
    for k in expected.keys():
        assert torch.equal(td[k], expected[k]), k
    validate_trajectory(td)


def test_builder_refuses_a_prompt_that_rewrites_the_past():
    b = TrajectoryBuilder()
    b.add_prompt([1, 2])
    b.add_generated(_Resp([3], [-0.1], [0]))
    with pytest.raises(ValueError, match="does not extend the trajectory"):
        b.add_prompt([1, 2, 4, 5])
    with pytest.raises(ValueError, match="lengths differ"):
        b.add_generated(_Resp([3, 4], [-0.1], [0, 0]))
    assert b.input_ids == [1, 2, 3] and len(b) == 3  # nothing appended by the refused calls


# ---------------------------------------------------------------- concat_padded


def test_concat_padded_unequal_lengths_pads_with_documented_values():
    out = concat_padded(_three())
    assert out.batch_size == torch.Size([3])
    for k in TOKEN_KEYS:
        assert out[k].shape == (3, 4), k
    assert out["input_ids"].tolist() == [[11, 12, 13, 0], [21, 0, 0, 0], [31, 32, 33, 34]]
    assert out["attention_mask"].tolist() == [
        [True, True, True, False], [True, False, False, False], [True, True, True, True]]
    assert out["loss_mask"].tolist() == [
        [False, True, True, False], [False, False, False, False], [False, False, True, True]]
    assert out["logprobs"].tolist() == [[0.0, -0.5, -0.25, 0.0], [0.0, 0.0, 0.0, 0.0], [0.0, 0.0, -1.0, -2.0]]
    assert out["versions"].tolist() == [[-1, 3, 3, -1], [-1, -1, -1, -1], [-1, -1, 7, 8]]
    assert out["rewards"].tolist() == [1.0, 0.0, 0.5]
    assert out["group_id"].tolist() == [2, 5, 2]
    expected_dtypes = {
        "input_ids": torch.long, "attention_mask": torch.bool, "loss_mask": torch.bool,
        "logprobs": torch.float32, "versions": torch.long, "rewards": torch.float32, "group_id": torch.long,
    }
    for k, dt in expected_dtypes.items():
        assert out[k].dtype == dt, k
    validate_trajectory(out)


def test_concat_padded_keeps_extra_per_sequence_keys():
    out = concat_padded(_three())
    assert "truncated" in out.keys()
    assert out["truncated"].shape == (3,)
    assert out["truncated"].dtype == torch.float32
    assert out["truncated"].tolist() == [1.0, 0.0, 0.0]


def test_concat_padded_pads_extra_per_token_key_with_zero():
    a, b, _ = _three()
    a["ref_logprobs"] = torch.tensor([[-0.1, -0.2, -0.3]])
    b["ref_logprobs"] = torch.tensor([[-0.7]])
    out = concat_padded([a, b])
    assert out["ref_logprobs"].shape == (2, 3)
    assert torch.equal(out["ref_logprobs"], torch.tensor([[-0.1, -0.2, -0.3], [-0.7, 0.0, 0.0]]))


def test_concat_padded_of_already_batched_inputs():
    a, b, c = _three()
    left = concat_padded([a, b])  # width 3
    right = concat_padded([c])  # width 4
    out = concat_padded([left, right])
    assert out.batch_size == torch.Size([3])
    assert out["input_ids"].tolist() == [[11, 12, 13, 0], [21, 0, 0, 0], [31, 32, 33, 34]]
    assert out["versions"].tolist() == [[-1, 3, 3, -1], [-1, -1, -1, -1], [-1, -1, 7, 8]]
    assert out["truncated"].tolist() == [1.0, 0.0, 0.0]


def test_concat_padded_empty_raises():
    with pytest.raises(ValueError, match="concat_padded: empty list"):
        concat_padded([])


def test_seq_lengths():
    out = concat_padded(_three())
    assert seq_lengths(out).tolist() == [3, 1, 4]


# ---------------------------------------------------------------- pack / unpack


def test_pack_sequences_cu_seqlens_and_packed_values():
    packed, cu = pack_sequences(concat_padded(_three()))
    assert cu.dtype == torch.int32
    assert cu.tolist() == [0, 3, 4, 8]
    assert packed.batch_size == torch.Size([8])
    # only the token keys are packed; per-sequence keys are not part of the packed view
    assert sorted(packed.keys()) == sorted(TOKEN_KEYS)
    assert packed["input_ids"].tolist() == [11, 12, 13, 21, 31, 32, 33, 34]
    assert packed["versions"].tolist() == [-1, 3, 3, -1, -1, -1, 7, 8]
    assert packed["logprobs"].tolist() == [0.0, -0.5, -0.25, 0.0, 0.0, 0.0, -1.0, -2.0]
    assert packed["loss_mask"].tolist() == [False, True, True, False, False, False, True, True]
    assert packed["attention_mask"].tolist() == [True] * 8


def test_unpack_roundtrip_equals_padded_input_exactly():
    padded = concat_padded(_three())
    packed, cu = pack_sequences(padded)
    back = unpack_sequences(packed, cu)
    assert back.batch_size == torch.Size([3])
    assert sorted(back.keys()) == sorted(TOKEN_KEYS)
    for k in TOKEN_KEYS:
        assert back[k].dtype == padded[k].dtype, k
        assert back[k].shape == padded[k].shape, k
        assert torch.equal(back[k], padded[k]), k


def test_unpack_roundtrip_with_extra_token_key_and_empty_sequence():
    a, b, c = _three()
    empty = make_trajectory([], [], [], [], 0.0, truncated=0.0)
    parts = [a, empty, c]
    for td, adv in zip(parts, ([[0.5, 0.5, 0.5]], [[]], [[-1.0, -1.0, -1.0, -1.0]])):
        td["advantages_tok"] = torch.tensor(adv, dtype=torch.float32).reshape(1, -1)
    padded = concat_padded(parts)
    packed, cu = pack_sequences(padded)
    assert cu.tolist() == [0, 3, 3, 7]
    back = unpack_sequences(packed, cu)
    for k in TOKEN_KEYS + ("advantages_tok",):
        assert torch.equal(back[k], padded[k]), k
    assert back["advantages_tok"].tolist() == [[0.5, 0.5, 0.5, 0.0], [0.0] * 4, [-1.0] * 4]


# ---------------------------------------------------------------- validate_trajectory


def test_validate_accepts_a_well_formed_batch():
    assert validate_trajectory(concat_padded(_three())) is None


@pytest.mark.parametrize("key", ["versions", "group_id"])
def test_validate_names_missing_key(key):
    td = concat_padded(_three())
    del td[key]
    with pytest.raises(ValueError, match=rf"missing keys \['{key}'\]"):
        validate_trajectory(td)


def test_validate_names_mismatched_token_key():
    td = concat_padded(_three())  # [3, 4]
    td["logprobs"] = torch.zeros(3, 5)
    with pytest.raises(ValueError, match=r"key 'logprobs' has shape \(3, 5\), input_ids has \(3, 4\)"):
        validate_trajectory(td)


def test_validate_rejects_two_batch_dims():
    td = concat_padded(_three())
    td2 = TensorDict({k: td[k].unsqueeze(0) for k in td.keys()}, batch_size=[1, 3])
    with pytest.raises(ValueError, match=r"one batch dim, got batch_size \(1, 3\)"):
        validate_trajectory(td2)


def test_validate_rejects_loss_mask_on_padding():
    td = concat_padded(_three())
    td["loss_mask"][1, 2] = True  # row 1 has length 1: column 2 is padding
    with pytest.raises(ValueError, match="loss_mask is 1 on a padding position"):
        validate_trajectory(td)


def test_validate_names_misshaped_per_sequence_key():
    td = concat_padded(_three())
    td["rewards"] = torch.zeros(3, 2)
    with pytest.raises(ValueError, match="rewards"):
        validate_trajectory(td)
