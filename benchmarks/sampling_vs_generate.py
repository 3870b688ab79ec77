"""Our Transformers engine's sampling against HF `model.generate`'s (what TRL's `GRPOTrainer` samples with), on
the same model, prompts and settings: the sampling ablation of issue V, measured directly instead of through
whole runs.

Both draw `--samples` completions of each of `--prompts` training prompts of `--task` (vs_trl.py's rows: the
recipe's instruction under the model's chat template) at the recipe's temperature (0.7), top-k 0, top-p 1 and
48 new tokens, stopping at the same EOS ids:
  engine    `TransformersEngine.generate` (our batched KV-cache decoder and `RowSampler`);
  generate  `model.generate(do_sample=True, temperature, top_k=0, top_p=1.0)`, prompts left-padded, as TRL 1.16
            calls it (grpo_trainer.py's generation kwargs).
Each completion is decoded with `skip_special_tokens=True` (as both trainers do) and scored by the task's
reasoning-gym scorer. Per sampler: mean reward, mean length, the truncated fraction, and the mean per-token
log-probability of the samples under the tempered model (one full forward, the same code for both). Two exact
samplers of one distribution agree on each in expectation, so each difference is given with its z-score
(difference / its standard error from the samples).

Run: `.venv/bin/python benchmarks/sampling_vs_generate.py` (~5 min on 2 cores). Smoke: `--smoke` (tiny offline
model, 2 prompts x 4). The last stdout line is the JSON result, also written to `--out`.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--task", default="chain_sum", help="a task of vs_trl.TASKS")
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--batch-prompts", type=int, default=8, help="prompts per generate call (x samples rows)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", default="models/SmolLM2-135M-Instruct.Q4_1.gguf")
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--out", default="")
    args = p.parse_args(argv)
    if args.smoke:
        from rayllm_rl.models.tiny import ensure_tiny_model

        args.model, args.prompts, args.samples = ensure_tiny_model(), 2, 4
    args.out = args.out or ("/tmp/sampling_vs_generate_smoke.json" if args.smoke
                            else "benchmarks/results/sampling_vs_generate.json")
    return args


def cut_at_eos(ids: list[int], eos: frozenset[int]) -> tuple[list[int], bool]:
    """The completion up to and including its first EOS; truncated = no EOS in it."""
    for i, t in enumerate(ids):
        if t in eos:
            return ids[:i + 1], False
    return ids, True


def sample_engine(engine, prompts: list[list[int]], samples: int, temperature: float, max_new: int) -> list[list[int]]:
    from rayllm_rl.inference.protocol import LLMRequest, SamplingParams

    sp = SamplingParams(max_new_tokens=max_new, temperature=temperature)
    out = engine.generate([LLMRequest(list(ids), sp) for ids in prompts for _ in range(samples)])
    return [list(r.output_tokens) for r in out]


def sample_generate(model, prompts: list[list[int]], samples: int, temperature: float, max_new: int, pad: int,
                    eos: list[int], batch_prompts: int) -> list[list[int]]:
    import torch

    out: list[list[int]] = []
    for b in range(0, len(prompts), batch_prompts):
        chunk = [ids for ids in prompts[b:b + batch_prompts] for _ in range(samples)]
        width = max(map(len, chunk))
        input_ids = torch.tensor([[pad] * (width - len(ids)) + list(ids) for ids in chunk])
        mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids in chunk])
        with torch.no_grad():
            gen = model.generate(input_ids=input_ids, attention_mask=mask, do_sample=True, temperature=temperature,
                                 top_k=0, top_p=1.0, max_new_tokens=max_new, pad_token_id=pad, eos_token_id=eos)
        out += [row.tolist() for row in gen[:, width:]]
    return out


def tempered_logprobs(model, prompt: list[int], completion: list[int], temperature: float) -> list[float]:
    """log p_T(token) of each completion token under the model (one full forward)."""
    import torch

    ids = torch.tensor([list(prompt) + list(completion)])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1:-1].float() / temperature
    lp = torch.log_softmax(logits, dim=-1)
    return lp.gather(1, torch.tensor(completion)[:, None])[:, 0].tolist()


def describe(rows: list[dict]) -> dict:
    def mean_se(xs):
        m = statistics.fmean(xs)
        return m, (statistics.stdev(xs) / math.sqrt(len(xs)) if len(xs) > 1 else 0.0)

    out = {"n": len(rows)}
    for key in ("reward", "length", "truncated", "token_logprob"):
        m, se = mean_se([float(r[key]) for r in rows])
        out[key], out[key + "_se"] = m, se
    return out


def main(argv=None) -> dict:
    import torch
    import yaml
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import vs_trl
    from rayllm_rl.envs.reasoning_gym_task import make_reward, make_splits
    from rayllm_rl.hub import resolve_model_path
    from rayllm_rl.inference.transformers.engine import TransformersEngine
    from rayllm_rl.workflows.rlvr import tokenize_prompt

    args = parse_args(argv)
    recipe = yaml.safe_load((ROOT / vs_trl.RECIPE).read_text())
    temperature, max_new = recipe["rollout"]["temperature"], recipe["rollout"]["max_new_tokens"]
    settings = vs_trl.settings(vs_trl.parse_args(["--task", args.task, "--steps", "1"]))
    cfg = vs_trl.rg_config(args.task, settings)
    train, _ = make_splits(cfg, 8)
    rows = [train[i] for i in range(args.prompts)]
    scorer = make_reward(cfg)
    model_dir = resolve_model_path(args.model)
    tok = AutoTokenizer.from_pretrained(model_dir)
    prompts = [tokenize_prompt(tok, r["messages"]) for r in rows]
    torch.manual_seed(args.seed)
    engine = TransformersEngine(model_dir, seed=args.seed, device="cpu")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    eos = sorted(engine.eos_token_ids)
    drawn, seconds = {}, {}
    t0 = time.perf_counter()
    drawn["engine"] = sample_engine(engine, prompts, args.samples, temperature, max_new)
    seconds["engine"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    drawn["generate"] = sample_generate(model, prompts, args.samples, temperature, max_new, engine.pad_token_id, eos,
                                        args.batch_prompts)
    seconds["generate"] = time.perf_counter() - t0
    per_sampler = {}
    for name, completions in drawn.items():
        scored = []
        for k, raw in enumerate(completions):
            row, prompt = rows[k // args.samples], prompts[k // args.samples]
            ids, truncated = cut_at_eos(raw, engine.eos_token_ids)
            text = tok.decode(ids, skip_special_tokens=True)
            reward = scorer(None, text, None, None, rg_seed=row["rg_seed"], rg_size=row["rg_size"],
                            rg_index=row["rg_index"], question=row["question"])["reward"]
            lps = tempered_logprobs(model, prompt, ids, temperature)
            scored.append({"reward": reward, "length": len(ids), "truncated": truncated,
                           "token_logprob": statistics.fmean(lps)})
        per_sampler[name] = {**describe(scored), "seconds": round(seconds[name], 1)}
    a, b = per_sampler["engine"], per_sampler["generate"]
    z = {key: (a[key] - b[key]) / math.sqrt(a[key + "_se"] ** 2 + b[key + "_se"] ** 2)
         if a[key + "_se"] or b[key + "_se"] else 0.0 for key in ("reward", "length", "truncated", "token_logprob")}
    result = {"task": args.task, "prompts": args.prompts, "samples": args.samples, "temperature": temperature,
              "max_new_tokens": max_new, "seed": args.seed, "model": args.model, "smoke": args.smoke,
              "samplers": per_sampler, "difference_z": z, "torch_threads": torch.get_num_threads()}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
