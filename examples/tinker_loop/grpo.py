"""A GRPO loop of your own on Tinker's primitives (rayllm_rl.tinker): sample, score, forward_backward, optim_step.

    python examples/tinker_loop/grpo.py                      # the offline tiny model, about a minute
    python examples/tinker_loop/grpo.py --backend ray        # the same loop on Ray actors
    python examples/tinker_loop/grpo.py --base-url http://127.0.0.1:PORT   # the unmodified tinker SDK against
                                                             # `rayllm-rl serve MODEL` (TINKER_API_KEY=tml-...)

Small: a cross-entropy warm start on sums where a quarter of the answers are in <answer> tags, then GRPO whose
reward is half for the tags, half for the right number. Prints one JSON line per step, then a summary.
"""
import argparse, json, random, re, statistics, sys, time  # noqa: E401
from pathlib import Path

import tinker
from tinker import types as T

ROOT = Path(__file__).resolve().parents[2]
ANSWER = re.compile(r"<answer>\s*(-?\d+)\s*</answer>")


def reward(text: str, answer: int) -> float:
    tagged = ANSWER.findall(text)
    numbers = tagged or re.findall(r"-?\d+", text)
    return 0.5 * bool(tagged) + 0.5 * (bool(numbers) and int(numbers[-1]) == answer)


def datum(prompt: list[int], tokens: list[int], **per_token: list[float]) -> tinker.Datum:
    """Tinker's layout: the model reads all but the last token and is scored on the next token at each position."""
    full, pad = prompt + tokens, [0.0] * (len(prompt) - 1)
    return tinker.Datum(model_input=T.ModelInput.from_ints(full[:-1]),
                        loss_fn_inputs={"target_tokens": full[1:], **{k: pad + v for k, v in per_token.items()}})


def main(argv: list[str]) -> dict:
    p = argparse.ArgumentParser()
    p.add_argument("--backend", default="local"), p.add_argument("--base-url", default="")
    p.add_argument("--steps", type=int, default=40), p.add_argument("--sft-steps", type=int, default=80)
    p.add_argument("--prompts", type=int, default=8), p.add_argument("--group", type=int, default=8)
    p.add_argument("--lr", type=float, default=2e-4), p.add_argument("overrides", nargs="*")
    a = p.parse_args(argv)
    from rayllm_rl.models.tiny import ensure_tiny_model
    from rayllm_rl.tinker import TinkerService

    model = ensure_tiny_model()  # the SDK (--base-url) or the primitives in this process: one loop for both
    service = tinker.ServiceClient(base_url=a.base_url) if a.base_url else TinkerService(model, a.backend, a.overrides)
    with service:
        return run(a, service.create_lora_training_client(base_model=model, rank=0).result())


def run(a, training) -> dict:
    tok, rng = training.get_tokenizer(), random.Random(0)
    chat = lambda q: tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,  # noqa
                                             return_dict=True)["input_ids"]
    rows = [(f"{x}+{y}=", x + y) for x in range(10) for y in range(10)]
    for step in range(a.sft_steps):  # warm start: imitate demonstrations, a quarter of them tagged
        batch = rng.sample(rows, 32)
        demos = [(chat(q), tok.encode(f"<answer>{s}</answer>" if i % 4 == 0 else str(s)) + [tok.eos_token_id])
                 for i, (q, s) in enumerate(batch)]
        training.forward_backward([datum(q, d, weights=[1.0] * len(d)) for q, d in demos], "cross_entropy")
        training.optim_step(T.AdamParams(learning_rate=1e-3))
    history, t0 = [], time.time()
    for step in range(a.steps):
        sampler = training.save_weights_and_get_sampling_client().result()  # weights to the replicas, pinned
        batch = rng.sample(rows, a.prompts)
        params = T.SamplingParams(max_tokens=10, temperature=1.0, stop=[tok.eos_token_id])
        futures = [sampler.sample(T.ModelInput.from_ints(chat(q)), a.group, params) for q, _ in batch]
        data, rewards = [], []
        for (q, answer), fut in zip(batch, futures):
            seqs = fut.result().sequences
            r = [reward(tok.decode(s.tokens), answer) for s in seqs]
            rewards += r
            mean = statistics.fmean(r)
            data += [datum(chat(q), s.tokens, logprobs=list(s.logprobs), advantages=[ri - mean] * len(s.tokens))
                     for s, ri in zip(seqs, r) if ri != mean]  # a uniform group teaches nothing
        if data:
            training.forward_backward(data, "importance_sampling")
            training.optim_step(T.AdamParams(learning_rate=a.lr)).result()
        history.append(statistics.fmean(rewards))
        print(json.dumps({"step": step + 1, "reward": history[-1]}), flush=True)
    k = max(1, len(history) // 4)
    summary = {"example": "tinker_loop", "backend": a.base_url or a.backend, "steps": a.steps, "rewards": history,
               "reward_first": statistics.fmean(history[:k]), "reward_last": statistics.fmean(history[-k:]),
               "sequences_per_s": a.steps * a.prompts * a.group / (time.time() - t0)}
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    main(sys.argv[1:])
