"""Running a job's loop on what a test set up (its own Ray, or none): `driver.train` of the config's plan; and
reading what a run wrote (its step records, its traced rows, a multi-turn row's turns token by token)."""
from __future__ import annotations

import json
from pathlib import Path

from rayllm_rl.orchestration import driver
from rayllm_rl.job.plan import make_plan


def run_job(cfg, inputs=None, **kwargs) -> dict:
    """The driver's loop over `make_plan(cfg, inputs)` (the config resolved or not); returns the summary.
    Unlike `rayllm_rl.train` it neither starts nor stops Ray."""
    return driver.train(make_plan(cfg, inputs), inputs, **kwargs)


def rl_records(summary) -> list[dict]:
    """The run's RL step records (`metrics.jsonl` of `summary["run_dir"]`, phase "rl")."""
    lines = (Path(summary["run_dir"]) / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["phase"] == "rl"]


def trace_samples(summary) -> list[dict]:
    """The run's decoded trace rows (`traces.jsonl`: a few trained rows per step, token by token)."""
    lines = (Path(summary["run_dir"]) / "traces.jsonl").read_text().splitlines()
    return [sample for line in lines for sample in json.loads(line).get("samples", ())]


STEP1_LOGPROB_BOUND = 1e-3
"""Max |learner - engine| logprob of a traced token trained from the version that sampled it (`trained_from` 0): the
same tokens under the same float32 weights, the engine decoding with a KV cache and the learner in one padded
forward, so only the order of the sums differs; each rounds at float32's eps (6e-8) relative, ~1e-6 in a logprob
of the tiny model (the engine contract holds the same pair to 1e-4). 1e-3, test_smollm2_rl_step's bound for a
30-layer model, leaves room for any CPU's vector width and stays far below what one update moves a logprob."""


def trace_turns(sample) -> list[tuple[bool, str]]:
    """A trace row's tokens after the prompt as runs of (trained, text): the engine's reply, the environment's
    turn, the next reply, ..."""
    out: list[tuple[bool, str]] = []
    for tok, trained in zip(sample["tokens"], sample["trained"]):
        if out and out[-1][0] == trained:
            out[-1] = (trained, out[-1][1] + tok)
        else:
            out.append((trained, tok))
    return out


def replies_of(sample, tokenizer, turns: int, feedback, lossy: bool = False) -> list[str]:
    """The engine's replies in a traced row of `turns` turns, checked token by token: the trained runs of tokens
    (the engine's; at step 1 the learner's logprob of each is within STEP1_LOGPROB_BOUND of the engine's) alternate
    with the environment's turn, whose tokens are exactly the chat template's rendering of `feedback(k, reply)` (the
    messages the environment answered the k-th reply with) after the reply's end-of-turn token. `lossy`: the feedback
    quotes the reply, whose bytes of a split character the trace (decoded a token at a time) and the environment
    (decoded whole) show as different runs of U+FFFD, so those are left out of the comparison."""
    from rayllm_rl.data.chat_template import next_turns_text

    parts = trace_turns(sample)
    assert [trained for trained, _ in parts] == [True, False] * (turns - 1) + [True]
    replies = []
    for k in range(0, len(parts), 2):
        said = parts[k][1]
        reply = said
        for special in tokenizer.all_special_tokens:  # what the environment got: decoded without special tokens
            reply = reply.replace(special, "")
        replies.append(reply)
        if k + 1 < len(parts):
            closing = "" if said.endswith(tokenizer.eos_token) else tokenizer.eos_token
            expected = closing + next_turns_text(tokenizer, feedback(k // 2, reply))
            if lossy:
                assert parts[k + 1][1].replace("\ufffd", "") == expected.replace("\ufffd", "")
            else:
                assert parts[k + 1][1] == expected
    if sample.get("trained_from") == 0:
        gaps = [abs(m) for m in sample["mismatch"] if m is not None]
        assert gaps and max(gaps) < STEP1_LOGPROB_BOUND
    return replies


class ScriptPolicy:
    """A stand-in policy for the held-out evaluation of a tool environment (a fake, to reach known rewards; not a
    model): `script(prompt text) -> replies`, of which it serves the i-th when the prompt so far holds i
    `<tool_call>` blocks (each reply before it made one). Its replies are `ScriptedEngine`'s tokens."""

    def __init__(self, tokenizer, script) -> None:
        self.tokenizer, self.script = tokenizer, script

    async def agenerate(self, request):
        from rayllm_rl.environments.demonstrations import ScriptedEngine

        assert request.sampling.greedy, f"the held-out evaluation sampled: {request.sampling}"
        text = self.tokenizer.decode(request.input_ids)
        scripted = ScriptedEngine(self.tokenizer, self.script(text))
        scripted.turn = text.count("<tool_call>")
        return await scripted.agenerate(request)
