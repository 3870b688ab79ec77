"""The trace viewer: a real short job writes traces.jsonl, `python -m rayllm_rl.view` makes the page, and
a real headless Chromium shows it (filters and colours set through the URL fragment), with a screenshot."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from browser_helpers import browser_or_skip
from rayllm_rl.view.records import TRACE_FILE, TraceWriter, read_traces

pytestmark = pytest.mark.slow  # a short job and a browser: `make test`, not `make test-fast`
ROOT = Path(__file__).resolve().parents[1]
LAG_0, LAG_1 = "rgb(200, 247, 197)", "rgb(255, 243, 176)"  # the page's colours of version lag 0 and 1


def _chromium(*args: str) -> str:
    out = subprocess.run([browser_or_skip(), "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", *args],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """Three RL steps of the demo on the local backend (eta 1: steps 2 and 3 train tokens of lag 1)."""
    from rayllm_rl.config import load_config
    from job_helpers import run_job
    from rayllm_rl.job.config import GRPOJobConfig

    root = tmp_path_factory.mktemp("trace_run")
    cfg = load_config(GRPOJobConfig, ["trainer.backend=local", "trainer.steps=3", "sft.steps=5", "data.eval_size=4",
                                      "rollout.prompts_per_step=2", "rollout.group_size=4", "trainer.eval_every=0",
                                      "trainer.log_every=100", f"trainer.run_dir={root}"]).validate()
    return Path(run_job(cfg)["run_dir"])


def test_the_run_writes_bounded_traces_of_what_it_trained(run_dir):
    traces = read_traces(run_dir)
    assert [t["step"] for t in traces] == [1, 2, 3]
    for t in traces:
        assert 1 <= len(t["samples"]) <= 4
        for s in t["samples"]:
            n = len(s["tokens"])
            assert n > 0 and len(s["versions"]) == len(s["lag"]) == len(s["mismatch"]) == len(s["trained"]) == n
            assert s["prompt"].endswith("assistant\n") and s["trained_from"] == t["step"] - 1
            # eta 1: the first step trains version 0's tokens, later ones version 0 or 1's (lag <= 1)
            assert all(lag in (0, 1) for lag, tr in zip(s["lag"], s["trained"]) if tr)
            assert all(abs(d) <= 1e-4 for d in s["mismatch"] if d is not None)  # one model, two forwards
    assert any(max(s["lag"]) == 1 for t in traces for s in t["samples"])
    summary = json.loads((run_dir / "summary.json").read_text())  # the run's mismatch, over its RL steps
    m = summary["mismatch"]
    assert m["tokens"] > 0 and 0 <= m["abs_logp_diff"] <= 1e-4 and 0 <= m["k3"] <= 1e-8 and m["frac_outside"] == 0


def test_the_writer_stops_at_its_size_bound(tmp_path, tokenizer):
    row = {"prompt_ids": [1, 2], "ids": [3] * 50, "trained": [True] * 50, "versions": [0] * 50, "trained_from": 0,
           "rollout_logp": [-1.0] * 50, "learner_logp": [-1.0] * 50, "cut_tokens": 0, "reward": 1.0, "components": {}}
    writer = TraceWriter(tmp_path, tokenizer, max_bytes=4000)
    for step in range(1, 20):
        writer.write(step, [row])
    lines = (tmp_path / TRACE_FILE).read_text().splitlines()
    assert json.loads(lines[-1])["stopped"].endswith("no traces after this step")
    assert len(lines) < 19 and (tmp_path / TRACE_FILE).stat().st_size < 4000 + len(lines[-2]) + len(lines[-1]) + 2


def test_the_page_shows_the_steps_and_filters_in_a_real_browser(run_dir):
    out = subprocess.run([sys.executable, "-m", "rayllm_rl.view", str(run_dir)], capture_output=True, text=True,
                         timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    page = out.stdout.strip()
    assert page == (run_dir / "trace.html").resolve().as_uri()
    traces = read_traces(run_dir)
    total = sum(len(t["samples"]) for t in traces)
    lag1 = sum(max(s["lag"]) == 1 for t in traces for s in t["samples"])

    dom = _chromium("--dump-dom", page)
    assert f"showing {total} of {total} samples in 3 steps" in dom
    assert len(re.findall(r'class="step" data-step="\d+"', dom)) == 3
    assert "mismatch_abs_logp_diff" in dom  # the step's figures, read from metrics.jsonl
    spans = re.findall(r'data-lag="(\d)" title="[^"]*" style="background: ([^;"]+)', dom)
    assert spans and all({"0": LAG_0, "1": LAG_1}[lag] == bg for lag, bg in spans)

    dom = _chromium("--dump-dom", page + "#lag=1&color=mismatch")
    assert f"showing {lag1} of {total} samples in {2 if lag1 else 0} steps" in dom
    assert 'data-step="1"' not in dom  # step 1 trained version 0's tokens only
    assert "rgba(" in dom and LAG_1 not in dom  # coloured by mismatch now
    dom = _chromium("--dump-dom", page + "#min_reward=2")  # the demo's reward is 0 or 1
    assert f"showing 0 of {total} samples in 0 steps" in dom

    shot = run_dir / "trace.png"
    _chromium(f"--screenshot={shot}", "--window-size=1200,900", page)
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 10_000


def test_a_run_without_traces_is_named(tmp_path):
    out = subprocess.run([sys.executable, "-m", "rayllm_rl.view", str(tmp_path)], capture_output=True, text=True,
                         timeout=120, cwd=ROOT)
    assert out.returncode == 2 and f"{tmp_path / TRACE_FILE} does not exist" in out.stderr
