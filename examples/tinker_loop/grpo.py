"""A GRPO loop of your own on Tinker's primitives (rayllm_rl.tinker): sample, score, forward_backward, optim_step.

    python examples/tinker_loop/grpo.py                      # the offline tiny model, about a minute
    python examples/tinker_loop/grpo.py --backend ray        # the same loop on Ray actors
    python examples/tinker_loop/grpo.py --base-url http://127.0.0.1:PORT   # the unmodified tinker SDK against
                                                             # `rayllm-rl serve MODEL` (TINKER_API_KEY=tml-...)

Small: a cross-entropy warm start on sums where a quarter of the answers are in <answer> tags, then GRPO whose
reward is half for the tags, half for the right number. Prints one JSON line per step, then a summary.
full_size.py runs the same loop on SmolLM2-135M-Instruct at the SmolLM2 recipe's settings.
"""
import argparse, json, random, re, statistics, sys, time  # noqa: E401
from pathlib import Path
from types import SimpleNamespace

import tinker
from tinker import types as T

ROOT = Path(__file__).resolve().parents[2]
ANSWER = re.compile(r"<answer>\s*(-?\d+)\s*</answer>")


def reward(text: str, row: dict) -> float:
    tagged = ANSWER.findall(text)
    numbers = tagged or re.findall(r"-?\d+", text)
    return 0.5 * bool(tagged) + 0.5 * (bool(numbers) and int(numbers[-1]) == row["answer"])


def datum(prompt: list[int], tokens: list[int], **per_token: list[float]) -> tinker.Datum:
    """Tinker's layout: the model reads all but the last token and is scored on the next token at each position."""
    full, pad = prompt + tokens, [0.0] * (len(prompt) - 1)
    return tinker.Datum(model_input=T.ModelInput.from_ints(full[:-1]),
                        loss_fn_inputs={"target_tokens": full[1:], **{k: pad + v for k, v in per_token.items()}})


def run(training, s, steps: int, prompts: int, group: int, seed: int = 0) -> dict:
    """`s`: the setting (`tiny` below, full_size.py's): rows (each with its chat `messages`), reward(text, row),
    demos for a warm start, sampling, the loss, Adam's parameters at each step, whether to divide by the std."""
    tok, rng = training.get_tokenizer(), random.Random(seed)
    chat = lambda row: tok.apply_chat_template(row["messages"], add_generation_prompt=True,  # noqa: E731
                                               return_dict=True)["input_ids"]
    for _ in range(s.sft_steps):  # warm start: imitate demonstrations
        demos = [(chat(row), tok.encode(s.demo(i, row)) + [tok.eos_token_id])
                 for i, row in enumerate(rng.sample(s.rows, 32))]
        fb = training.forward_backward([datum(q, d, weights=[1.0] * len(d)) for q, d in demos], "cross_entropy")
        fb.result(), training.optim_step(T.AdamParams(learning_rate=1e-3)).result()
    history, t0 = [], time.time()
    params = T.SamplingParams(max_tokens=s.max_tokens, temperature=s.temperature, stop=[tok.eos_token_id])
    for step in range(steps):
        sampler = training.save_weights_and_get_sampling_client().result()  # weights to the replicas, pinned
        batch = rng.sample(s.rows, prompts)
        futures = [sampler.sample(T.ModelInput.from_ints(chat(row)), group, params) for row in batch]
        data, rewards = [], []
        for row, fut in zip(batch, futures):
            seqs = fut.result().sequences
            r = [s.reward(tok.decode(q.tokens, skip_special_tokens=True), row) for q in seqs]
            rewards += r
            mean, sd = statistics.fmean(r), statistics.pstdev(r) if s.std else 1.0
            data += [datum(chat(row), q.tokens, logprobs=list(q.logprobs),
                           advantages=[(ri - mean) / (sd + 1e-6)] * len(q.tokens))
                     for q, ri in zip(seqs, r) if ri != mean]  # a uniform group teaches nothing
        if data:  # both submitted at once; reading each result raises a failed call's error here
            fb, opt = training.forward_backward(data, s.loss), training.optim_step(s.adam(step))
            fb.result(), opt.result()
        history.append(statistics.fmean(rewards))
        print(json.dumps({"step": step + 1, "reward": history[-1]}), flush=True)
    k = max(1, len(history) // 4)
    return {"example": "tinker_loop", "steps": steps, "rewards": history,
            "reward_first": statistics.fmean(history[:k]), "reward_last": statistics.fmean(history[-k:]),
            "sequences_per_s": steps * prompts * group / (time.time() - t0)}


def tiny(lr: float, sft_steps: int = 80):
    rows = [{"messages": [{"role": "user", "content": f"{x}+{y}="}], "answer": x + y} for x in range(10)
            for y in range(10)]
    tagged = lambda i, row: f"<answer>{row['answer']}</answer>" if i % 4 == 0 else str(row["answer"])  # noqa: E731
    return SimpleNamespace(rows=rows, reward=reward, sft_steps=sft_steps, max_tokens=10, temperature=1.0, std=False,
                           demo=tagged, loss="importance_sampling", adam=lambda step: T.AdamParams(learning_rate=lr))


def main(argv: list[str]) -> dict:
    p = argparse.ArgumentParser()
    p.add_argument("--backend", default="local"), p.add_argument("--base-url", default="")
    p.add_argument("--steps", type=int, default=40), p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--group", type=int, default=8), p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--sft-steps", type=int, default=80), p.add_argument("overrides", nargs="*")
    a = p.parse_args(argv)
    from rayllm_rl.models.tiny import ensure_tiny_model
    from rayllm_rl.tinker import TinkerService

    model = ensure_tiny_model()  # the SDK (--base-url) or the primitives in this process: one loop for both
    service = (tinker.ServiceClient(base_url=a.base_url) if a.base_url
               else TinkerService(model, a.backend, a.overrides))
    with service:
        training = service.create_lora_training_client(base_model=model, rank=0).result()
        summary = run(training, tiny(a.lr, a.sft_steps), a.steps, a.prompts, a.group)
    summary["backend"] = a.base_url or a.backend
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    main(sys.argv[1:])
