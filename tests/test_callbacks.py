"""Callbacks (callbacks.py) on real jobs: a callback that stops the run ends it as at
trainer.steps (checkpoint, eval, summary); one that raises is counted and the run goes on; on_evaluate sees
every evaluation; `trainer.callbacks` by import path; a bad callback fails before anything starts. The Ray
backend runs the same hooks on the driver: test_custom_workflow's Ray job carries a callback defined there."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

import callback_helpers
from callback_helpers import Recorder
from conftest import small_job_config
from job_helpers import run_job
from rayllm_rl.api import entry
from rayllm_rl.callbacks import Callback
from rayllm_rl.job.config import GRPOJobConfig
from rayllm_rl.orchestration.reporting import SUMMARY_KEYS


def job(tmp_path, *extra: str, backend: str = "local") -> GRPOJobConfig:
    """conftest's small job in `tmp_path` with 3 SFT steps and the default eval_every (100), as tests/test_one_driver.py
    runs it (a few seconds a step on the CPU); as loaded (not validated)."""
    return small_job_config(f"trainer.backend={backend}", "sft.steps=3", "trainer.eval_every=100", *extra,
                            run_dir=tmp_path)


def logged(summary, phase: str) -> list[dict]:
    """The run's metrics.jsonl records of `phase`, without the reporter's own `time_s`."""
    lines = (Path(summary["run_dir"]) / "metrics.jsonl").read_text().splitlines()
    return [{k: v for k, v in r.items() if k != "time_s"} for r in map(json.loads, lines) if r["phase"] == phase]


def as_logged(record: dict) -> dict:
    return json.loads(json.dumps(record, default=float))


class Raiser(Callback):
    """Breaks the record it is shown, then raises, at every step and at the end."""

    def on_step_end(self, record, control):
        record["reward"] = -99.0
        raise RuntimeError(f"boom at step {record['step']}")

    def on_train_end(self, summary):
        raise KeyError("no such metric")


class StopOnEval(Callback):
    """Stops at the first evaluation during RL (not the one before it)."""

    def on_evaluate(self, record, control):
        if record["step"] > 0:
            control.stop(f"eval_reward={record['eval_reward']:.3f}")


@pytest.mark.slow
def test_a_callback_that_stops_at_step_k_ends_the_run_there_with_checkpoint_eval_and_summary(tmp_path):
    stopper = Recorder()
    stopper.stop_at = 2
    summary = run_job(job(tmp_path, "trainer.steps=5", "trainer.eval_every=0",
                               "trainer.checkpoint_every=2").validate(), callbacks=[stopper])
    assert set(summary) == SUMMARY_KEYS
    assert summary["steps"] == 2 and summary["version"] == 2 and summary["budget_cuts"] == []
    assert summary["stopped_by"] == {"callback": "Recorder", "hook": "on_step_end", "step": 2,
                                     "reason": "reached step 2"}
    assert summary["callback_errors"] == {"Recorder": 0}
    ckpt = Path(summary["checkpoint"])
    assert ckpt.name == "step_2" and (ckpt / "model.safetensors").stat().st_size > 0
    # the stop came before step 2's periodic checkpoint: saved once, as the final one
    assert sorted(p.name for p in ckpt.parent.iterdir()) == ["step_0", "step_2"]
    rl = logged(summary, "rl")
    assert [r["step"] for r in rl] == [1, 2] and [r["version"] for r in rl] == [1, 2]
    assert [as_logged(r) for r in stopper.steps] == rl  # exactly the logged records, value for value
    assert logged(summary, "stop") == [{"phase": "stop", "step": 2, "stopped":
                                        "callback 'Recorder' stopped the run in on_step_end at step 2: reached step 2"}]
    # then the end a full run has: drain, eval after, summary.json, on_train_end
    assert [e["step"] for e in stopper.evals] == [0, 2]
    assert stopper.evals[-1]["eval_reward"] == summary["eval_reward_after"]
    assert json.loads((Path(summary["run_dir"]) / "summary.json").read_text()) == as_logged(summary)
    assert stopper.summary["steps"] == 2 and stopper.summary["stopped_by"]["callback"] == "Recorder"
    (began,) = stopper.began
    assert began.max_steps == 5 and began.run_dir == summary["run_dir"] and began.config.trainer.steps == 5


@pytest.mark.slow
def test_a_callback_that_raises_is_counted_and_cannot_break_the_run(tmp_path, capsys):
    watcher = Recorder()
    summary = run_job(job(tmp_path, "trainer.steps=3", "trainer.eval_every=0").validate(),
                           callbacks=[Raiser(), watcher])
    assert summary["steps"] == 3 and summary["version"] == 3 and summary["stopped_by"] is None
    assert summary["callback_errors"] == {"Raiser": 3 + 1, "Recorder": 0}  # each step's, and on_train_end's
    rl = logged(summary, "rl")
    assert [r["step"] for r in watcher.steps] == [1, 2, 3]
    assert [as_logged(r) for r in watcher.steps] == rl  # the raiser's change to its copy reached no one
    assert all(r["reward"] != -99.0 for r in rl)
    errors = [(r["step"], r["hook"], r["error"]) for r in logged(summary, "callback_error")]
    assert errors == [(1, "on_step_end", "RuntimeError: boom at step 1"),
                      (2, "on_step_end", "RuntimeError: boom at step 2"),
                      (3, "on_step_end", "RuntimeError: boom at step 3"),
                      (3, "on_train_end", "KeyError: 'no such metric'")]
    assert json.loads((Path(summary["run_dir"]) / "summary.json").read_text())["callback_errors"]["Raiser"] == 4
    err = capsys.readouterr().err
    assert err.count("Traceback (most recent call last)") == 1  # the first in full, then one line each
    assert "callback 'Raiser' raised in on_step_end at step 1; the run goes on" in err
    assert 'in on_step_end\n    raise RuntimeError(f"boom at step' in err
    assert "callback 'Raiser' raised in on_train_end at step 3 (4 errors so far): KeyError" in err


@pytest.mark.slow
def test_on_evaluate_sees_every_evaluation_and_can_stop_the_run(tmp_path):
    watcher = Recorder()
    summary = run_job(job(tmp_path, "trainer.steps=6", "trainer.eval_every=2").validate(),
                           callbacks=[watcher, StopOnEval()])
    # before RL, the in-run eval at step 2 (which stops the run), the final one
    assert [e["step"] for e in watcher.evals] == [0, 2, 2]
    assert summary["steps"] == 2 and summary["version"] == 2
    assert summary["stopped_by"] == {"callback": "StopOnEval", "hook": "on_evaluate", "step": 2,
                                     "reason": f"eval_reward={watcher.evals[1]['eval_reward']:.3f}"}
    before, after = logged(summary, "eval")
    assert [as_logged(e) for e in (watcher.evals[0], watcher.evals[-1])] == [before, after]
    assert watcher.evals[0]["eval_reward"] == summary["eval_reward_before"]
    assert watcher.evals[-1]["eval_reward"] == summary["eval_reward_after"]
    assert watcher.evals[1]["eval_reward"] == logged(summary, "rl")[1]["eval_reward"]
    assert [r["step"] for r in watcher.steps] == [1, 2]  # step 2's on_step_end still ran
    assert 0.0 <= watcher.evals[1]["eval_reward"] <= 1.0 and set(watcher.evals[1]) >= {"phase", "step", "eval_reward"}


@pytest.mark.slow
def test_callbacks_by_import_path_run_after_those_passed_as_objects(tmp_path):
    callback_helpers.MADE.clear()
    mine = Recorder()
    summary = entry.train(job(tmp_path, "trainer.eval_every=0"),
                          ["trainer.steps=4",
                           "trainer.callbacks=[callback_helpers:make_recorder,callback_helpers:StopAtTwo]"],
                          callbacks=[mine])
    assert [type(cb).__name__ for cb in callback_helpers.MADE] == ["Recorder", "Recorder", "StopAtTwo"]
    assert callback_helpers.MADE[0] is mine
    assert summary["steps"] == 2 and summary["stopped_by"]["callback"] == "StopAtTwo"
    assert summary["callback_errors"] == {"Recorder": 0, "Recorder#2": 0, "StopAtTwo": 0}
    rl = logged(summary, "rl")
    for cb in callback_helpers.MADE:
        assert [as_logged(r) for r in cb.steps] == rl and len(cb.began) == 1


def test_a_bad_callback_fails_before_anything_starts_naming_it(tmp_path):
    import ray

    cases = [
        (["trainer.callbacks=[callback_helpers:Nope]"], {},
         ValueError, r"trainer\.callbacks\[0\]: cannot import 'callback_helpers:Nope'"),
        (["trainer.callbacks=[callback_helpers:Recorder, no_such_module:Cb]"], {},
         ValueError, r"trainer\.callbacks\[1\]: cannot import 'no_such_module:Cb': No module named 'no_such_module'"),
        (["trainer.callbacks=callback_helpers.Recorder"], {},
         ValueError, r"trainer\.callbacks\[0\]: expected 'package\.module:function', got 'callback_helpers\.Recorder'"),
        (["trainer.callbacks=[callback_helpers:MADE]"], {},
         ValueError, r"trainer\.callbacks\[0\]='callback_helpers:MADE' names \[.*\], not a class or factory"),
        (["trainer.callbacks=[callback_helpers:Unbuildable]"], {},
         ValueError, r"trainer\.callbacks\[0\]: calling .*Unbuildable.* with no arguments failed: "
                     r"RuntimeError: needs a token"),
        ([], {"callbacks": [Recorder(), object()]},
         TypeError, r"callbacks\[1\]=<object object at .*> has none of the hooks on_train_begin, on_step_end"),
    ]
    for overrides, kwargs, error, message in cases:  # the Ray backend: nothing of it may start
        with pytest.raises(error, match=message):
            entry.train(job(tmp_path, backend="ray"), overrides, **kwargs)
        assert not ray.is_initialized() and list(tmp_path.iterdir()) == []  # no Ray, no run directory
