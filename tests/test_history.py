"""History / ChatHistory: chat roundtrips, assistant masks, growth, incomplete messages, ragged batches."""
import pytest
import torch

from rayllm_rl.data.history import ChatHistory, History

CHAT = [
    {"role": "system", "content": "You are helpful."},
    {"role": "user", "content": "What is 2+3?"},
    {"role": "assistant", "content": "The answer is 5."},
]
SHORT = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    from rayllm_rl.models.tiny import ensure_tiny_model

    return AutoTokenizer.from_pretrained(ensure_tiny_model())


def _ids(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


def test_roundtrip_chats_text_from_text(tok):
    h = History.from_chats(CHAT)
    assert h.batch_size == torch.Size([3])
    assert h.to_chats() == [CHAT]
    text = h.apply_chat_template(tok)
    assert text == tok.apply_chat_template(CHAT, tokenize=False)
    back = History.from_text(text)
    assert back.to_chat() == CHAT
    assert back.is_complete.tolist() == [True, True, True]
    # with the generation prompt: the empty assistant header is not a message ...
    with_gen = h.apply_chat_template(tok, add_generation_prompt=True)
    assert with_gen.endswith("<|im_start|>assistant\n")
    assert History.from_text(with_gen).to_chat() == CHAT
    # ... unless asked for
    kept = History.from_text(with_gen, drop_generation_prompt=False)
    assert kept[-1].role == "assistant" and kept[-1].content == "" and not kept.is_complete[-1]


def test_assistant_mask_covers_content_and_im_end(tok):
    chat = CHAT + [{"role": "user", "content": "Sure?"}, {"role": "assistant", "content": "Yes 5"}]
    out = History.from_chats(chat).apply_chat_template(tok, return_assistant_tokens_mask=True)
    ids, mask = out["input_ids"], out["assistant_masks"]
    assert ids.tolist() == tok.apply_chat_template(chat, tokenize=True, return_dict=True)["input_ids"]
    im_start = tok.convert_tokens_to_ids("<|im_start|>")
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    header = _ids(tok, "<|im_start|>assistant\n")
    starts = [i for i, t in enumerate(ids.tolist()) if t == im_start]
    expected = torch.zeros_like(mask)
    for msg_index, content in ((2, "The answer is 5."), (4, "Yes 5")):
        begin = starts[msg_index] + len(header)
        body = _ids(tok, content) + [im_end]
        assert ids[begin : begin + len(body)].tolist() == body  # located by hand
        expected[begin : begin + len(body)] = True
    assert torch.equal(mask, expected)
    assert mask.sum().item() == len(_ids(tok, "The answer is 5.")) + len(_ids(tok, "Yes 5")) + 2


def test_tokenize_matches_hf(tok):
    h = History.from_chats(CHAT[:2])
    ids = h.apply_chat_template(tok, add_generation_prompt=True, tokenize=True)
    hf = tok.apply_chat_template(CHAT[:2], add_generation_prompt=True, tokenize=True, return_dict=True)
    assert ids.dtype == torch.long and ids.tolist() == hf["input_ids"]


def test_extend_and_append():
    h = History.from_chats(CHAT[:2])
    reply = {"role": "assistant", "content": "5"}
    h2 = h.append(reply)
    assert h.batch_size[0] == 2 and h2.to_chat() == CHAT[:2] + [reply]  # not in place by default
    h3 = h.extend(History.from_chats([reply, SHORT[0]]))
    assert h3.to_chat() == CHAT[:2] + [reply, SHORT[0]]
    assert h.append(History(role="assistant", content="5")).to_chat() == h2.to_chat()
    same = h.append(reply, inplace=True)
    assert same is h and h.to_chat() == CHAT[:2] + [reply]
    with pytest.raises(ValueError, match="message dim"):
        History.from_chats([CHAT, SHORT]).extend(History.from_chats([SHORT, SHORT]), dim=0)
    with pytest.raises(ValueError):
        h.append(History.from_chats([reply]))  # append takes one message, not a conversation


def test_incomplete_trailing_assistant(tok):
    prompt = History.from_chats(CHAT[:2]).apply_chat_template(tok, add_generation_prompt=True)
    h = History.from_text(prompt + "The ans")
    assert h.to_chat() == CHAT[:2] + [{"role": "assistant", "content": "The ans"}]
    assert h.is_complete.tolist() == [True, True, False]
    assert h[..., -1].is_complete.item() is False
    # rendered open again (no <|im_end|>), so text -> History -> text is the identity
    assert h.apply_chat_template(tok) == prompt + "The ans"
    done = History.from_text(prompt + "The answer<|im_end|><|endoftext|><|endoftext|>")
    assert done.is_complete.tolist() == [True, True, True] and done[-1].content == "The answer"
    bare = History.from_text("Just a body<|im_end|>")  # response text with no header
    assert bare.to_chat() == [{"role": "assistant", "content": "Just a body"}]


def test_batch_of_two_conversations(tok):
    h = History.from_chats([CHAT, SHORT])
    assert h.batch_size == torch.Size([2, -1])
    assert h.num_messages == [3, 1]
    assert h.to_chats() == [CHAT, SHORT]
    last = h[..., -1]
    assert last.batch_size == torch.Size([2])
    assert list(last.role) == ["assistant", "user"] and list(last.content) == ["The answer is 5.", "hi"]
    assert h[1].to_chat() == SHORT
    texts = h.apply_chat_template(tok, add_generation_prompt=True)
    assert texts == [tok.apply_chat_template(c, tokenize=False, add_generation_prompt=True) for c in (CHAT, SHORT)]
    assert History.from_text(texts).to_chats() == [CHAT, SHORT]
    masks = h.apply_chat_template(tok, return_assistant_tokens_mask=True)
    assert [m.sum().item() for m in masks["assistant_masks"]] == [len(_ids(tok, "The answer is 5.")) + 1, 0]
    reply = History.from_chats([{"role": "assistant", "content": "a"}, {"role": "assistant", "content": "b"}])
    grown = h.append(reply)  # one message per conversation
    assert grown.num_messages == [4, 2] and list(grown[..., -1].content) == ["a", "b"]
    more = h.extend(History.from_chats([[SHORT[0]], SHORT * 2]))
    assert more.num_messages == [4, 3]


def test_chat_history_contract():
    prompt = History.from_chats([CHAT[:2], SHORT])
    response = History.from_chats([[{"role": "assistant", "content": "5"}], [{"role": "assistant", "content": "hey"}]])
    ch = ChatHistory(prompt=prompt, response=response, batch_size=[2])
    assert ch.full is None
    ch.full = ch.prompt.extend(response, inplace=False, dim=-1)
    assert ch.full.num_messages == [3, 2]
    assert ch[1].full.to_chat() == SHORT + [{"role": "assistant", "content": "hey"}]
    nxt = ChatHistory(prompt=ch.full, batch_size=[2])  # what the env does
    assert nxt.prompt.to_chats() == ch.full.to_chats()


def test_errors():
    with pytest.raises(NotImplementedError):
        History.from_text("x", chat_template_name="llama3")
    with pytest.raises(ValueError, match="content"):
        History.from_chats([{"role": "user"}])
    assert History.from_chats([]).to_chat() == []
    assert History.from_chats([]).extend(SHORT).to_chat() == SHORT
