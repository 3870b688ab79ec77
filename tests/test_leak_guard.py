"""One failure stays one failure: the guard every test runs under (conftest.py, leak_guard.py) names what a test
left behind, cleans it up, and the tests after it start clean.

`RAYLLM_FAIL_ON_PURPOSE=1 make test` makes the first test below fail on purpose, leaving a Ray it did not hold,
a named actor, a child process and a shared-memory segment to the guard; every other test still passes. The
second test shows exactly that on a small suite, in a pytest of its own.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
from multiprocessing import shared_memory

import psutil
import pytest

import leak_guard
from conftest import SESSION_START

FAIL_VAR = "RAYLLM_FAIL_ON_PURPOSE"
TESTS_DIR = os.path.dirname(os.path.abspath(__file__))


def leave_everything_behind(segment_name: str):
    """What a careless test leaves: a Ray no fixture holds, a named actor on it (its handle kept, as in a module
    global: Ray ends a named actor whose handles are all gone), a child process, a segment."""
    import ray

    ray.init(address="local", num_cpus=1, include_dashboard=False)

    @ray.remote(num_cpus=0)
    class Stray:
        def ping(self) -> int:
            return 1

    stray = Stray.options(name="stray", namespace="leak-guard").remote()
    assert ray.get(stray.ping.remote(), timeout=120) == 1
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    # Popen returns once exec closed its pipe, which Linux does before it writes the new command line: read at once,
    # /proc/<pid>/cmdline can still be empty (a guard run in that gap names the process with no command)
    deadline = time.monotonic() + 30
    while "time.sleep(600)" not in " ".join(psutil.Process(child.pid).cmdline()):
        assert time.monotonic() < deadline, "the child showed no command line within 30 s"
        time.sleep(0.01)
    segment = shared_memory.SharedMemory(name=segment_name, create=True, size=4096)
    segment.close()  # the mapping goes, the segment stays until unlinked
    return child, stray


def test_the_guard_names_what_a_test_left_and_cleans_it_up():
    before = leak_guard.Snapshot.take(SESSION_START)
    name = f"rayllm_leak_{os.getpid()}"
    child, _stray = leave_everything_behind(name)
    found = before.leaks(ray_held=False, grace_s=0)
    assert found["ray"] == ["Ray is still initialised but no fixture holds it"]
    assert found["named actors"] == ["leak-guard/stray"]
    assert any(line.startswith(f"{child.pid}: ") and "time.sleep(600)" in line for line in found["processes"])
    assert found["shm segments"] == [name]
    if os.environ.get(FAIL_VAR) == "1":
        pytest.fail(f"failing on purpose ({FAIL_VAR}=1), leaving all of it to the guard")
    before.clean(ray_held=False)
    assert before.leaks(ray_held=False, grace_s=leak_guard.EXIT_GRACE_S) == {}
    child.wait(timeout=10)  # the guard reaped it (killed: Popen then reads no status of its own)
    assert not psutil.pid_exists(child.pid) and not os.path.exists(f"/dev/shm/{name}")


@pytest.mark.slow
def test_a_test_that_fails_on_purpose_fails_alone_and_the_tests_after_it_pass(tmp_path):
    """The first test above, with FAIL_VAR set, before two tests that need a clean start: one asserting that no
    Ray is up (as a config check that starts nothing), one that starts its own Ray through a fixture (as the Ray
    tests do, where a Ray left up once turned into 22 errors)."""
    suite = [f"{TESTS_DIR}/test_leak_guard.py::test_the_guard_names_what_a_test_left_and_cleans_it_up",
             f"{TESTS_DIR}/test_config_validation.py::test_train_refuses_a_bad_config_before_ray_starts",
             f"{TESTS_DIR}/test_placement.py::test_whole_gpus_give_distinct_devices"]
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfE", *suite],
                         env={**os.environ, FAIL_VAR: "1", "RAYLLM_LEAK_GRACE_S": "3"}, cwd=tmp_path,
                         capture_output=True, text=True, timeout=600)
    tail = out.stdout[-3000:]
    assert out.returncode == 1, tail
    assert "1 failed, 2 passed, 1 error" in tail, tail
    assert f"Failed: failing on purpose ({FAIL_VAR}=1)" in out.stdout, tail
    assert ("test_the_guard_names_what_a_test_left_and_cleans_it_up left behind ray: Ray is still initialised but no "
            "fixture holds it; named actors: leak-guard/stray; processes: ") in out.stdout, tail
    print(f"on-purpose failure and 2 clean tests after it in {time.monotonic() - t0:.0f}s")
