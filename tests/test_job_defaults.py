"""Job defaults fit a real run; the demo's settings live in the arithmetic task's preset; a value the user
sets (command line, YAML, Python) always wins over a preset; model.dtype=auto is resolved in one place
(`presets.resolve_presets`, a pure function: the config the user holds keeps None and "auto").
No Ray, no model weights: config resolution, the dry-run plan and the task's rows only."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from rayllm_rl.config import describe, load_config
from rayllm_rl.job.config import TASK_PRESETS, GRPOJobConfig
from rayllm_rl.job.presets import resolve_presets

FIXTURES = Path(__file__).parent / "fixtures"
DEMO = {"rollout.max_new_tokens": 10, "data.eval_size": 200, "sft.steps": 250, "sft.lr": 1e-3,
        "sft.time_budget_s": 300.0, "trainer.time_budget_s": 420.0, "optim.lr": 5e-5}
"""What the demo ran with before presets existed (the job defaults of 3b8954b)."""


def value(cfg, key: str):
    for part in key.split("."):
        cfg = getattr(cfg, part)
    return cfg


@pytest.fixture
def model_dir(tmp_path):
    """A local model directory (its config.json is all a plan reads)."""
    d = tmp_path / "my-model"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "qwen2", "hidden_size": 64, "intermediate_size": 128,
                                               "num_hidden_layers": 2, "num_attention_heads": 4,
                                               "num_key_value_heads": 2, "vocab_size": 1000}))
    return str(d)


def gsm8k_job(model_dir: str, *extra: str) -> GRPOJobConfig:
    return load_config(GRPOJobConfig, [f"model.path={model_dir}", "task=gsm8k",
                                       f"data.path={FIXTURES / 'gsm8k.jsonl'}", *extra]).validate()


def test_no_argument_config_keeps_every_demo_value():
    cfg = load_config(GRPOJobConfig, []).validate()
    assert {k: value(cfg, k) for k in DEMO} == DEMO == TASK_PRESETS["arithmetic"]
    assert cfg.model.dtype == "float32" and cfg.task == "arithmetic" and cfg.model.path == ""
    # the rest of what the demo relied on is unchanged job defaults
    assert (cfg.rollout.prompts_per_step, cfg.rollout.group_size, cfg.rollout.max_staleness) == (16, 8, 1)
    assert (cfg.trainer.steps, cfg.trainer.eval_every, cfg.sft.batch_size, cfg.sft.warmup_steps) == (500, 100, 64, 20)
    assert cfg.optim.warmup_steps == 10 and cfg.data.max_operand == 29 and cfg.inference.engine == "transformers"
    # the CPU demo recipe is the same job, value for value
    recipe = load_config(GRPOJobConfig, [f"config={Path(__file__).parents[1] / 'recipes' / 'cpu_demo.yaml'}"])
    assert dataclasses.asdict(recipe.validate()) == dataclasses.asdict(cfg)


def test_a_gsm8k_job_on_a_local_model_inherits_no_demo_value(model_dir):
    from rayllm_rl.orchestration.factories import build_task
    from rayllm_rl.job.describe import describe_job
    from rayllm_rl.algorithm.sft_warmup import sft_warm_start

    cfg = gsm8k_job(model_dir)
    for key, demo in DEMO.items():
        assert value(cfg, key) != demo, f"{key} kept the demo's {demo}"
    assert cfg.sft.steps == 0 and cfg.trainer.time_budget_s == 0 and cfg.sft.time_budget_s == 0  # none, no limit
    assert cfg.rollout.max_new_tokens == 512 and cfg.data.eval_size == 500 and cfg.optim.lr == 1e-6
    assert cfg.model.dtype == "float32"  # no GPUs asked for
    # the task builds from the file (5 rows: a fifth held out, as for any file smaller than eval_size)
    task = build_task(cfg)
    assert (len(task.train), len(task.eval)) == (4, 1)
    # no SFT warm start happens: neither the optimizer nor a train step is touched
    calls = []
    assert sft_warm_start(cfg, task, None, None, lambda *a: calls.append("step"),
                          lambda *a: calls.append("reset")) is None
    assert calls == []
    plan = describe_job(cfg)
    assert plan["schedule"] == {"sft_steps": 0, "rl_steps": 500, "optim_lr": 1e-6, "trainer_time_budget_s": 0.0,
                                "optim_lr_schedule": "warm-up 10 steps, then constant",
                                "eval": "500 prompts held out of the training rows"}
    assert plan["rollout"]["max_new_tokens"] == 512 and plan["model"]["config_source"].startswith(model_dir)


@pytest.mark.parametrize("task", ["gsm8k", "math", "ifeval"])
def test_each_task_has_its_generation_length(task):
    cfg = resolve_presets(load_config(GRPOJobConfig, [f"task={task}"]))
    assert cfg.rollout.max_new_tokens == TASK_PRESETS[task]["rollout.max_new_tokens"] >= 512
    assert cfg.sft.steps == 0 and cfg.trainer.time_budget_s == 0


def test_command_line_values_win_over_the_preset(model_dir):
    cfg = gsm8k_job(model_dir, "rollout.max_new_tokens=64", "sft.steps=3", "trainer.time_budget_s=60",
                    "optim.lr=3e-6", "data.eval_size=2")
    assert (cfg.rollout.max_new_tokens, cfg.sft.steps, cfg.trainer.time_budget_s, cfg.optim.lr, cfg.data.eval_size) \
        == (64, 3, 60.0, 3e-6, 2)
    assert cfg.sft.lr == 1e-5  # the fields not given still take the gsm8k preset
    demo = resolve_presets(load_config(GRPOJobConfig, ["sft.steps=0", "rollout.max_new_tokens=12"]))  # and on the demo
    assert (demo.sft.steps, demo.rollout.max_new_tokens, demo.trainer.time_budget_s) == (0, 12, 420.0)
    # 'null' hands a field back to the preset
    math = load_config(GRPOJobConfig, ["task=math", "rollout.max_new_tokens=77", "rollout.max_new_tokens=null"])
    assert resolve_presets(math).rollout.max_new_tokens == 1024


def test_yaml_values_win_and_the_command_line_wins_over_yaml(tmp_path, model_dir):
    path = tmp_path / "job.yaml"
    path.write_text("task: gsm8k\nrollout:\n  max_new_tokens: 300\nsft:\n  steps: 7\ntrainer:\n  time_budget_s: 90\n")
    cfg = load_config(GRPOJobConfig, [f"config={path}"]).validate()
    assert ((cfg.rollout.max_new_tokens, cfg.sft.steps, cfg.trainer.time_budget_s, cfg.data.eval_size)
            == (300, 7, 90.0, 500))
    cfg = load_config(GRPOJobConfig, [f"config={path}", "rollout.max_new_tokens=200"]).validate()
    assert cfg.rollout.max_new_tokens == 200


def test_python_values_win_and_resolution_is_a_pure_idempotent_function():
    cfg = GRPOJobConfig(task="gsm8k")
    cfg.rollout.max_new_tokens = 100
    cfg.sft.steps = 5
    before = dataclasses.asdict(cfg)
    resolved = cfg.validate()
    assert resolved is not cfg and dataclasses.asdict(cfg) == before  # a new config; the user's is left as it was
    assert (resolved.rollout.max_new_tokens, resolved.sft.steps, resolved.trainer.time_budget_s, resolved.optim.lr) \
        == (100, 5, 0.0, 1e-6)
    assert cfg.optim.lr is None and cfg.model.dtype == "auto"  # still the preset's to fill
    assert dataclasses.asdict(resolve_presets(resolved)) == dataclasses.asdict(resolved)  # idempotent
    # a value the user sets on a resolved config is theirs: resolving again keeps it
    resolved.trainer.time_budget_s = 30.0
    assert resolved.validate().trainer.time_budget_s == 30.0
    # so is every value a resolution filled: move to another task from the config as loaded
    resolved.task = "math"
    assert resolved.validate().rollout.max_new_tokens == 100 and resolved.validate().data.eval_size == 500


def test_changing_the_task_of_a_loaded_config_takes_the_new_presets_not_the_old_ones():
    """`train(load_config(...), ["task=gsm8k"])` and `cfg.task = ...; cfg.validate()` must not leak the demo."""
    from rayllm_rl.config import apply_dict, parse_overrides

    demo = load_config(GRPOJobConfig, ["sft.batch_size=32", "rollout.max_new_tokens=12"])  # arithmetic
    assert resolve_presets(demo).sft.steps == 250
    moved = apply_dict(demo, parse_overrides(["task=gsm8k"])).validate()
    assert (moved.sft.steps, moved.trainer.time_budget_s, moved.optim.lr) == (0, 0.0, 1e-6)
    assert moved.rollout.max_new_tokens == 12 and moved.sft.batch_size == 32  # the user's values stay
    demo.task = "math"
    math = demo.validate()
    assert (math.sft.steps, math.data.eval_size, math.rollout.max_new_tokens) == (0, 500, 12)


def test_the_python_api_resolves_after_its_overrides(tmp_path, monkeypatch):
    """`train(config, [...])`: the config the job records is resolved for the overridden task. The job
    stops at its first real step (an offline hub id that is not cached), after writing its config.json."""
    from rayllm_rl import train

    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")

    def recorded(config, overrides):
        run_root = tmp_path / f"runs{len(list(tmp_path.glob('runs*')))}"
        with pytest.raises(ValueError, match="acme/not-cached"):
            train(config, [*overrides, "trainer.backend=local", "model.path=acme/not-cached",
                           f"trainer.run_dir={run_root}"])
        return json.loads(next(run_root.glob("*/config.json")).read_text())

    base = GRPOJobConfig()
    saved = recorded(base, ["task=gsm8k", "rollout.max_new_tokens=256"])
    assert ((saved["rollout"]["max_new_tokens"], saved["sft"]["steps"], saved["trainer"]["time_budget_s"])
            == (256, 0, 0.0))
    assert dataclasses.asdict(base) == dataclasses.asdict(GRPOJobConfig())  # the caller's config is left alone
    saved = recorded(base, [])  # so reusing it runs the demo's preset, not the gsm8k run's values
    assert (saved["sft"]["steps"], saved["rollout"]["max_new_tokens"]) == (250, 10)
    saved = recorded(load_config(GRPOJobConfig, []), ["task=math"])  # a config loaded for the demo first
    assert (saved["sft"]["steps"], saved["rollout"]["max_new_tokens"], saved["optim"]["lr"]) == (0, 1024, 1e-6)


@pytest.fixture
def recorded(tmp_path, monkeypatch):
    """`recorded(config, overrides)`: the config.json a `train(config, overrides)` job writes; the job stops
    at its first real step (an offline hub id that is not cached), before Ray or any actor starts."""
    from rayllm_rl import train

    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")

    def run(config, overrides, backend="local"):
        run_root = tmp_path / f"runs{len(list(tmp_path.glob('runs*')))}"
        with pytest.raises(ValueError, match="acme/not-cached"):
            train(config, [*overrides, f"trainer.backend={backend}", "model.path=acme/not-cached",
                           f"trainer.run_dir={run_root}"])
        return json.loads(next(run_root.glob("*/config.json")).read_text())
    return run


def test_a_train_override_equal_to_an_earlier_preset_is_the_users(recorded):
    """The demo's preset filled 10 tokens and 250 SFT steps; overriding them with those same values while
    moving to gsm8k keeps them (they were not taken for leftovers of the demo)."""
    demo = load_config(GRPOJobConfig, [])
    saved = recorded(demo, ["task=gsm8k", "rollout.max_new_tokens=10", "sft.steps=250"])
    assert (saved["rollout"]["max_new_tokens"], saved["sft"]["steps"]) == (10, 250)
    # the keys not overridden still move to gsm8k's presets, in touched and untouched sections alike
    assert (saved["sft"]["lr"], saved["sft"]["time_budget_s"], saved["optim"]["lr"]) == (1e-5, 0.0, 1e-6)
    saved = recorded(demo, ["task=gsm8k", "rollout.temperature=0.7", "optim.warmup_steps=3"])
    assert ((saved["rollout"]["max_new_tokens"], saved["optim"]["lr"], saved["rollout"]["temperature"])
            == (512, 1e-6, 0.7))
    assert dataclasses.asdict(demo) == dataclasses.asdict(load_config(GRPOJobConfig, []))  # caller's untouched


def test_an_explicit_dtype_equal_to_the_cpu_auto_value_wins_on_gpus(recorded):
    cpu = load_config(GRPOJobConfig, [])  # dtype auto: float32 on this placement
    gpus = ["inference.engine=vllm", "ray.gpus_per_replica=1", "ray.gpus_per_learner=1"]
    assert recorded(cpu, [*gpus, "model.dtype=float32"], backend="ray")["model"]["dtype"] == "float32"
    assert recorded(cpu, gpus, backend="ray")["model"]["dtype"] == "bfloat16"  # left to auto: follows the GPUs


def test_a_python_assignment_equal_to_the_preset_is_the_users(recorded):
    cfg = load_config(GRPOJobConfig, [])  # the demo's preset would fill optim.lr 5e-5
    cfg.optim.lr = 5e-5  # the user's now, though the same number
    saved = recorded(cfg, ["task=gsm8k", "optim.warmup_steps=3"])  # the optim section is rebuilt by the override
    assert (saved["optim"]["lr"], saved["optim"]["warmup_steps"], saved["rollout"]["max_new_tokens"]) == (5e-5, 3, 512)
    cfg.task = "gsm8k"
    gsm8k = cfg.validate()
    assert (gsm8k.optim.lr, gsm8k.sft.steps, gsm8k.rollout.max_new_tokens) == (5e-5, 0, 512)
    cfg.rollout.max_new_tokens = 64
    cfg.rollout.max_new_tokens = None  # None hands a field back to the preset
    cfg.task = "math"
    assert (cfg.validate().rollout.max_new_tokens, cfg.optim.lr) == (1024, 5e-5)


@pytest.mark.parametrize("argv, dtype", [
    ([], "float32"),
    (["inference.engine=vllm"], "float32"),  # vLLM's CPU build
    (["inference.engine=vllm", "ray.gpus_per_replica=1"], "float32"),  # the learner is on the CPU
    (["ray.gpus_per_learner=1"], "float32"),  # the replica is on the CPU
    (["inference.engine=vllm", "ray.gpus_per_replica=1", "ray.gpus_per_learner=1"], "bfloat16"),
    (["inference.engine=vllm", "ray.gpus_per_replica=1", "ray.gpus_per_learner=1", "model.dtype=float32"], "float32"),
])
def test_dtype_auto_resolves_from_the_placement(argv, dtype):
    cfg = load_config(GRPOJobConfig, argv).validate()
    assert cfg.model.dtype == dtype
    py = GRPOJobConfig()
    assert py.model.dtype == "auto"  # unresolved until validate
    py.ray.gpus_per_learner = py.ray.gpus_per_replica = 1
    py.inference.engine = "vllm"
    assert py.validate().model.dtype == "bfloat16"
    py.ray.gpus_per_learner = py.ray.gpus_per_replica = 0  # auto follows the placement while it is auto's value
    assert py.validate().model.dtype == "float32"


def test_help_shows_the_fields_left_to_the_preset():
    text = describe(GRPOJobConfig())
    for key in ("rollout.max_new_tokens=None", "sft.steps=None", "trainer.time_budget_s=None", "optim.lr=None",
                "data.eval_size=None", "model.dtype='auto'"):
        assert key in text
    assert "None = the task's preset" in text


@pytest.mark.parametrize("argv, message", [
    (["rollout.max_new_tokens=0"], "rollout.max_new_tokens=0: must be > 0"),
    (["sft.steps=-1"], "sft.steps=-1: must be >= 0"),
    (["trainer.time_budget_s=-5"], "trainer.time_budget_s=-5.0: must be >= 0"),
    (["optim.lr=0"], "optim.lr=0.0: must be > 0"),
])
def test_bad_values_of_preset_fields_name_the_key(argv, message):
    with pytest.raises(ValueError, match=message):
        load_config(GRPOJobConfig, argv).validate()
