"""The engine contract, run for every engine: TransformersEngine and vLLM (its CPU build here).

Each engine is built once per module (vLLM's start-up costs tens of seconds on CPU) and driven
from one event loop thread, as its replica actor drives it. Weight updates go through the
engine's own sink over a real update group, with the test process as learner rank 0.
"""
from __future__ import annotations

import asyncio
import math
import threading
import weakref

import pytest
import torch

from rayllm_rl.inference.protocol import LLMRequest, PromptTooLongError, SamplingParams
from rayllm_rl.learner.logprobs import token_logprobs
from rayllm_rl.sampling_mask import SamplingMask
from rayllm_rl.weight_sync import metadata_of
from rayllm_rl.weight_sync.registry import TRANSPORTS, make_spec
from budgets import VLLM_START_S
from rayllm_rl.loop_thread import EventLoopThread
from weight_sync_helpers import OpenedInBackground

ENGINES = ["transformers", pytest.param("vllm", marks=pytest.mark.vllm)]
TIMEOUT_S = VLLM_START_S
"""The longest engine call the tests await: a vLLM engine's start (tests/budgets.py)."""


class LoopThread(EventLoopThread):
    """The product's loop thread, driving an engine as its actor does: `run` awaits one coroutine through the
    product's own bounded `call` (a TimeoutError names the call)."""

    def __init__(self):
        super().__init__("engine-test-loop")

    def run(self, coro, timeout_s: float = TIMEOUT_S):
        return self.call(coro, timeout_s, getattr(coro, "__qualname__", "an engine call"))


def build_engine(kind: str, path: str):
    if kind == "transformers":
        from rayllm_rl.inference.transformers.engine import TransformersEngine

        return TransformersEngine(path, seed=0)
    from rayllm_rl.inference.vllm.engine import VLLMEngine, VLLMOptions

    return VLLMEngine(path, seed=0, options=VLLMOptions(kv_cache_mb=128))


@pytest.fixture(scope="module", params=ENGINES)
def served(request, tiny_model_path):
    """(engine kind, engine, loop); the engine starts at version 0 with the checkpoint's weights."""
    loop = LoopThread()
    engine = build_engine(request.param, tiny_model_path)
    if hasattr(engine, "start"):
        loop.run(engine.start())
    yield request.param, engine, loop
    if hasattr(engine, "aclose"):
        loop.run(engine.aclose())
    loop.close()


@pytest.fixture(scope="module")
def hf_model(tiny_model_path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval()


def chat_ids(tok, text):
    return list(tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                        tokenize=True, return_dict=False))


def forward_logprobs(model, prompt, output, temperature=1.0):
    """log-softmax of one full forward pass at the given output tokens, `[len(output)]`."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + output])).logits[0].float() / temperature
    lp = torch.log_softmax(logits, -1)[len(prompt) - 1:-1]
    return lp.gather(-1, torch.tensor(output).unsqueeze(-1)).squeeze(-1)


def greedy_reference(model, prompt, n):
    """Greedy continuation by repeated full forwards (no KV cache at all)."""
    seq = list(prompt)
    for _ in range(n):
        with torch.no_grad():
            seq.append(int(model(torch.tensor([seq])).logits[0, -1].argmax()))
    return seq[len(prompt):]


def generate(loop, engine, prompts, sampling):
    async def go():
        return await asyncio.gather(*[engine.agenerate(LLMRequest(input_ids=p, sampling=sampling)) for p in prompts])

    return loop.run(go())


def prompts_for(tokenizer, n=8):
    return [chat_ids(tokenizer, f"What is {i}+{7 * i}?" + " please" * (i % 3)) for i in range(n)]


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_equal_full_forward(served, hf_model, tokenizer, temperature):
    kind, engine, loop = served
    sampling = SamplingParams(max_new_tokens=16, temperature=temperature)
    responses = generate(loop, engine, prompts_for(tokenizer), sampling)
    assert sum(r.output_len for r in responses) > 8
    for r in responses:
        ref = forward_logprobs(hf_model_for(engine, hf_model), r.input_tokens, r.output_tokens, temperature)
        assert (ref - torch.tensor(r.output_logprobs)).abs().max().item() <= 1e-4, kind


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_top_p_logprobs_equal_the_learners_masked_logprobs(served, hf_model, tokenizer, temperature):
    """Sampling-mask replay: at top-p 0.9 the engine reports the logprob of the kept set it drew from, and the
    learner's chunked LM head, rebuilding that set from its own logits, gives the same. Scored over the full
    vocabulary instead, every token is off by log M_t (M_t: the kept mass, >= 0.9): the bias replay removes."""
    kind, engine, loop = served
    responses = generate(loop, engine, prompts_for(tokenizer), SamplingParams(max_new_tokens=16,
                                                                              temperature=temperature, top_p=0.9))
    model, biases = hf_model_for(engine, hf_model), []
    for r in responses:
        ids = torch.tensor([r.input_tokens + r.output_tokens])
        positions = torch.zeros_like(ids, dtype=torch.bool)
        positions[0, len(r.input_tokens):] = True
        with torch.no_grad():
            scored = [token_logprobs(model, ids, torch.ones_like(ids), temperature, positions=positions, chunk_size=7,
                                     mask=mask)[0, len(r.input_tokens):]
                      for mask in (SamplingMask(0, 0.9), SamplingMask())]
        engine_lp = torch.tensor(r.output_logprobs, dtype=torch.float64)
        assert (scored[0] - engine_lp).abs().max().item() <= 1e-4, kind
        biases.append(scored[1] - engine_lp)
    bias = torch.cat(biases)
    assert bias.numel() > 8 and bias.max() <= 1e-4 and bias.min() >= math.log(0.9) - 1e-4, kind
    assert bias.mean() <= -0.02, (kind, float(bias.mean()))  # this model's nucleus keeps ~0.9 of the mass


UPDATED_REFERENCE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
"""Engine -> the HF model holding the weights a weight-update test below loaded into it; kept here by the test,
not on the engine, and gone with the engine."""


def hf_model_for(engine, hf_model):
    """The HF model holding the engine's current weights (tests below may have updated them)."""
    return UPDATED_REFERENCE.get(engine, hf_model)


def test_stop_and_length_reasons(served, tokenizer):
    kind, engine, loop = served
    p = chat_ids(tokenizer, "What is 2+2?")
    (r,) = generate(loop, engine, [p], SamplingParams(max_new_tokens=5, greedy=True, ignore_eos=True))
    assert r.stop_reason == "length" and r.output_len == 5
    stop_at = r.output_tokens[2]
    first = r.output_tokens.index(stop_at)
    (s,) = generate(loop, engine, [p], SamplingParams(max_new_tokens=5, greedy=True, ignore_eos=True,
                                                      stop_token_ids=(stop_at,)))
    assert s.stop_reason == "stop"
    assert s.output_tokens == r.output_tokens[:first + 1], "the stop token ends the output and is kept"


def test_greedy_is_deterministic_and_argmax(served, hf_model, tokenizer):
    kind, engine, loop = served
    p = chat_ids(tokenizer, "What is 12+30?")
    sp = SamplingParams(max_new_tokens=8, greedy=True, ignore_eos=True)
    a, b = generate(loop, engine, [p, p], sp)
    (c,) = generate(loop, engine, [p], sp)
    assert a.output_tokens == b.output_tokens == c.output_tokens
    assert a.output_tokens == greedy_reference(hf_model_for(engine, hf_model), p, 8)


def test_prompt_too_long_is_a_clear_error(served):
    kind, engine, loop = served
    req = LLMRequest(input_ids=[5] * 500, sampling=SamplingParams(max_new_tokens=64))
    with pytest.raises(PromptTooLongError, match="exceeds the model context of 512"):
        loop.run(engine.agenerate(req))


def perturbed(hf_model, scale, seed):
    g = torch.Generator().manual_seed(seed)
    return {k: v.detach() + scale * torch.randn(v.shape, generator=g) for k, v in hf_model.named_parameters()}


def update_over_group(loop, engine, named, version, transport):
    """Learner rank 0 in this process: send `named` stamped `version` through the engine's own sink,
    both ends built by the transport registry, learner rank 0's opened first as the driver does (a group
    binds its store there; Ray channels make what the receiver reads)."""
    metas = metadata_of(named)
    info = TRANSPORTS[transport]
    spec = make_spec(transport, [(m.name, m.shape, str(m.dtype).removeprefix("torch.")) for m in metas],
                     receivers=1, timeout_s=60.0, bucket_bytes=1 << 16, host="127.0.0.1",
                     readers=[reader_stand_in()] if info.needs_readers else ())
    rank0 = OpenedInBackground(spec, metas)  # finishes while the engine joins (a group waits for its peers)
    loop.run(engine.weights.init_update_group(rank0.spec.for_rank(1)))
    sender = rank0.sender(60)
    box: dict = {}
    if spec.info.pulls:  # publish first, then the receiver fetches what the handoff names
        stats, handoff = sender.send(named, version)
        result = loop.run(engine.weights.receive_weights(handoff))
    else:  # the bytes move in a collective both ends join
        send = threading.Thread(target=lambda: box.setdefault("sent", sender.send(named, version)))
        send.start()
        result = loop.run(engine.weights.receive_weights())
        send.join(60)
        stats = box["sent"][0]
    assert stats.version == version and stats.bytes == sum(m.nbytes for m in metas)
    return result, sender


def reader_stand_in():
    """(actor handle, node id) standing for this process as a channel's reader: Ray counts a channel's
    readers by actor, and the engine reads here, in the driver (Ray's Compiled Graphs stand a proxy actor
    in for the driver the same way)."""
    import ray

    @ray.remote(num_cpus=0)
    class ReaderStandIn:
        def node_id(self) -> str:
            return ray.get_runtime_context().get_node_id()

    handle = ReaderStandIn.remote()
    return handle, ray.get(handle.node_id.remote(), timeout=60)


@pytest.fixture(scope="module")
def ray_session():
    """A local Ray for the object-store transport: this process is learner rank 0 and the replica."""
    from ray_sessions import local_ray_session

    with local_ray_session("test_engine_contract", num_cpus=1):
        yield


CPU_TRANSPORTS = [pytest.param(name, marks=pytest.mark.ray) if info.receiver_needs_ray else name
                  for name, info in TRANSPORTS.items() if not info.gpu_only]


@pytest.mark.parametrize("transport", CPU_TRANSPORTS)
def test_update_bumps_version_and_leaves_no_stale_kv(served, hf_model, tokenizer, tiny_model_path, transport, request):
    """Versions are constant before a sync and v+1 after; tokens after it equal a fresh model with
    the new weights (prefix cache and KV of the old weights are not reused)."""
    from transformers import AutoModelForCausalLM

    kind, engine, loop = served
    if TRANSPORTS[transport].receiver_needs_ray:
        request.getfixturevalue("ray_session")
    p = chat_ids(tokenizer, "What is 3+4?")
    sp = SamplingParams(max_new_tokens=8, greedy=True, ignore_eos=True)
    v = engine.version
    before = generate(loop, engine, [p] * 3, sp)
    assert all(r.output_versions == [v] * 8 for r in before)

    new = perturbed(hf_model, 0.05, seed=v + 1)
    fresh = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval()
    fresh.load_state_dict(new, strict=False)
    result, sender = update_over_group(loop, engine, new, v + 1, transport)
    try:
        assert result["version"] == v + 1 and engine.version == v + 1
        assert result["stall_s"] >= 0 and result["receive_s"] >= 0
        sums_equal = abs(loop.run(engine.weights.weights_checksum()) - _checksum(new))
        assert sums_equal <= 1e-6 * abs(_checksum(new))
        (after,) = generate(loop, engine, [p], sp)
        assert after.output_versions == [v + 1] * 8
        assert after.output_tokens == greedy_reference(fresh, p, 8)
        ref = forward_logprobs(fresh, p, after.output_tokens)
        assert (ref - torch.tensor(after.output_logprobs)).abs().max().item() <= 1e-4
        assert after.output_tokens != before[0].output_tokens or \
            (forward_logprobs(hf_model, p, after.output_tokens) - ref).abs().max().item() > 1e-3
        UPDATED_REFERENCE[engine] = fresh  # later tests compare against the weights the engine now holds
    finally:
        loop.run(engine.weights.close_update_group())
        sender.close()


def _checksum(named):
    from rayllm_rl.inference.protocol import weights_checksum

    return weights_checksum(named)


def test_direct_load_weights_sets_weights_and_version(served, hf_model, tokenizer, tiny_model_path):
    """The sink's direct path (initial load, fallback without a group): weights handed over in the call."""
    from transformers import AutoModelForCausalLM

    kind, engine, loop = served
    v = engine.version
    new = perturbed(hf_model, 0.05, seed=100 + v)
    fresh = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval()
    fresh.load_state_dict(new, strict=False)
    assert loop.run(engine.weights.load_weights(new, v + 1)) == v + 1 and engine.version == v + 1
    assert abs(loop.run(engine.weights.weights_checksum()) - _checksum(new)) <= 1e-6 * abs(_checksum(new))
    p = chat_ids(tokenizer, "What is 5+6?")
    (r,) = generate(loop, engine, [p], SamplingParams(max_new_tokens=8, greedy=True, ignore_eos=True))
    assert r.output_versions == [v + 1] * 8
    assert r.output_tokens == greedy_reference(fresh, p, 8)
    UPDATED_REFERENCE[engine] = fresh


@pytest.mark.parametrize("kind", ENGINES)  # vllm's through conftest's rule: fails where `make` installs it, if missing
def test_every_engine_holds_a_weight_sink_and_generation_turns(kind, tiny_model_path):
    """The engine contract's three parts are separate protocols: an engine generates, and holds its weight sink
    (`engine.weights`) and its turns (`engine.turns`) as parts, not as mixed-in methods. Built, not started."""
    from rayllm_rl.inference.protocol import GenerationTurns, InferenceEngine, WeightSink
    from rayllm_rl.inference.registry import build_engine

    engine = build_engine(kind, tiny_model_path)
    assert isinstance(engine, InferenceEngine)
    assert isinstance(engine.weights, WeightSink) and isinstance(engine.turns, GenerationTurns)
    assert not isinstance(engine, WeightSink) and not isinstance(engine, GenerationTurns)
    assert not isinstance(engine.weights, GenerationTurns) and not isinstance(engine.turns, WeightSink)
    assert engine.version == engine.weights.version == 0
    assert not {"pause", "sleep", "wake_up", "resume"} & set(WeightSink.__dict__)
