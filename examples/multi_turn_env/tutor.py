"""An arithmetic tutor: a multi-turn environment with feedback between turns, as a rollout workflow of your own.

The model answers a sum; the tutor replies "41 is too low. Try again." (or too high, or "no number") and the model
tries again, up to `max_turns` tries. Solving at try t earns `turn_discount ** (t - 1)`. Token-in/token-out: each
try's prompt is the previous prompt + the model's own tokens + the tutor's feedback tokens, never a re-rendered
chat, and the feedback tokens are masked out of the loss (loss_mask 0, logprobs 0, versions -1).

    rollout.workflow=tutor:make_workflow        (PYTHONPATH holds this folder)   or   train(workflow=make_workflow)
"""
from __future__ import annotations

import random
import re

from rayllm_rl.data.trajectory import TrajectoryBuilder
from rayllm_rl.inference.protocol import LLMRequest
from rayllm_rl.workflows.base import RolloutWorkflow
from rayllm_rl.workflows.grouped import GroupedWorkflow
from rayllm_rl.workflows.multi_turn import feedback_suffix_ids
from rayllm_rl.workflows.rewards import RewardCaller
from rayllm_rl.workflows.rlvr import row_fields, row_messages, tokenize_prompt

NUMBER = re.compile(r"-?\d+")


def last_number(text: str) -> int | None:
    """The answer a try gives: the last number in it (inside <answer> tags or not)."""
    found = NUMBER.findall(text.replace(",", ""))
    return int(found[-1]) if found else None


def answered_right(prompt, completion, prompt_ids, completion_ids, answer, **columns) -> float:
    """The task's reward (reward.fn / reward_fn=): 1.0 when the completion's last number is the answer. The tutor
    scores every try with it, and the held-out evaluation scores the greedy first try with it."""
    return float(last_number(completion) == int(answer))


class Tutor:
    """The environment of one conversation: it knows the answer and words its feedback on a wrong try."""

    def __init__(self, answer: int):
        self.answer = int(answer)

    def feedback(self, completion: str) -> str:
        number = last_number(completion)
        if number is None:
            return "I see no number. Answer with a number."
        return f"{number} is too {'high' if number > self.answer else 'low'}. Try again."


class TutorAgent(RolloutWorkflow):
    """One conversation with the tutor -> one trajectory (`make_workflow` runs a group of them per prompt)."""

    def __init__(self, reward_fn, tokenizer, sampling, max_turns: int = 3, turn_discount: float = 0.9):
        if max_turns < 2:
            raise ValueError(f"the tutor needs rollout.max_turns >= 2 to give feedback, got {max_turns}")
        self.reward = RewardCaller(reward_fn)  # raising or hanging rewards score 0 and are counted in the summary
        self.tokenizer, self.sampling = tokenizer, sampling
        self.max_turns, self.turn_discount = max_turns, turn_discount

    async def arun_episode(self, engine, data):
        tok, row = self.tokenizer, row_fields(data)
        tutor = Tutor(row["answer"])
        traj = TrajectoryBuilder()
        traj.add_prompt(tokenize_prompt(tok, row_messages(data)))  # the chat rendered once, at the start
        rid = f"tutor{data.get('group_id', 0)}-{random.getrandbits(32)}"
        for turn in range(1, self.max_turns + 1):
            resp = await engine.agenerate(LLMRequest(input_ids=list(traj.input_ids), sampling=self.sampling, rid=rid))
            if resp.input_tokens != traj.input_ids:  # the engine saw exactly the trajectory so far
                raise RuntimeError(f"episode {rid}: the engine's input is not the trajectory's tokens")
            traj.add_generated(resp)  # trained on: loss_mask 1, the engine's logprobs and versions
            text = tok.decode(resp.output_tokens, skip_special_tokens=True)
            solved = (await self.reward.score(tok.decode(resp.input_tokens), text, resp.input_tokens,
                                              resp.output_tokens, **row))["reward"] >= 1.0
            if solved or turn == self.max_turns:
                break
            # the tutor's turn: appended as tokens after the model's own, masked out of the loss
            traj.add_context(feedback_suffix_ids(tok, traj.input_ids, tutor.feedback(text)))
        return traj.build(float(solved) * self.turn_discount ** (turn - 1), int(data.get("group_id", 0)),
                          turns=float(turn), solved=float(solved), solved_first_try=float(solved and turn == 1))


def make_workflow(reward_fn, tokenizer, sampling, group_size: int, max_turns: int = 3, turn_discount: float = 0.9):
    """The factory the job calls in every env worker with the keywords it names (docs/extending.md): `group_size`
    conversations per prompt share the prompt's group_id, GRPO's group."""
    return GroupedWorkflow(TutorAgent(reward_fn, tokenizer, sampling, max_turns, turn_discount), group_size)
