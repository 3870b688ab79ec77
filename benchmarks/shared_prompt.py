"""A learner step with each group's prompt run once (`optim.share_prompts`, learner/shared_prompt.py) against
padded rows, side by side on the same weights and batch.

The batch is the SmolLM2 recipe's: `--prompts` reasoning-gym questions (`--task`'s generator, the recipe's
instruction) under SmolLM2-135M-Instruct's own chat template and tokenizer, `--samples` completions each. The
completions are seeded random token ids (the step's cost depends on their lengths, not their text) with lengths
drawn to match a measured rollout: `--mean-len` tokens on average, a `--truncated` fraction cut at
`--max-new-tokens` (the defaults: basic_arithmetic's 12-step run, 23 tokens, 25-30% cut at 48). Two learners,
one per path, start from the same weights; lr 0 keeps them equal, so every step trains the same function, and
steps alternate between the two paths (paired, so the machine's drift hits both). Per path: the median
`train_step` seconds over `--steps` after one warm-up step, and the first step's gradient compared
(max |g_shared - g_padded| / max |g_padded| per tensor). The last stdout line is the JSON, also written to
`--out`.

    .venv/bin/python benchmarks/shared_prompt.py [--task chain_sum --mean-len 13 --truncated 0.05]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from tensordict import TensorDict  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    a = p.add_argument
    a("--model", default="models/SmolLM2-135M-Instruct.Q4_1.gguf")
    a("--task", default="basic_arithmetic")
    a("--prompts", type=int, default=8)
    a("--samples", type=int, default=8)
    a("--mean-len", type=float, default=23.0, help="completion tokens, mean")
    a("--truncated", type=float, default=0.28, help="fraction of completions cut at --max-new-tokens")
    a("--max-new-tokens", type=int, default=48)
    a("--steps", type=int, default=4, help="timed steps per path (after one warm-up step each)")
    a("--threads", type=int, default=1, help="torch threads (the learner actor's one core)")
    a("--seed", type=int, default=0)
    a("--out", default="benchmarks/results/shared_prompt.json")
    return p.parse_args(argv)


def build_batch(args, tokenizer) -> TensorDict:
    """`prompts x samples` right-padded rows: the chat-templated question, then a completion (trained)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from vs_trl import TASKS

    from rayllm_rl.envs.reasoning_gym_task import ReasoningGymConfig, make_splits
    from rayllm_rl.workflows.rlvr import tokenize_prompt

    cfg = ReasoningGymConfig(dataset=args.task, options=dict(TASKS[args.task]), train_size=200, seed=1,
                             eval_seed=2, instruction="Answer with a number.")
    train, _ = make_splits(cfg, 0)
    g = torch.Generator().manual_seed(args.seed)
    rows, vocab = [], len(tokenizer)
    for r in range(args.prompts):
        prompt = tokenize_prompt(tokenizer, train[r]["messages"])
        for _ in range(args.samples):
            cut = float(torch.rand((), generator=g)) < args.truncated
            free = (args.mean_len - args.truncated * args.max_new_tokens) / max(1e-9, 1 - args.truncated)
            n = args.max_new_tokens if cut else int(torch.randint(2, max(3, int(2 * free) - 1), (), generator=g))
            rows.append((prompt, torch.randint(0, vocab, (n,), generator=g).tolist()))
    t = max(len(p) + len(c) for p, c in rows)
    ids, am, lm = torch.zeros(len(rows), t, dtype=torch.long), torch.zeros(len(rows), t, dtype=torch.long), \
        torch.zeros(len(rows), t)
    for i, (p, c) in enumerate(rows):
        ids[i, :len(p) + len(c)] = torch.tensor(p + c)
        am[i, :len(p) + len(c)] = 1
        lm[i, len(p):len(p) + len(c)] = 1
    n = len(rows)
    return TensorDict({"input_ids": ids, "attention_mask": am, "loss_mask": lm,
                       "logprobs": torch.zeros(n, t), "versions": torch.zeros(n, t, dtype=torch.long),
                       "advantages": torch.randn(n, generator=g)}, batch_size=[n])


def main(argv=None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    from transformers import AutoTokenizer

    from rayllm_rl.hub import resolve_model_path
    from rayllm_rl.learner.learner import Learner, OptimConfig
    from rayllm_rl.learner.shared_prompt import packed_micro_batches
    from rayllm_rl.objectives import GRPOLoss

    path = resolve_model_path(args.model)
    td = build_batch(args, AutoTokenizer.from_pretrained(path))
    prompt_tokens = int(td["attention_mask"].sum() - td["loss_mask"].sum())
    learners = {share: Learner(path, OptimConfig(lr=0.0, grad_clip=0.0, max_tokens_per_micro_batch=2048,
                                                 share_prompts=share), seed=args.seed) for share in (False, True)}
    assert learners[True].can_share_prompts
    loss = GRPOLoss()
    seconds: dict[bool, list[float]] = {False: [], True: []}
    grads = {}
    for step in range(args.steps + 1):
        for share in ((False, True) if step % 2 == 0 else (True, False)):
            t0 = time.perf_counter()
            learners[share].train_step(td, loss)
            dt = time.perf_counter() - t0
            if step == 0:
                grads[share] = {k: p.grad.detach().clone() for k, p in learners[share].model.named_parameters()}
            else:
                seconds[share].append(dt)
    rel = max(float((grads[True][k] - grads[False][k]).abs().max() / grads[False][k].abs().max().clamp(min=1e-30))
              for k in grads[False])
    padded, shared = (statistics.median(seconds[s]) for s in (False, True))
    decoder_tokens = {"padded_rows": int(td["attention_mask"].sum()),  # real tokens each path runs
                      "shared_prompts": sum(int((p.segment >= 0).sum()) for p in packed_micro_batches(td, 2048))}
    result = {"benchmark": "shared_prompt", "task": args.task, "rows": td.batch_size[0],
              "prompt_tokens_mean": prompt_tokens / td.batch_size[0],
              "completion_tokens_mean": float(td["loss_mask"].sum()) / td.batch_size[0],
              "decoder_tokens": decoder_tokens, "threads": args.threads,
              "step_s": {"padded": seconds[False], "shared": seconds[True]},
              "step_s_median": {"padded": padded, "shared": shared}, "speedup": padded / shared,
              "grad_max_rel_diff": rel, "cpu": os.uname().machine, "torch": torch.__version__}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
