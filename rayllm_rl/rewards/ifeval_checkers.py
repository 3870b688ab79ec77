"""IFEval instruction checkers: one verifiable `check(response, **kwargs) -> bool` per instruction id.

Our own implementation of the semantics of google-research's IFEval `instructions.py` (the
verifiable instructions of "Instruction-Following Evaluation for Large Language Models", Zhou et
al. 2023), in pure Python: no nltk, no langdetect. Where the original relies on those libraries
(word/sentence tokenisation, language identification) a documented regex or Unicode heuristic
stands in, so scores can differ from the reference harness in edge cases.

Malformed kwargs (missing, wrong type, out of range) raise `ValueError` naming the instruction id
and the kwarg, instead of the original's silent random fill-in; kwargs a checker does not use are
ignored. `CHECKERS` maps every instruction id to its checker; `check_instruction` dispatches and
rejects unknown ids.
"""
from __future__ import annotations

import collections
import json
import re
import unicodedata
from typing import Any, Callable

CHECKERS: dict[str, Callable[..., bool]] = {}
"""Instruction id -> `check(response: str, **kwargs) -> bool`."""

RELATIONS = ("less than", "at least")
"""The comparison relations IFEval kwargs use: `count < n` and `count >= n`."""

CONSTRAINED_RESPONSE_OPTIONS = ("My answer is yes.", "My answer is no.", "My answer is maybe.")


# ---------------------------------------------------------------------------- kwarg validation
class _Args:
    """Typed access to one instruction's kwargs; every error names the instruction and the kwarg."""

    def __init__(self, instruction_id: str, kwargs: dict[str, Any]):
        self.instruction_id = instruction_id
        self.kwargs = {k: v for k, v in kwargs.items() if v is not None}

    def fail(self, name: str, why: str) -> ValueError:
        return ValueError(f"IFEval instruction {self.instruction_id!r}: kwarg {name!r} {why}")

    def _get(self, name: str) -> Any:
        if name not in self.kwargs:
            raise self.fail(name, f"is missing (got kwargs {sorted(self.kwargs)})")
        return self.kwargs[name]

    def integer(self, name: str, minimum: int = 0) -> int:
        """A non-negative integer; integral floats (parquet nulls turn int columns to float) are accepted."""
        value = self._get(name)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or int(value) != value:
            raise self.fail(name, f"must be an integer, got {value!r}")
        if value < minimum:
            raise self.fail(name, f"must be >= {minimum}, got {value!r}")
        return int(value)

    def string(self, name: str) -> str:
        value = self._get(name)
        if not isinstance(value, str) or not value.strip():
            raise self.fail(name, f"must be a non-empty string, got {value!r}")
        return value

    def relation(self, name: str) -> str:
        value = self._get(name)
        if value not in RELATIONS:
            raise self.fail(name, f"must be one of {RELATIONS}, got {value!r}")
        return value

    def str_list(self, name: str) -> list[str]:
        value = self._get(name)
        if isinstance(value, str) or not isinstance(value, (list, tuple)) or not value \
                or not all(isinstance(v, str) and v.strip() for v in value):
            raise self.fail(name, f"must be a non-empty list of non-empty strings, got {value!r}")
        return list(value)


def _compare(count: int, relation: str, target: int) -> bool:
    return count < target if relation == "less than" else count >= target


def _register(instruction_id: str):
    """Decorator: wrap `fn(response, args: _Args)` as `check(response, **kwargs)` in CHECKERS."""
    def deco(fn: Callable[[str, _Args], bool]) -> Callable[..., bool]:
        def check(response: str, **kwargs: Any) -> bool:
            return bool(fn(response, _Args(instruction_id, kwargs)))

        check.__name__ = fn.__name__
        check.__qualname__ = fn.__qualname__
        check.__doc__ = fn.__doc__
        check.instruction_id = instruction_id  # type: ignore[attr-defined]
        CHECKERS[instruction_id] = check
        return check
    return deco


def check_instruction(instruction_id: str, response: str, **kwargs: Any) -> bool:
    """Run the checker of `instruction_id`; ValueError for an unknown id or malformed kwargs."""
    checker = CHECKERS.get(instruction_id)
    if checker is None:
        raise ValueError(f"unknown IFEval instruction id {instruction_id!r}; known: {sorted(CHECKERS)}")
    return checker(response, **kwargs)


# ---------------------------------------------------------------------------- text utilities
_WORD_RE = re.compile(r"\w+")
_TOKEN_RE = re.compile(r"\w+(?:['\u2019.\-]\w+)*")
_PERIOD = "\ue000"  # private-use placeholder for periods that do not end a sentence
_ABBREVIATIONS = re.compile(
    r"\b(Mr|Mrs|Ms|Dr|Prof|Sr|Jr|St|Mt|vs|etc|e\.g|i\.e|Inc|Ltd|Co|Corp|No|Fig|approx|Ph\.D|a\.m|p\.m)\.",
    re.IGNORECASE)
_SENTENCE_END = re.compile(r"(?<![.!?])[.!?]++[\"'\u201d\u2019)\]]*+(?=\s|$)")  # possessive: linear on "!!!!x"


def count_words(text: str) -> int:
    """Number of `\\w+` runs (what nltk's `RegexpTokenizer(r"\\w+")` counts in the original)."""
    return sum(1 for _ in _WORD_RE.finditer(text))


def split_sentences(text: str) -> list[str]:
    """Regex sentence splitter: a sentence ends at `.`, `!` or `?` (plus closing quotes/brackets)
    followed by whitespace or the end of text. Periods in decimals (3.14), dotted acronyms (U.S.A.),
    domains (example.com) and common abbreviations (Mr., Dr., e.g., etc.) do not end a sentence.
    Newlines are plain whitespace (as in the original), so an unpunctuated heading joins the next
    sentence; trailing text without final punctuation is one more sentence."""
    t = re.sub(r"(?<=\d)\.(?=\d)", _PERIOD, text)
    t = _ABBREVIATIONS.sub(lambda m: m.group(1).replace(".", _PERIOD) + _PERIOD, t)
    t = re.sub(r"\b([A-Za-z])\.(?=[A-Za-z]\.)", r"\1" + _PERIOD, t)
    t = re.sub(r"\.(?=(?:com|org|net|edu|gov|io)\b)", _PERIOD, t)
    sentences, start = [], 0
    for m in _SENTENCE_END.finditer(t):
        sentences.append(t[start:m.end()])
        start = m.end()
    sentences.append(t[start:])
    return [s.strip().replace(_PERIOD, ".") for s in sentences if s.strip()]


def count_sentences(text: str) -> int:
    """Number of sentences per `split_sentences`."""
    return len(split_sentences(text))


# ---------------------------------------------------------------------------- language heuristic
_SCRIPT_LANGUAGES: dict[str, tuple[str, ...]] = {
    "CYRILLIC": ("ru", "uk", "bg", "mk", "be", "kk"), "ARABIC": ("ar", "fa", "ur", "ps"),
    "HEBREW": ("he", "iw"), "DEVANAGARI": ("hi", "mr", "ne"), "BENGALI": ("bn",), "GURMUKHI": ("pa",),
    "GUJARATI": ("gu",), "ORIYA": ("or",), "TAMIL": ("ta",), "TELUGU": ("te",), "KANNADA": ("kn",),
    "MALAYALAM": ("ml",), "THAI": ("th",), "GREEK": ("el",), "GEORGIAN": ("ka",), "ARMENIAN": ("hy",),
    "HANGUL": ("ko",),
}
_LANGUAGE_SCRIPT = {lang: script for script, langs in _SCRIPT_LANGUAGES.items() for lang in langs}
_STOPWORDS: dict[str, frozenset[str]] = {lang: frozenset(words.split()) for lang, words in {
    "en": "the and of to is in that it with for this are was you be have not they which",
    "de": "der die das und ist nicht ein eine ich zu mit den auf sich von dem auch es",
    "fr": "le la les et est une des du que pas pour dans je vous il sur avec ce",
    "es": "el la los las y es una que del por con para se lo no más pero como",
    "it": "il la e di che è non un una per sono con del della gli anche come le",
    "pt": "o a os as e é um uma que do da não em para com dos mais se",
    "pl": "i w nie się jest że z jak ale co tak od po czy jego być",
    "vi": "và của là có không những được các một cho với này trong người đã để",
    "sw": "na ya wa kwa ni za katika hii kuwa la cha yake hiyo lakini sana watu",
    "fi": "ja on ei että se hän ovat oli mutta kuin tämä myös ole joka niin kun",
}.items()}
_CJK_LANGUAGES = ("ja", "zh", "zh-cn", "zh-tw")
SUPPORTED_LANGUAGES = tuple(sorted(set(_LANGUAGE_SCRIPT) | set(_STOPWORDS) | set(_CJK_LANGUAGES)))
_SCRIPT_SHARE = 0.6


def _letter_scripts(text: str, limit: int = 20000) -> collections.Counter:
    """Counter of Unicode script (first word of the character name) over the first `limit` letters."""
    scripts: collections.Counter = collections.Counter()
    seen = 0
    for ch in text:
        if not ch.isalpha():
            continue
        if ch < "\x80":
            scripts["ASCII"] += 1
        else:
            name = unicodedata.name(ch, "UNKNOWN")
            script = name.split(" ", 1)[0]
            scripts["KANA" if script in ("HIRAGANA", "KATAKANA", "KATAKANA-HIRAGANA") else script] += 1
        seen += 1
        if seen >= limit:
            break
    return scripts


def detect_language_match(text: str, language: str) -> bool:
    """Heuristic stand-in for `langdetect.detect(text) == language` (langdetect is not a dependency).

    - Non-Latin scripts: at least 60% of the letters are in the language's script (Cyrillic for ru,
      Devanagari for hi, Hangul for ko, Han+kana with some kana for ja, Han without kana for zh...).
      Languages sharing a script (ru/uk/bg, ar/fa/ur, hi/mr/ne) are NOT told apart.
    - Latin-script languages (en, de, fr, es, it, pt, pl, vi, sw, fi): at least 60% Latin letters,
      then the language whose small stopword list has strictly the most hits among the first 2000
      words must be the requested one; with no clear winner the text is accepted, except that "en"
      always also needs >= 90% ASCII letters. Short or stopword-free text is therefore weakly judged.
    - Text without letters passes (the original counts langdetect's failure as followed).
    Unsupported codes raise ValueError.
    """
    lang = language.strip().lower()
    if lang not in SUPPORTED_LANGUAGES:
        raise ValueError(f"IFEval instruction 'language:response_language': kwarg 'language' "
                         f"{language!r} is not supported; supported: {SUPPORTED_LANGUAGES}")
    scripts = _letter_scripts(text)
    total = sum(scripts.values())
    if total == 0:
        return True
    if lang in _LANGUAGE_SCRIPT:
        return scripts[_LANGUAGE_SCRIPT[lang]] >= _SCRIPT_SHARE * total
    if lang in _CJK_LANGUAGES:
        han, kana = scripts["CJK"], scripts["KANA"]
        if lang == "ja":
            return kana > 0 and han + kana >= _SCRIPT_SHARE * total
        return han >= _SCRIPT_SHARE * total and kana <= 0.05 * (han + kana)
    latin = scripts["ASCII"] + scripts["LATIN"]
    if latin < _SCRIPT_SHARE * total:
        return False
    if lang == "en" and scripts["ASCII"] < 0.9 * total:
        return False
    hits = collections.Counter()
    for i, m in enumerate(_WORD_RE.finditer(text)):
        if i >= 2000:
            break
        word = m.group().lower()
        for code, words in _STOPWORDS.items():
            if word in words:
                hits[code] += 1
    ranked = hits.most_common(2)
    if not ranked or (len(ranked) == 2 and ranked[0][1] == ranked[1][1]):
        return True
    return ranked[0][0] == lang


# ---------------------------------------------------------------------------- keywords
@_register("keywords:existence")
def _keywords_existence(response: str, a: _Args) -> bool:
    """Every keyword in `keywords` appears (case-insensitive substring match)."""
    return all(re.search(re.escape(k), response, re.IGNORECASE) for k in a.str_list("keywords"))


@_register("keywords:frequency")
def _keywords_frequency(response: str, a: _Args) -> bool:
    """`keyword` occurs (case-insensitive substring count) `relation` `frequency` times."""
    keyword, frequency, relation = a.string("keyword"), a.integer("frequency"), a.relation("relation")
    return _compare(len(re.findall(re.escape(keyword), response, re.IGNORECASE)), relation, frequency)


@_register("keywords:forbidden_words")
def _forbidden_words(response: str, a: _Args) -> bool:
    """None of `forbidden_words` appears as a whole word (case-insensitive)."""
    return not any(re.search(r"\b" + re.escape(w) + r"\b", response, re.IGNORECASE)
                   for w in a.str_list("forbidden_words"))


@_register("keywords:letter_frequency")
def _letter_frequency(response: str, a: _Args) -> bool:
    """The ASCII `letter` occurs (case-insensitive) `let_relation` `let_frequency` times."""
    letter = a.string("letter")
    if len(letter) != 1 or not ("a" <= letter.lower() <= "z"):
        raise a.fail("letter", f"must be a single ASCII letter, got {letter!r}")
    frequency, relation = a.integer("let_frequency"), a.relation("let_relation")
    return _compare(response.lower().count(letter.lower()), relation, frequency)


# ---------------------------------------------------------------------------- length constraints
@_register("length_constraints:number_sentences")
def _number_sentences(response: str, a: _Args) -> bool:
    """Sentence count (see `split_sentences`) is `relation` `num_sentences`."""
    target, relation = a.integer("num_sentences"), a.relation("relation")
    return _compare(count_sentences(response), relation, target)


@_register("length_constraints:number_paragraphs")
def _number_paragraphs(response: str, a: _Args) -> bool:
    """Exactly `num_paragraphs` paragraphs separated by `***`; an empty paragraph in the middle fails,
    empty leading/trailing pieces are not counted."""
    target = a.integer("num_paragraphs")
    pieces = re.split(r"\s?\*\*\*\s?", response)
    count = len(pieces)
    for i, piece in enumerate(pieces):
        if not piece.strip():
            if i in (0, len(pieces) - 1):
                count -= 1
            else:
                return False
    return count == target


@_register("length_constraints:number_words")
def _number_words(response: str, a: _Args) -> bool:
    """Word count (`\\w+` runs, see `count_words`) is `relation` `num_words`."""
    target, relation = a.integer("num_words"), a.relation("relation")
    return _compare(count_words(response), relation, target)


@_register("length_constraints:nth_paragraph_first_word")
def _nth_paragraph_first_word(response: str, a: _Args) -> bool:
    """Exactly `num_paragraphs` non-empty paragraphs (split on "\\n\\n") and paragraph `nth_paragraph`
    (1-based) starts with `first_word` (case-insensitive, leading quotes and trailing punctuation cut)."""
    num_paragraphs, nth = a.integer("num_paragraphs", 1), a.integer("nth_paragraph", 1)
    if nth > num_paragraphs:
        raise a.fail("nth_paragraph", f"must be <= num_paragraphs={num_paragraphs}, got {nth}")
    first_word = a.string("first_word").strip().lower()
    paragraphs = response.split("\n\n")
    count = sum(1 for p in paragraphs if p.strip())
    if nth > count:
        return False
    paragraph = paragraphs[nth - 1].strip()
    if not paragraph:
        return False
    word = paragraph.split()[0].strip().lstrip("'").lstrip('"')
    found = ""
    for ch in word:
        if ch in ".,?!'\"":
            break
        found += ch.lower()
    return count == num_paragraphs and found == first_word


# ---------------------------------------------------------------------------- detectable content
@_register("detectable_content:number_placeholders")
def _number_placeholders(response: str, a: _Args) -> bool:
    """At least `num_placeholders` placeholders `[...]` (non-overlapping, within one line)."""
    target = a.integer("num_placeholders")
    count, open_ = 0, False
    for ch in response:  # linear scan equivalent to re.findall(r"\[.*?\]")
        if ch == "[" and not open_:
            open_ = True
        elif ch == "]" and open_:
            count, open_ = count + 1, False
        elif ch == "\n":
            open_ = False
    return count >= target


@_register("detectable_content:postscript")
def _postscript(response: str, a: _Args) -> bool:
    """A postscript introduced by `postscript_marker` appears (case-insensitive). "P.S." and "P.P.S"
    also match spaced forms ("p. s."); as in the original the marker may be anywhere in the text."""
    marker = a.string("postscript_marker").strip()
    if marker == "P.P.S":
        pattern = r"p\.\s?p\.\s?s"
    elif marker == "P.S.":
        pattern = r"p\.\s?s\."
    else:
        pattern = re.escape(marker.lower())
    return re.search(pattern, response.lower()) is not None


# ---------------------------------------------------------------------------- detectable format
@_register("detectable_format:number_bullet_lists")
def _number_bullet_lists(response: str, a: _Args) -> bool:
    """Exactly `num_bullets` markdown bullet lines: lines starting with `*` (not `**`) or `-`."""
    target = a.integer("num_bullets")
    stars = re.findall(r"^[^\S\n]*\*[^*].*$", response, re.MULTILINE)
    dashes = re.findall(r"^[^\S\n]*-.*$", response, re.MULTILINE)
    return len(stars) + len(dashes) == target


@_register("detectable_format:constrained_response")
def _constrained_response(response: str, a: _Args) -> bool:
    """The response contains one of "My answer is yes.", "My answer is no.", "My answer is maybe."."""
    text = response.strip()
    return any(option in text for option in CONSTRAINED_RESPONSE_OPTIONS)


@_register("detectable_format:number_highlighted_sections")
def _number_highlighted_sections(response: str, a: _Args) -> bool:
    """At least `num_highlights` non-empty markdown highlights `*text*` or `**text**` (single line)."""
    target = a.integer("num_highlights")
    singles = re.findall(r"\*[^\n*]*\*", response)
    doubles = re.findall(r"\*\*[^\n*]*\*\*", response)
    count = sum(1 for h in singles + doubles if h.strip("*").strip())
    return count >= target


@_register("detectable_format:multiple_sections")
def _multiple_sections(response: str, a: _Args) -> bool:
    """At least `num_sections` sections, each introduced by `section_spliter` and a number ("SECTION 1")."""
    spliter, target = a.string("section_spliter").strip(), a.integer("num_sections")
    sections = re.split(r"\s?" + re.escape(spliter) + r"\s?\d+\s?", response)
    return len(sections) - 1 >= target


@_register("detectable_format:json_format")
def _json_format(response: str, a: _Args) -> bool:
    """The whole response parses as JSON, optionally inside a ```json ... ``` fence (too deeply
    nested input, which overflows the parser's recursion, counts as not JSON)."""
    text = response.strip()
    for prefix in ("```json", "```Json", "```JSON", "```"):
        text = text.removeprefix(prefix)
    text = text.removesuffix("```").strip()
    try:
        json.loads(text)
    except (ValueError, RecursionError):
        return False
    return True


@_register("detectable_format:title")
def _title(response: str, a: _Args) -> bool:
    """A non-empty title wrapped in double angular brackets, `<<title>>`, on one line. Linear-time
    equivalent of the original's greedy `re.findall(r"<<[^\n]+>>")`: per line, first `<<` to last `>>`."""
    for line in response.split("\n"):
        start, end = line.find("<<"), line.rfind(">>")
        if start >= 0 and end >= start + 3 and line[start:end + 2].lstrip("<").rstrip(">").strip():
            return True
    return False


# ---------------------------------------------------------------------------- combination
@_register("combination:two_responses")
def _two_responses(response: str, a: _Args) -> bool:
    """Exactly two different non-empty responses separated by `******` (empty ends allowed)."""
    pieces = response.split("******")
    valid = []
    for i, piece in enumerate(pieces):
        if not piece.strip():
            if i not in (0, len(pieces) - 1):
                return False
        else:
            valid.append(piece.strip())
    return len(valid) == 2 and valid[0] != valid[1]


@_register("combination:repeat_prompt")
def _repeat_prompt(response: str, a: _Args) -> bool:
    """The response starts with `prompt_to_repeat` verbatim (case-insensitive, outer whitespace cut)."""
    return response.strip().lower().startswith(a.string("prompt_to_repeat").strip().lower())


# ---------------------------------------------------------------------------- start / end
@_register("startend:end_checker")
def _end_checker(response: str, a: _Args) -> bool:
    """The response ends with `end_phrase` (case-insensitive; outer whitespace and `"` ignored)."""
    return response.strip().strip('"').lower().endswith(a.string("end_phrase").strip().lower())


@_register("startend:quotation")
def _quotation(response: str, a: _Args) -> bool:
    """The whole response (outer whitespace cut) is wrapped in double quotes."""
    text = response.strip()
    return len(text) > 1 and text[0] == '"' and text[-1] == '"'


# ---------------------------------------------------------------------------- change case
@_register("change_case:capital_word_frequency")
def _capital_word_frequency(response: str, a: _Args) -> bool:
    """All-capital words are `capital_relation` `capital_frequency`. Words are `\\w+` runs joined by
    `'`, `-` or `.` ("DON'T", "U.S" count once), standing in for nltk's word_tokenize."""
    target, relation = a.integer("capital_frequency"), a.relation("capital_relation")
    count = sum(1 for m in _TOKEN_RE.finditer(response) if m.group().isupper())
    return _compare(count, relation, target)


@_register("change_case:english_capital")
def _english_capital(response: str, a: _Args) -> bool:
    """All cased letters are capitals and the text looks English (`detect_language_match`)."""
    return response.isupper() and detect_language_match(response, "en")


@_register("change_case:english_lowercase")
def _english_lowercase(response: str, a: _Args) -> bool:
    """All cased letters are lowercase and the text looks English (`detect_language_match`)."""
    return response.islower() and detect_language_match(response, "en")


# ---------------------------------------------------------------------------- punctuation / language
@_register("punctuation:no_comma")
def _no_comma(response: str, a: _Args) -> bool:
    """No ASCII comma anywhere in the response."""
    return "," not in response


@_register("language:response_language")
def _response_language(response: str, a: _Args) -> bool:
    """The response is in `language` (ISO 639-1 code) per the heuristic `detect_language_match`."""
    language = a.string("language")
    if language.strip().lower() not in SUPPORTED_LANGUAGES:
        raise a.fail("language", f"{language!r} is not supported; supported: {SUPPORTED_LANGUAGES}")
    return detect_language_match(response, language)
