"""rayllm_rl.config: overrides with type coercion, YAML files, error messages, field docstrings, and
the real GRPOJobConfig (overrides, build_loss, a docstring on every field)."""
from __future__ import annotations

import dataclasses
from typing import Literal, Optional

import pytest

from rayllm_rl.config import ConfigError, apply_dict, describe, field_docs, load_config, parse_overrides


@dataclasses.dataclass
class Inner:
    """Innermost section."""

    depth: int = 2
    """How deep to go."""
    mode: Literal["fast", "slow"] = "fast"
    """Speed mode."""


@dataclasses.dataclass
class Optim:
    """Optimizer section."""

    lr: float = 1e-3
    """Learning rate."""
    steps: int = 10
    """Number of
    optimizer   steps."""
    use_ema: bool = False
    """Keep an EMA copy of the weights."""
    betas: tuple[float, ...] = (0.9, 0.99)
    """Adam betas."""
    milestones: tuple[int, ...] = (1, 2)
    """Steps at which the lr decays."""
    inner: Inner = dataclasses.field(default_factory=Inner)
    """Nested sub-section."""


@dataclasses.dataclass
class Job:
    """Top-level test config."""

    name: str = "demo"
    """Run name."""
    seed: Optional[int] = None
    """Optional seed; None means random."""
    optim: Optim = dataclasses.field(default_factory=Optim)
    """Optimizer settings."""


@dataclasses.dataclass
class Partial:
    documented: int = 1
    """Has a doc."""
    undocumented: int = 2
    also_documented: str = "x"
    """Second doc."""


@dataclasses.dataclass
class ChildInner(Inner):
    extra: float = 0.5
    """Added by the subclass."""


@dataclasses.dataclass
class Pep604:
    maybe: int | None = None
    """An optional int written with PEP 604 syntax."""


OPTIM_KEYS = "['betas', 'inner', 'lr', 'milestones', 'steps', 'use_ema']"


# ---------------------------------------------------------------- parse_overrides


def test_parse_overrides_nests_keys_and_keeps_text_for_the_field_type():
    got = parse_overrides(["a.b=1", "a.c=x", "a.d.e=0.28", "f=true", "g=1,2", "h=", "i=null", "j=k=v"])
    assert got == {"a": {"b": "1", "c": "x", "d": {"e": "0.28"}}, "f": "true", "g": "1,2", "h": "", "i": "null",
                   "j": "k=v"}


def test_parse_overrides_without_equals_raises():
    with pytest.raises(ConfigError, match=r"override 'a\.b' must look like key\.sub=value"):
        parse_overrides(["a.b"])


def test_parse_overrides_conflicting_scalar_then_section_raises():
    with pytest.raises(ConfigError, match=r"conflicts with an earlier override of 'a'"):
        parse_overrides(["a=1", "a.b=2"])


def test_config_error_is_a_value_error():
    assert issubclass(ConfigError, ValueError)


# ---------------------------------------------------------------- load_config / apply_dict


def test_defaults_without_argv():
    assert load_config(Job) == Job()
    assert load_config(Job, []) == Job()


def test_overrides_coerce_types():
    cfg = load_config(Job, [
        "optim.steps=3", "optim.lr=0.28", "optim.use_ema=true", "optim.milestones=1,2,5",
        "optim.betas=0.5,0.6", "optim.inner.depth=7", "optim.inner.mode=slow", "seed=42", "name=run1",
    ])
    assert cfg.optim.steps == 3 and type(cfg.optim.steps) is int
    assert cfg.optim.lr == 0.28 and type(cfg.optim.lr) is float
    assert cfg.optim.use_ema is True
    assert cfg.optim.milestones == (1, 2, 5) and type(cfg.optim.milestones) is tuple
    assert cfg.optim.betas == (0.5, 0.6)
    assert cfg.optim.inner == Inner(depth=7, mode="slow")
    assert cfg.seed == 42
    assert cfg.name == "run1"


def test_overrides_leave_other_fields_at_defaults():
    cfg = load_config(Job, ["optim.steps=3"])
    assert cfg == Job(optim=Optim(steps=3))


@pytest.mark.parametrize("raw, expected", [("true", True), ("false", False), ("True", True), ("no", False)])
def test_bool_override(raw, expected):
    assert load_config(Job, [f"optim.use_ema={raw}"]).optim.use_ema is expected


def test_int_literal_becomes_float_and_integral_float_becomes_int():
    cfg = load_config(Job, ["optim.lr=1", "optim.steps=4.0"])
    assert cfg.optim.lr == 1.0 and type(cfg.optim.lr) is float
    assert cfg.optim.steps == 4 and type(cfg.optim.steps) is int


def test_optional_field_accepts_null_and_int():
    assert load_config(Job, ["seed=null"]).seed is None
    assert load_config(Job, ["seed=-3"]).seed == -3


def test_apply_dict_coerces_strings_and_does_not_mutate_input():
    base = Job()
    new = apply_dict(base, {"optim": {"steps": "3", "lr": "0.28", "use_ema": "yes", "milestones": "4,5"}})
    assert new.optim.steps == 3 and type(new.optim.steps) is int
    assert new.optim.lr == 0.28
    assert new.optim.use_ema is True
    assert new.optim.milestones == (4, 5)
    assert apply_dict(base, {"optim": {"use_ema": "0"}}).optim.use_ema is False
    assert base == Job()  # original untouched


def test_yaml_file_and_cli_override_wins(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text(
        "name: fromfile\n"
        "optim:\n"
        "  lr: 0.5\n"
        "  steps: 20\n"
        "  milestones: [3, 4]\n"
        "  inner:\n"
        "    mode: slow\n"
    )
    cfg = load_config(Job, [f"config={path}"])
    assert cfg == Job(name="fromfile", optim=Optim(lr=0.5, steps=20, milestones=(3, 4), inner=Inner(mode="slow")))
    # a CLI override beats the file whatever its position on the command line
    for argv in ([f"config={path}", "optim.steps=99"], ["optim.steps=99", f"config={path}"]):
        cfg = load_config(Job, argv)
        assert cfg.optim.steps == 99
        assert cfg.optim.lr == 0.5
        assert cfg.name == "fromfile"


def test_empty_yaml_file_gives_defaults(tmp_path):
    path = tmp_path / "empty.yaml"
    path.write_text("")
    assert load_config(Job, [f"config={path}"]) == Job()


def test_yaml_file_must_hold_a_mapping(tmp_path):
    path = tmp_path / "list.yaml"
    path.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="must hold a mapping at top level"):
        load_config(Job, [f"config={path}"])


def test_missing_yaml_file_names_it(tmp_path):
    with pytest.raises(ConfigError, match=r"config file '.*no-such\.yaml' does not exist"):
        load_config(Job, [f"config={tmp_path / 'no-such.yaml'}"])


@dataclasses.dataclass
class WithPreset:
    """A config whose `size` defaults to a value derived from `kind` (as the job's task presets)."""

    kind: Literal["small", "large"] = "small"
    """Which preset."""
    size: Optional[int] = None
    """None = the kind's preset."""


def test_load_config_returns_what_the_user_wrote_and_resolution_is_the_callers(tmp_path):
    path = tmp_path / "p.yaml"
    path.write_text("kind: large\n")
    assert load_config(WithPreset, [f"config={path}"]) == WithPreset("large", None)  # left to the preset
    assert load_config(WithPreset, [f"config={path}", "size=7"]) == WithPreset("large", 7)  # a value given stays
    assert load_config(Job, []) == Job()


def test_unknown_key_in_yaml_file_names_it(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("optim:\n  lrr: 0.1\n")
    with pytest.raises(ConfigError, match=r"unknown config key 'optim\.lrr'"):
        load_config(Job, [f"config={path}"])


def test_unknown_key_names_it_and_lists_valid_keys():
    with pytest.raises(ConfigError) as ei:
        load_config(Job, ["optim.nope=1"])
    msg = str(ei.value)
    assert "unknown config key 'optim.nope'" in msg
    assert f"valid keys here: {OPTIM_KEYS}" in msg


def test_unknown_top_level_key():
    with pytest.raises(ConfigError, match=r"unknown config key 'bogus'; valid keys here: \['name', 'optim', 'seed'\]"):
        load_config(Job, ["bogus=1"])


def test_unknown_nested_key_in_sub_section():
    with pytest.raises(ConfigError,
                       match=r"unknown config key 'optim\.inner\.width'; valid keys here: \['depth', 'mode'\]"):
        load_config(Job, ["optim.inner.width=3"])


@pytest.mark.parametrize("override, key, kind", [
    ("optim.steps=abc", "optim.steps", "expected an int"),
    ("optim.steps=2.5", "optim.steps", "expected an int"),
    ("optim.steps=true", "optim.steps", "expected an int"),
    ("optim.lr=abc", "optim.lr", "expected a float"),
    ("optim.use_ema=maybe", "optim.use_ema", "expected a bool"),
    ("optim.milestones=a,b", "optim.milestones", "expected an int"),
    ("optim.inner.mode=medium", "optim.inner.mode", "is not one of"),
    ("seed=abc", "seed", "does not match"),
])
def test_wrong_type_names_the_key(override, key, kind):
    with pytest.raises(ConfigError) as ei:
        load_config(Job, [override])
    msg = str(ei.value)
    assert f"config key {key!r}" in msg
    assert kind in msg


@pytest.mark.parametrize("override, key", [("optim=3", "optim"), ("optim.inner=x", "optim.inner")])
def test_setting_a_section_to_a_scalar_errors(override, key):
    with pytest.raises(ConfigError, match=rf"config key '{key}' is a section"):
        load_config(Job, [override])


# ---------------------------------------------------------------- field_docs / describe


def test_field_docs_returns_the_docstrings():
    assert field_docs(Optim) == {
        "lr": "Learning rate.",
        "steps": "Number of optimizer steps.",  # whitespace collapsed
        "use_ema": "Keep an EMA copy of the weights.",
        "betas": "Adam betas.",
        "milestones": "Steps at which the lr decays.",
        "inner": "Nested sub-section.",
    }
    assert field_docs(Inner) == {"depth": "How deep to go.", "mode": "Speed mode."}


def test_field_docs_skips_undocumented_fields():
    assert field_docs(Partial) == {"documented": "Has a doc.", "also_documented": "Second doc."}


def test_field_docs_includes_inherited_fields():
    assert field_docs(ChildInner) == {"depth": "How deep to go.", "mode": "Speed mode.",
                                      "extra": "Added by the subclass."}


def test_describe_lists_keys_defaults_and_docs():
    assert describe(Job()).splitlines() == [
        "  name='demo'  Run name.",
        "  seed=None  Optional seed; None means random.",
        "optim: Optimizer settings.",
        "  optim.lr=0.001  Learning rate.",
        "  optim.steps=10  Number of optimizer steps.",
        "  optim.use_ema=False  Keep an EMA copy of the weights.",
        "  optim.betas=(0.9, 0.99)  Adam betas.",
        "  optim.milestones=(1, 2)  Steps at which the lr decays.",
        "optim.inner: Nested sub-section.",
        "  optim.inner.depth=2  How deep to go.",
        "  optim.inner.mode='fast'  Speed mode.",
    ]


def test_describe_shows_current_values_not_class_defaults():
    text = describe(load_config(Job, ["optim.inner.depth=9"]))
    assert "  optim.inner.depth=9  How deep to go." in text.splitlines()


# ---------------------------------------------------------------- regressions of bugs found in review


def test_pep604_optional_rejects_wrong_type():
    with pytest.raises(ConfigError, match="'maybe'"):
        load_config(Pep604, ["maybe=abc"])


def test_bool_override_accepts_1_and_0():
    assert load_config(Job, ["optim.use_ema=1"]).optim.use_ema is True
    assert load_config(Job, ["optim.use_ema=0"]).optim.use_ema is False


def test_float_field_rejects_bool():
    with pytest.raises(ConfigError, match="'optim.lr'"):
        load_config(Job, ["optim.lr=true"])


def test_single_value_tuple_override():
    assert load_config(Job, ["optim.milestones=5"]).optim.milestones == (5,)


def test_str_field_keeps_the_text_as_typed():
    assert load_config(Job, ["name=1.10"]).name == "1.10"


# ---------------------------------------------------------------- the real job config


def test_grpo_job_config_overrides_and_build_loss():
    from rayllm_rl.objectives import GRPOLoss
    from rayllm_rl.job.config import GRPOJobConfig

    cfg = load_config(GRPOJobConfig, ["algo.clip_eps_high=0.28", "rollout.group_size=4", "algo.advantage.std=false"])
    assert cfg.algo.clip_eps_high == 0.28
    assert cfg.rollout.group_size == 4
    assert cfg.algo.advantage.std is False
    # untouched neighbours keep their defaults (the chosen loss's own, held by its options class)
    assert cfg.algo.clip_eps_low == 0.2
    assert cfg.algo.advantage.mean is True
    assert cfg.algo.advantage.mode == "group"
    assert cfg.rollout.prompts_per_step == 16
    assert cfg.optim.lr is None and cfg.optim.warmup_steps == 10  # None: the task's preset, filled by validate()
    assert cfg.validate().optim.lr == 5e-5
    loss = cfg.algo.build_loss()
    assert loss.clip_eps_low == 0.2  # GRPOLoss default
    assert type(loss) is GRPOLoss
    assert loss.clip_eps_high == 0.28
    assert loss.clip_eps_low == 0.2
    assert loss.kl_coef == 0.0
    assert loss.aggregation == "token-mean"


def test_grpo_job_config_build_sft_loss():
    from rayllm_rl.objectives import SFTLoss
    from rayllm_rl.job.config import GRPOJobConfig

    loss = load_config(GRPOJobConfig, ["algo.name=sft", "algo.aggregation=seq-mean"]).algo.build_loss()
    assert type(loss) is SFTLoss
    assert loss.aggregation == "seq-mean"


def test_grpo_job_config_unknown_loss_name():
    from rayllm_rl.job.config import GRPOJobConfig

    with pytest.raises(ValueError, match=r"'algo.name': 'nope' is not one of \('grpo', 'dapo'"):
        load_config(GRPOJobConfig, ["algo.name=nope"])  # at parse time, before anything is built
    cfg = GRPOJobConfig()
    cfg.algo.name = "nope"  # set from Python: build_loss still names the registered losses
    with pytest.raises(ValueError, match=r"unknown algo\.name 'nope'; choose one of \[.*'dapo'.*'grpo'.*\]"):
        cfg.algo.build_loss()


def test_grpo_job_config_invalid_advantage_mode_fails_at_load():
    from rayllm_rl.objectives.advantages import AdvantageConfig
    from rayllm_rl.job.config import GRPOJobConfig

    with pytest.raises(ValueError, match=r"'algo.advantage.mode': 'bogus' is not one of \('group', 'global', 'none'\)"):
        load_config(GRPOJobConfig, ["algo.advantage.mode=bogus"])
    with pytest.raises(ValueError, match="unknown advantage mode 'bogus'"):  # set from Python
        AdvantageConfig(mode="bogus")


def test_grpo_job_config_unknown_key_lists_section_keys():
    from rayllm_rl.job.config import GRPOJobConfig

    with pytest.raises(ConfigError, match=r"unknown config key 'rollout\.groupsize'.*'group_size'"):
        load_config(GRPOJobConfig, ["rollout.groupsize=4"])


def _walk(cls, prefix=""):
    """Yield (dotted key, owning class, field name) for every field of cls and its nested sections."""
    inst = cls()
    for f in dataclasses.fields(cls):
        key = f"{prefix}{f.name}"
        yield key, cls, f.name
        value = getattr(inst, f.name)
        if dataclasses.is_dataclass(value):
            yield from _walk(type(value), key + ".")


def test_every_grpo_job_config_field_has_a_docstring():
    """Project rule: a docstring per config field (what `--help` prints)."""
    from rayllm_rl.job.config import GRPOJobConfig

    entries = list(_walk(GRPOJobConfig))
    keys = {k for k, _, _ in entries}
    # the walk really descends into every section, including the nested advantage config
    assert {"model.path", "algo.clip_eps_high", "algo.advantage.std", "optim.lr", "trainer.run_dir"} <= keys
    assert len(entries) >= 40
    missing = [k for k, cls, name in entries if not field_docs(cls).get(name, "").strip()]
    assert missing == []
    # the same check does catch an undocumented field
    assert [k for k, cls, name in _walk(Partial) if not field_docs(cls).get(name, "").strip()] == ["undocumented"]


# ---------------------------------------------------------------- job config: engine and placement checks
def _job(*argv):
    from rayllm_rl.job.config import GRPOJobConfig

    return load_config(GRPOJobConfig, list(argv))


def test_engine_names_the_registered_engines():
    with pytest.raises(ValueError, match=r"inference.engine must be one of \('transformers', 'vllm'\), got 'sglang'"):
        _job("inference.engine=sglang").validate(environment=False)


def test_engine_options_are_the_engines_own_and_typed():
    """`inference.options.*` is checked against the chosen engine's Options before any actor starts."""
    from rayllm_rl.inference.registry import engine_options

    cfg = _job("inference.engine=vllm", "inference.options.kv_cache_mb=512", "inference.options.enforce_eager=false")
    opts = engine_options(cfg.inference.engine, cfg.inference.options)
    assert (opts.kv_cache_mb, opts.enforce_eager, opts.max_num_seqs) == (512, False, 256)  # typed; defaults kept
    with pytest.raises(ValueError, match=r"unknown config key 'inference.options.kv_cache'.*engine=vllm"):
        _job("inference.engine=vllm", "inference.options.kv_cache=1").validate(environment=False)
    with pytest.raises(ValueError, match=r"inference.options.kv_cache_mb.*(int|integer)"):
        _job("inference.engine=vllm", "inference.options.kv_cache_mb=lots").validate(environment=False)
    with pytest.raises(ValueError, match=r"unknown config key 'inference.options.kv_cache_mb'.*engine=transformers"):
        _job("inference.options.kv_cache_mb=128").validate(environment=False)


@pytest.mark.parametrize("argv, message", [
    (["inference.engine=vllm", "trainer.backend=local"], "trainer.backend=ray"),
    (["inference.options.device=cuda"], "inference.options.device=cuda needs ray.gpus_per_replica > 0"),
    (["ray.sync_transport=nccl"], "ray.gpus_per_learner > 0"),
    (["model.dtype=bfloat16"], "model.dtype=bfloat16"),
    (["inference.engine=vllm", "ray.gpus_per_replica=1", "ray.tensor_parallel_size=2"], "ray.tensor_parallel_size"),
    (["ray.gpus_per_learner=-1"], "ray.gpus_per_learner"),
])
def test_engine_and_placement_mistakes_fail_before_any_actor(argv, message):
    cfg = _job(*argv)
    with pytest.raises(ValueError, match=message.replace(".", r"\.").replace("(", r"\(")):
        cfg.validate()


def test_valid_gpu_config_passes_validation():
    cfg = _job("inference.engine=vllm", "model.dtype=bfloat16", "ray.gpus_per_replica=2", "ray.tensor_parallel_size=2",
               "ray.gpus_per_learner=1", "ray.sync_transport=nccl")
    resolved = cfg.validate()
    assert resolved is not cfg and resolved.model.dtype == "bfloat16" and resolved.rollout.max_new_tokens == 10


@pytest.mark.slow
def test_python_api_is_lazy_and_validates_before_starting():
    import subprocess
    import sys

    code = ("import sys, rayllm_rl; from rayllm_rl import GRPOJobConfig, train; "
            "assert 'ray' not in sys.modules, 'importing the API must not import ray'; "
            "import rayllm_rl.rollout.replay_buffer; assert 'ray' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
    from rayllm_rl import GRPOJobConfig, train

    with pytest.raises(ValueError, match=r"rollout.top_p must be in \(0, 1\].*got 1.5"):
        train(GRPOJobConfig(), ["inference.engine=vllm", "rollout.top_p=1.5"])
