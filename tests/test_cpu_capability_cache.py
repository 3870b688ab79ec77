"""Torch's inductor under `ATEN_CPU_CAPABILITY`: a cache of its own per capability (vllm/job.py's
`separate_inductor_cache`, called where the vLLM engine starts on CPU).

Inductor sizes its C++ vectors by ATEN_CPU_CAPABILITY, but its graph cache does not key on it (torch 2.13):
a process run with ATEN_CPU_CAPABILITY=avx2 on an AVX-512 machine reuses the 16-lane code an earlier
native run cached, builds it with AVX2's 8-lane vectors, and returns garbage past the 8th element. That is
how vLLM's tensor-parallel embedding failed under `make test` with ATEN_CPU_CAPABILITY=avx2 (docs/testing.md)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

# The shape of vLLM's vocab-parallel index mask: int32 ids, int64 arithmetic, compiled with dynamic shapes.
SCRIPT = r"""
import os, sys, json, torch
if sys.argv[1] == "separate":
    from rayllm_rl.inference.vllm.job import separate_inductor_cache
    separate_inductor_cache(os.environ)

@torch.compile(dynamic=True)
def shard_ids(ids, start: int, end: int):
    inside = (ids >= start) & (ids < end)
    return inside * (ids - start * inside)

torch.set_num_threads(1)
ids = torch.arange(17, dtype=torch.int32) * 7 % 23
print(json.dumps({"dir": os.environ["TORCHINDUCTOR_CACHE_DIR"], "out": shard_ids(ids, 0, 12).tolist()}))
"""
IDS = [i * 7 % 23 for i in range(17)]
EXPECTED = [i if i < 12 else 0 for i in IDS]


def _run(tmp_path, mode: str, capability: str | None) -> dict:
    import json

    env = {k: v for k, v in os.environ.items() if k not in ("TORCHINDUCTOR_CACHE_DIR", "ATEN_CPU_CAPABILITY")}
    env["TMPDIR"] = str(tmp_path)  # torch's default cache: <TMPDIR>/torchinductor_<user>, this test's own
    env["TORCHINDUCTOR_CPP_CACHE_PRECOMPILE_HEADERS"] = "0"  # no header to precompile per cache: ~20% sooner
    if capability:
        env["ATEN_CPU_CAPABILITY"] = capability
    out = subprocess.run([sys.executable, "-c", SCRIPT, mode], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_separate_inductor_cache_names_a_directory_per_capability(monkeypatch, tmp_path):
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    from rayllm_rl.inference.vllm.job import separate_inductor_cache

    default = os.path.abspath(default_cache_dir())
    env: dict = {}
    separate_inductor_cache(env)
    assert env == {}  # no capability chosen: torch's own default stays
    env = {"ATEN_CPU_CAPABILITY": "AVX2"}
    separate_inductor_cache(env)
    assert env["TORCHINDUCTOR_CACHE_DIR"] == default + "_avx2"
    separate_inductor_cache(env)  # a second engine in the process: unchanged
    assert env["TORCHINDUCTOR_CACHE_DIR"] == default + "_avx2"
    env = {"ATEN_CPU_CAPABILITY": "avx2", "TORCHINDUCTOR_CACHE_DIR": default}  # torch's cache_dir() sets its default
    separate_inductor_cache(env)
    assert env["TORCHINDUCTOR_CACHE_DIR"] == default + "_avx2"
    env = {"ATEN_CPU_CAPABILITY": "avx2", "TORCHINDUCTOR_CACHE_DIR": str(tmp_path)}  # the user's choice is kept
    separate_inductor_cache(env)
    assert env["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path)


@pytest.mark.slow
def test_an_avx2_run_after_a_native_run_computes_the_right_values(tmp_path):
    """On an AVX-512 machine this is the failing sequence itself: without `separate_inductor_cache` (or
    with one that leaves torch's default directory) the second run reads the first run's kernel and its
    elements 8-15 are garbage (checked by hand, docs/testing.md). On an AVX2 machine both runs build
    the same kernel and only the directory is checked."""
    native = _run(tmp_path, "plain", None)  # fills torch's default cache with this CPU's own kernels
    assert native["out"] == EXPECTED
    avx2 = _run(tmp_path, "separate", "avx2")
    assert avx2["dir"] == native["dir"] + "_avx2"
    assert avx2["out"] == EXPECTED
