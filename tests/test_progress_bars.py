"""Long work shows its progress on the driver's console (issue S): the eval (its own bar before and after RL, the
RL bar's postfix during it), the SFT warm start, the GGUF conversion's stages, and the hub's download bars while
the driver fetches the model."""
from __future__ import annotations

import asyncio
import io
import sys

import pytest

from rayllm_rl.orchestration.reporting import RunReporter, hub_download_bars
from test_console import screen


@pytest.fixture()
def take_err(monkeypatch):
    """Makes sys.stderr a StringIO and returns it; called in the test's body (pytest sets its own sys.stderr at
    each phase)."""
    def take():
        stream = io.StringIO()
        monkeypatch.setattr(sys, "stderr", stream)
        return stream

    return take


def test_the_eval_ticks_once_per_answer(engine, tokenizer):
    from rayllm_rl.workflows.evaluation import evaluate_greedy

    rows = [{"messages": [{"role": "user", "content": f"{a}+1="}], "answer": str(a + 1)} for a in range(5)]
    ticks: list[int] = []
    out = asyncio.run(evaluate_greedy(engine, tokenizer, rows, lambda *a, **k: 1.0, 3, progress=ticks.append))
    assert ticks == [1] * 5 and out["eval_n"] == 5.0 and out["eval_reward"] == 1.0


def test_work_outside_the_rl_loop_gets_its_own_bar_left_on_the_console(take_err, tmp_path):
    err = take_err()
    reporter = RunReporter(str(tmp_path))
    with reporter.task_progress(4, "eval") as tick:
        for _ in range(4):
            tick()
    shown = screen(err.getvalue())
    assert shown[-1].startswith("eval: 100%") and "4/4" in shown[-1], shown
    assert sys.stderr is err  # the console given back
    reporter.close()


def test_an_eval_during_rl_shows_in_the_rl_bars_postfix_and_leaves_it_as_it_was(take_err, tmp_path):
    err = take_err()
    import threading

    reporter = RunReporter(str(tmp_path))
    bar = reporter.progress(total=10, desc="grpo")
    bar.update(1, reward=0.5)
    before = bar.bar.postfix
    with reporter.task_progress(3, "eval") as tick:
        worker = threading.Thread(target=lambda: [tick() for _ in range(3)])  # the eval's own thread (Ray backend)
        worker.start()
        worker.join(10)
        assert bar.bar.postfix == "eval 3/3"
        assert "eval 3/3" in screen(err.getvalue())[-1]  # drawn when done, whatever the interval
    assert bar.bar.postfix == before and not bar.closed and reporter.bar is bar  # still the one bar
    reporter.close()


def test_the_sft_warm_start_has_a_bar(take_err, tmp_path, tokenizer):
    err = take_err()
    from rayllm_rl.config import load_config
    from rayllm_rl.orchestration.factories import build_task
    from rayllm_rl.job.config import GRPOJobConfig
    from rayllm_rl.algorithm.sft_warmup import sft_warm_start

    cfg = load_config(GRPOJobConfig, ["sft.steps=3", "sft.batch_size=2", "data.eval_size=4"]).validate()
    reporter, steps = RunReporter(str(tmp_path)), []
    assert sft_warm_start(cfg, build_task(cfg), tokenizer, reporter,
                          lambda batch, loss: steps.append(1) or {"nll": 1.0}, lambda optim: None) is None
    shown = screen(err.getvalue())
    assert len(steps) == 3 and shown[-1].startswith("sft warm start: 100%") and "3/3" in shown[-1], shown
    reporter.close()


def test_the_gguf_conversion_shows_its_stages(take_err):
    err = take_err()
    from rayllm_rl.models.gguf import stage_progress

    step = stage_progress("converting m.gguf (once)", ("dequantize", "save", "check the round trip"))
    assert "dequantize" in screen(err.getvalue())[-1]
    step("save")
    step("check the round trip")
    assert "check the round trip" in screen(err.getvalue())[-1] and "2/3" in screen(err.getvalue())[-1]
    step(None)
    assert screen(err.getvalue())[-1].startswith("converting m.gguf (once): 100%")


def test_the_hubs_download_bars_are_on_while_the_driver_fetches_and_put_back():
    import huggingface_hub.utils as hub_utils

    hub_utils.disable_progress_bars()
    try:
        with hub_download_bars():
            assert not hub_utils.are_progress_bars_disabled()
        assert hub_utils.are_progress_bars_disabled()
    finally:
        hub_utils.enable_progress_bars()
