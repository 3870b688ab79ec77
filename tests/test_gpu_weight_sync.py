"""benchmarks/gpu_weight_sync.py on CPU: the learner → replica sync between two processes, as it runs on a GPU.

On a GPU it measures CUDA IPC (docs/performance.md has the H200 figures); here the same two processes,
learner and Transformers replica, sync the tiny model over `shm`, and the run's own checks must hold:
each version swapped in, checksums equal after each mode, the next tokens stamped with the last version,
logprobs equal to the learner's.
"""
from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_weight_sync.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("gpu_weight_sync", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("argv, flag", [
    (["--syncs", "0"], "--syncs"),
    (["--timeout-s", "-1"], "--timeout-s"),
    (["--transport", "object_store"], "--transport"),  # needs Ray: not one of the two-process transports
    (["--transport", "cuda_ipc", "--device", "cpu"], "--transport cuda_ipc"),
])
def test_a_bad_flag_exits_naming_it(bench, capsys, argv, flag):
    with pytest.raises(SystemExit) as exc:
        bench.parse_args(["--device", "cpu", *argv] if "--device" not in argv else argv)
    assert exc.value.code == 2
    assert flag in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error of a machine without a GPU")
def test_cuda_without_a_gpu_says_so(bench, capsys):
    with pytest.raises(SystemExit):
        bench.parse_args(["--device", "cuda"])
    assert "--device cpu" in capsys.readouterr().err


@pytest.mark.slow
def test_two_processes_sync_every_version_and_agree(tmp_path):
    out = tmp_path / "sync.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--syncs", "2", "--timeout-s", "120",
                           "--out", str(out)], capture_output=True, text=True, timeout=300)
    result = json.loads(out.read_text())
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == result  # stdout carries the same JSON
    assert proc.returncode == 0 and result["errors"] == [], result.get("traceback", result["errors"])
    assert result["transport"] == "shm" and result["model"]["name"] == "tiny"
    assert result["bytes"] == 4 * result["model"]["params"]  # every parameter once, in float32
    # 2 modes x (1 warm-up + 2 timed) versions, each swapped in; the timed ones recorded
    assert [s["version"] for s in result["syncs"]] == [2, 3, 5, 6]
    assert [s["mode"] for s in result["syncs"]] == ["idle", "idle", "generating", "generating"]
    assert result["weights_equal_idle"] is True and result["weights_equal_generating"] is True
    assert result["versions_after"] == [6]
    assert result["logprob_max_abs_diff_v0"] < 1e-4 and result["logprob_max_abs_diff_after"] < 1e-4
    for mode in ("idle", "generating"):
        s = result["summary"][mode]
        assert s["bytes_per_s"] == pytest.approx(result["bytes"] / s["end_to_end_s"])
        assert 0 <= s["stall_s_max"] < s["end_to_end_s"]
    copy = result["device_copy"]
    assert copy["flat_bytes_per_s"] == pytest.approx(result["bytes"] / copy["flat_s"])
