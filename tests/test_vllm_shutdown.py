"""stop_async_llm: when vLLM's own process kill trips (psutil.NoSuchProcess on a child that exited
while it was being named), no engine process or worker outlives the stop and the sockets close.

The engine processes here are real (a multiprocessing engine with a child worker); only the
AsyncLLM shell whose `shutdown` raises is a stand-in, to reach the failure path vLLM hits by chance.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import shutil
import subprocess
import sys
import tempfile
import time
from types import SimpleNamespace

import psutil
import pytest

from rayllm_rl.inference.vllm.shutdown import engine_processes, kill_trees, process_trees, stop_async_llm


def _engine_with_a_worker(ready) -> None:
    """An engine-core stand-in: starts a worker child (as a TP engine does), reports, sleeps."""
    worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
    ready.send(worker.pid)
    time.sleep(300)


class Resources:
    """vLLM's BackgroundResources shape: an engine manager and a call that closes the sockets."""

    def __init__(self, procs):
        self.engine_manager = SimpleNamespace(processes=procs)
        self.calls = 0

    def __call__(self):
        self.calls += 1


class TrippingAsyncLLM:
    """Has the AsyncLLM attributes stop_async_llm reads; its shutdown fails as vLLM's does."""

    def __init__(self, procs, raise_exc: bool):
        self.raise_exc = raise_exc
        self.engine_core = SimpleNamespace(resources=Resources(procs))
        self.shutdowns = 0

    @property
    def closed(self) -> int:
        return self.engine_core.resources.calls

    def shutdown(self):
        self.shutdowns += 1
        if self.raise_exc:
            raise psutil.NoSuchProcess(12345, name=None, msg="process no longer exists")


def _start_engine():
    ctx = mp.get_context("spawn")
    recv, send = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_engine_with_a_worker, args=(send,), daemon=True)
    proc.start()
    assert recv.poll(60), "the engine stand-in did not start its worker within 60 s"
    return proc, recv.recv()


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


@pytest.mark.timeout(120)
def test_a_tripped_vllm_shutdown_still_kills_the_engine_and_its_worker_and_closes_the_sockets():
    proc, worker_pid = _start_engine()
    llm = TrippingAsyncLLM([proc], raise_exc=True)
    assert engine_processes(llm) == [proc]
    assert proc.is_alive() and not _gone(worker_pid)

    stop_async_llm(llm, reap_timeout_s=30)  # does not raise

    assert llm.shutdowns == 1 and llm.closed == 1
    assert not proc.is_alive() and proc.exitcode == -9  # reaped, killed by our SIGKILL
    deadline = time.monotonic() + 30
    while not _gone(worker_pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _gone(worker_pid), f"worker {worker_pid} outlived the stop"


@pytest.mark.timeout(60)
def test_a_clean_vllm_shutdown_is_not_redone_and_nothing_outlives_the_stop():
    """vLLM's shutdown returned (its own socket cleanup ran: ours does not run again), but the engine and its
    worker still run: after the bounded wait they are killed, since a stop leaves no engine process."""
    proc, worker_pid = _start_engine()
    try:
        llm = TrippingAsyncLLM([proc], raise_exc=False)
        t0 = time.monotonic()
        stop_async_llm(llm, reap_timeout_s=1.0)
        assert time.monotonic() - t0 < 10  # the waits are bounded
        assert llm.shutdowns == 1 and llm.closed == 0
        proc.join(10)
        assert proc.exitcode == -9 and _gone(worker_pid)
    finally:
        kill_trees([proc.pid])
        proc.join(30)


@pytest.mark.timeout(60)
def test_a_worker_whose_engine_core_died_is_killed_by_the_stop():
    """The engine core dies first (as when a tensor-parallel worker raised): its other worker is reparented, out
    of the tree vLLM's shutdown kills, and spins on its queue. The tree recorded at the start still names it."""
    proc, worker_pid = _start_engine()
    started = process_trees([proc])
    assert sorted(p.pid for p in started) == sorted([proc.pid, worker_pid])
    proc.kill()
    proc.join(10)
    assert not _gone(worker_pid) and worker_pid not in [p.pid for p in process_trees([proc])]
    try:
        stop_async_llm(TrippingAsyncLLM([proc], raise_exc=False), reap_timeout_s=1.0, started=started)
        deadline = time.monotonic() + 10
        while not _gone(worker_pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _gone(worker_pid), f"worker {worker_pid} outlived the stop"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(worker_pid, 9)


def test_kill_trees_tolerates_a_process_that_is_already_gone():
    done = subprocess.Popen([sys.executable, "-c", "pass"])
    done.wait(30)
    assert kill_trees([done.pid]) == []
    assert os.getpid() not in kill_trees([])


def _killed_worker_leaves_its_queue(name: str, ready) -> None:
    """A worker stand-in: makes its message queue's segment as vLLM's workers do, reports, and is killed."""
    from multiprocessing import shared_memory

    queue = shared_memory.SharedMemory(name=name, create=True, size=4096)
    ready.send(queue.name)
    time.sleep(300)


def _start_queue_holder(name: str):
    """A spawned worker stand-in that holds the segment `name`, once it has made it."""
    ctx = mp.get_context("spawn")
    recv, send = ctx.Pipe(duplex=False)
    worker = ctx.Process(target=_killed_worker_leaves_its_queue, args=(name, send), daemon=True)
    worker.start()
    assert recv.poll(60) and recv.recv() == name, "the worker stand-in did not make its segment within 60 s"
    return worker


@pytest.mark.parametrize("prefix", ["psm_", "vllm_dist_"])  # a queue's segment; a TP worker's all-reduce buffer
def test_segments_a_killed_worker_left_are_unlinked_and_live_ones_kept(tmp_path, prefix):
    """The sweep after an engine's stop: a segment made since the engine started whose maker was killed (so
    nobody maps it, and its resource tracker died with it) goes; one a live process maps, and one that existed
    before the engine started, stay."""
    from multiprocessing import shared_memory

    from rayllm_rl.inference.vllm.shutdown import shm_segments, unlink_orphaned_segments

    older = shared_memory.SharedMemory(create=True, size=4096)  # before the engine: not its to remove
    older.close()
    before = shm_segments()
    live = shared_memory.SharedMemory(create=True, size=4096)  # made since, still mapped here
    orphan_name = f"{prefix}t{os.getpid()}"
    worker = _start_queue_holder(orphan_name)
    try:
        worker.kill()
        worker.join(10)
        assert os.path.exists(f"/dev/shm/{orphan_name}")  # what vLLM's killed worker leaves
        assert unlink_orphaned_segments(before) == [orphan_name]
        assert not os.path.exists(f"/dev/shm/{orphan_name}")
        assert os.path.exists(f"/dev/shm/{live.name}") and os.path.exists(f"/dev/shm/{older.name}")
    finally:
        for seg in (live, older):
            seg.close()
            seg.unlink()


class KillingAsyncLLM:
    """vLLM's shutdown as it ends when a process outlasts its wait: SIGKILL sent (here landing 0.5 s later, as a
    busy machine may take to end a process that maps a segment), and return without waiting for the exit."""

    def __init__(self, procs):
        self.engine_core = SimpleNamespace(resources=Resources(procs))
        self.procs = procs

    def shutdown(self):
        import signal
        import threading

        for proc in self.procs:
            threading.Timer(0.5, os.kill, (proc.pid, signal.SIGKILL)).start()


@pytest.mark.timeout(120)
def test_the_sweep_after_a_stop_removes_the_segment_of_a_worker_vllm_killed_without_waiting():
    """stop_async_llm waits for the killed processes to exit, so the sweep that follows (VLLMEngine._stop) finds
    the segment unmapped. Without the wait the worker still maps it for 0.5 s and the sweep keeps it."""
    from rayllm_rl.inference.vllm.shutdown import shm_segments, unlink_orphaned_segments

    before = shm_segments()
    name = f"psm_k{os.getpid()}"
    worker = _start_queue_holder(name)
    try:
        stop_async_llm(KillingAsyncLLM([worker]), reap_timeout_s=30)
        assert unlink_orphaned_segments(before) == [name]
        assert not os.path.exists(f"/dev/shm/{name}")
    finally:
        worker.kill()
        worker.join(10)
        if os.path.exists(f"/dev/shm/{name}"):
            os.unlink(f"/dev/shm/{name}")


def test_each_engine_start_gets_its_own_socket_dir_and_no_later_process_inherits_it(monkeypatch, request):
    """vLLM's zmq sockets go to `VLLM_RPC_BASE_PATH`: an engine's start gets a new directory there, the variable
    is restored after the start (a Ray worker started later inherited a directory already removed: its engine
    failed with FileNotFoundError), a directory of ours inherited anyway is not built on, a user's base is."""
    from rayllm_rl.inference.vllm.shutdown import IPC_ENV, engine_ipc_dir, remove_ipc_dir

    monkeypatch.setenv(IPC_ENV, "/tmp/vllm-ipc-gone")  # inherited from an engine that has stopped
    with engine_ipc_dir() as path:
        assert os.environ[IPC_ENV] == path and os.path.isdir(path)
        assert os.path.dirname(path) != "/tmp/vllm-ipc-gone"
    assert os.environ[IPC_ENV] == "/tmp/vllm-ipc-gone" and os.path.isdir(path)  # kept until the engine stops
    remove_ipc_dir(path)
    assert not os.path.exists(path)

    user_base = tempfile.mkdtemp(prefix="/tmp/us-")  # short: a socket's path must fit sun_path
    request.addfinalizer(lambda: shutil.rmtree(user_base, ignore_errors=True))
    monkeypatch.setenv(IPC_ENV, str(user_base))
    with pytest.raises(RuntimeError, match="start failed"):
        with engine_ipc_dir() as path:
            assert os.path.dirname(path) == str(user_base)
            raise RuntimeError("start failed")
    assert not os.path.exists(path) and os.environ[IPC_ENV] == str(user_base)  # a failed start removes it

    monkeypatch.delenv(IPC_ENV)
    with engine_ipc_dir() as path:
        pass
    assert IPC_ENV not in os.environ
    remove_ipc_dir(path)
