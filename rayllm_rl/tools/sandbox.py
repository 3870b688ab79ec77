"""PythonSandbox: run untrusted, model-written Python in an isolated, resource-limited child process.

Model-written code is untrusted input (it may loop, fork-bomb, allocate, fill the disk, read or write files, open
sockets, or signal other processes). Each ``run`` gets its own process tree and a fresh temporary workdir (deleted
afterwards): the code is written there as ``main.py`` (``files`` next to it) and run with ``python -I`` (isolated
mode: stdlib and the interpreter's site-packages, no user site, PYTHON* variables ignored, no cwd on sys.path).

Protections (``SandboxResult.isolation`` records which were active for the run):

* always: rlimits (CPU seconds, address space, processes, file size, no core dumps, 256 fds), a clean environment
  (PATH, HOME=workdir, LANG, PYTHONHASHSEED only), a wall-clock timeout that SIGKILLs the whole run, and
  stdout/stderr capped at ``max_output_bytes`` each (drained beyond the cap so the child never blocks).
* host is root and namespaces are permitted (the usual container case): new network namespace (loopback down),
  PID namespace (everything dies with the run, and with the host: a SIGKILLed host takes the launcher and the
  namespace's init down through PDEATHSIG, and the kernel then kills and reaps every process of the run; a private
  /proc shows only the run), mount namespace with private size-capped tmpfs over /tmp, /var/tmp, /dev/shm, the
  workdir a copy of the staged inputs at /tmp/work inside that tmpfs (writes never reach the host disk) and every
  other mount read-only (/ and any volume), plus a per-run unique unprivileged uid/gid (runs cannot read each
  other's or root's private files or signal host processes, and RLIMIT_NPROC, which counts per uid, contains fork
  bombs). Code never runs as root: if the private uid cannot be used (e.g. the interpreter is not reachable for it
  and no mount namespace can expose it) the run fails with exit code 126 and the reason.
* fallbacks: without a network namespace and with ``network=False`` a Python audit hook refuses non-AF_UNIX
  sockets and DNS (weaker: ctypes, subprocess or C extensions bypass it); without a PID namespace leftovers are
  killed by process group and, with a private uid, by uid (``kill(-1)`` as that uid), and reaped by the launcher
  (a child subreaper); without a mount namespace the workdir is the host one (0700, owned by the private uid).
  A degraded setup logs one warning per distinct combination.

The isolation itself is done by ``_sandbox_launcher.py``, executed as a fresh single-threaded process (no
``preexec_fn``: the host may be a multithreaded Ray actor). ``PythonSandbox`` holds only its configuration, so one
instance is thread-safe and may run many sandboxes concurrently; ``arun`` runs the blocking part in a thread.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import secrets
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import PurePosixPath

__all__ = ["PythonSandbox", "SandboxResult", "kill_uid", "pids_of_uid", "remove_tree", "reserved_uids"]

log = logging.getLogger(__name__)

_LAUNCHER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_sandbox_launcher.py")
_MAIN = "main.py"
_PATH = "/usr/local/bin:/usr/bin:/bin"
_GRACE_S = 0.5  # after the launcher exits: how long to wait for stdout/stderr EOF from leftovers
_NOFILE = 256
_UID_RANGES = ((200_000, 2_000_000_000), (20_000, 65_000))  # preferred private uid ranges (2nd: small uid_map)
_PROBE = ("import json, os, sys; print(json.dumps([sys.prefix, sys.base_prefix, sys.exec_prefix, "
          "sys.base_exec_prefix, os.path.dirname(os.path.realpath(sys.executable)), *sys.path]))")

_lock = threading.Lock()  # guards the process-wide caches below (no per-run state lives on the instance)
_probe_cache: dict[str, list[str]] = {}
_uids_in_use: set[int] = set()
_warned: set[tuple[str, ...]] = set()


@dataclass
class SandboxResult:
    """Outcome of one sandboxed run.

    ``exit_code``: the user process's exit status, negative for "killed by signal N" (e.g. -24 SIGXCPU, -9
    SIGKILL), 126 if the sandbox refused to start it (e.g. the private uid cannot run the interpreter), 125 if its
    setup failed, None when the wall-clock timeout killed it (``timed_out``); reasons for 125/126 are on stderr.
    ``isolation``: which protections were active (see module docstring). ``uid``: private uid used, or None.
    """

    stdout: str
    stderr: str
    exit_code: int | None
    timed_out: bool
    stdout_truncated: bool
    stderr_truncated: bool
    duration_s: float
    isolation: dict[str, bool] = field(default_factory=dict)
    uid: int | None = None

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out


def _interpreter_paths(python: str) -> list[str]:
    """Directories the interpreter needs (prefixes, sys.path under -I); the launcher exposes hidden ones."""
    with _lock:
        hit = _probe_cache.get(python)
    if hit is not None:
        return hit
    paths = [os.path.dirname(os.path.realpath(python))]
    try:
        out = subprocess.run([python, "-I", "-c", _PROBE], capture_output=True, text=True, timeout=60,
                             env={"PATH": _PATH}, check=True).stdout
        paths += json.loads(out)
    except (OSError, subprocess.SubprocessError, ValueError) as e:
        log.warning("PythonSandbox: could not probe interpreter %s: %s", python, e)
    paths = sorted({os.path.realpath(p) for p in paths if p and os.path.isdir(p)})
    with _lock:
        _probe_cache[python] = paths
    return paths


def pids_of_uid(uid: int) -> list[int]:
    """Live host pids whose real, effective, saved or fs uid is ``uid`` (scan of /proc; zombies are dead)."""
    pids = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/status") as f:
                    fields = dict(ln.split(":", 1) for ln in f if ln.startswith(("State:", "Uid:")))
            except (OSError, ValueError):
                continue
            if str(uid) in fields.get("Uid", "").split() and not fields.get("State", "").strip().startswith("Z"):
                pids.append(int(name))
    return pids


def reserved_uids() -> frozenset[int]:
    """The private uids this process's runs hold now: each run reserves one and releases it when it ends."""
    with _lock:
        return frozenset(_uids_in_use)


def _id_ranges(path: str) -> list[tuple[int, int]]:
    with open(path) as f:
        return [(int(a), int(a) + int(n)) for a, _, n in (ln.split() for ln in f if ln.strip())]


def _acquire_uid() -> int | None:
    """A random uid/gid mapped in this user namespace, unused by any process and by concurrent runs here."""
    try:
        mapped = [(max(a, c), min(b, d)) for a, b in _id_ranges("/proc/self/uid_map")
                  for c, d in _id_ranges("/proc/self/gid_map")]
    except OSError:
        mapped = [(0, 65_536)]
    for lo, hi in _UID_RANGES:
        spans = [(max(a, lo), min(b, hi)) for a, b in mapped if min(b, hi) > max(a, lo)]
        for _ in range(20 if spans else 0):
            a, b = spans[secrets.randbelow(len(spans))]
            uid = a + secrets.randbelow(b - a)
            with _lock:  # reserve first, then scan /proc outside the lock (concurrent runs do not queue on it)
                if uid in _uids_in_use:
                    continue
                _uids_in_use.add(uid)
            if not pids_of_uid(uid):
                return uid
            with _lock:
                _uids_in_use.discard(uid)
    return None


def kill_uid(uid: int) -> None:
    """Kill every process of ``uid`` (a run's ``SandboxResult.uid``; belt and braces after a run, where normally
    the PID namespace already did)."""
    if not pids_of_uid(uid):
        return
    subprocess.run([sys.executable, "-I", "-S", _LAUNCHER, "--kill-uid", str(uid)], timeout=30,
                   env={"PATH": _PATH}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    if pids_of_uid(uid):
        log.error("PythonSandbox: processes of sandbox uid %d survived cleanup", uid)


def _prepare_workdir(code: str, files: dict[str, str | bytes] | None, uid: int | None) -> str:
    workdir = tempfile.mkdtemp(prefix="rayllm-sandbox-")
    try:
        for rel, data in (files or {}).items():
            p = PurePosixPath(rel)
            if not rel or p.is_absolute() or ".." in p.parts or str(p) == _MAIN:
                raise ValueError(f"invalid sandbox file name {rel!r} (relative, no '..', not {_MAIN!r})")
            path = os.path.join(workdir, *p.parts)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "wb") as f:
                f.write(data.encode() if isinstance(data, str) else data)
        with open(os.path.join(workdir, _MAIN), "w", encoding="utf-8") as f:
            f.write(code)
        if uid is not None:
            for root, dirs, names in os.walk(workdir):
                for n in [root] + [os.path.join(root, x) for x in dirs + names]:
                    os.chown(n, uid, uid, follow_symlinks=False)
        os.chmod(workdir, 0o700)
    except BaseException:
        remove_tree(workdir)
        raise
    return workdir


def _tree_size(path: str) -> int:
    return sum(os.path.getsize(os.path.join(r, n)) for r, _, names in os.walk(path) for n in names)


def remove_tree(path: str) -> None:
    """Delete the tree at ``path`` (a run's workdir), also where the code chmod'ed its own directories to 000
    (without root: each is made 0700 again and emptied from inside); what still cannot go is left, silently."""
    def retry(func, p, _exc):  # unprivileged fallback: the code may have chmod'ed its own dirs to 000
        try:
            os.chmod(os.path.dirname(p), 0o700)
            os.chmod(p, 0o700)
            if os.path.isdir(p) and not os.path.islink(p):
                remove_tree(p)  # rmtree failed to open it (func is os.open, which needs flags): start over inside
            else:
                func(p)
        except OSError:
            pass
    shutil.rmtree(path, onerror=retry)


def _has_exited(pid: int) -> bool | None:
    """True once ``pid`` is a zombie; does not reap it, so its pid/pgid cannot be reused while we kill.
    None if unknown (the host ignores SIGCHLD, so children are reaped automatically)."""
    try:
        return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:
        return None


def _warn_degraded(isolation: dict[str, bool], notes: list[str], root: bool) -> None:
    """Log once per distinct degradation: which protections are missing and why (launcher notes)."""
    wanted = ("net_namespace", "pid_namespace", "mount_namespace", "private_uid", "private_tmp", "private_proc")
    missing = tuple(k for k in wanted if not isolation.get(k)) if root else ("all but rlimits (not root)",)
    with _lock:
        if not missing or missing in _warned:
            return
        _warned.add(missing)
    log.warning("PythonSandbox: degraded isolation, missing: %s; active: %s. %s", ", ".join(missing),
                ", ".join(k for k, v in isolation.items() if v) or "none", "; ".join(notes))


class PythonSandbox:
    """Runs untrusted Python code in a fresh, isolated, resource-limited process per call (see module doc)."""

    def __init__(self, cpu_seconds: int = 10, memory_mb: int = 1024, max_processes: int = 64,
                 max_file_mb: int = 16, max_output_bytes: int = 64 * 1024, network: bool = False,
                 python: str | None = None, *, _force_fallback: bool = False) -> None:
        """``_force_fallback`` (tests only): skip namespaces and the private uid even when root."""
        self.cpu_seconds, self.memory_mb, self.max_processes = int(cpu_seconds), int(memory_mb), int(max_processes)
        self.max_file_mb, self.max_output_bytes, self.network = int(max_file_mb), int(max_output_bytes), network
        python = python or sys.executable
        self.python = python if os.path.isabs(python) else (shutil.which(python) or python)
        self._force_fallback = _force_fallback

    def run(self, code: str, timeout: float = 10.0, stdin: str = "",
            files: dict[str, str | bytes] | None = None) -> SandboxResult:
        """Run ``code`` to completion or until ``timeout`` wall-clock seconds; never raises for user-code failures."""
        root = os.geteuid() == 0 and not self._force_fallback
        uid = _acquire_uid() if root else None
        if root and uid is None:
            log.warning("PythonSandbox: no free private uid; code will not run")
            return SandboxResult("", "sandbox: no free private uid\n", 126, False, False, False, 0.0, {}, None)
        expose = _interpreter_paths(self.python)
        start, workdir = time.monotonic(), None
        try:
            workdir = _prepare_workdir(code, files, uid)
            status_r, status_w = os.pipe()
            cfg = {"workdir": workdir, "main": _MAIN, "python": self.python, "expose": expose, "uid": uid,
                   "isolate": root, "network": self.network, "ppid": os.getpid(), "status_fd": status_w,
                   "tmpfs_mb": max(64, 4 * self.max_file_mb) + (_tree_size(workdir) >> 20),
                   "env": {"PATH": _PATH, "LANG": "C.UTF-8", "PYTHONHASHSEED": "0"},
                   "limits": {"cpu": self.cpu_seconds, "as": self.memory_mb << 20, "nproc": self.max_processes,
                              "fsize": self.max_file_mb << 20, "nofile": _NOFILE}}
            try:
                proc = subprocess.Popen([sys.executable, "-I", "-S", _LAUNCHER, json.dumps(cfg)],
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                        pass_fds=(status_w,), start_new_session=True, env={"PATH": _PATH}, cwd="/")
            except BaseException:
                os.close(status_r)
                raise
            finally:
                os.close(status_w)
            out, err, msg, timed_out = self._pump(proc, stdin.encode(), status_r, timeout, uid)
        finally:
            if uid is not None and workdir is not None:
                kill_uid(uid)  # no-op unless something of this uid survived
            if workdir is not None:
                remove_tree(workdir)
            if uid is not None:
                with _lock:
                    _uids_in_use.discard(uid)
        isolation = msg.get("isolation", {})
        _warn_degraded(isolation, msg.get("notes", []), root)
        # no exit code reported: the sandbox failed before the user code ran (125, reason in stderr)
        exit_code = None if timed_out else msg.get("exit_code", 125)
        return SandboxResult(out[0].decode(errors="replace"), err[0].decode(errors="replace"), exit_code,
                             timed_out, out[1], err[1], time.monotonic() - start, isolation, uid)

    async def arun(self, code: str, timeout: float = 10.0, stdin: str = "",
                   files: dict[str, str | bytes] | None = None) -> SandboxResult:
        """``run`` without blocking the event loop (executes in the default thread pool)."""
        return await asyncio.to_thread(self.run, code, timeout, stdin, files)

    def _pump(self, proc: subprocess.Popen, stdin: bytes, status_r: int, timeout: float, uid: int | None):
        """Feed stdin and drain stdout/stderr/status concurrently (one selector loop) until done or timeout."""
        cap, sel = self.max_output_bytes, selectors.DefaultSelector()
        out_fd, err_fd, in_fd = proc.stdout.fileno(), proc.stderr.fileno(), proc.stdin.fileno()
        bufs = {out_fd: [bytearray(), False], err_fd: [bytearray(), False]}
        msg: dict = {}
        status = bytearray()
        for fd in (*bufs, status_r):
            os.set_blocking(fd, False)
            sel.register(fd, selectors.EVENT_READ)
        if stdin:
            os.set_blocking(in_fd, False)
            sel.register(in_fd, selectors.EVENT_WRITE)
        else:
            proc.stdin.close()
        sent = 0

        def step(wait: float) -> None:
            nonlocal sent, status
            for key, _ in sel.select(wait):
                fd = key.fd
                if fd == in_fd:
                    try:
                        sent += os.write(fd, stdin[sent:sent + 65536])
                    except BlockingIOError:
                        pass
                    except BrokenPipeError:  # the code exited or closed stdin: drop the rest
                        sent = len(stdin)
                    if sent >= len(stdin):
                        sel.unregister(fd)
                        proc.stdin.close()
                    continue
                try:
                    data = os.read(fd, 65536)
                except BlockingIOError:
                    continue
                if not data:
                    sel.unregister(fd)
                elif fd == status_r:
                    status += data
                    *lines, status = status.split(b"\n")
                    for line in lines:
                        with contextlib.suppress(ValueError):
                            msg.update(json.loads(line))
                        if b'"exit_code"' in line and uid is not None and "init_pid" not in msg:
                            kill_uid(uid)  # no PID namespace: kill leftovers now so init can reap them
                else:
                    buf = bufs[fd]
                    room = cap - len(buf[0])
                    buf[0] += data[:max(room, 0)]
                    buf[1] = buf[1] or len(data) > room

        deadline = time.monotonic() + timeout
        timed_out, exited_at, escalate_at = False, None, None
        try:
            while True:
                now = time.monotonic()
                exited = _has_exited(proc.pid)
                if exited is None:  # SIGCHLD ignored: launcher and init are gone once the status pipe is closed
                    exited = status_r not in sel.get_map()
                if exited_at is None and exited:
                    exited_at = now
                    self._kill(proc.pid, {}, uid)  # leftovers (a no-op inside a PID namespace)
                if exited_at is not None and (not sel.get_map() or now >= exited_at + _GRACE_S):
                    break
                if exited_at is None and escalate_at is None and now >= deadline:
                    step(0)  # an exit code already on its way means the code finished in time
                    timed_out = "exit_code" not in msg
                    if timed_out:
                        self._kill(proc.pid, msg, uid)
                    escalate_at = now + 1.0
                elif exited_at is None and escalate_at is not None and now >= escalate_at:
                    self._kill(proc.pid, {}, uid)  # the launcher itself did not finish: kill its group
                    escalate_at = float("inf")
                if now >= deadline + 10:  # unkillable (should not happen): stop reading, never hang the host
                    break
                step(0.05)
        finally:
            sel.close()
            os.close(status_r)
            for f in (proc.stdin, proc.stdout, proc.stderr):
                f.close()
            if _has_exited(proc.pid) is False:
                self._kill(proc.pid, {}, uid)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=10)
        return bufs[out_fd], bufs[err_fd], msg, timed_out

    @staticmethod
    def _kill(launcher_pgid: int, msg: dict, uid: int | None) -> None:
        """SIGKILL the run: its init (the kernel then kills the PID namespace), else the user's process group and
        uid, else (nothing reported yet, or escalation) the launcher's own process group."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            if "init_pid" in msg:
                os.kill(msg["init_pid"], signal.SIGKILL)
            elif "user_pgid" in msg:
                os.killpg(msg["user_pgid"], signal.SIGKILL)
            else:
                os.killpg(launcher_pgid, signal.SIGKILL)
        if uid is not None:
            kill_uid(uid)
