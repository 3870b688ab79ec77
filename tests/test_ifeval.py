"""IFEval checkers and scorer against hand-written responses and hand-computed rewards."""
from __future__ import annotations

import json
import pathlib
import time

import pytest

from rayllm_rl.rewards.ifeval import (
    IFEvalScoreData,
    IFEvalScorer,
    loose_variants,
    normalize_kwargs,
    score_ifeval,
)
from rayllm_rl.rewards.ifeval_checkers import (
    CHECKERS,
    check_instruction,
    count_sentences,
    count_words,
    detect_language_match,
    split_sentences,
)

FIXTURE = pathlib.Path(__file__).parent / "fixtures" / "ifeval.jsonl"
END = "Is there anything else I can help with?"

# (instruction id, kwargs, a response that follows it, a response that does not)
CASES = [
    ("keywords:existence", {"keywords": ["ocean", "Blue"]},
     "The OCEAN is deep and blue.", "The ocean is deep and green."),
    ("keywords:frequency", {"keyword": "cat", "frequency": 3, "relation": "at least"},
     "Cat, cat and another CAT.", "A cat and a cat."),
    ("keywords:frequency", {"keyword": "cat", "frequency": 2, "relation": "less than"},
     "Only one cat here.", "A cat and a cat."),
    ("keywords:forbidden_words", {"forbidden_words": ["bad", "ugly"]},
     "A badge is not a forbidden word.", "That was a Bad idea."),
    ("keywords:letter_frequency", {"letter": "z", "let_frequency": 3, "let_relation": "at least"},
     "Zebras zigzag in a zoo.", "Zebras run."),
    ("keywords:letter_frequency", {"letter": "e", "let_frequency": 3, "let_relation": "less than"},
     "A cat sat.", "Eleven eels."),
    ("length_constraints:number_sentences", {"num_sentences": 3, "relation": "less than"},
     "Dr. Who paid $3.50 today. It was fine.", "One. Two! Three?"),
    ("length_constraints:number_sentences", {"num_sentences": 3, "relation": "at least"},
     "One. Two! Three? Four", "Mr. Smith left. He came back."),
    ("length_constraints:number_paragraphs", {"num_paragraphs": 3},
     "First part.\n***\nSecond part.\n***\nThird part.", "First part.\n***\n***\nThird part."),
    ("length_constraints:number_words", {"num_words": 5, "relation": "at least"},
     "one two three four five", "one two three four"),
    ("length_constraints:number_words", {"num_words": 5, "relation": "less than"},
     "one two three four", "one two three four five"),
    ("length_constraints:nth_paragraph_first_word", {"num_paragraphs": 3, "nth_paragraph": 2, "first_word": "However"},
     "Intro text.\n\n\"However, this matters.\n\nEnd.", "Intro text.\n\nBut this matters.\n\nEnd."),
    ("detectable_content:number_placeholders", {"num_placeholders": 2},
     "Dear [name], see you at [address].", "Dear [name], see you soon."),
    ("detectable_content:postscript", {"postscript_marker": "P.S."},
     "Hello there.\n\nP.S. Bring snacks.", "Hello there. Bring snacks."),
    ("detectable_content:postscript", {"postscript_marker": "P.P.S"},
     "Hi.\nP.S. one\nP.P.S two", "Hi.\nP.S. one"),
    ("detectable_format:number_bullet_lists", {"num_bullets": 2},
     "Intro\n* first\n- second", "Intro\n* first\n* second\n* third"),
    ("detectable_format:constrained_response", {},
     "Hmm. My answer is maybe.", "My answer is perhaps."),
    ("detectable_format:number_highlighted_sections", {"num_highlights": 2},
     "This is *one* and **two**.", "This is *one* and ** **."),
    ("detectable_format:multiple_sections", {"section_spliter": "SECTION", "num_sections": 2},
     "SECTION 1\nIntro.\nSECTION 2\nBody.", "SECTION 1\nIntro only."),
    ("detectable_format:json_format", {},
     '```json\n{"a": [1, 2]}\n```', "{'a': 1}"),
    ("detectable_format:title", {},
     "<<A Day at Sea>>\nThe waves rolled.", "<< >>\nThe waves rolled."),
    ("combination:two_responses", {},
     "First answer.\n******\nSecond answer.", "Same.\n******\nSame."),
    ("combination:repeat_prompt", {"prompt_to_repeat": "What is 2+2?"},
     "what is 2+2? It is 4.", "Sure! What is 2+2? It is 4."),
    ("startend:end_checker", {"end_phrase": END},
     f'"Done. {END}"', f"{END} Done."),
    ("startend:quotation", {},
     '  "The whole thing is quoted."\n', '"Only the start is quoted.'),
    ("change_case:capital_word_frequency", {"capital_frequency": 2, "capital_relation": "at least"},
     "The NASA and ESA teams met.", "The NASA team met."),
    ("change_case:capital_word_frequency", {"capital_frequency": 2, "capital_relation": "less than"},
     "Only NASA here.", "NASA, ESA and JAXA."),
    ("change_case:english_capital", {},
     "THIS IS THE ANSWER AND IT IS IN ENGLISH.", "This is the answer and it is in English."),
    ("change_case:english_lowercase", {},
     "this is the answer and it is in english.", "this is the answer and it is in English."),
    ("punctuation:no_comma", {},
     "No commas here. None at all.", "Well, here is one."),
    ("language:response_language", {"language": "ru"},
     "Зима — моё любимое время года.", "Winter is my favourite season."),
    ("language:response_language", {"language": "en"},
     "Winter is the season that I love.", "Der Winter ist die Jahreszeit, die ich liebe und nicht hasse."),
    ("language:response_language", {"language": "ja"},
     "冬は私の一番好きな季節です。", "冬天是我最喜欢的季节。"),
    ("language:response_language", {"language": "hi"},
     "सर्दी मेरा पसंदीदा मौसम है।", "Sardi mera pasandida mausam hai."),
]


def test_every_checker_has_a_case():
    assert {c[0] for c in CASES} == set(CHECKERS)
    assert len(CHECKERS) == 25


@pytest.mark.parametrize("iid,kwargs,good,bad", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_checker_pass_and_fail(iid, kwargs, good, bad):
    assert CHECKERS[iid](good, **kwargs) is True
    assert CHECKERS[iid](bad, **kwargs) is False
    assert check_instruction(iid, good, **kwargs) is True


BAD_KWARGS = [
    ("keywords:existence", {}, "keywords"),
    ("keywords:existence", {"keywords": "ocean"}, "keywords"),
    ("keywords:frequency", {"keyword": "cat", "frequency": 2, "relation": "at most"}, "relation"),
    ("keywords:frequency", {"keyword": "cat", "frequency": "two", "relation": "at least"}, "frequency"),
    ("keywords:letter_frequency", {"letter": "ab", "let_frequency": 1, "let_relation": "at least"}, "letter"),
    ("length_constraints:number_words", {"num_words": -1, "relation": "at least"}, "num_words"),
    ("length_constraints:number_words", {"num_words": True, "relation": "at least"}, "num_words"),
    ("length_constraints:nth_paragraph_first_word", {"num_paragraphs": 2, "nth_paragraph": 3, "first_word": "a"},
     "nth_paragraph"),
    ("detectable_content:postscript", {"postscript_marker": None}, "postscript_marker"),
    ("combination:repeat_prompt", {"prompt_to_repeat": ""}, "prompt_to_repeat"),
    ("language:response_language", {"language": "xx"}, "language"),
]


@pytest.mark.parametrize("iid,kwargs,name", BAD_KWARGS)
def test_malformed_kwargs_name_instruction_and_kwarg(iid, kwargs, name):
    with pytest.raises(ValueError) as info:
        CHECKERS[iid]("some response", **kwargs)
    assert iid in str(info.value) and repr(name) in str(info.value)


def test_unknown_instruction_id():
    with pytest.raises(ValueError, match="no_such:thing"):
        check_instruction("no_such:thing", "text")
    with pytest.raises(ValueError, match="no_such:thing"):
        score_ifeval("text", ["punctuation:no_comma", "no_such:thing"], [{}, {}])


def test_integral_float_kwargs_accepted_and_extra_kwargs_ignored():
    # parquet int columns with nulls can come back as floats
    assert CHECKERS["length_constraints:number_words"]("a b c", num_words=3.0, relation="at least", keyword=None)
    with pytest.raises(ValueError, match="num_words"):
        CHECKERS["length_constraints:number_words"]("a b c", num_words=2.5, relation="at least")


def test_text_utilities():
    assert count_words("Hello, world! It's 2024.") == 5  # Hello world It s 2024
    assert split_sentences("Mr. Smith paid $3.50 at example.com today. Then he left! Really?") == [
        "Mr. Smith paid $3.50 at example.com today.", "Then he left!", "Really?"]
    assert count_sentences("") == 0
    assert count_sentences("no final punctuation") == 1
    assert detect_language_match("12345 !!!", "fr")  # no letters: counted as followed, like the original
    assert detect_language_match("Le chat est sur la table et il dort.", "fr")
    assert not detect_language_match("Le chat est sur la table et il dort.", "es")


# ---------------------------------------------------------------------------- strict vs loose
def test_loose_passes_where_strict_fails():
    response = 'Sure, here it is:\n"The quick brown fox jumps over the lazy dog."'
    data = score_ifeval(response, ["startend:quotation"], [{}])
    assert isinstance(data, IFEvalScoreData)
    assert data.strict_results == [False] and data.loose_results == [True]
    assert (data.prompt_level_strict_acc, data.inst_level_strict_acc) == (0.0, 0.0)
    assert (data.prompt_level_loose_acc, data.inst_level_loose_acc) == (1.0, 1.0)


def test_loose_variants_and_star_removal():
    assert loose_variants("a\n*b*\nc") == ["a\n*b*\nc", "a\nb\nc", "*b*\nc", "a\n*b*", "*b*", "b\nc", "a\nb", "b"]
    # `*` removal lets a bolded JSON answer pass loosely
    data = score_ifeval('**{"a": 1}**', ["detectable_format:json_format"], [{}])
    assert data.strict_results == [False] and data.loose_results == [True]


def test_blank_response_never_follows():
    data = score_ifeval("   ", ["punctuation:no_comma"], [{}])
    assert data.strict_results == [False] and data.loose_results == [False]


def test_repeat_prompt_falls_back_to_prompt():
    data = score_ifeval("Name a color. Blue.", ["combination:repeat_prompt"], [{}], prompt="Name a color.")
    assert data.strict_results == [True]
    with pytest.raises(ValueError, match="prompt_to_repeat"):
        score_ifeval("Name a color. Blue.", ["combination:repeat_prompt"], [{}])


def test_kwargs_normalization():
    assert normalize_kwargs('[{"num_words": 5, "relation": null}, {}]', 2) == [{"num_words": 5}, {}]
    assert normalize_kwargs(None, 2) == [{}, {}]
    assert normalize_kwargs([None, {"a": None}], 2) == [{}, {}]
    with pytest.raises(ValueError, match="2 entries for 3"):
        normalize_kwargs([{}, {}], 3)


# ---------------------------------------------------------------------------- scorer aggregation
def _wrap(answer: str, think: str = "Let me plan.") -> str:
    return f"<think>{think}</think><answer>{answer}</answer>"


ROW = {"instruction_id_list": ["punctuation:no_comma", "startend:quotation"], "kwargs": [{}, {}]}


def test_scorer_component_keys():
    out = IFEvalScorer()("prompt", _wrap('"hi"'), [1], [2], **ROW)
    assert IFEvalScorer.component_keys == tuple(k for k in out if k != "reward")
    assert list(out) == ["reward", *IFEvalScorer.component_keys]


def test_scorer_all_pass():
    out = IFEvalScorer()("prompt", _wrap('"All good here."'), [], [], **ROW)
    assert out["format_score"] == pytest.approx(1.0)
    assert out["structure_score"] == 1.0 and out["completion_bonus"] == 0.2
    assert out["reward"] == pytest.approx(1.0 + 1.0 + 0.2)
    assert out["success"] == 1.0


def test_scorer_half_pass():
    # no_comma fails (strict and loose), quotation passes: prompt-level 0, instruction-level 1/2
    out = IFEvalScorer()("prompt", _wrap('"Yes, quoted."'), [], [], **ROW)
    expected_format = 0.4 * 0.0 + 0.3 * 0.5 + 0.2 * 0.0 + 0.1 * 0.5  # = 0.2
    assert out["inst_level_strict_acc"] == 0.5 and out["prompt_level_strict_acc"] == 0.0
    assert out["format_score"] == pytest.approx(expected_format) == pytest.approx(0.2)
    assert out["reward"] == pytest.approx(0.2 + 1.0 + 0.2)
    assert out["success"] == 0.0


def test_scorer_custom_weights():
    scorer = IFEvalScorer(weights=(0.0, 1.0, 0.0, 0.0), think_score=0.25, answer_score=0.25, completion_bonus=0.0)
    out = scorer("prompt", _wrap('"Yes, quoted."'), [], [], **ROW)
    assert out["reward"] == pytest.approx(0.5 + 0.25 + 0.25)
    with pytest.raises(ValueError, match="weights"):
        IFEvalScorer(weights=(1.0, 0.0))


def test_scorer_missing_tags():
    scorer = IFEvalScorer()
    text = '"No tags at all."'
    out = scorer("prompt", text, [], [], **ROW)  # checked on the whole response
    assert out["format_score"] == pytest.approx(1.0)
    assert out["structure_score"] == 0.0 and out["completion_bonus"] == 0.0
    assert out["reward"] == pytest.approx(1.0)
    assert not scorer.done(text)
    # think only, answer never closed: structure 0.5, not complete, checkers see the whole text
    text = '<think>plan</think><answer>"unfinished'
    out = scorer("prompt", text, [], [], **ROW)
    assert out["structure_score"] == 0.5 and out["completion_bonus"] == 0.0
    assert out["inst_level_strict_acc"] == 0.5  # no comma passes; quotation fails on the whole text
    assert out["reward"] == pytest.approx(0.3 * 0.5 + 0.1 * 0.5 + 0.5)
    # an explicit `complete` (EOS seen) overrides the default
    assert scorer.score(text, **ROW, complete=True)["completion_bonus"] == 0.2


def test_scorer_uses_last_answer_block():
    scorer = IFEvalScorer()
    text = '<think>a</think><answer>no, quotes</answer><answer>"final"</answer>'
    out = scorer("prompt", text, [], [], **ROW)
    assert out["prompt_level_strict_acc"] == 1.0
    # two answer blocks: no answer_score, but still complete
    assert out["structure_score"] == 0.5 and out["completion_bonus"] == 0.2
    assert out["reward"] == pytest.approx(1.0 + 0.5 + 0.2)
    assert scorer.done(text)
    # empty think block earns nothing
    assert scorer("p", '<think> </think><answer>"x"</answer>', [], [], **ROW)["structure_score"] == 0.5


def test_scorer_unicode():
    row = {"instruction_id_list": ["language:response_language", "punctuation:no_comma",
                                   "length_constraints:number_words"],
           "kwargs": json.dumps([{"language": "ru"}, {}, {"relation": "at least", "num_words": 5}])}
    good = _wrap("Я люблю зиму потому что идёт снег.", think="Думаю по-русски 🤔")
    out = IFEvalScorer()("prompt", good, [], [], **row)
    assert out["reward"] == pytest.approx(2.2) and out["success"] == 1.0
    bad = _wrap("Я люблю зиму, потому что идёт снег.")  # a comma: 2 of 3 pass, loose too
    out = IFEvalScorer()("prompt", bad, [], [], **row)
    assert out["inst_level_strict_acc"] == pytest.approx(2 / 3)
    assert out["format_score"] == pytest.approx(0.3 * 2 / 3 + 0.1 * 2 / 3)
    assert out["reward"] == pytest.approx(0.4 * 2 / 3 + 1.2)


def test_scorer_long_response_is_fast_and_correct():
    words = " ".join(["word"] * 50_000)
    row = {"instruction_id_list": ["length_constraints:number_words", "length_constraints:number_words",
                                   "punctuation:no_comma", "detectable_content:number_placeholders",
                                   "length_constraints:number_sentences", "language:response_language",
                                   "change_case:english_lowercase", "detectable_format:number_highlighted_sections"],
           "kwargs": [{"relation": "at least", "num_words": 50_000}, {"relation": "less than", "num_words": 50_000},
                      {}, {"num_placeholders": 1}, {"relation": "less than", "num_sentences": 2},
                      {"language": "en"}, {}, {"num_highlights": 1}]}
    start = time.perf_counter()
    out = IFEvalScorer()("prompt", _wrap("[" + words + "."), [], [], **row)
    elapsed = time.perf_counter() - start
    assert elapsed < 5.0, elapsed
    # passing: >=50000 words, no comma, 1 sentence, english (no stopwords: ASCII), lowercase;
    # failing: <50000 words, no closed placeholder, no highlight -> 5 of 8
    assert out["inst_level_strict_acc"] == pytest.approx(5 / 8)
    assert out["inst_level_loose_acc"] == pytest.approx(5 / 8)
    assert out["reward"] == pytest.approx(0.3 * 5 / 8 + 0.1 * 5 / 8 + 1.2)


@pytest.mark.parametrize("text", ["<think>" * 50_000, "<answer>" * 50_000, "<<" * 100_000,
                                  "!" * 200_000 + "x", "[" * 200_000, "\n" * 200_000 + "- x"])
def test_adversarial_inputs_are_linear(text):
    """Unclosed tags, bracket/punctuation runs: no quadratic regex backtracking, no RecursionError."""
    row = {"instruction_id_list": ["detectable_format:title", "length_constraints:number_sentences",
                                   "detectable_format:json_format", "detectable_format:number_bullet_lists",
                                   "detectable_content:number_placeholders"],
           "kwargs": [{}, {"relation": "at least", "num_sentences": 1}, {}, {"num_bullets": 1},
                      {"num_placeholders": 1}]}
    start = time.perf_counter()
    out = IFEvalScorer()("prompt", text, [], [], **row)
    assert time.perf_counter() - start < 5.0
    assert out["structure_score"] == 0.0 and out["completion_bonus"] == 0.0
    assert not IFEvalScorer.done(text)


def test_scorer_row_errors():
    with pytest.raises(ValueError, match="instruction_id_list"):
        IFEvalScorer()("prompt", _wrap("x"), [], [], kwargs=[{}])
    with pytest.raises(ValueError, match="instruction_id_list"):
        IFEvalScorer()("prompt", _wrap("x"), [], [], instruction_id_list=[], kwargs=[])
    with pytest.raises(ValueError, match="length_constraints:number_words"):
        IFEvalScorer()("prompt", _wrap("x"), [], [], instruction_id_list=["length_constraints:number_words"],
                       kwargs=[{"num_words": 3}])


# ---------------------------------------------------------------------------- real-format fixture
COMPLETIONS = {  # key -> (a completion that follows every instruction, one that does not)
    1001: ("The sea is wide and the sea is deep\nIt sings to sailors while the harbour lights sleep\n"
           "Blue waves roll on",
           "The sea is wide, and deep."),
    1005: ('"A cat who hated each Monday\nWould sulk and would hide away\nShe slept through the morn\n'
           f'Looked grumpy and worn\nThen purred for the rest of the day. {END}"',
           f'A cat who hated each Monday would sulk. {END}'),
    1010: ("<<Why Walk Daily>>\n* Better mood.\n* Stronger heart.\n* More sleep.",
           "<<Why Walk Daily>>\n* Better mood.\n* Stronger heart."),
    1015: ("What is the capital of France and why is it famous? Paris, famous for the Eiffel Tower.",
           "The capital of France is Paris."),
    1020: ("Моё любимое время года — осень. Листья становятся золотыми.\n\nP.S. Спасибо за вопрос.",
           "My favourite season is autumn.\n\nP.S. Thanks for asking."),
    1025: ('```json\n{"title": "Dune", "author": "Frank Herbert", "about": "desert planet"}\n```',
           '{"name": "Dune", "writer": "Frank Herbert"}'),
    1030: ("Houseplants *clean the air* and brighten rooms.\n***\nThey are also *calming* to care for.",
           "Houseplants clean the air.\n***\n***\nSome look ugly."),
}


@pytest.fixture(scope="module")
def ifeval_rows():
    import datasets  # a core dependency: missing, it is a failure, not a skip

    ds = datasets.Dataset.from_json(str(FIXTURE))
    return list(ds)


def test_fixture_is_real_format(ifeval_rows):
    assert len(ifeval_rows) == len(COMPLETIONS) == 7
    for row in ifeval_rows:
        assert set(row) == {"key", "prompt", "instruction_id_list", "kwargs"}
        assert len(row["kwargs"]) == len(row["instruction_id_list"])
    parquet_style = [r for r in ifeval_rows if r["key"] == 1010][0]
    assert len(parquet_style["kwargs"][0]) == 24 and parquet_style["kwargs"][0]["num_bullets"] == 3
    assert parquet_style["kwargs"][0]["keywords"] is None


def test_fixture_rows_score(ifeval_rows):
    scorer = IFEvalScorer()
    for row in ifeval_rows:
        good, bad = COMPLETIONS[row["key"]]
        row_fields = {k: v for k, v in row.items() if k != "prompt"}  # the reward caller drops `prompt`
        out = scorer(row["prompt"], _wrap(good), [], [], **row_fields)
        assert out["success"] == 1.0 and out["reward"] == pytest.approx(2.2), (row["key"], out)
        out = scorer(row["prompt"], _wrap(bad), [], [], **row_fields)
        assert out["success"] == 0.0 and out["prompt_level_strict_acc"] == 0.0, (row["key"], out)
        assert out["reward"] < 2.2
        raw = score_ifeval(bad, row["instruction_id_list"], row["kwargs"], prompt=row["prompt"])
        assert not all(raw.strict_results), row["key"]
