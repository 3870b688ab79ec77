"""PromptLoader (deterministic, per-epoch reshuffle, exact resume) and make_sft_batch (assistant loss mask)."""
import pytest
import torch
from datasets import Dataset

from rayllm_rl.data.loader import PromptLoader
from rayllm_rl.data.sft import make_sft_batch
from rayllm_rl.data.trajectory import TOKEN_KEYS, validate_trajectory

N = 10


@pytest.fixture(scope="module")
def ds():
    return Dataset.from_list([{"id": i, "prompt": f"p{i}"} for i in range(N)])


def _ids(rows):
    return [r["id"] for r in rows]


# ---------------------------------------------------------------- PromptLoader


def test_rows_are_full_dicts(ds):
    row = PromptLoader(ds, shuffle=False).next_row()
    assert row == {"id": 0, "prompt": "p0"}
    assert type(row) is dict


def test_unshuffled_order_is_dataset_order_every_epoch(ds):
    loader = PromptLoader(ds, shuffle=False)
    assert _ids(loader.next_rows(25)) == list(range(10)) + list(range(10)) + list(range(5))


def test_same_seed_gives_same_order(ds):
    a = _ids(PromptLoader(ds, seed=3).next_rows(35))
    b = _ids(PromptLoader(ds, seed=3).next_rows(35))
    assert a == b


def test_different_seed_gives_different_first_epoch(ds):
    a = _ids(PromptLoader(ds, seed=3).next_rows(N))
    b = _ids(PromptLoader(ds, seed=4).next_rows(N))
    assert sorted(a) == sorted(b) == list(range(N))
    assert a != b


def test_every_row_exactly_once_per_epoch_and_reshuffled(ds):
    loader = PromptLoader(ds, seed=7)
    epochs = [_ids(loader.next_rows(N)) for _ in range(3)]
    for e in epochs:
        assert sorted(e) == list(range(N))  # a permutation: every row exactly once
    assert epochs[0] != list(range(N))  # actually shuffled
    assert epochs[0] != epochs[1]
    assert epochs[1] != epochs[2]
    assert loader.state_dict() == {"epoch": 2, "position": N, "seed": 7}
    loader.next_row()
    assert loader.state_dict() == {"epoch": 3, "position": 1, "seed": 7}


def test_state_dict_after_seven_rows(ds):
    loader = PromptLoader(ds, seed=5)
    loader.next_rows(7)
    assert loader.state_dict() == {"epoch": 0, "position": 7, "seed": 5}


def test_resume_matches_uninterrupted_run(ds):
    loader = PromptLoader(ds, seed=11)
    loader.next_rows(7)
    state = loader.state_dict()
    expected = loader.next_rows(20)  # crosses two epoch boundaries (N = 10)

    resumed = PromptLoader(ds, seed=11)
    resumed.load_state_dict(state)
    assert resumed.next_rows(20) == expected


def test_resume_restores_the_seed_too(ds):
    loader = PromptLoader(ds, seed=11)
    loader.next_rows(7)
    state = loader.state_dict()
    expected = loader.next_rows(20)

    resumed = PromptLoader(ds, seed=999)  # constructed with another seed: the state wins
    resumed.load_state_dict(state)
    assert resumed.seed == 11
    assert resumed.next_rows(20) == expected


def test_resume_at_an_epoch_boundary(ds):
    loader = PromptLoader(ds, seed=2)
    loader.next_rows(N)
    state = loader.state_dict()
    assert state == {"epoch": 0, "position": N, "seed": 2}
    expected = loader.next_rows(13)

    resumed = PromptLoader(ds, seed=2)
    resumed.load_state_dict(state)
    assert resumed.next_rows(13) == expected


def test_empty_dataset_raises():
    with pytest.raises(ValueError, match="PromptLoader: the dataset is empty"):
        PromptLoader(Dataset.from_list([]))


# ---------------------------------------------------------------- make_sft_batch


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    from rayllm_rl.models.tiny import ensure_tiny_model

    return AutoTokenizer.from_pretrained(ensure_tiny_model())


def _enc(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


def _expected(tok, pieces):
    """pieces: (text, is_assistant) -> (ids, loss mask) built by tokenizing each piece separately."""
    ids, mask = [], []
    for text, on in pieces:
        t = _enc(tok, text)
        ids += t
        mask += [int(on)] * len(t)
    return ids, mask


CHAT = [
    {"role": "system", "content": "You are helpful."},
    {"role": "user", "content": "What is 2+3?"},
    {"role": "assistant", "content": "The answer is 5."},
]


def test_single_chat_mask_covers_assistant_content_and_im_end(tok):
    ids, mask = _expected(tok, [
        ("<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nWhat is 2+3?<|im_end|>\n"
         "<|im_start|>assistant\n", False),
        ("The answer is 5.", True),
        ("<|im_end|>", True),
        ("\n", False),
    ])
    assert sum(mask) == len(_enc(tok, "The answer is 5.")) + 1  # content + exactly one <|im_end|>
    batch = make_sft_batch(tok, [CHAT])
    assert batch.batch_size == torch.Size([1])
    assert batch["input_ids"][0].tolist() == ids
    assert batch["loss_mask"][0].int().tolist() == mask
    assert batch["loss_mask"][0, -1].item() is False  # the trailing newline
    assert batch["attention_mask"].all()
    assert batch["advantages"].shape == (1,)
    assert batch["advantages"].dtype == torch.float32
    assert batch["advantages"].tolist() == [0.0]


def test_multi_turn_masks_every_assistant_turn(tok):
    chat = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"},
        {"role": "user", "content": "What is 4+4?"},
        {"role": "assistant", "content": "<answer>8</answer>"},
    ]
    ids, mask = _expected(tok, [
        ("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n", False),
        ("hello<|im_end|>", True),
        ("\n<|im_start|>user\nWhat is 4+4?<|im_end|>\n<|im_start|>assistant\n", False),
        ("<answer>8</answer><|im_end|>", True),
        ("\n", False),
    ])
    batch = make_sft_batch(tok, [chat])
    assert batch["input_ids"][0].tolist() == ids
    assert batch["loss_mask"][0].int().tolist() == mask


def test_empty_assistant_content_masks_only_im_end(tok):
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": ""}]
    ids, mask = _expected(tok, [
        ("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n", False),
        ("<|im_end|>", True),
        ("\n", False),
    ])
    batch = make_sft_batch(tok, [chat])
    assert batch["input_ids"][0].tolist() == ids
    assert batch["loss_mask"][0].int().tolist() == mask
    assert int(batch["loss_mask"].sum()) == 1


def test_batch_of_unequal_chats_is_right_padded(tok):
    short = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}]
    ids_long, mask_long = _expected(tok, [
        ("<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nWhat is 2+3?<|im_end|>\n"
         "<|im_start|>assistant\n", False),
        ("The answer is 5.<|im_end|>", True),
        ("\n", False),
    ])
    ids_short, mask_short = _expected(tok, [
        ("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n", False),
        ("ok<|im_end|>", True),
        ("\n", False),
    ])
    width, ls = len(ids_long), len(ids_short)
    assert ls < width
    pad = width - ls

    batch = make_sft_batch(tok, [CHAT, short])
    assert batch.batch_size == torch.Size([2])
    for k in TOKEN_KEYS:
        assert batch[k].shape == (2, width), k
    assert batch["input_ids"].tolist() == [ids_long, ids_short + [0] * pad]
    assert batch["loss_mask"].int().tolist() == [mask_long, mask_short + [0] * pad]
    assert batch["attention_mask"].int().tolist() == [[1] * width, [1] * ls + [0] * pad]
    assert batch["versions"].tolist() == [[-1] * width, [-1] * width]
    assert batch["logprobs"].tolist() == [[0.0] * width, [0.0] * width]
    assert batch["rewards"].tolist() == [0.0, 0.0]
    assert batch["advantages"].shape == (2,)
    assert batch["advantages"].dtype == torch.float32
    assert batch["advantages"].tolist() == [0.0, 0.0]
    validate_trajectory(batch)


def test_chat_without_assistant_message_raises(tok):
    with pytest.raises(ValueError, match="SFT chat has no assistant tokens"):
        make_sft_batch(tok, [CHAT, [{"role": "user", "content": "hi"}]])
