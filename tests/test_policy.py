"""LLMPolicy + ChatEnv: TorchRL's ChatHistory contract (prompt/response/full) with a real engine."""
from __future__ import annotations

import asyncio

import pytest
import torch
from datasets import Dataset

from rayllm_rl.envs import ChatEnv, DataLoadingPrimer
from rayllm_rl.envs.transforms import Transform
from rayllm_rl.inference.policy import LLMPolicy
from rayllm_rl.inference.protocol import SamplingParams

RETRY = "Not quite. Try again."


class AskAgain(Transform):
    """Appends a user message after every assistant turn (a minimal multi-turn env)."""

    def step(self, td_next, td_action):
        for elem in td_next.unbind(0):
            self.env.add_messages(elem, {"role": "user", "content": RETRY})
        return td_next


def forward_logprobs(model, full_ids, n_prompt):
    with torch.no_grad():
        lp = torch.log_softmax(model(full_ids.unsqueeze(0)).logits[0].float(), -1)
    return lp[n_prompt - 1:-1].gather(-1, full_ids[n_prompt:].unsqueeze(-1)).squeeze(-1)


def test_history_mode_two_turns_token_first(engine, tokenizer):
    ds = Dataset.from_list([{"question": "What is 3+4?"}, {"question": "What is 10+5?"}])
    env = ChatEnv(tokenizer, input_mode="history", batch_size=2, with_tokenizer=True,
                  system_prompt="You add numbers.")
    env.append_transform(DataLoadingPrimer(ds, batch_size=2, shuffle=False)).append_transform(AskAgain())
    policy = LLMPolicy(engine, tokenizer, input_mode="history", prefer_tokens=True,
                       sampling=SamplingParams(max_new_tokens=12))
    td = env.reset()
    engine.weights.load_weights_sync(engine.weights.named_parameters(), version=7)
    for turn in range(2):
        prompt_tokens = [t.clone() for t in td.get(("tokens", "prompt"), as_list=True)]
        td = asyncio.run(policy(td))
        for i, elem in enumerate(td.unbind(0)):
            hist = elem["history"]
            assert hist.full is not None and hist.response is not None
            assert hist.full.to_chat() == hist.prompt.to_chat() + hist.response.to_chat()
            assert hist.response.to_chat()[0]["role"] == "assistant"
            full = elem["tokens", "full"]
            # The engine got exactly the env's pre-tokenized prompt (no re-tokenization).
            assert full[:len(prompt_tokens[i])].tolist() == prompt_tokens[i].tolist()
            assert full.tolist() == elem["tokens", "prompt"].tolist() + elem["tokens", "response"].tolist()
            ref = forward_logprobs(engine.model, full, len(prompt_tokens[i]))
            assert (ref - elem["log_probs", "response"]).abs().max().item() <= 1e-4
            assert elem["versions", "response"].tolist() == [7] * len(elem["tokens", "response"])
        nxt = env.step_mdp(env.step(td))
        for elem, act in zip(nxt.unbind(0), td.unbind(0)):
            assert (elem["history", "prompt"].to_chat()
                    == act["history", "full"].to_chat() + [{"role": "user", "content": RETRY}])
            # Next prompt tokens extend the exact previous tokens.
            full = act["tokens", "full"].tolist()
            assert elem["tokens", "prompt"].tolist()[:len(full)] == full
        td = nxt


@pytest.mark.parametrize("mode", ["text", "tokens"])
def test_text_and_tokens_modes_full_becomes_prompt(engine, tokenizer, mode):
    env = ChatEnv(tokenizer, input_mode=mode, batch_size=1)
    from tensordict import TensorDict

    td = env.reset(TensorDict(query=["Say hi"], batch_size=[1]))
    policy = LLMPolicy(engine, tokenizer, input_mode=mode, sampling=SamplingParams(max_new_tokens=6))
    td = asyncio.run(policy(td))
    nxt = env.step_mdp(env.step(td))
    if mode == "text":
        assert nxt[0]["text", "prompt"] == td[0]["text", "full"]
        assert td[0]["text", "full"] == td[0]["text", "prompt"] + td[0]["text", "response"]
    else:
        assert nxt[0]["tokens", "prompt"].tolist() == td[0]["tokens", "full"].tolist()


def test_policy_rejects_bad_mode_and_missing_prompt(engine, tokenizer):
    with pytest.raises(ValueError, match="input_mode"):
        LLMPolicy(engine, tokenizer, input_mode="images")
    from tensordict import TensorDict

    with pytest.raises(KeyError, match="tokens"):
        asyncio.run(LLMPolicy(engine, tokenizer, input_mode="tokens")(TensorDict({}, batch_size=[1])))


class EchoEngine:
    """Answers every request with tokens [7, 8] (logprobs -0.5, -0.25, version 3), recording requests."""

    def __init__(self):
        self.requests = []

    async def agenerate(self, req):
        from rayllm_rl.inference.protocol import LLMResponse

        self.requests.append(req)
        return LLMResponse(list(req.input_ids), [7, 8], [-0.5, -0.25], [3, 3], "length", rid=req.rid)


def test_rids_and_response_of_give_back_the_engine_call(tokenizer):
    from tensordict import TensorDict

    from rayllm_rl.inference.policy import response_of

    env = ChatEnv(tokenizer, input_mode="tokens", batch_size=2)
    td = env.reset(TensorDict(query=["a", "b"], batch_size=[2]))
    engine = EchoEngine()
    policy = LLMPolicy(engine, tokenizer, input_mode="tokens", sampling=SamplingParams(max_new_tokens=2))
    td = asyncio.run(policy(td, rids=["conv-0", "conv-1"]))
    assert [r.rid for r in engine.requests] == ["conv-0", "conv-1"]
    for req, elem in zip(engine.requests, td.unbind(0)):
        resp = response_of(elem)
        assert resp.input_tokens == req.input_ids and resp.output_tokens == [7, 8]
        assert resp.output_logprobs == [-0.5, -0.25] and resp.output_versions == [3, 3]
        assert resp.stop_reason == "length"
    with pytest.raises(ValueError, match="rids"):
        asyncio.run(policy(td, rids=["only-one"]))
