"""GGUF checkpoints as `model.path`: dequantized once into a cached HF safetensors directory.

transformers reads GGUF (`from_pretrained(folder, gguf_file=name)`) by dequantizing every tensor to
float32, but a model loaded that way is flagged quantized (it refuses `save_pretrained`), vLLM's
engines want a plain HF directory, and the dequantization costs tens of seconds per load. So a GGUF
file is converted once: a model built from the file's config (without `quantization_config`) takes
the dequantized state dict and is saved as ordinary float32 safetensors, with the tokenizer
(vocabulary, merges and chat template from the GGUF metadata) and a generation config, in
`<cache>/gguf/<sha256[:16] of the file>`. The key is the file's content, so a renamed copy
hits the cache and a changed file misses it. Every role (learner, both engines, reference,
tokenizer) then loads that directory like any other model. The conversion checks itself before it is
cached: the saved directory, loaded back, must give exactly the GGUF-loaded model's logits on a probe
chat (`round_trip` in its record). `inspect_gguf` reads only the metadata
(milliseconds), so a file transformers cannot dequantize fails with its architecture named before
any actor starts, and the dry run can say what it will load.
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

CONVERTER_VERSION = 2
"""Bumped when the converted directory's layout or record changes (2: the record holds the round-trip check);
part of the record, checked on reuse, so an older conversion is redone."""
SOURCE_RECORD = "gguf_source.json"
"""The record a converted directory carries: the GGUF file's sha256, architecture, tensor types, and the
converter and transformers versions; its presence marks a complete conversion."""


class GGUFError(ValueError):
    """A GGUF `model.path` that cannot be used: unreadable, not GGUF, or an architecture transformers
    cannot dequantize into a causal LM. The message names the file and the reason."""


@dataclasses.dataclass(frozen=True)
class GGUFInfo:
    """What a GGUF file's metadata says, read without touching its tensors."""

    path: str
    """The .gguf file."""
    architecture: str
    """`general.architecture` (llama.cpp's name, e.g. 'llama', 'qwen2')."""
    model_type: str
    """The transformers model type it becomes (e.g. 'llama', 'mistral', 'qwen2_moe')."""
    name: str
    """`general.name`, or '' when the file has none."""
    tensor_types: dict[str, int]
    """{GGML tensor type name: number of tensors of that type}, e.g. {'Q4_1': 211, 'F32': 61}."""
    size_bytes: int
    config: dict
    """The HF config transformers derives from the metadata (`to_dict()` of its config)."""

    @property
    def num_tensors(self) -> int:
        return sum(self.tensor_types.values())


def default_gguf_cache_dir() -> Path:
    """`$RAYLLM_RL_CACHE/gguf` (default `~/.cache/rayllm_rl/gguf`): where converted GGUF models live."""
    from rayllm_rl.models.tiny import default_cache_dir

    return default_cache_dir() / "gguf"


def file_sha256(path: str, chunk: int = 1 << 22) -> str:
    """The sha256 of a file's bytes (about 0.3 s for SmolLM2's 98 MB here)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def inspect_gguf(path: str) -> GGUFInfo:
    """Read a GGUF file's metadata and check that transformers can dequantize it into a causal LM.

    Raises GGUFError naming the file: not a GGUF file (bad magic, truncated), an architecture
    transformers' GGUF loader does not know (its list is in the message), a model type that is not a
    causal LM (e.g. T5), or a tensor type the `gguf` package cannot dequantize."""
    if not os.path.isfile(path):
        raise GGUFError(f"GGUF file {path!r} does not exist")
    try:
        import gguf  # noqa: F401 - transformers' loader needs it; say so here rather than mid-load
        import transformers.modeling_gguf_pytorch_utils  # noqa: F401
    except ImportError as error:  # pragma: no cover - both are project dependencies
        raise GGUFError(f"reading GGUF file {path!r} needs the 'gguf' and 'accelerate' packages: {error}") from error
    st = os.stat(path)
    key = (os.path.realpath(path), st.st_size, st.st_mtime_ns)
    if key not in _INFO:  # a file is parsed once per process (~3 s for SmolLM2): a dry run, then the conversion
        with read_once():  # the reader below and load_gguf_checkpoint's: one parse of the file
            _INFO[key] = _read_info(path)
    info = _INFO[key]
    return dataclasses.replace(info, path=os.path.abspath(path), tensor_types=dict(info.tensor_types),
                               config=copy.deepcopy(info.config))


_INFO: dict[tuple, GGUFInfo] = {}
"""`inspect_gguf`'s results by (real path, size, mtime): a changed file is read again."""


def _read_info(path: str) -> GGUFInfo:
    """`inspect_gguf`'s reading and checks (the readers it makes are `gguf.GGUFReader`'s at call time)."""
    import gguf
    from gguf.quants import _type_traits
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES, load_gguf_checkpoint

    try:
        reader = gguf.GGUFReader(path)
        architecture = str(_field(reader, "general.architecture"))
        name = str(_field(reader, "general.name") or "")
        types: dict[str, int] = {}
        for tensor in reader.tensors:
            types[tensor.tensor_type.name] = types.get(tensor.tensor_type.name, 0) + 1
            unsupported = tensor.tensor_type not in _type_traits and tensor.tensor_type.name not in ("F32", "F16")
            if unsupported:
                raise GGUFError(f"GGUF file {path!r}: tensor {tensor.name!r} is of type {tensor.tensor_type.name}, "
                                "which the installed gguf package cannot dequantize")
    except GGUFError:
        raise
    except Exception as error:  # noqa: BLE001 - GGUFReader raises ValueError, struct.error, IndexError, ...
        raise GGUFError(f"{path!r} is not a readable GGUF file: {type(error).__name__}: {error}") from error
    try:
        parsed = load_gguf_checkpoint(path, return_tensors=False)
    except ValueError as error:
        raise GGUFError(f"GGUF file {path!r} has architecture {architecture!r}, which transformers cannot dequantize "
                        f"({error}); its GGUF loader knows {sorted(GGUF_SUPPORTED_ARCHITECTURES)}") from error
    config = dict(parsed["config"])
    model_type = str(config.get("model_type", architecture))
    _check_causal_lm(path, architecture, model_type)
    return GGUFInfo(path=os.path.abspath(path), architecture=architecture, model_type=model_type, name=name,
                    tensor_types=types, size_bytes=os.path.getsize(path), config=config)


def _field(reader, key: str):
    """One scalar or string field of a GGUF reader, or None when absent."""
    field = reader.fields.get(key)
    if field is None:
        return None
    return field.contents()


def _check_causal_lm(path: str, architecture: str, model_type: str) -> None:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise GGUFError(f"GGUF file {path!r} has architecture {architecture!r} (transformers model type "
                        f"{model_type!r}), which is not a causal language model: a policy must be one")


def converted_dir(path: str, sha256: str | None = None, cache_dir: str | Path | None = None) -> Path:
    """Where the conversion of GGUF file `path` lives: `<cache>/<sha256[:16] of its bytes>`, whatever its name
    (its record, `gguf_source.json`, names the file it came from)."""
    root = Path(cache_dir) if cache_dir else default_gguf_cache_dir()
    return root / (sha256 or file_sha256(path))[:16]


def is_converted(directory: str | Path) -> bool:
    """True when `directory` holds a complete conversion of this converter version."""
    record = Path(directory) / SOURCE_RECORD
    if not record.is_file():
        return False
    try:
        return json.loads(record.read_text()).get("converter_version") == CONVERTER_VERSION
    except (OSError, ValueError):
        return False


PROBE_CHAT = [{"role": "user", "content": "What is 17 + 25? Answer with a number."}]
"""The conversion's round-trip probe: rendered with the file's own chat template (template tokens included)."""


@dataclasses.dataclass
class Dequantized:
    """A GGUF file dequantized by transformers: a plain float32 model that saves as ordinary safetensors,
    its tokenizer, and the GGUF-loaded model's logits on the probe, which the saved copy must reproduce."""

    model: Any
    tokenizer: Any
    probe_ids: Any
    """`[1, T]` token ids of `PROBE_CHAT` rendered with the tokenizer's chat template."""
    probe_logits: Any
    """`[1, T, V]` float32 logits of the model transformers loaded from the GGUF file itself."""


def probe_ids(tokenizer):
    """`PROBE_CHAT` as `[1, T]` ids: the chat template's render, or the plain text without a template."""
    import torch

    if tokenizer.chat_template:
        ids = tokenizer.apply_chat_template(PROBE_CHAT, add_generation_prompt=True, return_dict=True)["input_ids"]
    else:
        ids = tokenizer(PROBE_CHAT[0]["content"])["input_ids"]
    return torch.tensor([list(ids)])


def dequantize_gguf(path: str) -> Dequantized:
    """GGUF file `path` dequantized by transformers to float32. The model transformers loads is flagged
    quantized (no `save_pretrained`), so a plain one built from the config (no `quantization_config`) takes
    its state dict; the loaded one's logits on the probe are kept for the round-trip check."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = os.path.dirname(os.path.abspath(path)), os.path.basename(path)
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    ids = probe_ids(tokenizer)
    with torch.no_grad():
        logits = loaded(input_ids=ids).logits
    config = copy.deepcopy(loaded.config)  # the loaded model's: parsing the file again costs seconds
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = plain.load_state_dict(loaded.state_dict(), strict=False)
    tied = {k for k in missing if k.endswith("lm_head.weight") and getattr(config, "tie_word_embeddings", False)}
    if set(missing) - tied or unexpected:
        raise GGUFError(f"GGUF file {path!r}: the dequantized weights do not fit {type(plain).__name__} "
                        f"(missing {sorted(set(missing) - tied)[:5]}, unexpected {sorted(unexpected)[:5]})")
    plain.tie_weights()
    plain.eval()
    return Dequantized(plain, tokenizer, ids, logits)


def check_round_trip(path: str, want, got) -> dict[str, Any]:
    """The saved conversion's logits `got` against the GGUF-loaded model's `want` (`[1, T, V]`): the same
    float32 weights through the same kernels give the same bits, so anything else means the saved
    directory is not the GGUF's model (a wrong tie, a dropped tensor) and raises GGUFError."""
    diff = (got - want).abs().max().item() if got.shape == want.shape else float("inf")
    if diff != 0.0:
        raise GGUFError(f"GGUF file {path!r}: the converted model's logits differ from the GGUF-loaded model's on "
                        f"the probe chat (max |diff| {diff:.3g}, shapes {tuple(got.shape)} / {tuple(want.shape)}); "
                        "nothing was cached")
    return {"probe_tokens": int(want.shape[1]), "max_abs_logit_diff": diff, "equal": True}


@contextlib.contextmanager
def read_once():
    """Within the block, every `gguf.GGUFReader` of one file is the same reader: transformers makes one for the
    config, one for the tensors and one for the tokenizer, and `inspect_gguf` one, each parsing the whole file
    (~3 s each for SmolLM2, most of it its vocabulary). transformers imports the name from `gguf` at each call,
    so the name is swapped there for the block and restored after."""
    import gguf

    real, readers = gguf.GGUFReader, {}

    def reader(path, mode="r"):
        key = (os.path.abspath(path), mode)
        if key not in readers:
            readers[key] = real(path, mode)
        return readers[key]

    gguf.GGUFReader = reader
    try:
        yield
    finally:
        gguf.GGUFReader = real


def ensure_dequantized(path: str, cache_dir: str | Path | None = None) -> str:
    """The HF model directory of GGUF file `path`, converting it on the first call (atomically: a
    concurrent converter either wins or finds it done). Raises GGUFError before converting when the
    file cannot be used (`inspect_gguf`), and after, caching nothing, when the saved copy does not
    reproduce the GGUF-loaded model's logits (`check_round_trip`)."""
    import torch
    from transformers import AutoModelForCausalLM

    sha = file_sha256(path)
    final = converted_dir(path, sha, cache_dir)
    if is_converted(final):
        return str(final)
    bar = stage_progress(f"converting {Path(path).name} (once)", ("dequantize", "save", "check the round trip"))
    with read_once():  # the file parsed once for both (16.6 s instead of 26.4 s for SmolLM2-135M)
        info = inspect_gguf(path)
        done = dequantize_gguf(path)
    bar("save")
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=final.parent))
    try:
        done.model.save_pretrained(tmp)
        done.tokenizer.save_pretrained(tmp)
        bar("check the round trip")
        with torch.no_grad():
            reloaded = AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32).eval()
            round_trip = check_round_trip(path, done.probe_logits, reloaded(input_ids=done.probe_ids).logits)
        bar(None)
        _write_record(tmp, info, sha, round_trip)
        os.chmod(tmp, 0o755)  # mkdtemp's 0700 would hide a shared cache from other users
        if final.exists() and not is_converted(final):  # an older converter's or an interrupted one's output
            shutil.rmtree(final, ignore_errors=True)
        try:
            os.rename(tmp, final)
        except OSError:
            if not is_converted(final):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return str(final)


def stage_progress(desc: str, stages: tuple[str, ...]):
    """A progress bar on stderr over named stages (the conversion takes tens of seconds): the first stage shown
    now; the returned `next_stage(name)` moves on to `name`, `next_stage(None)` completes and closes it."""
    import sys

    from tqdm import tqdm

    bar = tqdm(total=len(stages), desc=desc, unit="stage", file=sys.stderr, mininterval=0, dynamic_ncols=True)
    bar.set_postfix_str(stages[0])

    def next_stage(name: str | None) -> None:
        bar.update(1)
        if name is None:
            bar.close()
        else:
            bar.set_postfix_str(name)

    return next_stage


def _write_record(directory: Path, info: GGUFInfo, sha: str, round_trip: dict[str, Any]) -> None:
    import transformers

    record = {"source": info.path, "sha256": sha, "architecture": info.architecture, "model_type": info.model_type,
              "name": info.name, "tensor_types": info.tensor_types, "size_bytes": info.size_bytes,
              "converter_version": CONVERTER_VERSION, "transformers_version": transformers.__version__,
              "round_trip": round_trip}
    (directory / SOURCE_RECORD).write_text(json.dumps(record, indent=1) + "\n")


def gguf_file_in(directory: str, gguf_file: str = "") -> str | None:
    """The .gguf file a local directory names: `gguf_file` inside it, or its only .gguf when it has no
    config.json; None for an HF model directory (config.json, no `gguf_file`). Several .gguf files and
    no `gguf_file` is an error listing them."""
    if gguf_file:
        candidate = os.path.join(directory, gguf_file)
        if not os.path.isfile(candidate):
            found = sorted(p.name for p in Path(directory).glob("*.gguf"))
            raise GGUFError(f"model.gguf_file={gguf_file!r} is not in {directory!r} "
                            f"(its .gguf files: {found or 'none'})")
        return candidate
    if os.path.isfile(os.path.join(directory, "config.json")):
        return None
    found = sorted(p.name for p in Path(directory).glob("*.gguf"))
    if len(found) > 1:
        raise GGUFError(f"{directory!r} holds several GGUF files {found}: name one with model.gguf_file=<name>")
    return os.path.join(directory, found[0]) if found else None


def looks_converted(path: str) -> bool:
    """True when `path` has the shape of a conversion directory (`.../gguf/<16 hex>`), existing or not:
    a role on another node handed a conversion its node lacks gets an error that says so."""
    p = Path(path)
    return p.parent.name == "gguf" and len(p.name) == 16 and all(c in "0123456789abcdef" for c in p.name)
