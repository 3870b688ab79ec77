"""benchmarks/gpu_check.py on CPU: its flags, its JSON schema, a failing phase, and a `--device cpu` smoke run.

The GPU figures themselves need a GPU (docs/gpu-check.md); here the same code runs on the tiny model in
float32 with the Transformers engine, Ray's object store for the hand-over, and the demo through the driver.
"""
from __future__ import annotations

import copy
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_check.py"


@pytest.fixture(scope="module")
def gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("argv, flag", [
    (["--steps", "0"], "--steps"),
    (["--steps", "two"], "--steps"),
    (["--engine", "sglang"], "--engine"),
    (["--device", "tpu"], "--device"),
    (["--peak-tflops", "-5"], "--peak-tflops"),
    (["--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization"),
    (["--requests", "1.5"], "--requests"),
])
def test_a_bad_flag_value_exits_naming_the_flag(gpu_check, capsys, argv, flag):
    with pytest.raises(SystemExit) as exc:
        gpu_check.parse_args(["--device", "cpu", *argv])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {flag}" in err or f"{flag}:" in err, err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error of a machine without a GPU")
def test_cuda_without_a_gpu_exits_telling_to_pass_device_cpu(gpu_check, capsys):
    for argv in ([], ["--device", "cuda"]):
        with pytest.raises(SystemExit) as exc:
            gpu_check.parse_args(argv)
        assert exc.value.code == 2
        err = capsys.readouterr().err
        assert "--device" in err and ("--device cpu" in err or "no CUDA device" in err), err


def test_device_defaults_and_the_engine_choice(gpu_check):
    args = gpu_check.parse_args(["--device", "cpu", "--engine", "transformers"])
    assert (args.model, args.requests, args.prompt_len, args.new_tokens, args.steps) == ("tiny", 8, 16, 16, 4)
    args = gpu_check.parse_args(["--device", "cpu", "--steps", "7", "--model", "qwen2-0.5b"])
    assert args.steps == 7 and args.model == "qwen2-0.5b"
    assert args.engine == ("vllm" if importlib.util.find_spec("vllm") else "transformers")  # auto


def test_peak_flops_by_gpu_name(gpu_check):
    assert gpu_check.peak_flops("NVIDIA H100 80GB HBM3", None) == 989e12
    assert gpu_check.peak_flops("NVIDIA H100 PCIe", None) == 756e12
    assert gpu_check.peak_flops("NVIDIA A100-SXM4-80GB", None) == 312e12
    assert gpu_check.peak_flops("NVIDIA L4", None) == 121e12
    assert gpu_check.peak_flops("NVIDIA L40S", None) is None  # not the L4
    assert gpu_check.peak_flops("NVIDIA L40S", 362.0) == 362e12


def test_the_schema_checker_accepts_the_empty_result_and_names_what_is_wrong(gpu_check):
    good = gpu_check.empty_result("cpu", "transformers")
    assert gpu_check.schema_problems(good) == []
    filled = copy.deepcopy(good)
    filled["model"] = {"name": "tiny", "params": 10, "hidden_size": 2, "layers": 1, "vocab": 5, "dtype": "float32"}
    filled["demo"] = {"eval_reward_before": 0.1, "eval_reward_after": 0.5, "eval_reward_gain": 0.4, "steps": 2,
                      "wall_s": 3.0, "weight_transport": "object_store"}
    filled["phases_s"] = {"model": 1.0, "generate": 2}
    assert gpu_check.schema_problems(filled) == []

    missing = copy.deepcopy(filled)
    del missing["weight_handoff"]["bytes"]
    del missing["errors"]
    assert sorted(gpu_check.schema_problems(missing)) == ["errors: missing", "weight_handoff.bytes: missing"]
    bad = copy.deepcopy(filled)
    bad["learner"]["tokens_per_s"] = "fast"
    bad["model"]["params"] = True  # a bool is not an int here
    bad["demo"]["steps"] = 2.0
    bad["phases_s"]["train"] = float("nan")
    bad["errors"] = ["ok", 3]
    bad["extra"] = 1
    problems = gpu_check.schema_problems(bad)
    assert len(problems) == 6, problems
    for where in ("learner.tokens_per_s", "model.params", "demo.steps", "phases_s.train", "errors.1", "extra"):
        assert any(p.startswith(where + ":") for p in problems), (where, problems)


def test_a_failing_phase_is_recorded_and_the_phases_that_need_it_are_not_run(gpu_check):
    check = gpu_check.GPUCheck(gpu_check.parse_args(["--device", "cpu", "--engine", "transformers"]))
    try:
        with check.phase("generate") as ok:
            assert ok
            raise ValueError("no engine today")
        with check.phase("logprobs", needs=("batch",)) as ok:
            assert not ok
        assert check.result["errors"] == [
            "generate: ValueError: no engine today",
            "logprobs: not run: an earlier phase that makes batch failed"]
        assert set(check.result["phases_s"]) == {"generate"}
    finally:
        check.close()


def run_check(tmp_path, *argv: str, timeout: float) -> tuple[subprocess.CompletedProcess, dict]:
    out = tmp_path / "gpu_check.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--engine", "transformers",
                           "--out", str(out), *argv], capture_output=True, text=True, timeout=timeout)
    lines = proc.stdout.splitlines()
    assert len(lines) == 1, (proc.stdout[-2000:], proc.stderr[-4000:])  # stdout: the JSON only
    report = json.loads(lines[0])
    assert json.loads(out.read_text()) == report
    return proc, report


@pytest.mark.slow
def test_a_phase_that_times_out_fails_the_check_with_exit_code_1(gpu_check, tmp_path):
    proc, report = run_check(tmp_path, "--skip-demo", "--phase-timeout-s", "0.001", timeout=120)
    assert proc.returncode == 1
    assert gpu_check.schema_problems(report) == []
    errors = report["errors"]
    assert errors[0].startswith("generate: TimeoutError: ") and "--phase-timeout-s=0.001" in errors[0], errors
    assert [e.split(":")[0] for e in errors[1:]] == ["logprobs", "train", "handoff", "device_copy", "after_handoff"]
    assert all("not run" in e for e in errors[1:]), errors
    assert report["generation"]["tokens_per_s"] is None and report["demo"] is None
    assert "ray" not in report["phases_s"]  # nothing needed Ray


@pytest.mark.slow
@pytest.mark.ray
def test_cpu_smoke_run(gpu_check, tmp_path):
    proc, r = run_check(tmp_path, "--steps", "2", timeout=240)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert gpu_check.schema_problems(r) == [] and r["errors"] == []
    assert r["device"] == "cpu" and r["engine"] == "transformers" and r["cuda_device_name"] is None
    m = r["model"]
    assert m["name"] == "tiny" and m["dtype"] == "float32" and m["params"] > 100_000
    la = r["logprob_agreement"]
    assert la["dtype"] == "float32" and la["tokens"] == 8 * 16  # every sampled token of 8 requests x 16
    assert 0 <= la["mean_abs_diff"] <= la["max_abs_diff"] < 1e-4  # measured 9.5e-7 (float32, same weights)
    g, lr = r["generation"], r["learner"]
    assert g["requests"] == 8 and g["new_tokens"] == 128 and g["tokens_per_s"] > 0
    assert lr["tokens_per_s"] > 0 and lr["step_s"] > 0 and lr["tokens_per_step"] == 8 * (16 + 16)
    assert lr["mfu"] is None and lr["peak_flops"] is None  # no MFU on the CPU
    h = r["weight_handoff"]
    assert h["transport"] == "object_store" and h["bytes"] == m["params"] * 4  # float32, tied head once
    assert (h["handoff_s"] > 0 and h["device_copy_s"] > 0
            and h["ratio"] == pytest.approx(h["handoff_s"] / h["device_copy_s"]))
    assert h["weights_equal"] is True and h["version_after"] == 1 and h["logprob_max_abs_diff_after"] < 1e-4
    assert "VmHWM" in r["memory_source"]
    assert all(r["peak_memory_bytes"][p] >= 0 for p in ("generate", "train", "handoff"))
    assert r["device_used_bytes"] == {"generate": None, "train": None, "handoff": None}
    d = r["demo"]
    assert d["steps"] == 2 and d["weight_transport"] == "object_store" and d["wall_s"] > 0
    assert 0 <= d["eval_reward_before"] <= 1 and 0 <= d["eval_reward_after"] <= 1
    assert d["eval_reward_gain"] == pytest.approx(d["eval_reward_after"] - d["eval_reward_before"], abs=1e-6)
    assert set(r["phases_s"]) == {"model", "generate", "logprobs", "train", "ray", "handoff", "device_copy",
                                  "after_handoff", "demo"}
