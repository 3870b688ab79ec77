"""`make test`'s worker count (tests/idle_workers.py): the idle cores, at most 2, and one (`-n 0`) when a core is
already busy; the leak guard's session mark is a worker's own under xdist."""
from __future__ import annotations

import os

import pytest

import idle_workers
import leak_guard


def readings(monkeypatch, cores: int, busy_fraction: float) -> None:
    """/proc/stat as it reads when `busy_fraction` of `cores` cores was busy over the sample."""
    ticks = iter([(0, 0), (int(busy_fraction * 1000 * cores), 1000 * cores)])
    monkeypatch.setattr(idle_workers, "cpu_times", lambda: next(ticks))
    monkeypatch.setattr(idle_workers.os, "cpu_count", lambda: cores)


@pytest.mark.parametrize("cores, busy, workers", [(2, 0.03, 2), (2, 0.2, 2), (2, 0.5, 1), (2, 0.9, 1), (1, 0.0, 1),
                                                  (16, 0.1, 2), (16, 0.99, 1)])
def test_the_workers_are_the_idle_cores_up_to_two(monkeypatch, cores, busy, workers):
    readings(monkeypatch, cores, busy)
    assert idle_workers.idle_workers(sample_s=0) == workers


def test_one_worker_is_no_worker_process_and_a_bad_setting_names_itself(monkeypatch):
    readings(monkeypatch, 2, 0.5)  # one core busy
    assert idle_workers.xdist_arg("auto") == "0"
    assert idle_workers.xdist_arg("1") == "0" and idle_workers.xdist_arg("2") == "2"
    with pytest.raises(ValueError, match="PYTEST_WORKERS='0': expected 'auto' or a count >= 1"):
        idle_workers.xdist_arg("0")


def test_an_xdist_worker_marks_its_processes_as_its_own(monkeypatch):
    monkeypatch.setenv(leak_guard.SESSION_VAR, "abc")
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw1")
    assert leak_guard.start_session() == "abc-gw1" == os.environ[leak_guard.SESSION_VAR]
    assert leak_guard.start_session() == "abc-gw1"  # a pytest a test starts keeps its worker's mark
    monkeypatch.delenv("PYTEST_XDIST_WORKER")
    assert leak_guard.start_session() == "abc-gw1"
