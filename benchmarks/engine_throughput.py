"""Decode throughput of `TransformersEngine` vs plain Hugging Face `model.generate`.

What it measures
    Generated tokens per second (sum of the output lengths of all rows / wall time of the
    call) for one batch of `--batch-size` chat-templated prompts of varied length, on the
    same model instance (float32, same `torch.get_num_threads()`), decoding `--new-tokens`
    tokens per row by multinomial sampling at temperature 1 (no top-k / top-p):

    * engine (sync):  `TransformersEngine.generate(requests)`  -- one left-padded batch.
    * engine (async): `--batch-size` concurrent `agenerate` calls gathered with asyncio; the
      engine must batch them into one forward per decode step (checked via `engine.stats`:
      the run must take exactly one batch).
    * HF generate:    `model.generate(..., do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
      min_new_tokens=N, max_new_tokens=N)` with left padding and an attention mask, under
      `torch.inference_mode()`.

    To keep the work identical both sides are forced to decode exactly N tokens per row: HF via
    `min_new_tokens=max_new_tokens=N`, the engine via `SamplingParams(ignore_eos=True)` when the
    field exists. The actually generated token counts are reported anyway, and tokens/s is
    always computed from them. After one warm-up of each variant the variants are interleaved
    (the order rotates every repeat) and the median tokens/s over `--repeats` is reported;
    `ratio = engine_tokens_per_s / hf_generate_tokens_per_s` with a goal of >= 0.9.

How to run (CPU is fine; numbers are noisy when other processes share the cores)
    .venv/bin/python benchmarks/engine_throughput.py
    .venv/bin/python benchmarks/engine_throughput.py --hidden-size 256 --layers 6 \
        --out benchmarks/results/engine_throughput_h256_l6.json

The last stdout line is the JSON result (one line); it is also written, indented, to `--out`.
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rayllm_rl.inference.protocol import LLMRequest, SamplingParams  # noqa: E402
from rayllm_rl.inference.transformers_engine import TransformersEngine  # noqa: E402
from rayllm_rl.models.tiny import TinyModelSpec, ensure_tiny_model  # noqa: E402

GOAL = 0.9
_SPEC_DEFAULTS = TinyModelSpec()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch-size", type=int, default=32, help="rows per batch / concurrent agenerate calls")
    p.add_argument("--new-tokens", type=int, default=64, help="tokens generated per row")
    p.add_argument("--repeats", type=int, default=5, help="timed repeats per variant (median reported)")
    p.add_argument("--hidden-size", type=int, default=_SPEC_DEFAULTS.hidden_size, help="tiny Qwen2 width")
    p.add_argument("--layers", type=int, default=_SPEC_DEFAULTS.num_hidden_layers, help="tiny Qwen2 blocks")
    p.add_argument("--intermediate-size", type=int, default=None,
                   help="MLP width (default: the TinyModelSpec default scaled by hidden-size/128)")
    p.add_argument("--mode", choices=["sync", "async", "both"], default="both",
                   help="which engine entry point(s) to compare with HF generate")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: leave as is)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="benchmarks/results/engine_throughput.json")
    return p.parse_args(argv)


# ---------------------------------------------------------------------------- inputs
def make_prompts(tokenizer, n: int, seed: int) -> list[list[int]]:
    """`n` chat-templated "What is a+b?" prompts of varied length, as token id lists."""
    rng = random.Random(seed)
    fillers = [
        "", "Please answer.", "Think step by step.",
        "Think step by step and write the final answer in <answer></answer>.",
        "You can use python code if you want, then print the result and give the final answer.",
        "Solve the question. Think step by step, check the sum again, and then give the final "
        "answer in <answer></answer> tags. If it is wrong, please try again.",
    ]
    prompts = []
    for i in range(n):
        a, b = rng.randint(0, 999), rng.randint(0, 999)
        text = f"What is {a}+{b}? {fillers[i % len(fillers)]}".strip()
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True, return_dict=False,
        )
        if isinstance(ids, dict) or hasattr(ids, "keys"):  # defensive: some versions return a BatchEncoding
            ids = ids["input_ids"]
        prompts.append([int(t) for t in ids])
    return prompts


# ---------------------------------------------------------------------------- runners
def run_hf(model, prompts: list[list[int]], new_tokens: int, pad_id: int, eos_ids: set[int]) -> dict:
    t0, c0 = time.perf_counter(), time.process_time()
    n, width = len(prompts), max(len(p) for p in prompts)
    ids = torch.full((n, width), pad_id, dtype=torch.long)
    attn = torch.zeros((n, width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p, dtype=torch.long)
        attn[i, width - len(p):] = 1
    with torch.inference_mode():
        out = model.generate(
            input_ids=ids, attention_mask=attn, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
            min_new_tokens=new_tokens, max_new_tokens=new_tokens, pad_token_id=pad_id,
        )
    rows = out[:, width:].tolist()
    elapsed, cpu = time.perf_counter() - t0, time.process_time() - c0
    tokens = 0
    for row in rows:  # a row ends at its first eos (inclusive); min_new_tokens makes that never happen
        k = next((j + 1 for j, t in enumerate(row) if t in eos_ids), len(row))
        tokens += k
    return {"seconds": elapsed, "cpu_seconds": cpu, "tokens": tokens, "tokens_per_s": tokens / elapsed}


def make_requests(prompts: list[list[int]], params: SamplingParams) -> list[LLMRequest]:
    return [LLMRequest(input_ids=list(p), sampling=params, rid=f"bench-{i}") for i, p in enumerate(prompts)]


def run_engine_sync(engine: TransformersEngine, prompts, params: SamplingParams) -> dict:
    reqs = make_requests(prompts, params)
    s0 = dataclasses.replace(engine.stats)
    t0, c0 = time.perf_counter(), time.process_time()
    resps = engine.generate(reqs)
    elapsed, cpu = time.perf_counter() - t0, time.process_time() - c0
    tokens = sum(r.output_len for r in resps)
    return {"seconds": elapsed, "cpu_seconds": cpu, "tokens": tokens, "tokens_per_s": tokens / elapsed,
            "batches": engine.stats.batches - s0.batches, "decode_steps": engine.stats.decode_steps - s0.decode_steps}


def run_engine_async(engine: TransformersEngine, loop: asyncio.AbstractEventLoop, prompts, params: SamplingParams) -> dict:
    reqs = make_requests(prompts, params)
    s0 = dataclasses.replace(engine.stats)

    async def go():
        return await asyncio.gather(*(engine.agenerate(r) for r in reqs))

    t0, c0 = time.perf_counter(), time.process_time()
    resps = loop.run_until_complete(go())
    elapsed, cpu = time.perf_counter() - t0, time.process_time() - c0
    tokens = sum(r.output_len for r in resps)
    return {"seconds": elapsed, "cpu_seconds": cpu, "tokens": tokens, "tokens_per_s": tokens / elapsed,
            "batches": engine.stats.batches - s0.batches, "decode_steps": engine.stats.decode_steps - s0.decode_steps}


# ---------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    load_before = os.getloadavg()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()

    inter = args.intermediate_size or max(1, _SPEC_DEFAULTS.intermediate_size * args.hidden_size // _SPEC_DEFAULTS.hidden_size)
    spec = TinyModelSpec(hidden_size=args.hidden_size, num_hidden_layers=args.layers, intermediate_size=inter)
    path = ensure_tiny_model(spec)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.eval().requires_grad_(False)
    # One model instance shared by both sides: identical weights, dtype and threads.
    engine = TransformersEngine(path, model=model, dtype=torch.float32, seed=args.seed)

    prompts = make_prompts(tokenizer, args.batch_size, args.seed)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(engine.eos_token_ids)
    eos_ids = set(engine.eos_token_ids)
    sp_kw = dict(max_new_tokens=args.new_tokens, temperature=1.0, top_p=1.0, top_k=0, greedy=False)
    has_ignore_eos = hasattr(SamplingParams(), "ignore_eos")
    if has_ignore_eos:
        sp_kw["ignore_eos"] = True
    params = SamplingParams(**sp_kw)

    loop = asyncio.new_event_loop()
    variants: dict[str, callable] = {}
    if args.mode in ("sync", "both"):
        variants["engine"] = lambda: run_engine_sync(engine, prompts, params)
    variants["hf_generate"] = lambda: run_hf(model, prompts, args.new_tokens, pad_id, eos_ids)
    if args.mode in ("async", "both"):
        variants["engine_async"] = lambda: run_engine_async(engine, loop, prompts, params)

    names = list(variants)
    warmup = {}
    for name in names:  # one warm-up of each
        warmup[name] = variants[name]()
        print(f"warm-up {name:13s} {warmup[name]['tokens_per_s']:9.1f} tok/s", file=sys.stderr)

    runs = []
    per: dict[str, list[dict]] = {n: [] for n in names}
    for rep in range(args.repeats):
        order = names[rep % len(names):] + names[:rep % len(names)]  # rotate to spread drift / cache effects
        for name in order:
            r = variants[name]()
            r = {"variant": name, "repeat": rep, **r}
            runs.append(r)
            per[name].append(r)
            print(f"repeat {rep} {name:13s} {r['tokens_per_s']:9.1f} tok/s  ({r['tokens']} tok, {r['seconds']:.3f}s)",
                  file=sys.stderr)
    pending = asyncio.all_tasks(loop)  # the engine's idle batching worker
    for t in pending:
        t.cancel()
    if pending:
        loop.run_until_complete(asyncio.wait(pending))
    loop.run_until_complete(loop.shutdown_default_executor())
    loop.close()

    def med(name):
        return statistics.median(r["tokens_per_s"] for r in per[name]) if name in per else None

    def tokens(name):
        return sorted({r["tokens"] for r in per[name]}) if name in per else None

    hf = med("hf_generate")
    eng, eng_async = med("engine"), med("engine_async")
    ratio = eng / hf if eng is not None else None
    ratio_async = eng_async / hf if eng_async is not None else None
    measured = [r for r in (ratio, ratio_async) if r is not None]

    def cpu_ratio(name):  # tokens per CPU-second, engine / HF (medians)
        if name not in per:
            return None
        tps = {n: statistics.median(r["tokens"] / r["cpu_seconds"] for r in per[n]) for n in (name, "hf_generate")}
        return tps[name] / tps["hf_generate"]

    def paired(name):  # per-repeat ratio to the HF run of the same repeat: robust to slow load drift
        if name not in per:
            return None
        return statistics.median(a["tokens_per_s"] / b["tokens_per_s"] for a, b in zip(per[name], per["hf_generate"]))
    async_batched = all(r["batches"] == 1 and r["decode_steps"] == args.new_tokens for r in per.get("engine_async", []))

    result = {
        "batch_size": args.batch_size,
        "new_tokens": args.new_tokens,
        "model": {"hidden_size": spec.hidden_size, "layers": spec.num_hidden_layers,
                  "intermediate_size": spec.intermediate_size, "vocab_size": model.config.vocab_size, "path": path},
        "model_params": sum(p.numel() for p in model.parameters()),
        "dtype": "float32",
        "torch_threads": torch.get_num_threads(),
        "prompt_tokens": {"min": min(map(len, prompts)), "max": max(map(len, prompts)), "total": sum(map(len, prompts))},
        "engine_ignore_eos": has_ignore_eos,
        "engine_tokens_per_s": eng,
        "hf_generate_tokens_per_s": hf,
        "ratio": ratio,
        "engine_async_tokens_per_s": eng_async,
        "ratio_async": ratio_async,
        "ratio_paired_median": paired("engine"),
        # Same ratio from process CPU time (all threads) instead of wall time: less sensitive to
        # other processes stealing the cores, but counts spin-waiting of the OpenMP pool too.
        "ratio_cpu_time": cpu_ratio("engine"),
        "ratio_async_cpu_time": cpu_ratio("engine_async"),
        "ratio_async_paired_median": paired("engine_async"),
        "engine_async_one_forward_per_step": async_batched if "engine_async" in per else None,
        "generated_tokens_per_run": {n: tokens(n) for n in names},
        "goal": GOAL,
        "meets_goal": bool(measured) and all(r >= GOAL for r in measured),
        "repeats": args.repeats,
        "mode": args.mode,
        "env": {"torch": torch.__version__, "transformers": __import__("transformers").__version__,
                "python": platform.python_version(), "cpu_count": os.cpu_count(),
                # 1-min load average before / after: > cpu_count means other processes shared the cores
                "loadavg_1m_before_after": [round(load_before[0], 2), round(os.getloadavg()[0], 2)]},
        "warmup": [{"variant": n, **warmup[n]} for n in names],
        "runs": runs,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
