"""The job's summary line stays small (issue AB, item 6): the last stdout line of `rayllm-rl train` / `jobs/grpo.py`
holds the same keys, and lists and mappings of the same sizes, whatever the number of steps; a replica's policy
versions are a count and the newest few (`backend.versions_held_summary`), not one number per step."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from rayllm_rl.orchestration.backend import VERSIONS_SHOWN, versions_held_summary
from rayllm_rl.orchestration.reporting import SUMMARY_KEYS

TINY = ("trainer.backend=local", "sft.steps=0", "data.eval_size=4", "data.max_operand=9", "rollout.prompts_per_step=2",
        "rollout.group_size=2", "rollout.max_new_tokens=4", "trainer.eval_every=0", "trainer.log_every=100",
        "trainer.max_recoveries=0", "trainer.call_timeout_s=120")
"""The tiny model on the arithmetic task in this process: a few seconds a run."""


def shape(value):
    """`value` with every scalar made the same: what is left are the keys and the lengths of every list."""
    if isinstance(value, dict):
        return {k: shape(v) for k, v in value.items()}
    if isinstance(value, list):
        return [shape(v) for v in value]
    return "."


def zeroed(value):
    """`value` with every number 0 (a bool stays)."""
    if isinstance(value, dict):
        return {k: zeroed(v) for k, v in value.items()}
    if isinstance(value, list):
        return [zeroed(v) for v in value]
    return 0 if isinstance(value, (int, float)) and not isinstance(value, bool) else value


def summary_line(capsys, tmp_path, steps: int) -> tuple[str, dict]:
    """The job's command line (`cli.job_main`, what `jobs/grpo.py` and `rayllm-rl train` run), in this process:
    (its last stdout line, the summary.json it wrote)."""
    from rayllm_rl.cli import job_main

    capsys.readouterr()
    job_main([*TINY, f"trainer.steps={steps}", f"trainer.run_dir={tmp_path / f'steps_{steps}'}"])
    line = capsys.readouterr().out.strip().splitlines()[-1]
    written = json.loads((Path(json.loads(line)["run_dir"]) / "summary.json").read_text())
    return line, written


def test_a_replicas_versions_are_a_count_and_the_newest_few():
    assert versions_held_summary([0, 0, 1, 2]) == {"count": 4, "last": [0, 0, 1, 2], "in_order": True}
    held = versions_held_summary([0, 0, *range(1, 501)])  # the demo's 500 steps
    assert held == {"count": 502, "last": [496, 497, 498, 499, 500], "in_order": True}
    assert versions_held_summary([0, 3, 2])["in_order"] is False
    assert len(versions_held_summary(list(range(10_000)))["last"]) == VERSIONS_SHOWN


@pytest.mark.slow
def test_the_summary_line_does_not_grow_with_the_steps(capsys, tmp_path):
    short, short_written = summary_line(capsys, tmp_path, 3)
    long, long_written = summary_line(capsys, tmp_path, 9)
    a, b = json.loads(short), json.loads(long)
    assert set(a) == set(b) == SUMMARY_KEYS and (a["steps"], b["steps"]) == (3, 9)
    assert shape(b) == shape(a), "a field of the summary grew with the number of steps"
    # the same dict in the run dir's summary.json
    assert short_written == a and long_written == b
    # the engine's load (v0), the sync before RL (v0), then one sync a step: all 5, then the newest 5 of 11
    assert a["replica_versions_held"] == [{"count": 5, "last": [0, 0, 1, 2, 3], "in_order": True}]
    assert b["replica_versions_held"] == [{"count": 11, "last": [5, 6, 7, 8, 9], "in_order": True}]
    # the line's length, but for its numbers' digits (the two runs' paths differ only in a digit: steps_3, step_9)
    assert len(json.dumps(zeroed(b))) == len(json.dumps(zeroed(a))), (len(short), len(long))
