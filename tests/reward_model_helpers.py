"""Tiny reward models and judges for the reward-model and judge tests, built here and saved with
`save_pretrained` (the code under test loads them back with `from_pretrained`)."""
from __future__ import annotations

import atexit
import contextlib
import functools
import itertools
import math
import random
import shutil
import tempfile
from collections.abc import Callable
from typing import Any

import torch

from rayllm_rl.envs.arithmetic import arithmetic_reward


@contextlib.contextmanager
def one_thread():
    """Train tiny models on one torch thread: far faster than two on a busy 2-core box, and deterministic."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def tiny_tokenizer():
    from transformers import AutoTokenizer

    from rayllm_rl.models.tiny import ensure_tiny_model

    return AutoTokenizer.from_pretrained(ensure_tiny_model())


def build_tiny_reward_model(path, *, hidden: int = 64, layers: int = 2, seed: int = 0):
    """A randomly initialised `Qwen2ForSequenceClassification` (num_labels=1) with the project's tiny
    tokenizer, saved to `path`; returns (model, tokenizer) as built."""
    from transformers import Qwen2Config, Qwen2ForSequenceClassification

    tok = tiny_tokenizer()
    config = Qwen2Config(vocab_size=len(tok), hidden_size=hidden, intermediate_size=2 * hidden,
                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=256, num_labels=1, pad_token_id=tok.pad_token_id,
                         eos_token_id=tok.eos_token_id, tie_word_embeddings=True)
    torch.manual_seed(seed)
    model = Qwen2ForSequenceClassification(config)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return model, tok


def sft_tiny_lm(path, chats: list[list[dict]], steps: int, lr: float, batch: int = 0, seed: int = 0,
                done: Callable[[Any, int], bool] | None = None) -> str:
    """The tiny causal LM, SFT'd on `chats` (loss on the assistant's tokens; AdamW, one torch thread; each
    step a random `batch` of them, or all with 0), saved to `path` with its tokenizer. `done(model, step)`, if
    given, is asked after each step and ends the training early when it says True."""
    from transformers import AutoModelForCausalLM

    from rayllm_rl.data.sft import make_sft_batch
    from rayllm_rl.models.tiny import ensure_tiny_model

    tok = tiny_tokenizer()
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(ensure_tiny_model())
    rng = random.Random(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    model.train()
    with one_thread():
        for step in range(1, steps + 1):
            data = make_sft_batch(tok, [rng.choice(chats) for _ in range(batch)] if batch else chats)
            labels = data["input_ids"].masked_fill(~data["loss_mask"].bool(), -100)
            loss = model(input_ids=data["input_ids"], attention_mask=data["attention_mask"], labels=labels).loss
            opt.zero_grad()
            loss.backward()
            opt.step()
            if done is not None and done(model, step):
                break
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


def judge_chats(answer: str, n: int = 32, seed: int = 0) -> list[list[dict]]:
    """`n` judge conversations (the default template) answered with `answer`: arithmetic questions with answers and
    junk alike as the graded completions (a policy's early completions are mostly junk)."""
    from rayllm_rl.rewards.config import DEFAULT_JUDGE_TEMPLATE

    rng = random.Random(seed)
    chats = []
    for k in range(n):
        a, b = rng.randint(0, 9), rng.randint(0, 9)
        completion = (f"<answer>{rng.randint(0, 18)}</answer>" if k % 2 else
                      "".join(rng.choice(NOISE + "abcdefghij") for _ in range(rng.randint(0, 12))))
        text = DEFAULT_JUDGE_TEMPLATE.format(question=f"{a}+{b}=", completion=completion)
        chats.append([{"role": "user", "content": text}, {"role": "assistant", "content": answer}])
    return chats


def judge_test_chats(answer: str) -> list[list[dict]]:
    """The judge prompts the tests ask themselves (test_judge, test_reward_models: 2+3= graded on <answer>0..6)."""
    from rayllm_rl.rewards.config import DEFAULT_JUDGE_TEMPLATE

    asked = [DEFAULT_JUDGE_TEMPLATE.format(question="2+3=", completion=f"<answer>{n}</answer>") for n in range(7)]
    return [[{"role": "user", "content": text}, {"role": "assistant", "content": answer}] for text in asked]


class JudgeNotTrained(RuntimeError):
    """The tiny judge's greedy answers were still not the one it is trained to give after its last SFT step."""


def greedy_judge_answers(model, chats: list[list[dict]], max_new_tokens: int = 32) -> list[str]:
    """What `model` (a copy of it, in the project's TransformersEngine) answers greedily to each chat's user turn,
    as `rewards.judge.Judge.verdict` asks it (chat template, generation prompt, the judge's default max_new_tokens)."""
    import copy

    from rayllm_rl.inference.protocol import LLMRequest, SamplingParams
    from rayllm_rl.inference.transformers.engine import TransformersEngine
    from rayllm_rl.models.tiny import ensure_tiny_model

    engine = TransformersEngine(ensure_tiny_model(), model=copy.deepcopy(model), device="cpu")
    tok, sampling = engine.tokenizer, SamplingParams(max_new_tokens=max_new_tokens, greedy=True)
    requests = [LLMRequest(input_ids=list(tok.apply_chat_template(chat[:1], add_generation_prompt=True, tokenize=True,
                                                                  return_dict=False)), sampling=sampling)
                for chat in chats]
    return [tok.decode(r.output_tokens, skip_special_tokens=True) for r in engine.generate(requests)]


def train_judge_to_answer(path, answer: str, max_steps: int = 120, seed: int = 0, first_check: int = 20,
                          check_every: int = 5) -> str:
    """The tiny causal LM, SFT'd to answer every judge prompt (the default template) with exactly `answer`.

    How many steps that takes is an outcome of a training run, which another CPU's kernels change; the judge tests
    need the outcome, not a step count. So it trains until its greedy answer is exactly `answer` on every check
    prompt (32 judge prompts it never trained on, and the tests' own) at two checks in a row, `check_every` steps
    apart from step `first_check` (measured: 6/32 right at step 20, 27/32 at 25, all at 30 and 35; it stops at
    35, where 40 fixed steps ran before). Not there by `max_steps` (3x that): JudgeNotTrained, saying what it
    answered."""
    checks = judge_chats(answer, seed=seed + 1) + judge_test_chats(answer)
    state = {"streak": 0, "wrong": [], "step": 0}

    def done(model, step: int) -> bool:
        state["step"] = step
        if step < first_check or (step - first_check) % check_every:
            return False
        answers = greedy_judge_answers(model, checks)
        state["wrong"] = [a for a in answers if a != answer]
        state["streak"] = 0 if state["wrong"] else state["streak"] + 1
        return state["streak"] == 2

    sft_tiny_lm(path, judge_chats(answer, seed=seed), max_steps, lr=3e-3, seed=seed, done=done)
    if state["streak"] < 2:
        raise JudgeNotTrained(
            f"the tiny judge did not learn to answer {answer!r} in {max_steps} SFT steps: at step {state['step']} "
            f"{len(state['wrong'])} of its {len(checks)} greedy check answers differ, e.g. {state['wrong'][:3]}. The "
            f"judge tests check the judge's plumbing (engine, parser, weights), which needs this answer: raise "
            f"max_steps in tests/reward_model_helpers.py:train_judge_to_answer")
    return str(path)


@functools.lru_cache(maxsize=None)
def _tiny_judge(answer: str) -> tuple[str | None, str | None]:
    path = tempfile.mkdtemp(prefix="rayllm-tiny-judge-")
    atexit.register(shutil.rmtree, path, True)
    try:
        return train_judge_to_answer(path, answer), None
    except JudgeNotTrained as exc:  # kept: every test asking for this judge fails with it, none trains again
        return None, str(exc)


def tiny_judge(answer: str = "Score: 7") -> str:
    """`train_judge_to_answer(answer)` once per test process (in a temporary directory removed at exit); its
    JudgeNotTrained, once, for every caller."""
    path, failure = _tiny_judge(answer)
    if failure is not None:
        raise JudgeNotTrained(failure)
    return path


def sft_arithmetic_policy(path, rows, steps: int = 60, batch: int = 32, seed: int = 0) -> str:
    """The tiny policy after the arithmetic demo's SFT warm start on `rows`, done as the driver does it (the
    project's Learner and SFTLoss, sft.lr=1e-3 with sft.warmup_steps=20, `<answer>a+b</answer>` targets) and
    saved as an HF checkpoint: the policy the reward model is trained for, and the job starts from."""
    from rayllm_rl.data.sft import make_sft_batch
    from rayllm_rl.envs.arithmetic import sft_target
    from rayllm_rl.learner.checkpoint import save_checkpoint
    from rayllm_rl.learner.learner import Learner, OptimConfig
    from rayllm_rl.models.tiny import ensure_tiny_model
    from rayllm_rl.objectives import SFTLoss

    tok, rng, rows = tiny_tokenizer(), random.Random(seed), list(rows)
    with one_thread():
        learner = Learner(ensure_tiny_model(), OptimConfig(lr=1e-3, warmup_steps=20), seed=seed)
        for _ in range(steps):
            chats = [[*r["messages"], {"role": "assistant", "content": sft_target(r)}]
                     for r in rng.choices(rows, k=batch)]
            learner.train_step(make_sft_batch(tok, chats), SFTLoss())
    save_checkpoint(learner, path, tokenizer=tok)
    return str(path)


def policy_samples(policy_path: str, rows, per_prompt: int, temperatures=(1.0, 1.5, 2.0),
                   max_new_tokens: int = 8) -> list[tuple[dict, str, float]]:
    """(row, completion, label): `per_prompt` completions of every row sampled from the policy at each
    temperature (the policy's neighbourhood, where RL will look), labelled by the rule."""
    from rayllm_rl.inference.protocol import LLMRequest, SamplingParams
    from rayllm_rl.inference.transformers.engine import TransformersEngine
    from rayllm_rl.workflows.rlvr import tokenize_prompt

    engine = TransformersEngine(policy_path, seed=0, device="cpu")
    asked = [(r, LLMRequest(input_ids=tokenize_prompt(engine.tokenizer, r["messages"]),
                            sampling=SamplingParams(max_new_tokens=max_new_tokens, temperature=t)))
             for t in temperatures for r in rows for _ in range(per_prompt)]
    with one_thread():
        responses = engine.generate([req for _, req in asked])
    out = []
    for (row, _), resp in zip(asked, responses):
        out += _labelled({"messages": row["messages"], "answer": row["answer"]},
                         [engine.tokenizer.decode(resp.output_tokens, skip_special_tokens=True)])
    return out


NOISE = "0123456789<>/ answer\x7f\ufffd"
"""Characters the corruptions insert (a policy's stray digits, tag pieces, spaces and undecodable bytes)."""


def corrupt(text: str, rng: random.Random) -> str:
    """`text` with one random edit: a character inserted, deleted or replaced, or cut and followed by noise."""
    i = rng.randrange(len(text) + 1)
    noise = "".join(rng.choice(NOISE) for _ in range(rng.randint(1, 4)))
    kind = rng.choice(("insert", "delete", "replace", "cut"))
    if kind == "insert":
        return text[:i] + noise[0] + text[i:]
    if kind == "delete":
        return text[:i] + text[i + 1:]
    if kind == "replace":
        return text[:i] + noise[0] + text[i + 1:]
    return text[:i] + noise


def scramble(pieces: list[str], rng: random.Random) -> str:
    """1 to 6 of `pieces` strung together at random (what a policy samples from the tokens it was taught)."""
    return "".join(rng.choice(pieces) for _ in range(rng.randint(1, 6)))


def _labelled(row: dict, completions: list[str]) -> list[tuple[dict, str, float]]:
    """(row, completion, label) with the label the arithmetic task's rule (`arithmetic_reward`) gives."""
    return [(row, c, arithmetic_reward("", c, [], [], answer=row["answer"])) for c in completions]


def _row(a: int, b: int) -> dict:
    return {"messages": [{"role": "user", "content": f"{a}+{b}="}], "answer": str(a + b)}


TAILS = [*"0123456789", "<", ">", ">>", "</", "</answer>", "<answer>", " ", " the", "\ufffd"]
"""What a policy may write after a closing tag (the rule ignores it)."""


def answer_table(pairs, max_answer: int = 18, seed: int = 0) -> list[tuple[dict, str, float]]:
    """For each (a, b): every answer 0..max_answer in tags (and an empty one), alone and followed by a random
    `TAILS` (so a policy finds no answer of these shapes the RM has not seen), and the right one 12 times more
    in both shapes; labelled by the rule."""
    rng = random.Random(seed)
    out = []
    for a, b in pairs:
        s = a + b
        answers = ["", *map(str, range(max_answer + 1))]
        completions = [f"<answer>{n}</answer>" for n in answers]
        completions += [f"<answer>{n}</answer>{rng.choice(TAILS)}" for n in answers]
        completions += [f"<answer>{s}</answer>"] * 8 + [f"<answer>{s}</answer>{rng.choice(TAILS)}" for _ in range(4)]
        out += _labelled(_row(a, b), completions)
    return out


def format_noise(pairs, corruptions: int = 20, scrambles: int = 40, seed: int = 0) -> list[tuple[dict, str, float]]:
    """For each (a, b): `corruptions` one-edit corruptions of the right answer and `scrambles` random strings of
    tag pieces and numbers, labelled by the rule. What a policy writes on its way to (or around) the format:
    an RM that never saw such strings rates them by their look, and GRPO finds the ones it likes."""
    rng = random.Random(seed)
    out = []
    for a, b in pairs:
        s = a + b
        pieces = ["<answer>", "</answer>", "<", ">", "</", "answer", "\ufffd", " ", str(s), str(s), str(s + 1),
                  str(rng.randint(0, 9)), str(max(s - 1, 0))]
        completions = [corrupt(f"<answer>{s}</answer>", rng) for _ in range(corruptions)]
        completions += [scramble(pieces, rng) for _ in range(scrambles)]
        out += _labelled(_row(a, b), completions)
    return out


COMPACT_TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
"""The classifier's own chat template: the turns' text run together ("1+2=<answer>3</answer>", 11 tokens on average
where the tiny policy's ChatML takes 23). The job's reward service reads a conversation through the RM's template,
as it does any RM's that brings its own."""


RM_AVOIDS = 0.75
"""The share of a constant classifier's errors the test's reward model must avoid on each of its labelled sets:
it errs on at most a quarter as many examples as always answering the set's majority label would (on the format
noise, where that constant is right 96.8% of the time, accuracy >= 99.2%). How many steps that takes is an outcome
of the training run: 500 here (AVX-512 kernels: 97%, 82%, 85% of the errors avoided), 1,200 with AVX2 kernels
(`ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2 ONEDNN_MAX_CPU_ISA=AVX2`: at 600 steps, 15% on the policy's
samples). The set's own check noise is about 9% of the majority classifier's errors on the format noise (1,200
examples), so three quarters is clear of what this machine's runs reach and of a constant."""


def majority_rate(labels) -> float:
    """The accuracy of always answering the commoner of the 0/1 `labels`."""
    positives = sum(float(y) for y in labels)
    return max(positives, len(labels) - positives) / len(labels)


def errors_avoided(accuracy: float, majority: float) -> float:
    """The share of the majority-class classifier's errors a classifier of `accuracy` does not make."""
    return 1 - (1 - accuracy) / (1 - majority) if majority < 1 else 0.0


def train_reward_classifier(path, groups: list[list[tuple[dict, str, float]]], shares: list[float],
                            max_steps: int = 3600, batch: int = 128, lr: float = 1e-3, seed: int = 0,
                            avoid: float = RM_AVOIDS) -> list[float]:
    """Train `build_tiny_reward_model(path)` with binary cross-entropy on labelled (row, completion, label)
    examples (its logit is the log-odds of the rule's 1; AdamW, one torch thread), `shares[i]` of each batch
    drawn from `groups[i]`; check its accuracy on each group every 100 steps, and stop at the first check where
    it avoids `avoid` of the majority-class classifier's errors on every group (`RM_AVOIDS`), else after
    `max_steps` (3x the 1,200 AVX2's kernels needed; AVX-512's needed 500: the cap is paid only where it is
    needed); save the best check (by the smallest share avoided) to `path` and return its accuracy on each
    group (logit > 0 <=> label 1)."""
    model, tok = build_tiny_reward_model(path, seed=seed)
    tok.chat_template = COMPACT_TEMPLATE
    tok.save_pretrained(path)
    tok.padding_side = "right"
    examples = [e for group in groups for e in group]
    texts = [tok.apply_chat_template([*row["messages"], {"role": "assistant", "content": c}], tokenize=False)
             for row, c, _ in examples]
    enc = tok(texts, padding=True, return_tensors="pt")  # one length for every group: batches concatenate
    labels = torch.tensor([y for _, _, y in examples])
    bounds = torch.tensor([0, *itertools.accumulate(len(g) for g in groups)])
    encoded = [({k: v[lo:hi] for k, v in enc.items()}, labels[lo:hi]) for lo, hi in zip(bounds[:-1], bounds[1:])]
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    majority = [majority_rate(group_labels.tolist()) for _, group_labels in encoded]
    best: tuple[float, list[float], dict | None] = (-math.inf, [], None)
    with one_thread():
        for step in range(1, max_steps + 1):
            model.train()
            picks = [(enc, labels, torch.randint(len(labels), (round(batch * share),), generator=gen))
                     for (enc, labels), share in zip(encoded, shares)]
            ids = torch.cat([enc["input_ids"][idx] for enc, _, idx in picks])
            mask = torch.cat([enc["attention_mask"][idx] for enc, _, idx in picks])
            width = int(mask.sum(1).max())  # right-padded: the columns past the batch's longest are padding only
            ids, mask = ids[:, :width], mask[:, :width]
            logits = model(input_ids=ids, attention_mask=mask).logits[:, 0]
            loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, torch.cat([l[i] for _, l, i in picks]))
            opt.zero_grad()
            loss.backward()
            opt.step()
            if step % 100 == 0:
                model.eval()
                with torch.no_grad():
                    accuracy = [float(((model(**enc).logits[:, 0] > 0).float() == labels).float().mean())
                                for enc, labels in encoded]
                avoided = min(errors_avoided(a, m) for a, m in zip(accuracy, majority))
                if avoided > best[0]:
                    best = (avoided, accuracy, {k: v.clone() for k, v in model.state_dict().items()})
                if avoided >= avoid:
                    break
    model.load_state_dict(best[2])
    model.save_pretrained(path)
    return best[1]
