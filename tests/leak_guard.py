"""What a test leaves behind, and cleaning it up: one failure stays one failure.

`conftest.py` takes a `Snapshot` before each test (and each module) and checks after it that the test left
nothing behind: Ray initialised while no fixture holds it, named actors, processes this pytest session started
(every descendant carries `SESSION_VAR`, even one orphaned to init), shared-memory segments. A leak is
cleaned up (actors killed, processes killed, segments unlinked, Ray shut down) and reported by name, so the
next test starts clean instead of failing for the same cause.
"""
from __future__ import annotations

import dataclasses
import os
import signal
import time
import uuid

import psutil

SESSION_VAR = "RAYLLM_TEST_SESSION"
"""Set in the pytest process at start: every process it starts (and theirs) inherits it."""

SHM_DIR = "/dev/shm"
SHM_PREFIXES = ("rayllm_", "psm_", "torch_")
"""Segments the product (its shm transport), Python's `shared_memory` (vLLM's message queues) and torch create.
A new one that a process of another session maps or holds open is that session's (`held_elsewhere`)."""

RAY_DAEMONS = ("raylet", "gcs_server", "dashboard", "log_monitor", "monitor.py", "ray::", "runtime_env",
               "plasma_store")
"""Processes of a Ray session: a held session's own processes and workers come and go with it."""

PROCESS_SINGLETONS = ("multiprocessing.resource_tracker", "multiprocessing.forkserver", "wandb-core")
"""Helpers started once for this process and kept for its life (shared memory's tracker, torch's forkserver,
W&B's service, which `wandb.finish` leaves for the next run of the process): the first test that needs one
starts it, none leaks it."""

KINDS = ("named actors", "processes", "shm segments")
"""What a test may leave besides a Ray nobody holds; a `fixture_owned` marker names those a fixture owns."""

EXIT_GRACE_S = float(os.environ.get("RAYLLM_LEAK_GRACE_S", "15"))
"""How long a process or an actor name may take to go once its owner stopped it (a killed Ray worker, a vLLM
engine core that shuts down) before it counts as left behind. A test that leaks on purpose waits all of it
(test_leak_guard's suite in a pytest of its own sets 3 s: what it leaks never goes by itself)."""


def start_session() -> str:
    """Mark this pytest process, so the guard can tell its processes from anybody else's. An xdist worker
    (`make test` runs two) gets a mark of its own: the other worker's processes and segments are another
    session's, as a second pytest's on the machine would be (a pytest a test starts keeps its worker's mark)."""
    mark = os.environ.setdefault(SESSION_VAR, uuid.uuid4().hex)
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if worker and not mark.endswith(f"-{worker}"):
        mark = os.environ[SESSION_VAR] = f"{mark}-{worker}"
    return mark


def _ray_initialized() -> bool:
    import sys

    ray = sys.modules.get("ray")
    return bool(ray is not None and ray.is_initialized())


def named_actors() -> set[tuple[str, str]]:
    """(namespace, name) of every live named actor of the Ray this process is connected to."""
    if not _ray_initialized():
        return set()
    import ray

    try:
        return {(a["namespace"], a["name"]) for a in ray.util.list_named_actors(all_namespaces=True)}
    except Exception:  # noqa: BLE001 - a Ray that is going away has no actors left to find
        return set()


def _is_ray_daemon(proc: psutil.Process) -> bool:
    try:
        cmd = " ".join(proc.cmdline()) or proc.name()
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return False
    return any(d in cmd for d in RAY_DAEMONS)


def _proc_table() -> dict[int, tuple[int, int, str]]:
    """{pid: (ppid, start time in clock ticks, state)} of every process, from one pass over /proc (a few ms)."""
    table = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
        except OSError:
            continue
        table[int(entry)] = (int(fields[1]), int(fields[19]), fields[0].decode())
    return table


def session_processes(since: int) -> dict[int, int]:
    """{pid: start ticks} of live processes of this session: descendants of this process, and orphans
    (re-parented to init) started at or after `since` (clock ticks) that carry this session's mark."""
    table, me = _proc_table(), os.getpid()
    children: dict[int, list[int]] = {}
    for pid, (ppid, _, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    found, todo = {}, list(children.get(me, []))
    while todo:
        pid = todo.pop()
        found[pid] = table[pid][1]
        todo.extend(children.get(pid, []))
    mark = os.environ.get(SESSION_VAR)
    for pid in children.get(1, []):
        if table[pid][1] >= since and pid not in found:
            try:
                if psutil.Process(pid).environ().get(SESSION_VAR) == mark:
                    found[pid] = table[pid][1]
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                pass
    return {pid: start for pid, start in found.items() if table[pid][2] != "Z"}


def own_start_ticks() -> int:
    """This process's start, in the clock ticks /proc counts (orphans started since are this session's)."""
    return _proc_table()[os.getpid()][1]


def shm_segments() -> set[str]:
    try:
        return {n for n in os.listdir(SHM_DIR) if n.startswith(SHM_PREFIXES)}
    except FileNotFoundError:
        return set()


def held_elsewhere(names: set[str], since: int) -> set[str]:
    """Those of `names` that a live process outside this session maps or holds open: another suite's (a second
    pytest on the machine) segments, which are not this session's to report or unlink."""
    if not names:
        return set()
    ours = set(session_processes(since)) | {os.getpid()}
    paths = {os.path.join(SHM_DIR, n): n for n in names}
    held = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) in ours:
            continue
        try:
            with open(f"/proc/{entry}/maps") as f:
                held.update(name for path, name in paths.items() if path in f.read())
            for fd in os.listdir(f"/proc/{entry}/fd"):
                target = os.readlink(f"/proc/{entry}/fd/{fd}")
                if target in paths:
                    held.add(paths[target])
        except OSError:
            continue
    return held


@dataclasses.dataclass
class Snapshot:
    """What existed before a test (or a module): what it finds later is what the test made."""

    since: int
    processes: dict[int, int]
    actors: set[tuple[str, str]]
    segments: set[str]

    @classmethod
    def take(cls, since: int) -> "Snapshot":
        return cls(since, session_processes(since), named_actors(), shm_segments())

    def new_segments(self) -> set[str]:
        """Segments made since, that no process of another session holds."""
        new = shm_segments() - self.segments
        return new - held_elsewhere(new, self.since)

    def new_processes(self, ray_held: bool) -> dict[int, str]:
        """Processes started since, as {pid: command}; with a held Ray, its daemons' workers are its own."""
        found, ray_roots = {}, set()
        now = session_processes(self.since)
        if ray_held:  # the subtree of a held session's daemons (raylet: its workers) comes and goes with it
            ray_roots = {pid for pid in now if _is_ray_daemon_pid(pid)}
        for pid, created in now.items():
            if self.processes.get(pid) == created or _under(pid, ray_roots):
                continue
            try:
                cmd = " ".join(psutil.Process(pid).cmdline())
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                continue
            if not any(s in cmd for s in PROCESS_SINGLETONS):
                found[pid] = cmd[:200]
        return found

    def leaks(self, ray_held: bool, grace_s: float = EXIT_GRACE_S, skip: tuple[str, ...] = ()) -> dict[str, list[str]]:
        """What is left, after waiting up to `grace_s` for what is going away: {kind: descriptions}; the kinds in
        `skip` ("processes", "shm segments", "named actors") are a longer-lived fixture's and not looked at."""
        if unknown := set(skip) - set(KINDS):
            raise ValueError(f"unknown kinds {sorted(unknown)}; kinds: {KINDS}")
        deadline = time.monotonic() + grace_s
        while True:
            new = {} if "processes" in skip else self.new_processes(ray_held)
            out = {"ray": ["Ray is still initialised but no fixture holds it"] if _ray_initialized() and not ray_held
                   else [],
                   "named actors": [] if "named actors" in skip else
                   sorted(f"{ns}/{name}" for ns, name in named_actors() - self.actors),
                   "processes": [f"{pid}: {cmd}" for pid, cmd in sorted(new.items())],
                   "shm segments": [] if "shm segments" in skip else sorted(self.new_segments())}
            out = {k: v for k, v in out.items() if v}
            if not out or time.monotonic() > deadline or list(out) == ["ray"]:
                return out
            time.sleep(0.2)

    def clean(self, ray_held: bool, skip: tuple[str, ...] = ()) -> None:
        """Remove what the test left: its named actors, Ray if nobody holds it, its processes, its segments (but
        not the kinds in `skip`, a longer-lived fixture's)."""
        if _ray_initialized():
            import ray

            for ns, name in () if "named actors" in skip else named_actors() - self.actors:
                try:
                    ray.kill(ray.get_actor(name, namespace=ns), no_restart=True)
                except Exception:  # noqa: BLE001 - gone meanwhile
                    pass
            if not ray_held:
                ray.shutdown()
        for pid in () if "processes" in skip else self.new_processes(ray_held):
            _kill_tree(pid)
        for name in () if "shm segments" in skip else self.new_segments():
            try:
                os.unlink(os.path.join(SHM_DIR, name))
            except FileNotFoundError:
                pass


def _is_ray_daemon_pid(pid: int) -> bool:
    try:
        return _is_ray_daemon(psutil.Process(pid))
    except psutil.NoSuchProcess:
        return False


def _under(pid: int, roots: set[int]) -> bool:
    """Whether `pid` is one of `roots` or descends from one."""
    if not roots:
        return False
    try:
        proc = psutil.Process(pid)
        return pid in roots or any(p.pid in roots for p in proc.parents())
    except psutil.NoSuchProcess:
        return False


def _kill_tree(pid: int) -> None:
    try:
        proc = psutil.Process(pid)
        procs = proc.children(recursive=True) + [proc]
    except psutil.NoSuchProcess:
        return
    for p in procs:
        try:
            p.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(procs, timeout=10)


def describe(leaks: dict[str, list[str]]) -> str:
    return "; ".join(f"{kind}: {', '.join(items)}" for kind, items in leaks.items())


RAY_HOLDERS: list[str] = []
"""Fixtures holding a Ray session right now (a module's, or one test's): Ray up is theirs, not a leak."""


def ray_held() -> bool:
    return bool(RAY_HOLDERS)


class holding_ray:
    """`with holding_ray("name"):` around a fixture's Ray session (its setup, yield and teardown)."""

    def __init__(self, owner: str):
        self.owner = owner

    def __enter__(self):
        RAY_HOLDERS.append(self.owner)
        return self

    def __exit__(self, *exc) -> None:
        RAY_HOLDERS.remove(self.owner)
