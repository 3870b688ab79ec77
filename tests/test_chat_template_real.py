"""SmolLM2-135M-Instruct's own chat template (ChatML with a default system line, no `{% generation %}`
marks) through History / ChatHistory: text round trips, assistant masks cover exactly the assistant's
tokens, and a multi-turn episode appends the next turn without the template's default system line."""
from __future__ import annotations

import pytest
import torch

from rayllm_rl.data.chat_template import assistant_token_mask, has_generation_marks, next_turn_text
from rayllm_rl.data.history import ChatHistory, History


DEFAULT_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
CHAT = [{"role": "user", "content": "What is 17 + 25?"}, {"role": "assistant", "content": "17 + 25 = 42"},
        {"role": "user", "content": "And 3 + 4?"}, {"role": "assistant", "content": "7, because 3 + 4 = 7."}]


@pytest.fixture(scope="module")
def smol_tokenizer(smollm2_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_path)  # the cached conversion's tokenizer


def test_text_round_trips_through_history(smol_tokenizer):
    history = History.from_chats(CHAT)
    text = history.apply_chat_template(smol_tokenizer)
    assert text.startswith(f"<|im_start|>system\n{DEFAULT_SYSTEM}<|im_end|>\n<|im_start|>user\nWhat is 17 + 25?")
    back = History.from_text(text)
    assert back.to_chat() == [{"role": "system", "content": DEFAULT_SYSTEM}, *CHAT]
    # a generation cut short is an open assistant message; the generation prompt alone is dropped
    cut = History.from_text(history[:1].apply_chat_template(smol_tokenizer, add_generation_prompt=True) + "17 + 2")
    assert cut.to_chat()[-1] == {"role": "assistant", "content": "17 + 2"} and not bool(cut.is_complete[-1])
    batch = History.from_chats([CHAT[:2], CHAT])
    chat_history = ChatHistory(prompt=batch, batch_size=[2])
    texts = chat_history.prompt.apply_chat_template(smol_tokenizer)
    assert [History.from_text(t).to_chat()[1:] for t in texts] == [CHAT[:2], CHAT]


def test_assistant_masks_cover_exactly_the_assistants_tokens(smol_tokenizer):
    assert not has_generation_marks(smol_tokenizer)  # HF's return_assistant_tokens_mask gives all zeros here
    out = History.from_chats(CHAT).apply_chat_template(smol_tokenizer, return_assistant_tokens_mask=True)
    ids, mask = out["input_ids"], out["assistant_masks"]
    assert ids.tolist() == smol_tokenizer.apply_chat_template(CHAT, tokenize=True, return_dict=False)
    im_end = smol_tokenizer.convert_tokens_to_ids("<|im_end|>")
    # each masked span is an assistant message's content tokens and its <|im_end|>, nothing else
    spans, start = [], None
    for i, m in enumerate(mask.tolist() + [False]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            spans.append((start, i))
            start = None
    assert len(spans) == 2
    for (a, b), message in zip(spans, [CHAT[1], CHAT[3]]):
        assert ids[b - 1] == im_end and smol_tokenizer.decode(ids[a:b - 1]) == message["content"]
        assert smol_tokenizer.decode(ids[:a]).endswith("<|im_start|>assistant\n")  # the header is not trained on
    assert int(mask.sum()) == sum(len(smol_tokenizer.encode(m["content"])) + 1 for m in (CHAT[1], CHAT[3]))


def test_prefix_masks_agree_with_generation_marks_where_both_exist(tokenizer):
    """The tiny model's template has {% generation %} marks: the prefix-render method gives HF's mask."""
    from rayllm_rl.data import chat_template

    assert has_generation_marks(tokenizer)
    hf = assistant_token_mask(tokenizer, CHAT)
    text = tokenizer.apply_chat_template(CHAT, tokenize=False)
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    spans = chat_template.assistant_spans(tokenizer, CHAT)
    ours = torch.tensor([any(s <= a < e for s, e in spans) for a, _ in enc["offset_mapping"]])
    assert enc["input_ids"] == hf["input_ids"].tolist() and torch.equal(ours, hf["assistant_masks"])


def test_next_turn_has_no_default_system_line(smol_tokenizer):
    from rayllm_rl.workflows.multi_turn import feedback_suffix_ids

    turn = next_turn_text(smol_tokenizer, "user", "Try again.")
    assert turn == "\n<|im_start|>user\nTry again.<|im_end|>\n<|im_start|>assistant\n"
    lone = smol_tokenizer.apply_chat_template([{"role": "user", "content": "Try again."}], tokenize=False,
                                              add_generation_prompt=True)
    assert DEFAULT_SYSTEM in lone and DEFAULT_SYSTEM not in turn  # what rendering the lone message would add
    first = smol_tokenizer.apply_chat_template(CHAT[:1], tokenize=True, add_generation_prompt=True, return_dict=False)
    answer = smol_tokenizer.encode("17 + 25 = 42<|im_end|>")
    ids = first + answer + feedback_suffix_ids(smol_tokenizer, first + answer, "And 3 + 4?")
    # token-in/token-out equals a render of the whole chat: the past is never re-tokenized differently
    assert ids == smol_tokenizer.apply_chat_template(CHAT[:3], tokenize=True, add_generation_prompt=True,
                                                     return_dict=False)
    cut = smol_tokenizer.encode("17 + 25 =")  # cut before <|im_end|>: the turn is closed first
    assert smol_tokenizer.decode(feedback_suffix_ids(smol_tokenizer, first + cut, "Go on."))[:11] == "<|im_end|>\n"
