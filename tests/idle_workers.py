"""How many pytest-xdist workers `make test` starts: the machine's idle cores when the suite starts, at most
`MAX_WORKERS`, printed as pytest's `-n` value (0 for one: the suite in pytest's own process).

Two workers on an idle 2-core machine take ~17 minutes where one took ~25 (docs/testing.md, "Time"). With a core
already busy (another job, a benchmark), two workers would share one core with it, so one runs: the suite as it
ran before, which is green with one core busy. `python tests/idle_workers.py N` prints N as given (`auto` measures).
"""
from __future__ import annotations

import os
import sys
import time

MAX_WORKERS = 2
"""Each worker runs Ray sessions of several actors and vLLM engines: two fit 24 GiB with room to spare."""
SAMPLE_S = 1.0
HEADROOM = 0.5
"""Idle cores are rounded to the nearest count, half down: 2 cores 20% busy give 2 workers, one core busy gives 1."""


def cpu_times() -> tuple[int, int]:
    """(busy, total) clock ticks of all CPUs since boot, from /proc/stat."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    return sum(fields) - idle, sum(fields)


def idle_workers(sample_s: float = SAMPLE_S) -> int:
    """Idle cores over `sample_s` seconds, at most `MAX_WORKERS`, at least 1 (1 where /proc/stat is missing)."""
    cores = os.cpu_count() or 1
    try:
        busy0, total0 = cpu_times()
        time.sleep(sample_s)
        busy1, total1 = cpu_times()
    except OSError:
        return 1
    busy = (busy1 - busy0) / max(total1 - total0, 1)
    return max(1, min(MAX_WORKERS, int(cores * (1 - busy) + HEADROOM)))


def xdist_arg(setting: str) -> str:
    """pytest's `-n` for `setting` ("auto" or a count): "0" for one worker (no worker processes at all)."""
    workers = idle_workers() if setting == "auto" else int(setting)
    if workers < 1:
        raise ValueError(f"PYTEST_WORKERS={setting!r}: expected 'auto' or a count >= 1")
    return "0" if workers == 1 else str(workers)


if __name__ == "__main__":
    print(xdist_arg(sys.argv[1] if len(sys.argv) > 1 else "auto"))
