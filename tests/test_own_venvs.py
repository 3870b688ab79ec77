"""The test modules that run in a venv of their own (conftest.OWN_VENV_TESTS: tests/test_openenv.py needs openenv,
whose fastmcp needs mcp<2 where the `mcp` extra pins 2.3; docs/environments.md), run from the main suite: a pytest
in that venv's Python, one per module. Under `make test`'s two xdist workers a module's run then overlaps the other
worker's files instead of following the whole suite (it did: +45 s of wall time at the end of `make test`).

This run's marker expression goes along (`make test-fast` runs their fast tests only). The sub-run has the same
conftest, so its leak guards check it as they check this suite; what it prints is in the failure message."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from conftest import OWN_VENV, OWN_VENV_TESTS

ROOT = Path(__file__).resolve().parent.parent
SUB_RUN_TIMEOUT_S = 540
"""A sub-run's bound: under this test's own 600 s (pyproject's pytest timeout), so a hang fails here, naming it."""


@pytest.mark.parametrize("module", sorted(OWN_VENV_TESTS))
def test_a_module_of_its_own_venv_passes_there(module, request):
    python = ROOT / OWN_VENV / "bin" / "python"
    assert python.exists(), f"{python} is missing: `make test` builds it (Makefile: OE_STAMP), then runs this test"
    args = [str(python), "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfE", f"tests/{module}"]
    markexpr = request.config.getoption("markexpr")
    if markexpr:
        args += ["-m", markexpr]
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_XDIST") and k != "PYTEST_CURRENT_TEST"}
    try:
        out = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=SUB_RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired as exc:
        tail = (exc.stdout or b"")[-6000:]
        pytest.fail(f"tests/{module} in {OWN_VENV} did not finish within {SUB_RUN_TIMEOUT_S} s: {tail!r}")
    summary = out.stdout.strip().splitlines()[-1:] or [""]
    print(f"tests/{module} in {OWN_VENV}: {summary[0]}")
    # 5: no test selected (a marker expression that leaves none of the module's tests), which is no failure
    assert out.returncode in (0, 5), f"tests/{module} in {OWN_VENV} failed:\n{out.stdout[-8000:]}\n{out.stderr[-3000:]}"
    assert " passed" in summary[0] or out.returncode == 5, out.stdout[-3000:]
