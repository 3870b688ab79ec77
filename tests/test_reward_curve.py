"""`reward_curve.png` is redrawn at every evaluation (a long run shows its curve before it ends), and drawing it
leaves the process's matplotlib backend alone (a notebook that calls train() keeps its inline backend)."""
from __future__ import annotations

import hashlib
import subprocess
import sys
import textwrap

from rayllm_rl.orchestration.reporting import RunReporter


def digest(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_the_curve_is_redrawn_at_every_evaluation(tmp_path):
    reporter = RunReporter(str(tmp_path))
    try:
        curve = reporter.run_dir / "reward_curve.png"
        reporter.log({"phase": "eval", "step": 0, "eval_reward": 0.1})
        assert not curve.exists()  # no training step yet: nothing to draw
        for step in (1, 2):
            reporter.log({"phase": "rl", "step": step, "reward": 0.1 * step})
        assert not curve.exists()  # steps alone do not redraw it
        reporter.log({"phase": "eval", "step": 2, "eval_reward": 0.3})
        first = digest(curve)
        assert curve.stat().st_size > 1000 and curve.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        reporter.log({"phase": "rl", "step": 3, "reward": 0.5})
        assert digest(curve) == first
        reporter.log({"phase": "eval", "step": 3, "eval_reward": 0.6})
        assert digest(curve) != first  # the new step and evaluation are drawn
    finally:
        reporter.close()


def test_drawing_the_curve_keeps_the_processs_matplotlib_backend(tmp_path):
    """In a fresh interpreter (this one's backend may be set already): a backend chosen as a notebook's would be,
    a run's curve drawn, the backend unchanged and pyplot never imported by the reporter."""
    code = textwrap.dedent(f"""
        import sys, matplotlib
        matplotlib.use("svg")
        from rayllm_rl.orchestration.reporting import RunReporter
        r = RunReporter({str(tmp_path)!r})
        r.log({{"phase": "rl", "step": 1, "reward": 0.2}})
        r.log({{"phase": "eval", "step": 1, "eval_reward": 0.4}})
        r.finish({{"steps": 1}})
        assert (r.run_dir / "reward_curve.png").stat().st_size > 1000
        print(matplotlib.get_backend(), "matplotlib.pyplot" in sys.modules)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["svg", "False"]
