"""Stopping a vLLM AsyncLLM so that no engine process, and no shared-memory queue, outlives it, even when
vLLM's own stop trips.

vLLM 0.32's `kill_process_tree` (vllm/utils/system_utils.py) logs `child.name()` before it kills
each child and suppresses only `ProcessLookupError`. A tensor-parallel worker that exits between
the listing and the naming raises `psutil.NoSuchProcess` out of `AsyncLLM.shutdown`: the rest of
the tree is not killed and the client's sockets are not closed, and a second `shutdown` is a no-op
(its finalizer is already detached). `stop_async_llm` finishes both jobs itself.

A worker vLLM had to kill (on a busy machine its exit can outlast vLLM's wait) leaves its message queue's
segment (`/dev/shm/psm_*`; a tensor-parallel one its all-reduce buffer too, `vllm_dist_*`) to Python's resource
tracker (or to nobody), which unlinks it only when the process that started
the tracker exits: a replica actor killed by Ray takes its tracker with it, a long-lived process keeps the
segment until it ends. `unlink_orphaned_segments` removes the ones that appeared since the engine started and
that no live process maps any more; `stop_async_llm` returns only once the killed processes have exited (vLLM
sends SIGKILL and returns at once), so that a dying worker's mapping does not keep its segment from the sweep.

vLLM names its zmq sockets `ipc://<VLLM_RPC_BASE_PATH>/<uuid>` (default: the temp dir) and never removes
them: three per engine. `engine_ipc_dir` gives each engine's start a directory of its own for them, which
`remove_ipc_dir` deletes when the engine stops.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import tempfile
import time
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


def process_trees(procs: list[Any]) -> list[Any]:
    """psutil handles of `procs` (multiprocessing processes) and all their descendants, as they are now."""
    import psutil

    tree = []
    for proc in procs:
        with contextlib.suppress(psutil.Error, ValueError):
            top = psutil.Process(proc.pid)
            tree += [top] + top.children(recursive=True)
    return tree


def wait_gone(tree: list[Any], timeout_s: float) -> list[Any]:
    """Wait until every process of `tree` has exited (a zombie counts: it maps no memory any more), at most
    `timeout_s`. Returns those still running then. vLLM's shutdown SIGKILLs what outlasts its wait and returns
    at once; a segment the dying process still maps would be taken for a live one by the sweep that follows."""
    import psutil

    def running(p) -> bool:
        try:
            return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
        except psutil.Error:
            return False

    deadline = time.monotonic() + timeout_s
    left = [p for p in tree if running(p)]
    while left and time.monotonic() < deadline:
        time.sleep(0.05)
        left = [p for p in left if running(p)]
    return left


def stop_async_llm(llm: Any, reap_timeout_s: float = REAP_TIMEOUT_S, started: list[Any] = ()) -> None:
    """`llm.shutdown()`; if vLLM's process kill trips on a child that already exited, kill the
    engine processes' trees here, reap them, and run the client's socket cleanup that was skipped.
    Returns once the engine's processes have exited. `started`: the tree as it was when the engine started
    (`process_trees`); a worker whose engine core died is no longer in it now (it was reparented) and vLLM's
    shutdown does not reach it: one still running `reap_timeout_s` after the shutdown is killed here."""
    import psutil

    procs = engine_processes(llm)
    tree = list({p.pid: p for p in [*started, *process_trees(procs)]}.values())  # vLLM kills without waiting
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
    left = wait_gone(tree, reap_timeout_s)
    if left:
        log.warning("vLLM's engine processes %s still ran %.0f s after its shutdown (a worker whose engine core "
                    "died is out of vLLM's reach); killing them", [p.pid for p in left], reap_timeout_s)
        for p in left:
            with contextlib.suppress(psutil.Error):
                p.kill()  # psutil checks that the pid is still this process
        left = wait_gone(left, reap_timeout_s)
        if left:
            log.error("vLLM's engine processes %s outlived SIGKILL by %.0f s", [p.pid for p in left], reap_timeout_s)


SEGMENT_PREFIXES = ("psm_", "vllm_dist_")
"""Segments a stopped engine's killed processes can leave: Python's `shared_memory` names (vLLM's message queues
between the engine core and its workers), and vLLM-CPU's tensor-parallel all-reduce buffers
(`<VLLM_DIST_IDENT>-<group>-[ranks]-cpushm_<rank>`, VLLM_DIST_IDENT being `vllm_dist_<hex>`:
vllm/distributed/device_communicators/cpu_communicator.py), 4 MB a rank, which a TP worker killed before its
communicator's destructor leaves in /dev/shm (found after a `make test` run, 2026-12-07)."""


def shm_segments(directory: str = "/dev/shm") -> set[str]:
    """Names of the shared-memory segments a vLLM engine's queues may use, now."""
    try:
        return {n for n in os.listdir(directory) if n.startswith(SEGMENT_PREFIXES)}
    except FileNotFoundError:
        return set()


def mapped_segments(names: set[str], directory: str = "/dev/shm") -> set[str]:
    """Those of `names` that some live process maps or holds open (its /proc maps and fds)."""
    paths = {os.path.join(directory, n): n for n in names}
    held: set[str] = set()
    for entry in os.listdir("/proc") if names else ():
        if not entry.isdigit():
            continue
        with contextlib.suppress(OSError):
            with open(f"/proc/{entry}/maps") as f:
                text = f.read()
            held.update(name for path, name in paths.items() if path in text)
            for fd in os.listdir(f"/proc/{entry}/fd"):
                with contextlib.suppress(OSError):
                    target = os.readlink(f"/proc/{entry}/fd/{fd}")
                    if target in paths:
                        held.add(paths[target])
    return held


def unlink_orphaned_segments(before: set[str], directory: str = "/dev/shm") -> list[str]:
    """Unlink the segments made since `before` (taken when the engine started) that no live process maps:
    what the engine's killed processes left. Returns their names."""
    new = shm_segments(directory) - before
    orphans = sorted(new - mapped_segments(new, directory))
    for name in orphans:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(directory, name))
    if orphans:
        log.info("unlinked %d shared-memory segment(s) vLLM's stopped processes left: %s", len(orphans), orphans)
    return orphans


IPC_ENV = "VLLM_RPC_BASE_PATH"
IPC_PREFIX = "vllm-ipc-"
IPC_PATH_MAX = 107
"""The longest unix socket path (`sizeof(sockaddr_un.sun_path) - 1`): zmq refuses longer ones."""


@contextlib.contextmanager
def engine_ipc_dir():
    """Yield a new directory for the zmq sockets of the engine started inside the block: it is vLLM's
    `VLLM_RPC_BASE_PATH` there (the engine core spawned meanwhile inherits it) and the variable is restored after,
    so no later process inherits a directory that goes when the engine stops. The caller removes the directory
    with `remove_ipc_dir` when the engine stops; a block that raises removes it here. A base the user set is
    kept: the directory is made inside it."""
    before = os.environ.get(IPC_ENV)
    base = before if before and os.path.isdir(before) and not os.path.basename(before).startswith(IPC_PREFIX) \
        else tempfile.gettempdir()
    if len(base) + len(f"/{IPC_PREFIX}12345678/") + 36 > IPC_PATH_MAX:  # a uuid's socket would not fit sun_path
        base = "/tmp"
    path = tempfile.mkdtemp(prefix=IPC_PREFIX, dir=base)
    os.environ[IPC_ENV] = path
    try:
        yield path
    except BaseException:
        remove_ipc_dir(path)
        raise
    finally:
        if before is None:
            os.environ.pop(IPC_ENV, None)
        else:
            os.environ[IPC_ENV] = before


def remove_ipc_dir(path: str | None) -> None:
    """Delete an engine's socket directory (once its processes are stopped); None: nothing to do."""
    if path:
        shutil.rmtree(path, ignore_errors=True)
