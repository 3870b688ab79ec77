"""Sandbox launcher: a fresh single-threaded process that isolates itself, then execs untrusted Python.

Started by ``rayllm_rl.tools.sandbox`` as ``python -I -S _sandbox_launcher.py CONFIG_JSON`` and never imported by the
host: it forks, and forking a multithreaded host (e.g. a Ray actor) is unsafe, hence no ``preexec_fn``. Process tree:

    launcher  (host PID namespace; leader of its own session/process group; dies with the host via PDEATHSIG)
      `- init  (PID 1 of a new PID namespace when permitted): builds the private mount tree, waits, reports status
           `- user code: rlimits, no_new_privs, private uid/gid, exec(python -I main.py) with a clean environment

When init exits, the kernel SIGKILLs everything left in its PID namespace, so no background process outlives a run.
The host's death takes the run down without any user-space code having to run: the launcher's PDEATHSIG is
SIGKILL, and so is init's in a PID namespace (forced into a namespace init because it comes from the parent
namespace); init's exit then kills and reaps every member. Each link sets PDEATHSIG first and then checks that its
parent is still the one it was forked by (launcher: ``getppid``; init: EOF on a pipe only the launcher holds open;
user code: ``getppid``), so a parent that died before the PDEATHSIG was armed is noticed instead of leaving an
orphan that nothing would ever stop. Without a PID namespace, init's PDEATHSIG is SIGTERM and its handler kills the
run by process group and uid before exiting.
Every isolation step degrades independently when not permitted. What was active, the pids the host needs to kill the
run on timeout, and finally the user process's exit code are JSON lines on the inherited ``status_fd``. Dropping
privileges fails closed: if the private uid cannot be assumed, the user code is not run (exit 126, reason on stderr).

``_sandbox_launcher.py --kill-uid UID`` becomes UID and kill(-1, SIGKILL)s every process of that uid (cleanup).
"""
from __future__ import annotations

import contextlib
import ctypes
import json
import os
import resource
import shutil
import signal
import sys
import time

CLONE_NEWNS, CLONE_NEWIPC, CLONE_NEWPID, CLONE_NEWNET = 0x00020000, 0x08000000, 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
PR_SET_PDEATHSIG, PR_SET_CHILD_SUBREAPER, PR_SET_NO_NEW_PRIVS = 1, 36, 38
TMP_DIRS = ("/tmp", "/var/tmp", "/dev/shm")  # world-writable places that get a private tmpfs
SANDBOX_WORKDIR = "/tmp/work"  # the workdir inside the mount namespace (in the private /tmp tmpfs)
ISOLATION_KEYS = ("net_namespace", "pid_namespace", "mount_namespace", "private_uid", "private_tmp",
                  "private_proc", "readonly_root", "ipc_namespace", "net_audit_hook")

# Weaker network block used when no network namespace is available: at the Python level, refuses creating
# non-AF_UNIX sockets, name resolution, and connect/bind/sendto/sendmsg on any socket (also AF_UNIX: host services
# such as Ray's raylet listen on unix sockets under /tmp); socketpair() (asyncio) still works. ctypes, subprocess
# (curl, ...) or C extensions bypass it.
_NET_HOOK = r"""
import sys, _socket
def _sandbox_net_hook(ev, args, _unix=_socket.AF_UNIX):
    if ev.startswith(("socket.getaddrinfo", "socket.gethostby", "socket.getnameinfo", "socket.connect",
                      "socket.bind", "socket.sendto", "socket.sendmsg")) or (
            ev == "socket.__new__" and args[1] != _unix):
        raise PermissionError(f"network access is disabled in this sandbox ({ev})")
sys.addaudithook(_sandbox_net_hook)
del sys.argv[0]
import runpy
runpy.run_path(sys.argv[0], run_name="__main__")
"""

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
_libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
_libc.unshare.argtypes = [ctypes.c_int]


def _check(rc: int, what: str) -> None:
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _mount(src, dst, fstype, flags, data=None) -> None:
    enc = lambda s: None if s is None else s.encode()  # noqa: E731
    _check(_libc.mount(enc(src), enc(dst), enc(fstype), flags, enc(data)), f"mount {dst}")


def _send(fd: int, msg: dict) -> None:
    os.write(fd, (json.dumps(msg) + "\n").encode())


def _under(path: str, d: str) -> bool:
    return path == d or path.startswith(d.rstrip("/") + "/")


def _blocker(path: str) -> str | None:
    """First strict ancestor of ``path`` that other users cannot traverse (no o+x bit), e.g. /root for pyenv."""
    parts = path.strip("/").split("/")
    for i in range(1, len(parts)):
        d = "/" + "/".join(parts[:i])
        if not os.stat(d).st_mode & 0o001:
            return d
    return None


def _copy_tree(src: str, dst: str, uid: int | None) -> None:
    """Copy the host-staged workdir (only plain files/dirs the host wrote) to ``dst``, owned by ``uid``."""
    shutil.copytree(src, dst, copy_function=shutil.copyfile)
    for root, dirs, files in os.walk(dst):
        for path in [root, *(os.path.join(root, n) for n in dirs + files)]:
            if uid is not None:
                os.chown(path, uid, uid, follow_symlinks=False)


def _setup_mounts(cfg: dict, wfd: int, iso: dict, notes: list) -> str | None:
    """Private mount tree (inside the new mount namespace only; the host never sees these mounts).

    tmpfs over /tmp, /var/tmp, /dev/shm (``tmpfs_mb`` each); the workdir as a copy of the host-staged one (read via
    ``wfd``, opened before /tmp is covered) at /tmp/work, so every write stays in RAM-backed, size-capped tmpfs that
    vanishes with the namespace and never fills the host disk; interpreter directories hidden by that tmpfs or by a
    non-traversable ancestor (e.g. a pyenv under 0700 /root) re-exposed read-only at their own path, over a tmpfs
    that masks the rest of that ancestor; a fresh /proc for the PID namespace; / remounted read-only.
    Returns the in-sandbox workdir path (None: keep the host one).
    """
    _mount(None, "/", None, MS_REC | MS_PRIVATE)  # nothing below propagates back to the host
    tmp_dirs = [d for d in TMP_DIRS if os.path.isdir(d) and not os.path.islink(d)]
    masks, keep = set(), {}
    for p in sorted({os.path.realpath(p) for p in cfg["expose"]}, key=len):
        if not os.path.isdir(p) or any(_under(p, k) for k in keep):
            continue
        hidden = any(_under(p, t) for t in tmp_dirs)
        blocker = None if hidden else _blocker(p)
        if hidden or blocker:
            keep[p] = os.open(p, os.O_PATH | os.O_DIRECTORY)
            masks.update([blocker] if blocker else [])
    ok, work = 0, None
    for d in tmp_dirs:
        try:
            _mount("tmpfs", d, "tmpfs", MS_NOSUID | MS_NODEV, f"size={cfg['tmpfs_mb']}m,mode=1777")
            ok += 1
        except OSError as e:
            notes.append(str(e))
    iso["private_tmp"] = ok == len(tmp_dirs) and "/tmp" in tmp_dirs
    for d in sorted(masks):
        _mount("tmpfs", d, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=0755")
    if "/tmp" in tmp_dirs and os.path.ismount("/tmp"):  # workdir = copy of the staged inputs in the capped tmpfs
        _copy_tree(f"/proc/self/fd/{wfd}", SANDBOX_WORKDIR, cfg["uid"])
        work = SANDBOX_WORKDIR
    for p, fd in keep.items():
        os.makedirs(p, 0o755, exist_ok=True)
        _mount(f"/proc/self/fd/{fd}", p, None, MS_BIND | MS_REC)
        _mount(None, p, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)
        os.close(fd)
    if iso["pid_namespace"]:
        try:  # after the /proc/self/fd binds above: from here on /proc shows only this namespace
            _mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
            iso["private_proc"] = True
        except OSError as e:
            notes.append(str(e))
    iso["readonly_root"] = _remount_readonly(["/proc", "/dev/pts", *tmp_dirs, *keep], notes)
    return work


def _mount_points() -> list[str]:
    """Mount points of this mount namespace (/proc/self/mountinfo field 5, octal escapes decoded)."""
    with open("/proc/self/mountinfo", "rb") as f:
        return [line.split()[4].decode("unicode_escape") for line in f if line.strip()]


def _remount_readonly(skip: list[str], notes: list) -> bool:
    """Remount read-only every mount but those at or under `skip` (the private tmpfs, /proc, ...): "/" and
    also any other mount (volumes, data dirs) whose world-writable directories would reach host storage.
    Returns whether "/" itself became read-only; a mount that refuses is noted."""
    root_ok = False
    for mp in dict.fromkeys(_mount_points()):
        if any(_under(mp, s) for s in skip) or not os.path.isdir(mp):
            continue
        try:
            keep_flags = os.statvfs(mp).f_flag & (MS_NOSUID | MS_NODEV | MS_NOEXEC)
            _mount(None, mp, None, MS_REMOUNT | MS_BIND | MS_RDONLY | keep_flags)
            root_ok = root_ok or mp == "/"
        except OSError as e:
            notes.append(f"read-only {mp}: {e}")
    return root_ok


def _set_limits(limits: dict) -> None:
    table = {resource.RLIMIT_CPU: (limits["cpu"], limits["cpu"] + 1),  # SIGXCPU, then SIGKILL a second later
             resource.RLIMIT_AS: (limits["as"],) * 2, resource.RLIMIT_NPROC: (limits["nproc"],) * 2,
             resource.RLIMIT_FSIZE: (limits["fsize"],) * 2, resource.RLIMIT_CORE: (0, 0),
             resource.RLIMIT_NOFILE: (limits["nofile"],) * 2}
    for res, (soft, hard) in table.items():
        cur_hard = resource.getrlimit(res)[1]
        if os.geteuid() != 0 and cur_hard != resource.RLIM_INFINITY:  # unprivileged: may only lower
            soft, hard = min(soft, cur_hard), min(hard, cur_hard)
        resource.setrlimit(res, (soft, hard))


def _die_with_parent(sig: int, parent: int) -> None:
    """Arm PDEATHSIG, then exit if the parent already died (we were re-parented before it was armed)."""
    _check(_libc.prctl(PR_SET_PDEATHSIG, sig, 0, 0, 0), "pdeathsig")
    if os.getppid() != parent:
        os._exit(1)


def _exec_user(cfg: dict, work: str, uid: int | None, net_hook: bool, init_pid: int) -> None:
    """In the forked user process: limits, privilege drop (fail closed), exec. Never returns."""
    try:
        os.setpgid(0, 0)
        _die_with_parent(signal.SIGKILL, init_pid)  # init died: die too (without PID namespace nothing else would)
        for sig in (signal.SIGPIPE, signal.SIGXFSZ, signal.SIGINT, signal.SIGTERM, signal.SIGCHLD):
            signal.signal(sig, signal.SIG_DFL)
        _set_limits(cfg["limits"])  # before setuid: as root the hard limits can still be raised
        _check(_libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")  # setuid binaries cannot elevate
        if uid is not None:
            os.setgroups([])
            os.setresgid(uid, uid, uid)
            os.setresuid(uid, uid, uid)
            if os.getresuid() != (uid,) * 3 or os.getresgid() != (uid,) * 3:
                raise OSError(f"could not switch to uid {uid}")
            _die_with_parent(signal.SIGKILL, init_pid)  # setuid cleared it: arm again, re-check the parent
            bad = [p for p in cfg["expose"] if not os.access(p, os.R_OK | os.X_OK)]
            if bad:
                raise OSError(f"interpreter paths not accessible to the sandbox uid (no mount namespace to "
                              f"expose them; refusing to run untrusted code as root): {bad}")
        os.chdir(work)
        argv = [cfg["python"], "-I"] + (["-c", _NET_HOOK] if net_hook else []) + [cfg["main"]]
        os.execve(cfg["python"], argv, dict(cfg["env"], HOME=work))
    except BaseException as e:  # noqa: BLE001 - report anything, never fall through into the launcher
        os.write(2, f"sandbox launcher: cannot start user code: {e}\n".encode())
    os._exit(126)


def _init(cfg: dict, sfd: int, wfd: int, lifeline: int, iso: dict, notes: list) -> None:
    """PID 1 of the sandbox, or without PID namespace a child subreaper that reaps the run's orphans. No return.

    ``lifeline``: read end of a pipe whose only write end the launcher holds; EOF means the launcher is gone."""
    pidns, user = iso["pid_namespace"], [0]

    def on_launcher_death(*_):  # no PID namespace: nothing kills the run for us, so kill it by group and uid
        with contextlib.suppress(OSError):
            if user[0]:
                os.killpg(user[0], signal.SIGKILL)
        with contextlib.suppress(OSError):  # even when the group is already gone (its leader exited)
            if cfg["uid"] is not None and os.fork() == 0:
                _kill_uid(cfg["uid"])  # also processes that left the process group (setsid)
        os._exit(1)
    if pidns:  # our death is the run's death (the kernel kills the namespace): no handler needs to run
        _check(_libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "pdeathsig")
    else:
        signal.signal(signal.SIGTERM, on_launcher_death)
        _check(_libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0), "pdeathsig")
    os.set_blocking(lifeline, False)
    try:  # the launcher died before PDEATHSIG was armed: we were re-parented and would never get it
        if os.read(lifeline, 1) == b"":
            os._exit(1)
    except BlockingIOError:
        pass  # the launcher is alive; from now on its death reaches us as PDEATHSIG
    os.close(lifeline)
    if not pidns:  # orphans come back to us instead of to the host's PID 1 (which may never reap them)
        _libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    os.fchdir(wfd)  # keeps the host workdir reachable even if the private /tmp below fails
    work = cfg["workdir"]
    if iso["mount_namespace"]:
        try:
            work = _setup_mounts(cfg, wfd, iso, notes) or work
        except OSError as e:
            notes.append(f"mount setup incomplete: {e}")
    os.close(wfd)
    iso["private_uid"] = cfg["uid"] is not None
    iso["net_audit_hook"] = net_hook = not cfg["network"] and not iso["net_namespace"]
    _send(sfd, {"isolation": iso, "notes": notes})
    me = os.getpid()  # 1 in a PID namespace
    child = os.fork()
    if child == 0:
        os.close(sfd)
        _exec_user(cfg, work, cfg["uid"], net_hook, me)
    with contextlib.suppress(OSError):  # (also done by the child) the user code gets its own process group
        os.setpgid(child, child)
    user[0] = child
    if not pidns:  # the host kills this group on timeout (without PID namespace it has no init to kill)
        _send(sfd, {"user_pgid": child})
    while True:  # reap orphans as they die; stop at the user process without reaping it (WNOWAIT) so
        info = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOWAIT)  # its pid/pgid cannot be reused meanwhile
        if info.si_pid == child:
            break
        os.waitpid(info.si_pid, 0)
    _send(sfd, {"exit_code": info.si_status if info.si_code == os.CLD_EXITED else -info.si_status})
    if not pidns:
        with contextlib.suppress(OSError):
            os.killpg(child, signal.SIGKILL)  # the rest of the user's process group
        deadline = time.monotonic() + 1.0  # reap what the host kills by uid; do not wait for unkillable ones
        while time.monotonic() < deadline:
            try:
                if os.waitpid(-1, os.WNOHANG)[0] == 0:
                    time.sleep(0.005)
            except ChildProcessError:
                break
    os._exit(0)  # in a PID namespace the kernel now kills and reaps every remaining process of the run


def _kill_uid(uid: int) -> None:
    os.setgroups([])
    os.setresgid(uid, uid, uid)
    os.setresuid(uid, uid, uid)
    for _ in range(3):  # kill(-1) signals every process we may signal (= all of this uid) except ourselves
        os.kill(-1, signal.SIGKILL)
        time.sleep(0.01)
    os._exit(0)


def main(argv: list[str]) -> int:
    if argv[1] == "--kill-uid":
        return _kill_uid(int(argv[2]))
    cfg = json.loads(argv[1])
    sfd = cfg["status_fd"]
    _libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)  # the host died: take the sandbox down with it
    if os.getppid() != cfg["ppid"]:
        return 1
    os.set_inheritable(sfd, False)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # an ignored SIGCHLD is inherited across exec: we must wait()
    os.umask(0o022)
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    iso, notes = dict.fromkeys(ISOLATION_KEYS, False), []
    if cfg["isolate"]:
        wanted = {"mount_namespace": CLONE_NEWNS, "pid_namespace": CLONE_NEWPID, "ipc_namespace": CLONE_NEWIPC}
        if not cfg["network"]:
            wanted["net_namespace"] = CLONE_NEWNET
        if _libc.unshare(sum(wanted.values())) == 0:
            iso.update(dict.fromkeys(wanted, True))
        else:  # fall back step by step
            notes.append(f"unshare(all): {os.strerror(ctypes.get_errno())}")
            for key, flag in wanted.items():
                iso[key] = _libc.unshare(flag) == 0
    wfd = os.open(cfg["workdir"], os.O_RDONLY | os.O_DIRECTORY)  # after unshare: must be a mount of the new ns
    life_r, life_w = os.pipe()  # we hold the write end until we die; init checks it (see _init)
    pid = os.fork()
    if pid == 0:
        try:
            os.close(life_w)
            _init(cfg, sfd, wfd, life_r, iso, notes)
        except BaseException as e:  # noqa: BLE001
            os.write(2, f"sandbox launcher: setup failed: {e!r}\n".encode())
        os._exit(125)
    if iso["pid_namespace"]:
        _send(sfd, {"init_pid": pid})  # the host kills init on timeout: the kernel then kills the namespace
    os.close(sfd)
    os.close(wfd)
    os.close(life_r)
    os.waitpid(pid, 0)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
