"""`model.path` as a hub id, offline: resolution through an HF cache laid out as huggingface_hub lays
it out (built here from the tiny model), both engines, a local job, and errors before any actor starts."""
from __future__ import annotations

import asyncio
import dataclasses
import os
import shutil
from pathlib import Path

import pytest
import torch

from budgets import VLLM_START_S
from fixtures.hub_cache import go_offline, gsm8k_rows, publish_dataset
from rayllm_rl.hub import HubResolutionError, add_to_hub_cache, cached_model_file, resolve_model_path
from rayllm_rl.inference.protocol import weights_checksum

REPO = "tiny-org/tiny-qwen2"


@dataclasses.dataclass
class HubModel:
    main: str
    """Snapshot directory of refs/main (the tiny model's own weights)."""
    v1: str
    """Snapshot directory of refs/v1 (the same model, every weight + 0.01)."""
    main_sum: float
    v1_sum: float


def _checksum(path: str) -> float:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return weights_checksum(dict(model.named_parameters()))


@pytest.fixture()
def hub_model(tmp_path, monkeypatch, tiny_model_path) -> HubModel:
    from transformers import AutoModelForCausalLM

    go_offline(tmp_path, monkeypatch)
    main = add_to_hub_cache(tiny_model_path, REPO)
    shifted = tmp_path / "v1"
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01)
    model.save_pretrained(shifted)
    for f in os.listdir(tiny_model_path):
        if f.startswith("tokenizer") or f.endswith(".jinja"):
            shutil.copy(os.path.join(tiny_model_path, f), shifted / f)
    v1 = add_to_hub_cache(str(shifted), REPO, ref="v1")
    return HubModel(main, v1, _checksum(tiny_model_path), _checksum(str(shifted)))


def test_hub_id_resolves_by_ref_and_commit_from_the_cache_layout(hub_model, tiny_model_path):
    cache = Path(os.environ["HF_HUB_CACHE"]) / "models--tiny-org--tiny-qwen2"
    assert (cache / "refs" / "main").read_text() == Path(hub_model.main).name
    assert resolve_model_path(REPO) == hub_model.main
    assert os.path.realpath(Path(hub_model.main) / "config.json").startswith(str(cache / "blobs"))
    assert resolve_model_path(REPO, "v1") == hub_model.v1 != hub_model.main
    commit = Path(hub_model.v1).name
    assert len(commit) == 40 and resolve_model_path(REPO, commit) == hub_model.v1
    # another node hands over its own snapshot dir: this node resolves the same commit from its cache
    assert resolve_model_path(f"/elsewhere/hub/models--tiny-org--tiny-qwen2/snapshots/{commit}") == hub_model.v1
    assert resolve_model_path(tiny_model_path) == os.path.abspath(tiny_model_path)
    assert cached_model_file(REPO, "config.json") == os.path.join(hub_model.main, "config.json")
    assert cached_model_file(REPO, "config.json", "v1") == os.path.join(hub_model.v1, "config.json")
    assert cached_model_file(REPO, "absent.json") is None and cached_model_file("no-org/none", "config.json") is None
    assert abs(hub_model.main_sum - hub_model.v1_sum) > 1.0


LLAMA_LIKE = {  # a Llama-3-style repo: HF shards plus the original/ copy; sizes in MB
    "config.json": 0, "generation_config.json": 0, "model-00001-of-00002.safetensors": 4976,
    "model-00002-of-00002.safetensors": 3050, "model.safetensors.index.json": 0, "special_tokens_map.json": 0,
    "tokenizer.json": 9, "tokenizer_config.json": 0, "original/consolidated.00.pth": 8030,
    "original/params.json": 0, "original/tokenizer.model": 2, "LICENSE": 0, "README.md": 0, ".gitattributes": 0}
OLD_STYLE = {  # a repo from before safetensors: one weight file per framework
    "config.json": 0, "pytorch_model.bin": 548, "tf_model.h5": 498, "flax_model.msgpack": 498,
    "rust_model.ot": 703, "onnx/decoder_model.onnx": 653, "vocab.json": 1, "merges.txt": 0, "README.md": 0}
MIXED = {  # safetensors next to .bin, gguf and Mistral's consolidated copy; a remote-code model with a chat template
    "config.json": 0, "model.safetensors": 988, "pytorch_model.bin": 988, "consolidated.safetensors": 988,
    "model-q4_k_m.gguf": 400, "tokenizer.model": 1, "qwen.tiktoken": 2, "chat_template.jinja": 0,
    "modeling_custom.py": 0, "configuration_custom.py": 0, "images/logo.png": 0}


@pytest.mark.parametrize("listing, kept, megabytes", [
    (LLAMA_LIKE, {"config.json", "generation_config.json", "model-00001-of-00002.safetensors",
                  "model-00002-of-00002.safetensors", "model.safetensors.index.json", "special_tokens_map.json",
                  "tokenizer.json", "tokenizer_config.json"}, 8035),  # of 16067: no original/*.pth
    (OLD_STYLE, {"config.json", "pytorch_model.bin", "vocab.json",
                 "merges.txt"}, 549),  # of 2901: .bin, no TF/Flax/ONNX
    (MIXED, {"config.json", "model.safetensors", "tokenizer.model", "qwen.tiktoken", "chat_template.jinja",
             "modeling_custom.py", "configuration_custom.py"}, 991),  # of 3367: one weight format
])
def test_a_hub_model_downloads_only_what_a_model_loads(listing, kept, megabytes):
    """The files snapshot_download keeps with resolve_model_path's patterns (huggingface_hub's own filter)."""
    from huggingface_hub.utils import filter_repo_objects

    from rayllm_rl.hub import NOT_MODEL_FILES, model_file_patterns

    chosen = set(filter_repo_objects(list(listing), allow_patterns=model_file_patterns(list(listing)),
                                     ignore_patterns=list(NOT_MODEL_FILES)))
    assert chosen == kept
    assert sum(listing[f] for f in chosen) == megabytes


def test_a_snapshot_downloaded_with_the_patterns_resolves_offline(hub_model, tmp_path):
    """An online download with the patterns leaves huggingface_hub's tree listing of the whole repo next to a
    snapshot without the skipped files; offline, resolution must ask for the same patterns, or
    huggingface_hub calls the snapshot incomplete."""
    import json

    storage = Path(os.environ["HF_HUB_CACHE"]) / "models--tiny-org--tiny-qwen2"
    commit = Path(hub_model.main).name
    files = {f: {"size": os.path.getsize(Path(hub_model.main) / f), "blob_id": "0" * 40}
             for f in os.listdir(hub_model.main)}
    files.update({"original/consolidated.00.pth": {"size": 10, "blob_id": "1" * 40},
                  "tiny-q4.gguf": {"size": 10, "blob_id": "2" * 40}, "README.md": {"size": 10, "blob_id": "3" * 40}})
    (storage / "trees").mkdir()
    (storage / "trees" / f"{commit}.json").write_text(json.dumps({"format_version": 1, "files": files}))
    assert resolve_model_path(REPO) == hub_model.main
    assert resolve_model_path(REPO, commit) == hub_model.main
    os.remove(Path(hub_model.main) / "model.safetensors")  # a weight the patterns ask for is missing: incomplete
    with pytest.raises(HubResolutionError, match=r"tiny-org/tiny-qwen2.*incomplete.*model.safetensors"):
        resolve_model_path(REPO)


def test_resolution_errors_name_the_id_revision_cache_and_offline_mode(hub_model, tmp_path):
    with pytest.raises(HubResolutionError, match=r"'wrong-org/no-such-model' at revision 'main'.*"
                       r"models--wrong-org--no-such-model/snapshots.*offline mode on"):
        resolve_model_path("wrong-org/no-such-model")
    with pytest.raises(HubResolutionError, match=r"'tiny-org/tiny-qwen2' at revision 'v9'"):
        resolve_model_path(REPO, "v9")
    (tmp_path / "empty").mkdir()
    with pytest.raises(HubResolutionError, match="without config.json"):
        resolve_model_path(str(tmp_path / "empty"))
    with pytest.raises(HubResolutionError, match="neither an existing local directory nor a hub id"):
        resolve_model_path("not/a/hub/id")
    assert isinstance(HubResolutionError("x"), ValueError)


def test_transformers_engine_from_hub_id_and_revision(hub_model, tokenizer):
    from rayllm_rl.inference.registry import build_engine
    from rayllm_rl.inference.protocol import LLMRequest, SamplingParams

    engine = build_engine("transformers", REPO)
    assert engine.model_path == hub_model.main
    assert asyncio.run(engine.weights.weights_checksum()) == pytest.approx(hub_model.main_sum, rel=1e-9)
    prompt = list(tokenizer.apply_chat_template([{"role": "user", "content": "What is 2+3?"}],
                                                add_generation_prompt=True, tokenize=True, return_dict=False))
    out = asyncio.run(engine.agenerate(LLMRequest(input_ids=prompt, sampling=SamplingParams(
        max_new_tokens=5, greedy=True, ignore_eos=True))))
    assert out.output_len == 5 and out.input_tokens == prompt
    pinned = build_engine("transformers", REPO, revision="v1")
    assert pinned.model_path == hub_model.v1
    assert asyncio.run(pinned.weights.weights_checksum()) == pytest.approx(hub_model.v1_sum, rel=1e-9)


@pytest.mark.vllm
@pytest.mark.slow
def test_vllm_engine_from_hub_id_reads_its_sink_metadata_from_the_snapshot(hub_model, tiny_model_path):
    """The vLLM sink lists *.safetensors in its model_path: built from a hub id it gets the snapshot."""
    from safetensors import safe_open
    from transformers import AutoTokenizer

    from rayllm_rl.inference.registry import build_engine
    from rayllm_rl.inference.protocol import LLMRequest, SamplingParams
    from rayllm_rl.loop_thread import EventLoopThread

    engine = build_engine("vllm", REPO, options={"kv_cache_mb": 128})
    assert engine.model_path == hub_model.main
    with safe_open(os.path.join(tiny_model_path, "model.safetensors"), framework="pt") as st:
        expected = {name: tuple(st.get_slice(name).get_shape()) for name in st.keys()}
    assert {name: shape for name, shape, _ in engine.weights.weight_metadata()} == expected
    loop = EventLoopThread("hub-vllm")
    try:
        loop.call(engine.start(), VLLM_START_S, "vLLM start")
        checksum = loop.call(engine.weights.weights_checksum(), 120, "vLLM checksum")
        prompt = list(AutoTokenizer.from_pretrained(REPO).apply_chat_template(
            [{"role": "user", "content": "What is 2+3?"}], add_generation_prompt=True, tokenize=True,
            return_dict=False))
        out = loop.call(engine.agenerate(LLMRequest(input_ids=prompt, sampling=SamplingParams(
            max_new_tokens=5, greedy=True, ignore_eos=True))), 120, "vLLM generate")
    finally:
        loop.close(first=engine.aclose(), timeout_s=120)
    assert checksum == pytest.approx(hub_model.main_sum, rel=1e-6)
    assert out.output_len == 5 and out.output_versions == [0] * 5


@pytest.mark.slow
def test_local_job_with_hub_model_and_hub_dataset(hub_model, tmp_path):
    """The user's command, offline: model.path=<hub id> task=gsm8k data.path=<hub dataset> (default config),
    with a reference model (KL) and checkpoints, every role from the resolved snapshot."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rayllm_rl.config import load_config
    from job_helpers import run_job
    from rayllm_rl.job.config import GRPOJobConfig

    rows = gsm8k_rows()
    publish_dataset("openai/gsm8k", {"main": {"train": rows}, "socratic": {"train": rows[:2]}}, tmp_path)
    cfg = load_config(GRPOJobConfig, [
        f"model.path={REPO}", "model.revision=v1", "task=gsm8k", "data.path=openai/gsm8k", "data.eval_size=2",
        "trainer.backend=local", "trainer.steps=2", "trainer.eval_every=0", "trainer.log_every=100",
        "rollout.prompts_per_step=2", "rollout.group_size=2", "rollout.max_new_tokens=8", "algo.kl_coef=0.05",
        f"trainer.run_dir={tmp_path / 'run'}", "trainer.call_timeout_s=120"]).validate()
    summary = run_job(cfg)
    assert summary["steps"] == 2 and summary["version"] == 2 and summary["failed_episodes"] == 0
    assert summary["eval_prompts"] == 2 and summary["learner_checksums_equal_replicas"]
    ckpt = Path(summary["checkpoint"])
    assert (ckpt / "reference.safetensors").exists()
    assert len(AutoTokenizer.from_pretrained(ckpt)) == len(AutoTokenizer.from_pretrained(hub_model.v1))
    trained = weights_checksum(dict(AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).named_parameters()))
    assert abs(trained - hub_model.v1_sum) < abs(trained - hub_model.main_sum)  # started from revision v1


def test_wrong_model_id_fails_before_any_actor_starts(hub_model, tmp_path):
    import ray

    from rayllm_rl.config import load_config
    from job_helpers import run_job
    from rayllm_rl.job.config import GRPOJobConfig

    assert not ray.is_initialized()
    cfg = load_config(GRPOJobConfig, ["model.path=tiny-org/not-there", "trainer.backend=ray",
                                      f"trainer.run_dir={tmp_path}"]).validate()
    with pytest.raises(HubResolutionError, match=r"'tiny-org/not-there'.*models--tiny-org--not-there.*offline mode on"):
        run_job(cfg)
    assert not ray.is_initialized(), "the error came before Ray (and so any actor) started"
