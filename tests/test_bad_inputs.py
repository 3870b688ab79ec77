"""Malformed inputs fail early and clearly: bad dataset files at load time (file + line), bad reward values as 0."""
from __future__ import annotations

import asyncio
import json
import math
import re
from pathlib import Path

import datasets
import pytest

from rayllm_rl.data.failures import code_of
from rayllm_rl.data.sources import check_fields, check_json_file, load_rows
from rayllm_rl.envs.dataset_envs import GSM8KEnv, IFEvalEnv, MATHEnv
from rayllm_rl.workflows.rewards import RewardCaller

FIXTURES = Path(__file__).parent / "fixtures"
GSM8K = [{"question": f"What is {a}+{a}?", "answer": f"{a}+{a}={2 * a}\n#### {2 * a}"} for a in range(1, 6)]


def write_lines(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


def rows_file(tmp_path: Path, rows: list, name: str = "rows.jsonl") -> Path:
    return write_lines(tmp_path / name, [r if isinstance(r, str) else json.dumps(r) for r in rows])


def build_task_for(task: str, path: Path, **data):
    """`build_task` as the driver calls it before any actor starts."""
    from rayllm_rl.config import load_config
    from rayllm_rl.orchestration.factories import build_task
    from rayllm_rl.job.config import GRPOJobConfig

    overrides = [f"task={task}", f"data.path={path}", "data.eval_size=1"] + [f"data.{k}={v}" for k, v in data.items()]
    return build_task(load_config(GRPOJobConfig, overrides))


def where(path: Path, line: int) -> str:
    return re.escape(f"{path}, line {line}:")


# ---------------------------------------------------------------- JSON Lines files
def test_a_non_json_line_names_file_line_and_json_error(tmp_path):
    path = rows_file(tmp_path, [GSM8K[0], GSM8K[1], '{"question": "What is 3+3?", "answer": "#### 6"', GSM8K[3]])
    with pytest.raises(ValueError, match=where(path, 3) + r" not valid JSON \(Expecting ',' delimiter at column 48\)"):
        load_rows(str(path))
    with pytest.raises(ValueError, match=where(path, 3)):
        build_task_for("gsm8k", path)


def test_line_numbers_count_blank_lines_and_the_line_must_be_an_object(tmp_path):
    path = rows_file(tmp_path, [GSM8K[0], "", "   ", '["question", "answer"]'])
    with pytest.raises(ValueError, match=where(path, 4) + r" expected an object with fields \[\], got a JSON array"):
        load_rows(str(path))
    path = rows_file(tmp_path, [GSM8K[0], "", GSM8K[1]], "blank.jsonl")
    assert len(load_rows(str(path))) == 2  # blank lines are skipped, as `datasets` does


def test_a_reader_failure_after_the_line_check_names_the_file_and_the_clashing_lines(tmp_path):
    path = rows_file(tmp_path, [{"question": "q", "answer": 1}, "", {"question": "q", "answer": "#### 2"}])
    message = (f"{path}: could not be read as a json file (.*); field 'answer' is a JSON number on line 1 "
               "but a JSON string on line 3; give each field one type")
    with pytest.raises(ValueError, match=re.escape(message).replace(re.escape("(.*)"), r"\(.*\)")):
        load_rows(str(path))


def test_invalid_utf8_names_the_line(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_bytes(json.dumps(GSM8K[0]).encode() + b"\n" + b'{"question": "\xff", "answer": "#### 1"}\n')
    with pytest.raises(ValueError, match=where(path, 2) + " not valid UTF-8"):
        load_rows(str(path))


@pytest.mark.parametrize("content", ["", "\n\n  \n"])
def test_an_empty_file_is_refused(tmp_path, content):
    path = tmp_path / "rows.jsonl"
    path.write_text(content)
    with pytest.raises(ValueError, match=re.escape(f"{path}: the file is empty (no rows)")):
        load_rows(str(path))
    with pytest.raises(ValueError, match=re.escape(str(path))):
        build_task_for("gsm8k", path)


def test_an_empty_eval_file_is_refused_too(tmp_path):
    train = rows_file(tmp_path, GSM8K)
    held = tmp_path / "eval.jsonl"
    held.write_text("")
    with pytest.raises(ValueError, match=re.escape(f"{held}: the file is empty")):
        build_task_for("gsm8k", train, eval_path=held)


@pytest.mark.parametrize("field", ["question", "answer"])
def test_gsm8k_row_missing_a_field_names_file_line_and_field(tmp_path, field):
    bad = {k: v for k, v in GSM8K[2].items() if k != field}
    path = rows_file(tmp_path, [GSM8K[0], GSM8K[1], bad, GSM8K[3]])
    message = where(path, 3) + f" missing required field '{field}'" + re.escape(" (required: ['question', 'answer']")
    with pytest.raises(ValueError, match=message):
        build_task_for("gsm8k", path)
    with pytest.raises(ValueError, match=message):
        GSM8KEnv(str(path), None)


def test_gsm8k_null_or_blank_field_and_numberless_answer(tmp_path):
    path = rows_file(tmp_path, [GSM8K[0], {"question": "  ", "answer": "#### 2"}])
    with pytest.raises(ValueError, match=where(path, 2) + " required field 'question' is empty"):
        build_task_for("gsm8k", path)
    path = rows_file(tmp_path, [GSM8K[0], {"question": "q", "answer": None}])
    with pytest.raises(ValueError, match=where(path, 2) + " required field 'answer' is empty"):
        build_task_for("gsm8k", path)
    path = rows_file(tmp_path, [GSM8K[0], {"question": "q", "answer": "about seven"}])
    with pytest.raises(ValueError, match=where(path, 2) + " field 'answer' holds no number"):
        build_task_for("gsm8k", path)
    path = rows_file(tmp_path, [GSM8K[0], {"question": "q", "answer": "so\n#### many"}])
    with pytest.raises(ValueError, match=where(path, 2) + " GSM8K answer has no number after '####'"):
        build_task_for("gsm8k", path)
    path = rows_file(tmp_path, [*GSM8K, {"question": "q", "answer": 7}])  # a bare number is a valid answer
    assert len(build_task_for("gsm8k", path).train) == 5


def test_math_row_needs_a_problem_and_a_reference_answer(tmp_path):
    good = {"problem": "1+1?", "solution": "It is $\\boxed{2}$."}
    path = rows_file(tmp_path, [good, {"solution": "$\\boxed{3}$"}])
    with pytest.raises(ValueError, match=where(path, 2) + " missing required field 'problem'"):
        build_task_for("math", path)
    path = rows_file(tmp_path, [good, good, {"problem": "2+2?", "solution": "four, no box"}])
    with pytest.raises(ValueError, match=where(path, 3) + r" MATH row needs an 'answer' field or a 'solution'"):
        build_task_for("math", path)
    with pytest.raises(ValueError, match=where(path, 3)):
        MATHEnv(str(path), None)


def test_ifeval_row_needs_known_instruction_ids_and_matching_kwargs(tmp_path):
    good = {"prompt": "Write.", "instruction_id_list": ["punctuation:no_comma"], "kwargs": [{}]}
    path = rows_file(tmp_path, [good, {"prompt": "Write.", "kwargs": [{}]}])
    with pytest.raises(ValueError, match=where(path, 2) + " missing required field 'instruction_id_list'"):
        build_task_for("ifeval", path)
    path = rows_file(tmp_path, [good, {**good, "instruction_id_list": ["no:such_id"]}])
    with pytest.raises(ValueError, match=where(path, 2) + " unknown IFEval instruction id 'no:such_id'; known: "):
        build_task_for("ifeval", path)
    path = rows_file(tmp_path, [good, {**good, "kwargs": [{}, {}]}])
    with pytest.raises(ValueError, match=where(path, 2) + " IFEval field 'kwargs' has 2 entries for 1 instructions"):
        IFEvalEnv(str(path), None)


def test_the_fixture_files_load(tmp_path):
    for task in ("gsm8k", "math", "ifeval"):
        path = FIXTURES / f"{task}.jsonl"
        assert check_json_file(path, *_checks(task)) == len(load_rows(str(path)))
        assert len(build_task_for(task, path).train) >= 1


def _checks(task: str):
    env = {"gsm8k": GSM8KEnv, "math": MATHEnv, "ifeval": IFEvalEnv}[task]
    return env.required_fields, env.check_row


# ---------------------------------------------------------------- a .json array, other formats
def test_json_array_errors_name_the_line_of_the_item(tmp_path):
    path = tmp_path / "rows.json"
    path.write_text("[\n" + ",\n".join(json.dumps(r, indent=1) for r in [GSM8K[0], {"question": "q"}]) + "\n]\n")
    with pytest.raises(ValueError, match=where(path, 6) + " missing required field 'answer'"):
        load_rows(str(path), required=("question", "answer"))
    path.write_text('[\n{"question": "q", "answer": "#### 1"},\n{"question": "q" "answer": 2}\n]')
    with pytest.raises(ValueError, match=where(path, 3) + r" not valid JSON \(Expecting ',' delimiter at column 18\)"):
        load_rows(str(path))
    path.write_text("[]")
    with pytest.raises(ValueError, match="the file is empty"):
        load_rows(str(path))
    path.write_text(json.dumps(GSM8K))
    assert len(load_rows(str(path), required=("question", "answer"))) == len(GSM8K)


def test_parquet_rows_are_checked_after_loading(tmp_path):
    path = tmp_path / "rows.parquet"
    datasets.Dataset.from_list([*GSM8K, {"question": "q", "answer": "no number"}]).to_parquet(str(path))
    with pytest.raises(ValueError, match=re.escape(f"{path}, row 6: field 'answer' holds no number")):
        build_task_for("gsm8k", path)
    empty = tmp_path / "empty.parquet"
    datasets.Dataset.from_list(GSM8K).select([]).to_parquet(str(empty))
    with pytest.raises(ValueError, match=re.escape(f"{empty}: the file is empty (no rows)")):
        load_rows(str(empty))
    header_only = tmp_path / "empty.csv"
    header_only.write_text("question,answer\n")
    with pytest.raises(ValueError, match=re.escape(f"{header_only}: the file is empty (no rows)")):
        load_rows(str(header_only))


def test_an_unreadable_file_of_another_format_names_the_file(tmp_path):
    path = tmp_path / "rows.parquet"
    path.write_bytes(b"this is not parquet")
    with pytest.raises(ValueError, match=re.escape(f"{path}: could not be read as a parquet file")):
        load_rows(str(path))


def test_check_fields_on_a_dataset_names_the_source_and_row():
    ds = datasets.Dataset.from_list([{"question": "q", "answer": "1"}, {"question": "q", "answer": ""}])
    with pytest.raises(ValueError, match=re.escape("mine, row 2: required field 'answer' is empty")):
        check_fields(ds, ("question", "answer"), "mine")
    with pytest.raises(ValueError, match=re.escape("GSM8KEnv, row 1: field 'answer' holds no number")):
        GSM8KEnv(datasets.Dataset.from_list([{"question": "q", "answer": "none"}]), None)


# ---------------------------------------------------------------- reward values
@pytest.mark.parametrize("value", [float("nan"), float("inf"), -math.inf, {"reward": float("nan")},
                                   {"reward": 1.0, "reward_right": float("inf")}])
def test_non_finite_reward_gives_zero_and_counts(value, caplog):
    def reward(*a, **k):
        return value

    reward.component_keys = ("reward_right",)
    caller = RewardCaller(reward)
    failed = {"reward": 0.0, "reward_right": 0.0, "failed": code_of("reward_nonfinite")}  # a failed sample, not a 0
    assert asyncio.run(caller.score("p", "c", [], [])) == failed
    assert caller.score_sync("p", "c", [], []) == failed
    assert (caller.num_nonfinite, caller.num_errors, caller.num_timeouts) == (2, 0, 0)
    assert caller.counters() == {"reward_calls": 2, "reward_errors": 0, "reward_timeouts": 0, "reward_nonfinite": 2}
    assert "non-finite" in caplog.text and "the trajectory failed (reward_nonfinite)" in caplog.text


def test_async_non_finite_reward_counts_too():
    async def reward(*a, **k):
        return float("nan")

    caller = RewardCaller(reward)
    assert asyncio.run(caller("p", "c", [], [])) == 0.0
    assert caller.score_sync("p", "c", [], []) == {"reward": 0.0, "failed": code_of("reward_nonfinite")}
    assert caller.counters()["reward_nonfinite"] == 2 and caller.num_errors == 0


@pytest.mark.parametrize("value", [None, "0.5", "nan", b"1", [1.0], object(), {"reward": None}])
def test_non_number_reward_gives_zero_and_counts_as_an_error(value, caplog):
    caller = RewardCaller(lambda *a, **k: value)
    assert asyncio.run(caller.score("p", "c", [], [])) == {"reward": 0.0, "failed": code_of("reward_raised")}
    assert caller.counters() == {"reward_calls": 1, "reward_errors": 1, "reward_timeouts": 0, "reward_nonfinite": 0}
    assert "expected a number" in caplog.text


def test_numbers_of_other_types_are_accepted():
    import numpy as np
    import torch

    for value, expected in [(np.float32(0.5), 0.5), (torch.tensor(1.0), 1.0), (True, 1.0), (3, 3.0)]:
        caller = RewardCaller(lambda *a, **k: value)
        assert asyncio.run(caller.score("p", "c", [], [])) == {"reward": expected}
        assert caller.num_errors == caller.num_nonfinite == 0
