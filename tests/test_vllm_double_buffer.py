"""vLLM's double-buffered weight update (inference/vllm/shadow.py): the update is loaded and processed
into a shadow copy of the model while the live one keeps generating the old version; the paused part
of the update is only the swap. Checked with numbers on vLLM's CPU build: tokens before the swap are
stamped v and equal the old model's greedy continuation (the live model was not touched by the load),
tokens after it are stamped v+1 and equal the new model's, with logprobs equal to a full forward; the
in-place path (what GPUs use) gives the same results.
"""
from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch

from test_engine_contract import LoopThread, chat_ids, forward_logprobs, generate, greedy_reference, perturbed

from rayllm_rl.inference.protocol import LLMRequest, SamplingParams
from rayllm_rl.weight_sync import metadata_of
from rayllm_rl.weight_sync.registry import make_spec
from weight_sync_helpers import OpenedInBackground

pytestmark = pytest.mark.vllm
GREEDY = SamplingParams(max_new_tokens=8, greedy=True, ignore_eos=True)
LONG = SamplingParams(max_new_tokens=64, greedy=True, ignore_eos=True)
"""Requests running while the update is received and loaded into the shadow."""


@pytest.fixture(scope="module")
def hf_model(tiny_model_path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval()


def model_with(path, named):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model.load_state_dict(named, strict=False)
    return model


@pytest.mark.parametrize("double_buffer", [True, False])
def test_update_loads_behind_generation_and_swaps_between_steps(tiny_model_path, tokenizer, hf_model, double_buffer):
    from rayllm_rl.inference.vllm.engine import VLLMEngine, VLLMOptions

    loop = LoopThread()
    engine = VLLMEngine(tiny_model_path, seed=0,
                        options=VLLMOptions(kv_cache_mb=64, double_buffer_weights=double_buffer))
    try:
        loop.run(engine.start())
        prompt = chat_ids(tokenizer, "What is 3+4?")
        old_tokens = greedy_reference(hf_model, prompt, 8)
        for version in (1, 2, 3):  # the shadow's first load, then reloads of each copy in turn
            new = perturbed(hf_model, 0.05, seed=version)
            fresh = model_with(tiny_model_path, new)
            metas = metadata_of(new)
            spec = make_spec("gloo", [(m.name, m.shape, str(m.dtype).removeprefix("torch.")) for m in metas],
                             receivers=1, timeout_s=60.0, bucket_bytes=1 << 16, host="127.0.0.1")
            rank0 = OpenedInBackground(spec, metas)  # binds its store here, finishes while the engine joins
            loop.run(engine.weights.init_update_group(rank0.spec.for_rank(1)))
            sender = rank0.sender(60)
            box: dict = {}
            try:
                send = threading.Thread(target=lambda: box.setdefault("sent", sender.send(new, version)))
                send.start()
                # The bytes arrive (and, double-buffered, are loaded into the shadow) while vLLM serves requests.
                loop.run(engine.weights.rpc("rayllm_begin_receive", 60.0, None))
                during = [asyncio.run_coroutine_threadsafe(
                    engine.agenerate(LLMRequest(input_ids=prompt, sampling=LONG)), loop.loop) for _ in range(4)]
                deadline = time.monotonic() + 120
                while not (state := loop.run(engine.weights.rpc("rayllm_receive_state")))["done"]:
                    assert time.monotonic() < deadline, "the receive did not finish"
                    time.sleep(0.01)
                send.join(60)
                assert state["error"] is None and state["version"] == version
                assert state["shadow_loaded"] is double_buffer  # the update waits, processed, in the shadow
                for r in [f.result(120) for f in during]:  # generated beside the load, all by version - 1
                    assert r.output_versions == [version - 1] * LONG.max_new_tokens
                    assert r.output_tokens[:8] == old_tokens
                (before,) = generate(loop, engine, [prompt], GREEDY)
                assert before.output_versions == [version - 1] * 8
                assert before.output_tokens == old_tokens  # the live model still holds version - 1

                if double_buffer:  # as receive_weights applies it: one swap inside the pause
                    apply = engine.weights.apply(version, lambda: engine.weights.rpc("rayllm_swap_shadow", version),
                                                 reload=False)
                else:  # vLLM's update lifecycle: layerwise reload around load_weights
                    apply = engine.weights.apply(version, lambda: engine.weights.update_request(version))
                stall = loop.run(apply)
                (after,) = generate(loop, engine, [prompt], GREEDY)
                assert stall > 0 and engine.version == version
                assert after.output_versions == [version] * 8
                assert after.output_tokens == greedy_reference(fresh, prompt, 8)
                ref = forward_logprobs(fresh, prompt, after.output_tokens)
                assert (ref - torch.tensor(after.output_logprobs)).abs().max().item() <= 1e-4
                old_tokens = after.output_tokens
            finally:
                loop.run(engine.weights.close_update_group())
                sender.close()
    finally:
        loop.run(engine.aclose())
        loop.close()
