"""The generative judge (`reward.judge`): score parsers, the prompt template, a tiny judge SFT'd here to
answer 'Score: 7' served in process, failures (garbage, timeouts) and the weighted combination of rule,
reward model and judge. The `judge-<i>` replica actors are tested with the other Ray actors in
test_reward_models.py (one Ray cluster for both)."""
from __future__ import annotations

import asyncio

import pytest

from rayllm_rl.config import load_config
from rayllm_rl.data.failures import code_of
from rayllm_rl.envs.arithmetic import arithmetic_reward
from rayllm_rl.job.config import GRPOJobConfig
from rayllm_rl.rewards.combined import CombinedReward
from rayllm_rl.rewards.config import DEFAULT_JUDGE_REGEX, DEFAULT_JUDGE_TEMPLATE, check_template
from rayllm_rl.rewards.judge import Judge, JudgeParseError, ScoreParser
from rayllm_rl.workflows.rewards import RewardCaller
from reward_model_helpers import build_tiny_reward_model, tiny_judge

pytestmark = pytest.mark.usefixtures("one_torch_thread")

ROW = {"messages": [{"role": "user", "content": "2+3="}], "answer": "5"}


# ---------------------------------------------------------------- parsers
@pytest.mark.parametrize("text, score", [
    ("Score: 7", 0.7), ("score=10", 1.0), ("SCORE 0 because it is wrong", 0.0), ("Score: 2.5. Score: 9", 0.25),
])
def test_default_regex_reads_the_first_score_scaled_to_0_1(text, score):
    assert ScoreParser("regex", DEFAULT_JUDGE_REGEX, 0, 10)(text) == pytest.approx(score)


@pytest.mark.parametrize("text, why", [
    ("Score: 11", "outside"), ("Score: -1", "outside"), ("I think it is right", "no score"), ("", "no score"),
])
def test_default_regex_refuses_garbage(text, why):
    with pytest.raises(JudgeParseError, match=why):
        ScoreParser("regex", DEFAULT_JUDGE_REGEX, 0, 10)(text)


def test_custom_regex_and_range():
    parse = ScoreParser("regex", r"<score>(\S+)</score>", 1, 5)
    assert parse("Thinking... <score>3</score>") == pytest.approx(0.5)
    with pytest.raises(JudgeParseError, match="not a number"):
        parse("<score>three</score>")
    with pytest.raises(JudgeParseError, match="outside"):
        parse("<score>nan</score>")  # a NaN is garbage too


@pytest.mark.parametrize("text, score", [("Yes, it is correct.", 1.0), ("no.", 0.0), ("NO - yes later", 0.0)])
def test_yes_no_reads_the_first_yes_or_no(text, score):
    assert ScoreParser("yes_no")(text) == score


@pytest.mark.parametrize("text", ["maybe", "Nope", "yesterday"])
def test_yes_no_refuses_anything_else(text):
    with pytest.raises(JudgeParseError, match="no yes/no"):
        ScoreParser("yes_no")(text)


# ---------------------------------------------------------------- template
def test_template_fills_question_completion_and_row_fields(tokenizer):
    judge = Judge(None, tokenizer, "Q={question} A={completion} ref={answer} all={prompt!r}", ScoreParser())
    assert judge.message("<prompt>", "<answer>5</answer>", ROW) == "Q=2+3= A=<answer>5</answer> ref=5 all='<prompt>'"
    assert judge.message("the prompt", "x", {"answer": 9}) == "Q=the prompt A=x ref=9 all='the prompt'"  # no messages
    with pytest.raises(KeyError, match=r"uses \{answer\}, which is neither question, completion, prompt"):
        judge.message("p", "x", {"messages": ROW["messages"]})


def test_judge_prompt_goes_through_the_judges_chat_template(tokenizer):
    judge = Judge(None, tokenizer, DEFAULT_JUDGE_TEMPLATE, ScoreParser(), system_prompt="Be strict.")
    ids = judge.prompt_ids("", "<answer>5</answer>", ROW)
    assert tokenizer.decode(ids) == ("<|im_start|>system\nBe strict.<|im_end|>\n<|im_start|>user\n"
                                     + DEFAULT_JUDGE_TEMPLATE.format(question="2+3=", completion="<answer>5</answer>")
                                     + "<|im_end|>\n<|im_start|>assistant\n")


@pytest.mark.parametrize("template, message", [
    ("Is {question} right?", "must use {completion}"),
    ("{0} {completion}", "fields must be names"),
    ("{row.answer} {completion}", "fields must be names"),
    ("{completion", "does not parse"),
])
def test_bad_templates_are_refused_naming_the_key(template, message):
    with pytest.raises(ValueError, match=f"reward.judge.template.*{message.replace('{', '.').replace('}', '.')}"):
        check_template(template)


@pytest.mark.parametrize("overrides, message", [
    (["reward.judge.path=/j", "reward.judge.template=no answer here"], "reward.judge.template must use"),
    (["reward.judge.path=/j", "reward.judge.regex=(unclosed"], "reward.judge.regex='(unclosed' is not a valid"),
    (["reward.judge.path=/j", r"reward.judge.regex=score \d+"], "has no group"),
    (["reward.judge.path=/j", "reward.judge.min_score=5", "reward.judge.max_score=5"],
     "reward.judge.min_score=5.0 must be <"),
    (["reward.judge.path=/j", "reward.judge.engine=sglang"], "reward.judge.engine must be one of"),
    (["reward.judge.path=/j", "reward.judge.options.kv_cache_mb=8"],
     "unknown config key 'reward.judge.options.kv_cache_mb'"),
    (["reward.judge.path=/j", "reward.judge.dtype=bfloat16"],
     "reward.judge.dtype=bfloat16 with reward.judge.engine=transformers"),
    (["reward.judge.path=/j", "reward.judge.num_replicas=0"], "reward.judge.num_replicas=0: must be > 0"),
    (["reward.judge.path=/j", "trainer.backend=local", "reward.judge.engine=vllm"],
     "reward.judge.engine=vllm runs in Ray replica actors: set trainer.backend=ray"),
    (["reward.judge.weight=2"], "reward.judge.weight is read only when reward.judge.path is set"),
])
def test_bad_judge_settings_fail_validation_naming_the_key(overrides, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)").replace(".", r"\.")):
        load_config(GRPOJobConfig, overrides).validate()


# ---------------------------------------------------------------- a real (tiny) judge in process
@pytest.fixture(scope="module")
def judge_path() -> str:
    """The tiny causal LM SFT'd to answer every judge prompt with 'Score: 7' (once per test process). Trained until
    its greedy answer is exactly that on held-out judge prompts and on these tests' own, whatever the CPU's kernels
    make of the run; a judge that never got there fails here, once, saying what it answered (JudgeNotTrained):
    these tests check the judge's plumbing, not its learning."""
    return tiny_judge("Score: 7")


def local_judge(path: str, *overrides: str):
    from rayllm_rl.job.plan import make_plan
    from rayllm_rl.orchestration.local.reward_scorers import local_reward_scorers

    plan = make_plan(load_config(GRPOJobConfig, [f"reward.judge.path={path}", "trainer.backend=local", *overrides]))
    return plan.config, local_reward_scorers(plan)["judge"]


@pytest.mark.slow  # the tiny judge is SFT'd first (about 10 s)
def test_judge_scores_through_its_engine_and_combines_with_rule_and_rm(judge_path, tmp_path):
    """reward = 0.5 * rule + 2 * rm + 3 * judge, every part real: the rule, a tiny RM and the SFT'd judge
    (its 'Score: 7' reads 0.7), all completions of a group in flight at once."""
    from rayllm_rl.rewards.reward_model import RewardModelScorer, rm_sample

    cfg, judge = local_judge(judge_path)
    build_tiny_reward_model(tmp_path)
    rm = RewardModelScorer(str(tmp_path))
    reward = RewardCaller(CombinedReward(arithmetic_reward, 0.5,
                                         {"model": (2.0, rm, 30.0), "judge": (3.0, judge, 60.0)}))
    completions = ["<answer>5</answer>", "<answer>6</answer>", "<answer>5</answer>"]

    async def go():
        return await asyncio.gather(*[reward.score("", c, [], [], **ROW) for c in completions])

    try:
        assert asyncio.run(judge.verdict("", "<answer>5</answer>", ROW)) == "Score: 7"
        outs = asyncio.run(go())
        rm_scores = [rm.forward([rm.text(rm_sample("", c, ROW))])[0] for c in completions]
    finally:
        judge.close()
        rm.close()
    for out, rule, rm_score in zip(outs, [1.0, 0.0, 1.0], rm_scores):
        assert out["reward_rule"] == rule and out["reward_judge"] == pytest.approx(0.7)
        assert out["reward_model"] == pytest.approx(rm_score, abs=1e-5)
        assert out["reward"] == pytest.approx(0.5 * rule + 2 * rm_score + 3 * 0.7, abs=1e-5)
        assert out["reward_judge_failed"] == out["reward_model_failed"] == 0.0
    assert reward.counters()["reward_judge_calls"] == 3 and reward.counters()["reward_judge_errors"] == 0


@pytest.mark.slow  # the tiny judge is SFT'd first (about 10 s)
def test_unparseable_verdict_scores_zero_and_counts(judge_path):
    """The same judge read with the yes/no parser: its 'Score: 7' is garbage, so 0, a warning and counters."""
    _, judge = local_judge(judge_path, "reward.judge.parser=yes_no")
    reward = RewardCaller(CombinedReward(arithmetic_reward, 1.0, {"judge": (1.0, judge, 60.0)}))
    try:
        out = asyncio.run(reward.score("", "<answer>5</answer>", [], [], **ROW))
    finally:
        judge.close()
    assert out == {"reward": 1.0, "reward_rule": 1.0, "reward_judge": 0.0, "reward_judge_failed": 1.0,
                   "failed": code_of("reward_raised")}  # a failed sample: rollout.on_failure decides
    counters = reward.counters()
    assert counters["reward_judge_errors"] == 1 and counters["reward_judge_unparsed"] == 1
    assert counters["reward_judge_timeouts"] == 0 and counters["reward_errors"] == 0


class StuckEngine:
    """A judge engine that never answers (reaches the timeout path)."""

    async def agenerate(self, request):
        await asyncio.sleep(3600)


def test_a_judge_that_hangs_times_out_to_zero(tokenizer):
    judge = Judge(StuckEngine(), tokenizer, DEFAULT_JUDGE_TEMPLATE, ScoreParser())
    reward = RewardCaller(CombinedReward(arithmetic_reward, 1.0, {"judge": (1.0, judge, 0.2)}))
    out = asyncio.run(reward.score("", "<answer>4</answer>", [], [], **ROW))
    assert out["reward"] == 0.0 and out["reward_judge_failed"] == 1.0 and out["failed"] == code_of("reward_timeout")
    assert reward.counters()["reward_judge_timeouts"] == 1 and reward.counters()["reward_judge_errors"] == 0
