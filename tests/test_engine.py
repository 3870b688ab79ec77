"""TransformersEngine: logprobs equal a full forward, versions are stamped, swaps land between steps."""
from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch

from rayllm_rl.inference.protocol import LLMRequest, SamplingParams
from rayllm_rl.inference.decoding import DecodeLock
from rayllm_rl.inference.transformers.engine import PromptTooLongError
from rayllm_rl.sampling_mask import SamplingMask, masked_logprobs


def chat_ids(tok, text):
    return list(tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                        tokenize=True, return_dict=False))


def forward_logprobs(model, prompt, output, temperature=1.0, mask=SamplingMask()):
    """log-softmax of a full forward pass at the sampled tokens (over top-k / top-p's kept set under `mask`)."""
    full = torch.tensor([prompt + output])
    with torch.no_grad():
        logits = model(full).logits[0].float() / temperature
    return masked_logprobs(logits[len(prompt) - 1:-1], torch.tensor(output), mask)


@pytest.mark.parametrize("sampling", [
    SamplingParams(max_new_tokens=24, temperature=1.0),
    SamplingParams(max_new_tokens=24, temperature=0.7, top_k=20),
    SamplingParams(max_new_tokens=24, temperature=1.3, top_p=0.9),
])
def test_logprobs_equal_full_forward_and_versions_stamped(engine, tokenizer, sampling):
    engine.weights.load_weights_sync(engine.weights.named_parameters(), version=3)  # same weights, version 3
    prompts = [chat_ids(tokenizer, "What is %d+%d?" % (i, 7 * i) + " please" * (i % 4)) for i in range(12)]

    async def run():
        return await asyncio.gather(*[engine.agenerate(LLMRequest(input_ids=p, sampling=sampling)) for p in prompts])

    responses = asyncio.run(run())
    assert engine.stats.batches == 1, "concurrent requests must share one batch"
    assert sum(r.output_len for r in responses) > 12
    for p, r in zip(prompts, responses):
        assert r.input_tokens == p
        ref = forward_logprobs(engine.model, p, r.output_tokens, sampling.temperature,
                               SamplingMask(sampling.top_k, sampling.top_p))
        assert (ref - torch.tensor(r.output_logprobs)).abs().max().item() <= 1e-4
        assert r.output_versions == [3] * r.output_len
        assert r.stop_reason in ("stop", "length")
        assert r.stop_reason == "stop" or r.output_len == sampling.max_new_tokens


def test_greedy_is_argmax_and_deterministic(engine, tokenizer):
    p = chat_ids(tokenizer, "What is 2+2?")
    sp = SamplingParams(max_new_tokens=8, greedy=True, ignore_eos=True)
    a, b = engine.generate([LLMRequest(input_ids=p, sampling=sp)] * 2)
    assert a.output_tokens == b.output_tokens and a.output_len == 8
    seq = list(p)
    for tok_id in a.output_tokens:
        with torch.no_grad():
            nxt = engine.model(torch.tensor([seq])).logits[0, -1].argmax().item()
        assert tok_id == nxt
        seq.append(tok_id)


def test_stop_reasons(engine, tokenizer):
    p = chat_ids(tokenizer, "hi")
    every_token = tuple(range(len(tokenizer)))
    stop, = engine.generate([LLMRequest(input_ids=p,
                                        sampling=SamplingParams(max_new_tokens=5, stop_token_ids=every_token))])
    assert stop.stop_reason == "stop" and stop.output_len == 1
    length, = engine.generate([LLMRequest(input_ids=p, sampling=SamplingParams(max_new_tokens=5, ignore_eos=True))])
    assert length.stop_reason == "length" and length.output_len == 5


def test_bad_requests_fail_clearly(engine, tokenizer):
    with pytest.raises(PromptTooLongError, match="exceeds the model context"):
        engine.generate([LLMRequest(input_ids=[5] * 500, sampling=SamplingParams(max_new_tokens=64))])
    with pytest.raises(TypeError, match="list of int token ids"):
        engine.generate([LLMRequest(input_ids=["hello"])])
    with pytest.raises(ValueError, match="empty input_ids"):
        engine.generate([LLMRequest(input_ids=[])])
    with pytest.raises(KeyError, match="unknown parameter names"):
        engine.weights.load_weights_sync({"not.a.param": torch.zeros(1)})


def test_bad_request_fails_only_its_caller(engine, tokenizer):
    async def run():
        good = engine.agenerate(LLMRequest(input_ids=chat_ids(tokenizer, "ok"),
                                           sampling=SamplingParams(max_new_tokens=3)))
        bad = engine.agenerate(LLMRequest(input_ids=[5] * 600))
        return await asyncio.gather(good, bad, return_exceptions=True)

    good, bad = asyncio.run(run())
    assert isinstance(bad, PromptTooLongError)
    assert good.output_len >= 1


def test_a_waiting_weight_writer_goes_before_the_next_decode_step():
    """A plain Lock lets the decode loop, which takes it again microseconds after releasing it,
    starve a writer for a whole generation; DecodeLock lets at most the running step finish."""
    lock, steps, stop = DecodeLock(), [0], threading.Event()

    def decode_loop():
        while not stop.is_set():
            with lock.decode_step():
                time.sleep(0.002)  # a decode step's forward (releases the GIL, like torch)
                steps[0] += 1

    worker = threading.Thread(target=decode_loop)
    worker.start()
    waited = []
    try:
        for _ in range(20):
            time.sleep(0.005)
            before = steps[0]
            with lock.writer():
                waited.append(steps[0] - before)  # decode steps that ended while the writer waited
    finally:
        stop.set()
        worker.join(timeout=10)
    assert sorted(waited)[len(waited) // 2] <= 1, waited  # the median: a loaded machine may preempt the writer


def test_weight_swap_lands_between_decode_steps(engine, tokenizer):
    """Update weights mid-generation: tokens before carry v0 and old-weight logprobs, after v1 and new."""
    import copy

    old_model = copy.deepcopy(engine.model)
    torch.manual_seed(1)
    new_weights = {k: v + 0.05 * torch.randn_like(v) for k, v in engine.weights.named_parameters().items()}
    prompts = [chat_ids(tokenizer, f"count {i}") for i in range(4)]
    sp = SamplingParams(max_new_tokens=400, ignore_eos=True)
    result = {}
    worker = threading.Thread(target=lambda: result.setdefault(
        "r", engine.generate([LLMRequest(input_ids=p, sampling=sp) for p in prompts])))
    worker.start()
    deadline = time.time() + 60
    while engine.stats.decode_steps < 20 and time.time() < deadline:
        time.sleep(0.001)
    engine.weights.load_weights_sync(new_weights, version=1)
    worker.join(timeout=120)
    assert not worker.is_alive()
    for p, r in zip(prompts, result["r"]):
        k = r.output_versions.index(1)
        assert 20 <= k < 400
        assert r.output_versions == [0] * k + [1] * (400 - k)  # monotonic, one switch
        before = forward_logprobs(old_model, p, r.output_tokens[:k])
        assert (before - torch.tensor(r.output_logprobs[:k])).abs().max().item() <= 1e-4
        after = forward_logprobs(engine.model, p, r.output_tokens)[k:]
        assert (after - torch.tensor(r.output_logprobs[k:])).abs().max().item() <= 1e-4
    assert all(torch.equal(engine.weights.named_parameters()[k], v) for k, v in new_weights.items())
    assert engine.stats.cache_rebuilds == 1


def test_swap_weights_exchanges_buffers_and_bumps_version(engine, tokenizer):
    old = {k: v.clone() for k, v in engine.weights.named_parameters().items()}
    back = {k: torch.empty_like(v) for k, v in engine.weights.named_parameters().items()}
    for k, v in back.items():
        v.copy_(old[k] + 1.0)
    stall = engine.weights.swap_weights(back, version=5)
    assert stall >= 0 and engine.version == 5
    for k, v in engine.weights.named_parameters().items():
        assert torch.equal(v, old[k] + 1.0) and torch.equal(back[k], old[k])
    r, = engine.generate([LLMRequest(input_ids=chat_ids(tokenizer, "x"),
                                     sampling=SamplingParams(max_new_tokens=4, ignore_eos=True))])
    assert r.output_versions == [5] * 4
    assert (forward_logprobs(engine.model, r.input_tokens, r.output_tokens)
            - torch.tensor(r.output_logprobs)).abs().max() <= 1e-4
    with pytest.raises(ValueError, match="expected"):
        engine.weights.swap_weights({"model.norm.weight": torch.zeros(3)}, version=6)
