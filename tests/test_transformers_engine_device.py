"""TransformersEngine: the job's dtype reaches the model, and sleep/wake_up for the colocated placement.

CPU tests run everywhere; the CUDA ones (host-tensor swap into device weights, memory freed by
sleep) run only where torch sees a GPU."""
from __future__ import annotations

import asyncio
import threading
import warnings

import numpy as np
import pytest
import torch

from rayllm_rl.inference.protocol import LLMRequest, SamplingParams, weights_checksum
from rayllm_rl.inference.registry import EngineJob
from rayllm_rl.inference.transformers.engine import TransformersEngine, TransformersOptions
from rayllm_rl.inference.transformers.job import TransformersJobSide

pytestmark = pytest.mark.usefixtures("one_torch_thread")
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")


def chat_ids(tok, text):
    return list(tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                        tokenize=True, return_dict=False))


def forward_logprobs(model, prompt, output):
    """log-softmax of one full forward pass (float32 logits) at the sampled tokens, on the CPU."""
    device = next(model.parameters()).device
    with torch.no_grad():
        logits = model(torch.tensor([prompt + output], device=device)).logits[0].float().cpu()
    lp = torch.log_softmax(logits, -1)[len(prompt) - 1:-1]
    return lp.gather(-1, torch.tensor(output).unsqueeze(-1)).squeeze(-1)


def rounded_logprobs(model, r):
    """`forward_logprobs` with the float32 logits rounded to bfloat16 first: an engine exact but for its output."""
    with torch.no_grad():
        logits = model(torch.tensor([r.input_tokens + r.output_tokens])).logits[0].float()
    lp = torch.log_softmax(logits.bfloat16().float(), -1)[len(r.input_tokens) - 1:-1]
    return lp.gather(-1, torch.tensor(r.output_tokens).unsqueeze(-1)).squeeze(-1)


def bfloat16_gaps(model, reference, responses) -> tuple[float, float]:
    """(largest logprob gap from rounding the float32 `reference`'s logits to bfloat16 alone, largest gap of a
    one-pass forward of the bfloat16 `model` from the reference) over the responses' tokens."""
    floor = one_pass = 0.0
    for r in responses:
        exact = forward_logprobs(reference, r.input_tokens, r.output_tokens)
        floor = max(floor, float((rounded_logprobs(reference, r) - exact).abs().max()))
        one_pass = max(one_pass, float((forward_logprobs(model, r.input_tokens, r.output_tokens) - exact).abs().max()))
    return floor, one_pass


def max_gap(model, responses):
    return max((forward_logprobs(model, r.input_tokens, r.output_tokens) - torch.tensor(r.output_logprobs))
               .abs().max().item() for r in responses)


def request(tok, text, n=12):
    return LLMRequest(input_ids=chat_ids(tok, text), sampling=SamplingParams(max_new_tokens=n, ignore_eos=True))


def perturbed(engine, seed, scale=0.05):
    g = torch.Generator().manual_seed(seed)
    return {k: (v.detach().cpu().float() + scale * torch.randn(v.shape, generator=g)).to(v.dtype)
            for k, v in engine.weights.named_parameters().items()}


# ------------------------------------------------------------------------------------------ dtype
def test_bfloat16_reaches_the_model_and_logprobs_stay_close_to_float32(tiny_model_path, tokenizer):
    from transformers import AutoModelForCausalLM

    engine = TransformersEngine(tiny_model_path, dtype=torch.bfloat16, seed=0, device="cpu")
    assert engine.device == torch.device("cpu") and engine.dtype == torch.bfloat16
    assert {p.dtype for p in engine.weights.named_parameters().values()} == {torch.bfloat16}
    assert engine.model.config._attn_implementation == "sdpa"
    reference = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    responses = engine.generate([request(tokenizer, "What is %d+%d?" % (i, 3 * i) + " please" * (i % 3), 24)
                                 for i in range(8)])
    gap = max_gap(reference, responses)
    # Both bounds from bfloat16's arithmetic on this CPU, not from a gap measured on one machine (0.0038 here with
    # AVX-512/AMX, 0.0047 with AVX2 kernels: `ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2
    # ONEDNN_MAX_CPU_ISA=AVX2`). Lower: the engine's logits are bfloat16 numbers, so each is at least as far from
    # the float32 logit as the nearest bfloat16 number (unit roundoff u = 2^-8); the largest logprob gap that this
    # rounding alone makes on these tokens (`floor`) is what any bfloat16 engine shows, up to half of it for
    # cancellation in the log-sum-exp; a float32 engine agrees to 1e-4 and fails it. Upper: a one-pass bfloat16
    # forward of the same weights (`one_pass`, the engine's own model, no KV cache) is off from float32 by this
    # CPU's bfloat16 roundings; the engine's decode rounds as much in another order, so it is within that plus the
    # two bfloat16 results' distance from each other, at most 3x the one pass's gap (triangle inequality).
    u = 2.0 ** -8
    floor, one_pass = bfloat16_gaps(engine.model, reference, responses)
    print(f"bfloat16 engine vs float32: max gap {gap:.2e} ({gap / u:.2f} u); rounding the logits alone {floor:.2e}, "
          f"a one-pass bfloat16 forward {one_pass:.2e}; bounds ({floor / 2:.2e}, {3 * one_pass:.2e})")
    assert floor / 2 < gap < 3 * one_pass, (gap, floor, one_pass)
    assert all(isinstance(x, float) for r in responses for x in r.output_logprobs)


def job(dtype, gpus, device="auto"):
    return EngineJob(gpus_per_replica=gpus, tensor_parallel_size=1, dtype=dtype,
                     environment=False, options=TransformersOptions(device=device))


def test_check_job_allows_bfloat16_on_gpu_replicas_only():
    with pytest.raises(ValueError, match=r"model\.dtype=bfloat16.*ray\.gpus_per_replica=0"):
        TransformersJobSide.check_job(job("bfloat16", 0))
    with pytest.raises(ValueError, match=r"model\.dtype=bfloat16.*inference\.options\.device=cpu"):
        TransformersJobSide.check_job(job("bfloat16", 1, device="cpu"))
    with pytest.raises(ValueError, match=r"inference\.options\.device=cuda needs ray\.gpus_per_replica > 0"):
        TransformersJobSide.check_job(job("float32", 0, device="cuda"))
    with pytest.raises(ValueError, match=r"inference\.options\.device must be one of .*'tpu'"):
        TransformersJobSide.check_job(job("float32", 1, device="tpu"))
    TransformersJobSide.check_job(job("bfloat16", 1))
    TransformersJobSide.check_job(job("bfloat16", 0.5))  # a colocated share of one GPU
    TransformersJobSide.check_job(job("float32", 0))


# ------------------------------------------------------------------------------------------ sleep
def test_a_request_sent_while_asleep_waits_for_both_tags(engine, tokenizer):
    before = {k: v.clone() for k, v in engine.weights.named_parameters().items()}
    engine.weights.set_version(4)

    async def run():
        await engine.turns.sleep(1)
        await engine.turns.sleep(1)  # idempotent
        assert engine.turns.sleeping
        task = asyncio.ensure_future(engine.agenerate(request(tokenizer, "hi there")))
        await asyncio.sleep(0.3)
        assert not task.done() and engine.stats.decode_steps == 0
        await engine.turns.wake_up(["weights"])
        await asyncio.sleep(0.2)
        assert engine.turns.sleeping and not task.done() and engine.stats.decode_steps == 0  # kv_cache still down
        await engine.turns.wake_up(["kv_cache"])
        await engine.turns.wake_up()  # idempotent
        return await asyncio.wait_for(task, 60)

    r = asyncio.run(run())
    assert not engine.turns.sleeping and engine.version == 4
    assert r.output_len == 12 and r.output_versions == [4] * 12
    assert max_gap(engine.model, [r]) <= 1e-4
    assert all(torch.equal(v, before[k]) for k, v in engine.weights.named_parameters().items())
    assert engine.stats.sleeps == 2


def test_sleep_stops_a_batch_in_flight_and_it_finishes_after_wake_up(engine, tokenizer):
    """The batch stops after its running step, drops its KV cache, and re-prefills on wake: the
    tokens after the break are still sampled from exactly the same policy."""
    async def run():
        prompts = [f"count {i}" + " please" * i for i in range(3)]  # of different lengths: left padding
        task = asyncio.ensure_future(asyncio.gather(*[engine.agenerate(request(tokenizer, p, 400)) for p in prompts]))
        for _ in range(6000):
            if engine.stats.decode_steps >= 10:
                break
            await asyncio.sleep(0.005)
        await engine.turns.sleep(1)
        held_at = engine.stats.decode_steps
        await asyncio.sleep(0.3)
        assert engine.stats.decode_steps == held_at and not task.done()
        await engine.turns.wake_up()
        return held_at, await asyncio.wait_for(task, 120)

    held_at, responses = asyncio.run(run())
    assert 10 <= held_at < 400
    assert engine.stats.batches == 1 and engine.stats.cache_rebuilds == 0
    assert all(r.output_len == 400 and r.output_versions == [0] * 400 for r in responses)
    assert max_gap(engine.model, responses) <= 1e-4


def test_bad_level_or_tag_is_a_clear_error(engine):
    async def run():
        with pytest.raises(ValueError, match="level must be 1 .* or 2 .*got 3"):
            await engine.turns.sleep(3)
        with pytest.raises(ValueError, match=r"unknown tags \['bogus'\]"):
            await engine.turns.wake_up(["bogus"])
        with pytest.raises(ValueError, match="the string 'weights'"):
            await engine.turns.wake_up("weights")

    asyncio.run(run())
    assert not engine.turns.sleeping


def test_a_weight_update_while_the_weights_sleep_raises(engine, tokenizer):
    new = perturbed(engine, 1)
    before = {k: v.clone() for k, v in engine.weights.named_parameters().items()}

    async def run():
        await engine.turns.sleep(1)
        with pytest.raises(RuntimeError, match=r"wake_up\(\['weights'\]\) before a weight sync"):
            await engine.weights.load_weights(new, version=1)
        with pytest.raises(RuntimeError, match=r"wake_up\(\['weights'\]\) before a weight sync"):
            engine.weights.swap_weights({k: v.clone() for k, v in new.items()}, version=1)
        assert engine.version == 0
        assert all(torch.equal(v, before[k]) for k, v in engine.weights.named_parameters().items())
        await engine.turns.wake_up(["weights"])  # the colocated hand-over: weights up, generation still held
        await engine.weights.load_weights(new, version=1)
        with pytest.raises(RuntimeError, match=r"asleep: turns\.wake_up\(\) first"):
            engine.generate([request(tokenizer, "x", 2)])
        await engine.turns.wake_up(["kv_cache"])
        return await engine.agenerate(request(tokenizer, "x", 6))

    r = asyncio.run(run())
    assert r.output_versions == [1] * 6 and max_gap(engine.model, [r]) <= 1e-4
    assert all(torch.equal(v, new[k]) for k, v in engine.weights.named_parameters().items())


def test_after_sleep_level_2_the_next_update_refills_the_weights(engine, tokenizer):
    new = perturbed(engine, 2)

    async def run():
        await engine.turns.sleep(2)
        await engine.turns.wake_up()
        with pytest.raises(RuntimeError, match="sleep\\(level=2\\) dropped the weights"):
            await engine.weights.weights_checksum()
        with pytest.raises(RuntimeError, match="sleep\\(level=2\\) dropped the weights"):
            await engine.agenerate(request(tokenizer, "x", 2))
        half = dict(list(new.items())[: len(new) // 2])
        await engine.weights.load_weights(half, version=2)
        with pytest.raises(RuntimeError, match=f"resent {len(new) - len(half)} of them"):
            await engine.agenerate(request(tokenizer, "x", 2))
        await engine.weights.load_weights(new, version=3)
        return await engine.weights.weights_checksum(), await engine.agenerate(request(tokenizer, "y", 8))

    checksum, r = asyncio.run(run())
    assert checksum == weights_checksum(new)
    assert r.output_versions == [3] * 8 and max_gap(engine.model, [r]) <= 1e-4
    assert all(torch.equal(v, new[k]) for k, v in engine.weights.named_parameters().items())


def test_pause_holds_generation_without_blocking_weight_writers(engine, tokenizer):
    new = perturbed(engine, 3)

    async def run():
        await engine.turns.pause()
        task = asyncio.ensure_future(engine.agenerate(request(tokenizer, "x", 4)))
        await asyncio.sleep(0.2)
        assert not task.done()
        await asyncio.wait_for(engine.weights.load_weights(new, version=5), 30)  # no deadlock with the pause
        await engine.turns.resume()
        return await asyncio.wait_for(task, 60)

    r = asyncio.run(run())
    assert r.output_versions == [5] * 4 and max_gap(engine.model, [r]) <= 1e-4


# ------------------------------------------------------------------------------------------ weight sink
def readonly_views(named):
    """Tensors over read-only host memory, as the object store's receiver hands them (`_tensor_of`)."""
    out = {}
    for k, v in named.items():
        arr = v.detach().cpu().contiguous().view(torch.uint8).numpy().copy()
        arr.flags.writeable = False
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            out[k] = torch.from_numpy(arr).view(v.dtype).view(v.shape)
    return out


def test_swap_in_host_views_then_update_and_checksum(engine, tokenizer):
    first, second = perturbed(engine, 4), perturbed(engine, 5)
    views = readonly_views(first)
    assert engine.weights.swap_weights(views, version=7) >= 0 and engine.version == 7
    assert all(torch.equal(v, first[k]) for k, v in engine.weights.named_parameters().items())
    assert asyncio.run(engine.weights.weights_checksum()) == weights_checksum(first)
    engine.weights.load_weights_sync(second, version=8)  # the views are read-only: fresh storage, never written
    assert all(torch.equal(v, second[k]) for k, v in engine.weights.named_parameters().items())
    assert all(not np.shares_memory(v.numpy(), engine.weights.named_parameters()[k].detach().numpy())
               for k, v in views.items())
    r, = engine.generate([request(tokenizer, "z", 5)])
    assert r.output_versions == [8] * 5 and max_gap(engine.model, [r]) <= 1e-4


# ------------------------------------------------------------------------------------------ CUDA only
@cuda
def test_cuda_host_tensors_are_copied_in_and_sleep_frees_the_gpu(tiny_model_path, tokenizer):
    from transformers import AutoModelForCausalLM

    engine = TransformersEngine(tiny_model_path, dtype=torch.bfloat16, seed=0)
    assert engine.device.type == "cuda" and engine.generator.device.type == "cuda"
    reference = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    r, = engine.generate([request(tokenizer, "What is 2+3?", 24)])
    # within 3x the gap of a one-pass bfloat16 forward on this GPU (test_bfloat16_reaches_the_model_...)
    assert max_gap(reference, [r]) < 3 * bfloat16_gaps(engine.model, reference, [r])[1]
    new = perturbed(engine, 6)
    engine.weights.swap_weights(readonly_views(new), version=1)  # host views: copied to the device, then swapped
    assert all(v.device == engine.device and torch.equal(v.cpu(), new[k])
               for k, v in engine.weights.named_parameters().items())
    assert not engine.weights.borrowed()
    weights_bytes = sum(v.numel() * v.element_size() for v in new.values())

    async def run():
        awake = torch.cuda.memory_allocated(engine.device)
        await engine.turns.sleep(1)
        asleep = torch.cuda.memory_allocated(engine.device)
        assert all(v.device.type == "cpu" and v.is_pinned() for v in engine.weights.named_parameters().values())
        await engine.turns.wake_up()
        assert all(torch.equal(v.cpu(), new[k]) for k, v in engine.weights.named_parameters().items())
        await engine.turns.sleep(2)
        dropped = torch.cuda.memory_allocated(engine.device)
        await engine.turns.wake_up(["weights"])
        await engine.weights.load_weights(new, version=2)
        await engine.turns.wake_up(["kv_cache"])
        return awake, asleep, dropped, await engine.agenerate(request(tokenizer, "y", 8))

    awake, asleep, dropped, r = asyncio.run(run())
    assert awake - asleep >= 0.9 * weights_bytes and awake - dropped >= 0.9 * weights_bytes
    assert r.output_versions == [2] * 8 and max_gap(engine.model, [r]) <= 1e-4


@cuda
def test_cuda_request_while_asleep_waits(tiny_model_path, tokenizer):
    engine = TransformersEngine(tiny_model_path, dtype=torch.bfloat16, seed=0)
    done = threading.Event()

    async def run():
        await engine.turns.sleep(1)
        task = asyncio.ensure_future(engine.agenerate(request(tokenizer, "hi", 6)))
        task.add_done_callback(lambda _: done.set())
        await asyncio.sleep(0.3)
        assert not done.is_set()
        await engine.turns.wake_up()
        return await asyncio.wait_for(task, 60)

    assert asyncio.run(run()).output_len == 6
