"""The checkout keeps to its ruff configuration (pyproject.toml, `[tool.ruff]`): no line over 120 characters, and
pycodestyle's and pyflakes' default rules. `ruff check` runs here as a contributor runs it, over every Python file
of the checkout; ruff is a dev dependency, so without it this test fails rather than skips."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_ruff_check_passes_on_the_whole_checkout():
    # --no-cache: the test leaves no .ruff_cache behind in the checkout
    out = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", str(ROOT)],
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, (f"`ruff check` exited {out.returncode} (wrap a long line by hand; do not run "
                                 f"`ruff format` over the code base):\n{out.stdout}{out.stderr}")
