"""Sampling-mask replay on SmolLM2-135M-Instruct (float32, CPU): what it costs the learner and what it fixes.

The Transformers engine samples `--prompts` x `--samples` chain_sum-style completions at temperature
`--temperature`, top-p `--top-p`. On that batch, side by side and alternating (`--repeats`, medians):
the learner's chunked LM-head logprobs forward + backward (`token_logprobs`, the train step's call)
with the mask replayed and without. Also, per sampled token: the kept count n (vLLM's rule), the
engine's logprob against the learner's masked one (|diff|), and the bias left without the replay
(full - engine = log M, the kept mass). The last stdout line is the JSON, also written to `--out`.

Run: `.venv/bin/python benchmarks/sampling_mask.py` (about 2 min here).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from rayllm_rl.inference.protocol import LLMRequest, SamplingParams  # noqa: E402
from rayllm_rl.learner.logprobs import token_logprobs  # noqa: E402
from rayllm_rl.sampling_mask import SamplingMask, kept_set  # noqa: E402

MODEL = "models/SmolLM2-135M-Instruct.Q4_1.gguf"


def sample_batch(model_path: str, tokenizer, args) -> list:
    from rayllm_rl.inference.transformers.engine import TransformersEngine

    engine = TransformersEngine(model_path, seed=args.seed, device="cpu")
    gen = torch.Generator().manual_seed(args.seed)
    prompts = []
    for _ in range(args.prompts):
        a, b = (int(x) for x in torch.randint(1, 100, (2,), generator=gen))
        msgs = [{"role": "user", "content": f"What is {a} + {b}? Answer with a number."}]
        prompts.append(list(tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True,
                                                          return_dict=False)))
    sp = SamplingParams(max_new_tokens=args.new_tokens, temperature=args.temperature, top_p=args.top_p)
    return engine.generate([LLMRequest(input_ids=p, sampling=sp) for p in prompts for _ in range(args.samples)])


def padded(responses) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """input_ids, attention_mask, completion positions `[B, T]`, right-padded."""
    width = max(len(r.input_tokens) + r.output_len for r in responses)
    ids = torch.zeros(len(responses), width, dtype=torch.long)
    am = torch.zeros_like(ids)
    pos = torch.zeros_like(ids, dtype=torch.bool)
    for i, r in enumerate(responses):
        seq = r.input_tokens + r.output_tokens
        ids[i, :len(seq)], am[i, :len(seq)] = torch.tensor(seq), 1
        pos[i, len(r.input_tokens):len(seq)] = True
    return ids, am, pos


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=MODEL)
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--samples", type=int, default=4)
    p.add_argument("--new-tokens", type=int, default=48)
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--top-p", type=float, default=0.9)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="benchmarks/results/sampling_mask.json")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rayllm_rl.hub import resolve_model_path

    path = resolve_model_path(args.model)
    tokenizer = AutoTokenizer.from_pretrained(path)
    responses = sample_batch(path, tokenizer, args)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    ids, am, pos = padded(responses)
    mask = SamplingMask(0, args.top_p)
    engine_lp = torch.cat([torch.tensor(r.output_logprobs, dtype=torch.float64) for r in responses])

    def step(m: SamplingMask) -> float:
        model.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        token_logprobs(model, ids, am, args.temperature, positions=pos, mask=m)[pos].sum().backward()
        return time.perf_counter() - t0

    times: dict[str, list[float]] = {"replayed": [], "full": []}
    step(mask)  # warm-up
    for _ in range(args.repeats):
        for name, m in (("replayed", mask), ("full", SamplingMask())):
            times[name].append(step(m))
    with torch.no_grad():
        masked_lp = token_logprobs(model, ids, am, args.temperature, positions=pos, mask=mask)[pos].double()
        full_lp = token_logprobs(model, ids, am, args.temperature, positions=pos)[pos].double()
        logits = model(input_ids=ids, attention_mask=am).logits[:, :-1][pos[:, 1:]].float() / args.temperature
        n, _, _ = kept_set(logits, 0, args.top_p)
    bias = full_lp - engine_lp
    nf = n.double()
    out = {
        "model": args.model, "temperature": args.temperature, "top_p": args.top_p, "tokens": int(pos.sum()),
        "sequences": len(responses), "threads": args.threads, "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "fwd_bwd_s_median": {k: statistics.median(v) for k, v in times.items()},
        "fwd_bwd_s_all": times,
        "replay_cost_x": statistics.median(times["replayed"]) / statistics.median(times["full"]),
        "kept_n": {"mean": float(nf.mean()), "p50": float(nf.median()), "p90": float(nf.quantile(0.9)),
                   "max": int(n.max()), "vocab": int(logits.shape[-1])},
        "engine_vs_replayed_abs_diff": {"mean": float((masked_lp - engine_lp).abs().mean()),
                                        "max": float((masked_lp - engine_lp).abs().max())},
        "bias_without_replay_log_m": {"mean": float(bias.mean()), "min": float(bias.min()),
                                      "max": float(bias.max()),
                                      "frac_tokens_below_minus_0.01": float((bias < -0.01).double().mean())},
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
