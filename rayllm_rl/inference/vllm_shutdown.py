"""Stopping a vLLM AsyncLLM so that no engine process outlives it, even when vLLM's own stop trips.

vLLM 0.32's `kill_process_tree` (vllm/utils/system_utils.py) logs `child.name()` before it kills
each child and suppresses only `ProcessLookupError`. A tensor-parallel worker that exits between
the listing and the naming raises `psutil.NoSuchProcess` out of `AsyncLLM.shutdown`: the rest of
the tree is not killed and the client's sockets are not closed, and a second `shutdown` is a no-op
(its finalizer is already detached). `stop_async_llm` finishes both jobs itself.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
from typing import Any

log = logging.getLogger(__name__)

REAP_TIMEOUT_S = 10.0
"""How long to wait for each killed engine process to be reaped."""


def engine_processes(llm: Any) -> list[Any]:
    """The engine-core processes (multiprocessing `BaseProcess`) an AsyncLLM started; [] if none."""
    resources = getattr(getattr(llm, "engine_core", None), "resources", None)
    manager = getattr(resources, "engine_manager", None)
    return list(getattr(manager, "processes", None) or [])


def kill_trees(pids: list[int]) -> list[int]:
    """SIGKILL every process in the trees under `pids`, children first, tolerating any that exit
    meanwhile. Returns the pids it signalled."""
    import psutil

    signalled = []
    for pid in pids:
        try:
            children = psutil.Process(pid).children(recursive=True)
        except psutil.NoSuchProcess:
            children = []
        for target in [c.pid for c in children] + [pid]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(target, signal.SIGKILL)
                signalled.append(target)
    return signalled


def stop_async_llm(llm: Any, reap_timeout_s: float = REAP_TIMEOUT_S) -> None:
    """`llm.shutdown()`; if vLLM's process kill trips on a child that already exited, kill the
    engine processes' trees here, reap them, and run the client's socket cleanup that was skipped."""
    import psutil

    procs = engine_processes(llm)
    try:
        llm.shutdown()
    except psutil.NoSuchProcess as exc:
        pids = [p.pid for p in procs if p.pid is not None and p.is_alive()]
        log.warning("vLLM's shutdown raised %r (a child exited while it was being killed); "
                    "killing the engine processes %s and closing the client's sockets", exc, pids)
        kill_trees(pids)
        for proc in procs:
            with contextlib.suppress(Exception):
                proc.join(reap_timeout_s)
        resources = getattr(getattr(llm, "engine_core", None), "resources", None)
        if callable(resources):
            resources()  # its engine manager is detached already: this closes the sockets and tasks
