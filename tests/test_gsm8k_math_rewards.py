"""GSM8K reward parser and MATH answer checker: hand-computed component values, real dataset
formats (fixtures in tests/fixtures), adversarial completions and the verifier's hard timeout."""
from __future__ import annotations

import asyncio
import logging
import pickle
import threading
import time
from pathlib import Path

import pytest

from rayllm_rl.rewards.gsm8k import (
    GSM8KRewardParser,
    extract_tag_blocks,
    gsm8k_final_answer,
    gsm8k_prompt,
    gsm8k_sft_target,
    normalize_number,
    numbers_in,
)
from rayllm_rl.rewards.math_answer import MathRewardFn, MathVerifier, last_boxed, math_reference_answer
from rayllm_rl.workflows.rewards import RewardCaller

FIXTURES = Path(__file__).parent / "fixtures"
SLEEPER = "rayllm_rl.rewards.math_answer._sleep_forever_for_tests"


def _load(name: str, tmp_path_factory) -> list[dict]:
    from datasets import load_dataset

    cache = tmp_path_factory.mktemp("hf_cache")
    return list(load_dataset("json", data_files=str(FIXTURES / name), cache_dir=str(cache))["train"])


@pytest.fixture(scope="module")
def gsm8k_rows(tmp_path_factory):
    return _load("gsm8k.jsonl", tmp_path_factory)


@pytest.fixture(scope="module")
def math_rows(tmp_path_factory):
    return _load("math.jsonl", tmp_path_factory)


@pytest.fixture(scope="module")
def verifier():
    v = MathVerifier(default_timeout_s=20.0).start()
    yield v
    v.close()


# ------------------------------------------------------------------------------------- GSM8K

@pytest.mark.parametrize("text,expected", [
    ("72", "72"), ("1,000", "1000"), ("$18.00", "18"), ("18 dollars", "18"), ("72.0", "72"),
    ("3/4", "0.75"), ("1/3", "1/3"), ("2/6", "1/3"), ("-3.50", "-3.5"), ("+5", "5"), ("18%", "18"),
    ("18 cm.", "18"), ("  (42)!  ", "42"), ("＄７２", "72"), ("−3", "-3"), ("答案是−3元", "-3"),
    ("他有72个苹果。", "72"), ("-$3.50", "-3.5"), ("$-3.50", "-3.5"), ("1,234,567.890", "1234567.89"),
    ("\\frac{3}{4}", "0.75"), ("\\boxed{72}", "72"), ("0.0", "0"), ("-0", "0"), (".5", "0.5"),
    ("48/2 = 24", "24"), ("first 5, then 7", "7"), ("10-3", "3"), ("1,2,3", "3"), ("½", "0.5"),
    ("no number here", None), ("", None), ("3/0", None), ("1" * 5000, None),
])
def test_normalize_number(text, expected):
    assert normalize_number(text) == expected


def test_numbers_in_and_final_answer():
    assert numbers_in("72 - 2 = 70, costs $1,000.50") == ["72", "2", "70", "1000.5"]
    assert gsm8k_final_answer("Natalia sold <<48/2=24>>24 clips.\n#### 72") == "72"
    assert gsm8k_final_answer("a #### 1 \n b\n#### 1,000") == "1000"  # the LAST marker counts
    with pytest.raises(ValueError, match="####"):
        gsm8k_final_answer("no marker 72")
    with pytest.raises(ValueError, match="no number"):
        gsm8k_final_answer("#### none")


def test_extract_tag_blocks_malformed():
    assert extract_tag_blocks("<a>1</a> x <a>2</a>", "a") == ["1", "2"]
    assert extract_tag_blocks("<a>1", "a") == []
    assert extract_tag_blocks("<a><a>7</a></a>", "a") == ["<a>7"]
    assert extract_tag_blocks("</a><a>5</a></a>", "a") == ["5"]


def _comp(think, answer, contained, right, reward):
    return {"reward": reward, "reward_answer": answer, "reward_think": think, "reward_right": right,
            "reward_contained": contained, "success": 1.0 if right else 0.0}


GSM_CASES = [
    # (truth answer field, completion, expected components)
    ("#### 72", "<think>48/2=24, 48+24=72</think><answer>72</answer>", _comp(0.1, 0.1, 0.2, 1.0, 1.0)),
    ("#### 72", "<think>48+20=68</think> <answer>68</answer>", _comp(0.1, 0.1, 0.0, 0.0, 0.2)),
    ("#### 72", "<think>t</think><answer>72 - 2 = 70</answer>", _comp(0.1, 0.1, 0.2, 0.0, 0.4)),
    ("#### 72", "<think>t</think><answer>70</answer><answer>72</answer>", _comp(0.1, 0.0, 0.2, 1.0, 1.0)),
    ("#### 72", "<answer>72</answer><answer>70</answer>", _comp(0.0, 0.0, 0.2, 0.0, 0.2)),
    ("#### 72", "<think>t</think><answer>72", _comp(0.1, 0.0, 0.0, 0.0, 0.1)),  # unclosed
    ("#### 72", "<think>t</think><answer><answer>72</answer></answer>", _comp(0.1, 0.1, 0.2, 1.0, 1.0)),
    ("#### 72", "<think>a<think>b</think></think><answer>71</answer>", _comp(0.1, 0.1, 0.0, 0.0, 0.2)),
    ("#### 72", "The answer is 72.", _comp(0.0, 0.0, 0.0, 0.0, 0.0)),  # no tags
    ("#### 72", "", _comp(0.0, 0.0, 0.0, 0.0, 0.0)),
    ("#### 72", "<think> </think><answer>72</answer>", _comp(0.0, 0.1, 0.2, 1.0, 1.0)),  # empty think
    ("#### 72", "<think>t</think><answer> </answer>", _comp(0.1, 0.0, 0.0, 0.0, 0.1)),  # empty answer
    ("#### 72", "<think>t</think><think>u</think><answer>7</answer>", _comp(0.0, 0.1, 0.0, 0.0, 0.1)),
    ("#### 72", "<THINK>t</THINK><Answer>72</Answer>", _comp(0.0, 0.0, 0.0, 0.0, 0.0)),  # case-sensitive
    # unicode
    ("#### 72", "<think>先算五月：48/2=24</think><answer>答案是＄７２元</answer>", _comp(0.1, 0.1, 0.2, 1.0, 1.0)),
    ("#### -3", "<think>5-8</think><answer>−3</answer>", _comp(0.1, 0.1, 0.2, 1.0, 1.0)),
    ("#### -3", "<think>5-8</think><answer>3</answer>", _comp(0.1, 0.1, 0.0, 0.0, 0.2)),
    # number formats
    ("#### 1,000", "<think>t</think><answer>1,000</answer>", _comp(0.1, 0.1, 0.2, 1.0, 1.0)),
    ("#### 1000", "<think>t</think><answer>$1,000.00</answer>", _comp(0.1, 0.1, 0.2, 1.0, 1.0)),
    ("#### 18", "<think>t</think><answer>$18.00</answer>", _comp(0.1, 0.1, 0.2, 1.0, 1.0)),
    ("#### 18", "<think>t</think><answer>18 dollars</answer>", _comp(0.1, 0.1, 0.2, 1.0, 1.0)),
    ("#### 72", "<think>t</think><answer>72.0</answer>", _comp(0.1, 0.1, 0.2, 1.0, 1.0)),
    ("0.75", "<think>t</think><answer>3/4</answer>", _comp(0.1, 0.1, 0.2, 1.0, 1.0)),
    ("#### 7", "<think>t</think><answer>7 cm</answer>", _comp(0.1, 0.1, 0.2, 1.0, 1.0)),
]


@pytest.mark.parametrize("truth,completion,expected", GSM_CASES)
def test_gsm8k_components(truth, completion, expected):
    parser = GSM8KRewardParser()
    out = parser("prompt", completion, [], [], answer=truth, question="q")
    assert out == pytest.approx(expected)
    assert set(out) == {"reward", *GSM8KRewardParser.component_keys}


def test_gsm8k_weights_and_truth_field():
    parser = GSM8KRewardParser(think_weight=1.0, answer_weight=2.0, contained_weight=3.0,
                               right_weight=5.0, success_reward=10.0)
    assert parser("p", "<think>t</think><answer>72 + 1</answer>", [], [], answer="72")["reward"] == 6.0
    assert parser("p", "<think>t</think><answer>72</answer>", [], [], answer=72)["reward"] == 10.0
    assert parser("p", "<think>t</think><answer>72</answer>", [], [], answer=72)["reward_right"] == 5.0
    with pytest.raises(ValueError, match="'answer'"):
        GSM8KRewardParser()("p", "<answer>72</answer>", [], [], question="q")
    with pytest.raises(ValueError, match="'answer'"):
        GSM8KRewardParser()("p", "<answer>72</answer>", [], [], answer="none")


@pytest.mark.parametrize("completion", [
    "<think>" + "x" * 100_000 + "</think><answer>72</answer>",
    "<answer>" * 12_500,                                   # 100k chars of unclosed tags
    "<answer>" + "1 " * 50_000 + "72</answer>",             # 50k number tokens in one block
    "<answer>" + "9" * 100_000 + "</answer>",               # a 100k-digit "number"
    "-" * 50_000 + "<answer>" + "-$" * 25_000 + "</answer>",
    "<think>" * 10_000 + "</think>" * 10_000 + "<answer>72</answer>",
])
def test_gsm8k_long_completions_are_fast(completion):
    """No regex backtracks over 100k characters: the slowest case parses in ~0.2 s on an idle 2-core machine, a
    quadratic one would take minutes; 10 s tells them apart also with the machine's cores busy."""
    parser = GSM8KRewardParser()
    start = time.perf_counter()
    out = parser("p", completion, [], [], answer="#### 72")
    assert time.perf_counter() - start < 10.0
    assert 0.0 <= out["reward"] <= 1.0


def test_gsm8k_long_completion_values():
    out = GSM8KRewardParser()("p", "<think>" + "x" * 100_000 + "</think><answer>72</answer>", [], [], answer="#### 72")
    assert out == pytest.approx(_comp(0.1, 0.1, 0.2, 1.0, 1.0))
    out = GSM8KRewardParser()("p", "<answer>" + "1 " * 50_000 + "72</answer>", [], [], answer="#### 72")
    assert out == pytest.approx(_comp(0.0, 0.1, 0.2, 1.0, 1.0))


def test_gsm8k_fixture_rows(gsm8k_rows):
    assert len(gsm8k_rows) == 5
    truths = [gsm8k_final_answer(r["answer"]) for r in gsm8k_rows]
    assert truths == ["72", "1000", "11", "-3", "300"]
    parser = GSM8KRewardParser()
    for row, truth in zip(gsm8k_rows, truths):
        target = gsm8k_sft_target(row)
        assert "<<" not in target and "####" not in target
        assert target.endswith(f"<answer>{truth}</answer>") and target.startswith("<think>")
        assert parser("p", target, [], [], **row) == pytest.approx(_comp(0.1, 0.1, 0.2, 1.0, 1.0))
        wrong = f"<think>x</think><answer>{truth}0</answer>"
        assert parser("p", wrong, [], [], **row)["reward"] == pytest.approx(0.2)
    assert gsm8k_sft_target(gsm8k_rows[0]) == (
        "<think>Natalia sold 48/2 = 24 clips in May.\nNatalia sold 48+24 = 72 clips altogether in April and May."
        "</think><answer>72</answer>")
    messages = gsm8k_prompt(gsm8k_rows[0]["question"])
    assert [m["role"] for m in messages] == ["system", "user"]
    assert "<think>" in messages[0]["content"] and "<answer>" in messages[0]["content"]
    assert messages[1]["content"] == gsm8k_rows[0]["question"]


def test_gsm8k_through_reward_caller():
    caller = RewardCaller(GSM8KRewardParser())
    out = asyncio.run(caller.score("p", "<think>t</think><answer>70</answer>", [], [], answer="#### 72"))
    assert out == pytest.approx({"reward": 0.2, "reward_answer": 0.1, "reward_think": 0.1, "reward_right": 0.0,
                                 "reward_contained": 0.0, "success": 0.0})


# -------------------------------------------------------------------------------------- MATH

def test_last_boxed():
    assert last_boxed(r"so $x = \boxed{\frac{\sqrt{3}}{2}}$.") == r"\frac{\sqrt{3}}{2}"
    assert last_boxed(r"\boxed{1} then \fbox{2}") == "2"
    assert last_boxed(r"\boxed{\boxed{3} + 1}") == r"\boxed{3} + 1"
    assert last_boxed(r"\boxed{\{1, 2\}}") == r"\{1, 2\}"
    assert last_boxed(r"\boxed{4} and \boxed{unclosed") == "4"
    assert last_boxed(r"\boxed{\left\{ x \right\}") is None
    assert last_boxed(r"the answer is $\boxed 5$.") == "5"
    assert last_boxed("no box") is None and last_boxed(None) is None
    start = time.perf_counter()
    assert last_boxed("\\boxed{" * 15_000 + "\\boxed{7}") == "7"
    assert time.perf_counter() - start < 1.0


def test_math_reference_answer(math_rows):
    assert [math_reference_answer(r) for r in math_rows] == [
        r"\frac{1}{2}", r"\frac{\sqrt{2}}{2}", "(-2, 2)", "15", "2, 3"]
    with pytest.raises(ValueError, match="'answer'.*'solution'"):
        math_reference_answer({"problem": "p", "solution": "no box"})


@pytest.mark.slow
@pytest.mark.parametrize("gold,pred,expected", [
    (r"\frac{1}{2}", "0.5", True),
    (r"\frac{1}{2}", r"\dfrac12", True),
    (r"\frac{1}{2}", "1/2", True),
    (r"\frac{1}{2}", r"\frac12", True),
    (r"\sqrt{2}/2", r"\frac{\sqrt2}{2}", True),
    (r"\frac{\sqrt{2}}{2}", r"\frac{1}{\sqrt{2}}", True),
    (r"\frac{1}{2}", r"\frac{1}{3}", False),
    ("3", "4", False),
    ("(-2, 2)", "(-2,2)", True),
    ("(-2, 2)", "[-2, 2]", False),
    ("[1, 2)", "(1, 2]", False),
    (r"\{1, 2\}", r"\{2, 1\}", True),
    ("2, 3", "3, 2", True),
    ("2, 3", "2", False),
    (r"\text{(C)}", "C", True),
    ("5", "The answer is 5", True),
    ("5", r"\boxed{5}", True),
    ("x^2+1", "1+x^2", True),
])
def test_math_verifier_equivalence(verifier, gold, pred, expected):
    assert verifier.check(gold, pred, timeout_s=20.0) is expected


@pytest.mark.slow
def test_math_reward_fn(verifier, math_rows):
    fn = MathRewardFn(verifier)
    assert set(MathRewardFn.component_keys) == {"reward_right", "reward_format", "success"}
    full = {"reward": 1.0, "reward_right": 1.0, "reward_format": 1.0, "success": 1.0}
    for row in math_rows:  # the reference solution itself scores 1 (boxed fallback)
        assert asyncio.run(fn("p", row["solution"], [], [], **row)) == full
    half = {"problem": "p", "answer": r"\frac{1}{2}"}
    assert asyncio.run(fn("p", "<think>..</think><answer>0.5</answer>", [], [], **half)) == full
    # the last <answer> block wins over an earlier \boxed{}
    assert asyncio.run(fn("p", r"\boxed{0.5} <answer>1/3</answer>", [], [], **half))["reward"] == 0.0
    wrong = asyncio.run(fn("p", r"so \boxed{\frac{1}{3}}", [], [], **half))
    assert wrong == {"reward": 0.0, "reward_right": 0.0, "reward_format": 1.0, "success": 0.0}
    missing = asyncio.run(fn("p", "I think it is one half", [], [], **half))
    assert missing == {"reward": 0.0, "reward_right": 0.0, "reward_format": 0.0, "success": 0.0}
    assert asyncio.run(fn("p", "<answer>  </answer>", [], [], **half))["reward_format"] == 0.0
    out = asyncio.run(RewardCaller(fn).score("p", "<answer>1/2</answer>", [], [], **half))
    assert out == full


@pytest.mark.slow
def test_verifier_concurrent_threads_and_asyncio(verifier):
    pairs = [(r"\frac{1}{2}", "0.5", True), ("3", "4", False)] * 8
    results: list = [None] * len(pairs)

    def work(i):
        results[i] = verifier.check(pairs[i][0], pairs[i][1], timeout_s=20.0)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(pairs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [p[2] for p in pairs]

    async def many():
        return await asyncio.gather(*(verifier.acheck(g, p, 20.0) for g, p, _ in pairs))

    assert asyncio.run(many()) == [p[2] for p in pairs]


@pytest.mark.slow
def test_verifier_timeout_hook_then_recovers():
    with MathVerifier(check_fn=SLEEPER).start() as v:
        start = time.perf_counter()
        assert v.check("__sleep__", "1", timeout_s=1.0) is None
        assert time.perf_counter() - start < 1.0 + 4.0
        assert v.num_timeouts == 1 and v.num_errors == 0
        assert v.check(r"\frac{1}{2}", "0.5", timeout_s=20.0) is True
        assert v.check("__raise__", "1", timeout_s=20.0) is False
        assert v.num_errors == 1
        assert v.check("2", "3", timeout_s=20.0) is False
        assert v.counters() == {"math_checks": 4, "math_timeouts": 1, "math_errors": 1}


@pytest.mark.slow
# the verifier starts a fresh worker after the timeout: the module's fixture owns it
@pytest.mark.fixture_owned("processes")
def test_verifier_real_pathological_input(verifier):
    """sympy evaluates 9^(9^(9^9)) with exact big ints in C: only killing the process stops it."""
    before = verifier.num_timeouts
    start = time.perf_counter()
    assert verifier.check("2", "9^{9^{9^{9}}}", timeout_s=2.0) is None
    assert time.perf_counter() - start < 2.0 + 4.0
    assert verifier.num_timeouts == before + 1
    assert verifier.check(r"\frac{1}{2}", "0.5", timeout_s=20.0) is True


@pytest.mark.slow
def test_verifier_survives_a_killed_worker_and_bad_config():
    with MathVerifier().start() as v:
        v.process.kill()
        v.process.join(5)
        assert v.check("1", "1.0", timeout_s=20.0) is True
    with pytest.raises(RuntimeError, match="closed"):
        v.check("1", "1")
    with pytest.raises(RuntimeError, match="failed to start"):
        MathVerifier(check_fn="rayllm_rl.rewards.math_answer.no_such_function").check("1", "1")


@pytest.mark.slow
def test_a_math_check_past_its_timeout_is_a_failed_sample_not_a_zero(caplog):
    """A check the verifier kills is not a wrong answer: MathRewardFn raises TimeoutError, and the RewardCaller makes
    the sample a failed one of cause reward_timeout (rollout.on_failure decides), logged and counted."""
    from rayllm_rl.data.failures import FAILED_KEY, code_of
    from rayllm_rl.workflows.rewards import RewardCaller

    fn = MathRewardFn(MathVerifier(check_fn=SLEEPER), timeout_s=1.0)
    caller = RewardCaller(fn)
    try:
        fn.verifier.start()
        with pytest.raises(TimeoutError, match=r"math-verify's check ran past 1\.0s \(gold=__sleep__, pred=1\)"):
            asyncio.run(fn("p", "<answer>1</answer>", [], [], problem="p", answer="__sleep__"))
        with caplog.at_level(logging.WARNING, logger="rayllm_rl.workflows.rewards"):
            out = asyncio.run(caller.score("p", "<answer>1</answer>", [], [], problem="p", answer="__sleep__"))
        assert out == {"reward": 0.0, "reward_right": 0.0, "reward_format": 0.0, "success": 0.0,
                       FAILED_KEY: float(code_of("reward_timeout"))}
        assert any("timed out (math-verify's check ran past 1.0s" in r.getMessage() for r in caplog.records)
        assert caller.num_timeouts == 1 and fn.verifier.num_timeouts == 2
        ok = asyncio.run(caller.score("p", "<answer>1</answer>", [], [], problem="p", answer="1"))
        assert ok == {"reward": 1.0, "reward_right": 1.0, "reward_format": 1.0, "success": 1.0}
    finally:
        fn.close()


@pytest.mark.slow
def test_math_reward_queued_behind_slow_checks_is_still_scored():
    """The verifier runs checks in turn; a correct answer waiting behind two checks that run into the
    verifier's own timeout is scored 1, not cut off by an outer timeout that counts the queue."""
    from rayllm_rl.data.failures import FAILED_KEY, code_of
    from rayllm_rl.workflows.rewards import RewardCaller

    fn = MathRewardFn(MathVerifier(check_fn=SLEEPER), timeout_s=1.0)
    caller = RewardCaller(fn, timeout_s=1.5)  # shorter than the queue: ignored, fn bounds its own time
    try:
        fn.verifier.start()

        async def right_after_slow():
            await asyncio.sleep(0.3)  # the two slow checks hold the verifier first
            return await caller.score("p", "<answer>1</answer>", [], [], problem="p", answer="1")

        async def three():
            slow = [caller.score("p", "<answer>1</answer>", [], [], problem="p", answer="__sleep__") for _ in range(2)]
            return await asyncio.gather(*slow, right_after_slow())

        *slow, right = asyncio.run(three())
        assert right == {"reward": 1.0, "reward_right": 1.0, "reward_format": 1.0, "success": 1.0}
        assert all(s[FAILED_KEY] == code_of("reward_timeout") for s in slow)  # the verifier's bound, not the caller's
        assert caller.num_timeouts == 2 and fn.verifier.num_timeouts == 2
    finally:
        fn.close()


@pytest.mark.slow
def test_math_reward_fn_pickles_without_its_process():
    fn = MathRewardFn(timeout_s=7.0)
    clone = pickle.loads(pickle.dumps(fn))
    assert clone.timeout_s == 7.0 and clone.verifier.default_timeout_s == 7.0
    assert clone.verifier.process is None and clone.verifier.num_checks == 0
    try:
        assert asyncio.run(clone("p", r"\boxed{\dfrac{1}{2}}", [], [], answer="0.5"))["reward"] == 1.0
    finally:
        clone.close()
        fn.close()
