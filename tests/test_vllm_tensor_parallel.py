"""A vLLM replica with tensor_parallel_size=2 (vLLM's CPU build, two worker processes) receives weights:
over a group transport each worker joins as a rank of its own (the replica's first rank + its TP rank),
over the object store the replica's actor stages them once for both workers. After the update, greedy
tokens and logprobs equal a full forward of the new weights."""
from __future__ import annotations

import threading

import pytest
import torch

from rayllm_rl.inference.protocol import LLMRequest, SamplingParams
from rayllm_rl.weight_sync import metadata_of
from rayllm_rl.weight_sync.registry import make_spec

from test_engine_contract import ray_session  # noqa: E402,F401  (the contract's local Ray, as a fixture here)
from weight_sync_helpers import OpenedInBackground  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def test_cpu_thread_binding_splits_the_cores_per_worker(monkeypatch):
    import os

    from rayllm_rl.inference.vllm.engine import cpu_thread_binding

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    assert cpu_thread_binding(2) == "0,1|2,3"
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0})
    with pytest.raises(ValueError, match="ray.tensor_parallel_size=2 on CPU needs at least one core per worker"):
        cpu_thread_binding(2)


@pytest.fixture(scope="module")
def tp_engine(tiny_model_path):
    """One tensor-parallel engine for both transports (a TP=2 start is two vLLM workers): each test joins it to
    its transport's group afresh and sends it the next version."""
    from types import SimpleNamespace

    from rayllm_rl.inference.vllm.engine import VLLMEngine, VLLMOptions
    from test_engine_contract import LoopThread

    loop = LoopThread()
    engine = VLLMEngine(tiny_model_path, seed=0, tensor_parallel_size=2, options=VLLMOptions(kv_cache_mb=64))
    try:
        loop.run(engine.start())
        yield SimpleNamespace(loop=loop, engine=engine, versions=iter(range(1, 100)))
    finally:
        loop.run(engine.aclose())
        loop.close()


@pytest.mark.parametrize("transport", ["gloo", pytest.param("object_store", marks=pytest.mark.ray)])
def test_a_tensor_parallel_replica_receives_weights_on_every_worker(tiny_model_path, tokenizer, tp_engine, transport,
                                                                    request):
    from transformers import AutoModelForCausalLM

    from test_engine_contract import chat_ids, forward_logprobs, greedy_reference, perturbed

    if transport == "object_store":
        request.getfixturevalue("ray_session")
    loop, engine, version = tp_engine.loop, tp_engine.engine, next(tp_engine.versions)
    ranks = engine.weights.receiving_processes(transport)
    assert ranks == (2 if transport == "gloo" else 1)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval()
    new = perturbed(base, 0.05, seed=6 + version)
    fresh = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval()
    fresh.load_state_dict(new, strict=False)
    metas = metadata_of(new)
    spec = make_spec(transport, [(m.name, m.shape, str(m.dtype).removeprefix("torch.")) for m in metas],
                     receivers=ranks, timeout_s=120.0, bucket_bytes=1 << 16, host="127.0.0.1")
    rank0 = OpenedInBackground(spec, metas)  # a group binds its store here, finishes while the workers join
    loop.run(engine.weights.init_update_group(rank0.spec.for_rank(1)))  # the workers take ranks 1 and 2
    sender = rank0.sender(120)
    try:
        p = chat_ids(tokenizer, "What is 3+4?")
        sp = SamplingParams(max_new_tokens=8, greedy=True, ignore_eos=True)
        held = loop.run(engine.agenerate(LLMRequest(input_ids=p, sampling=sp)))  # the version it holds now
        box: dict = {}
        if spec.info.pulls:
            _, handoff = sender.send(new, version)
            out = loop.run(engine.weights.receive_weights(handoff))
        else:
            send = threading.Thread(target=lambda: box.setdefault("sent", sender.send(new, version)))
            send.start()
            out = loop.run(engine.weights.receive_weights())
            send.join(120)
            assert box["sent"][0].bytes == sum(m.nbytes for m in metas)
        assert out["version"] == version and engine.version == version
        r = loop.run(engine.agenerate(LLMRequest(input_ids=p, sampling=sp)))
        assert r.output_versions == [version] * 8
        assert r.output_tokens == greedy_reference(fresh, p, 8)
        ref = forward_logprobs(fresh, p, r.output_tokens)
        assert (ref - torch.tensor(r.output_logprobs)).abs().max().item() <= 1e-4
        # the update mattered: the weights it held before give other logprobs for these tokens
        assert (forward_logprobs(base, p, r.output_tokens) - ref).abs().max().item() > 1e-3
        assert held.output_versions == [version - 1] * 8
    finally:
        loop.run(engine.weights.close_update_group())
        sender.close()
