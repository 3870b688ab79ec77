"""Config mistakes fail before any actor starts, naming the key, the value and what is allowed."""
from __future__ import annotations

import pytest

from rayllm_rl.config import ConfigError, load_config
from rayllm_rl.job.config import GRPOJobConfig


def cfg_of(*overrides: str) -> GRPOJobConfig:
    return load_config(GRPOJobConfig, list(overrides)).validate()


@pytest.mark.parametrize("override,key", [("trainer.backend=lcoal", "trainer.backend"),
                                          ("ray.sync_transport=tcp", "ray.sync_transport")])
def test_enum_typos_name_key_value_and_allowed(override, key):
    value = override.split("=")[1]
    with pytest.raises(ConfigError, match=rf"{key}.*{value}.*not one of"):
        cfg_of(override)


def test_a_task_typo_names_the_built_in_tasks_and_the_close_one():
    """`task` is a built-in name (the registry) or an import path; a typo fails before anything starts."""
    with pytest.raises(ValueError, match=r"task='gsm9k' is neither a built-in task \['arithmetic', 'gsm8k', 'ifeval', "
                                         r"'math', 'openenv', 'prompts', 'reasoning_gym', 'verifiers'\] "
                                         r"\(close: \['gsm8k'\]\) nor an import path"):
        cfg_of("task=gsm9k")


def test_a_workflow_typo_names_the_built_in_workflows_and_the_close_one():
    """`rollout.workflow` is a built-in name or an import path of a workflow of your own (test_custom_workflow.py)."""
    with pytest.raises(ValueError, match=r"rollout.workflow='rlvx' is neither a built-in workflow \['auto', 'rlvr', "
                                         r"'multi_turn', 'env', 'openai_agent', 'python_tool'\] \(close: \['rlvr'\]\) "
                                         r"nor an import path 'package.module:Name'"):
        cfg_of("rollout.workflow=rlvx")


def test_enum_set_in_python_is_checked_too():
    cfg = GRPOJobConfig()
    cfg.trainer.backend = "lcoal"
    with pytest.raises(ConfigError, match=r"'trainer.backend': 'lcoal' is not one of"):
        cfg.validate()
    cfg = GRPOJobConfig()
    cfg.rollout.workflow = "multiturn"
    with pytest.raises(ValueError, match=r"rollout.workflow='multiturn' is neither a built-in workflow .* \(close: "
                                         r"\['multi_turn'\]\)"):
        cfg.validate()


@pytest.mark.parametrize("overrides,message", [
    (["rollout.workflow=rlvr", "rollout.max_turns=3"], "rollout.max_turns=3 is read only by"),
    (["rollout.workflow=rlvr", "rollout.turn_discount=0.5"], "rollout.turn_discount is read only by"),
    (["rollout.agent=rayllm_rl.agents.examples:answer_then_check"], "goes with rollout.workflow=openai_agent"),
    (["rollout.workflow=openai_agent"], "goes with rollout.workflow=openai_agent"),
    (["rollout.workflow=openai_agent", "rollout.agent=no.such.module:fn"], "cannot import 'no.such.module:fn'"),
    (["rollout.workflow=env"], "task=arithmetic has none"),
    (["trainer.keep_checkpoints=-1"], "trainer.keep_checkpoints=-1: must be >= 0"),
    (["ray.env_worker_restarts=-2"], "ray.env_worker_restarts=-2"),
    (["ray.sync_bucket_mb=-1"], "ray.sync_bucket_mb=-1"),
    (["trainer.callbacks=[rayllm_rl.callbacks:Callback,no.such.module:Cb]"],
     r"trainer.callbacks\[1\]: cannot import 'no.such.module:Cb'"),
])
def test_fields_the_chosen_workflow_does_not_read_are_errors(overrides, message):
    with pytest.raises(ValueError, match=message):
        cfg_of(*overrides)


def test_valid_combinations_pass():
    cfg_of("rollout.workflow=multi_turn", "rollout.max_turns=3", "rollout.turn_discount=0.5")
    cfg_of("rollout.workflow=openai_agent", "rollout.agent=rayllm_rl.agents.examples:answer_then_check")
    cfg_of("task=gsm8k", "rollout.workflow=env", "rollout.max_turns=2")


def test_train_refuses_a_bad_config_before_ray_starts():
    import ray

    from rayllm_rl import train

    assert not ray.is_initialized()
    with pytest.raises(ValueError, match="rollout.max_turns"):
        train(overrides=["rollout.workflow=rlvr", "rollout.max_turns=4"])
    assert not ray.is_initialized()


def test_a_loss_field_the_chosen_loss_never_reads_is_an_error():
    with pytest.raises(ValueError, match=r"algo.kl_coef=0.1 is not read by algo.name=cispo \(it is by \['dr_grpo', "
                                         r"'grpo', 'grpo_tis', 'ppo_decoupled'\]\)"):
        cfg_of("algo.name=cispo", "algo.kl_coef=0.1")
    with pytest.raises(ValueError, match="algo.tis_cap=2.0 is not read by algo.name=grpo"):
        cfg_of("algo.tis_cap=2.0")
    cfg_of("algo.name=grpo", "algo.kl_coef=0.1", "algo.kl_reward_coef=0.01")  # both read, one outside the loss


def test_algo_names_are_the_registered_losses_and_enums_are_checked():
    from rayllm_rl.objectives import LOSSES
    from rayllm_rl.job.config import ALGOS

    assert list(ALGOS) == ["grpo", "dapo", "dr_grpo", "cispo", "ppo_decoupled", "grpo_tis", "sft"]
    assert set(ALGOS) == set(LOSSES)
    with pytest.raises(ConfigError, match="'algo.name': 'grpoo' is not one of"):
        cfg_of("algo.name=grpoo")
    cfg = GRPOJobConfig()
    cfg.algo.kl_estimator = "k4"
    with pytest.raises(ConfigError, match=r"'algo.kl_estimator': 'k4' is not one of \('k1', 'k2', 'k3'\)"):
        cfg.validate()


def test_each_algo_class_is_its_loss_options_class_so_the_defaults_are_the_losses():
    """Each `algo.*` class is its loss's options class (objectives/options.py) plus `AlgoBase`, and `build_loss`
    hands the loss an instance of that class: the defaults are written once. SFT's section keeps only
    `aggregation` of SFTOptions (SFTOptions says why); Dr.GRPO's max_tokens=None is the generation budget."""
    import dataclasses

    from rayllm_rl.objectives import LOSSES
    from rayllm_rl.job.config import ALGOS, AlgoBase

    shared = {f.name for f in dataclasses.fields(AlgoBase)}
    for name, cls in ALGOS.items():
        options_class = LOSSES[name].options_class
        assert name == "sft" or issubclass(cls, options_class), name
        own = [f.name for f in dataclasses.fields(cls) if f.name not in shared]
        assert set(own) <= {f.name for f in dataclasses.fields(options_class)}, name
        options = cls().loss_options(max_new_tokens=7)
        assert type(options) is options_class, name
        for key in own:
            if not (name == "dr_grpo" and key == "max_tokens"):
                assert getattr(options, key) == getattr(options_class(), key), (name, key)
    assert [f.name for f in dataclasses.fields(ALGOS["sft"]) if f.name not in shared] == ["aggregation"]
    assert ALGOS["dr_grpo"]().loss_options(max_new_tokens=7).max_tokens == 7
    assert ALGOS["dr_grpo"](max_tokens=5).loss_options(max_new_tokens=7).max_tokens == 5


def test_a_tilde_key_takes_back_what_the_yaml_set_so_the_loss_can_switch(tmp_path):
    """The SmolLM2 recipe sets a decoupled-PPO option: `algo.name=grpo` alone refuses it (naming `~key`), and
    `~algo.prox_logp_method` returns it to its default first; a `~` of a key that does not exist names it."""
    from rayllm_rl.config import packaged_recipes

    recipe = f"config={packaged_recipes()['smollm2-135m_reasoning-gym_cpu']}"
    assert load_config(GRPOJobConfig, [recipe]).algo.prox_logp_method == "loglinear"
    with pytest.raises(ConfigError, match=r"algo.prox_logp_method=loglinear is not read by algo.name=grpo .*"
                                          r"unset it \(~algo.prox_logp_method on the command line\)"):
        load_config(GRPOJobConfig, [recipe, "algo.name=grpo"])
    algo = load_config(GRPOJobConfig, [recipe, "~algo.prox_logp_method", "algo.name=grpo"]).algo
    assert (algo.name, algo.clip_eps_high) == ("grpo", 0.2)
    ppo = load_config(GRPOJobConfig, [recipe, "~algo.prox_logp_method"]).algo
    assert (ppo.name, ppo.prox_logp_method) == ("ppo_decoupled", "recompute")  # the class's own default
    assert load_config(GRPOJobConfig, [recipe, "~rollout.temperature"]).rollout.temperature == 1.0
    with pytest.raises(ConfigError, match=r"~algo.prox_logp: algo has no key 'prox_logp' \(its keys: "):
        load_config(GRPOJobConfig, [recipe, "~algo.prox_logp"])
    with pytest.raises(ConfigError, match=r"~rollout.temperature.x: rollout.temperature has no key 'x'"):
        load_config(GRPOJobConfig, ["~rollout.temperature.x"])


def test_switching_the_loss_keeps_what_the_user_set_and_takes_the_new_loss_defaults(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text("algo:\n  name: dapo\n  clip_eps_low: 0.1\n  kl_reward_coef: 0.01\n")
    grpo = load_config(GRPOJobConfig, [f"config={path}", "algo.name=grpo"]).algo
    assert (grpo.name, grpo.clip_eps_low, grpo.clip_eps_high, grpo.kl_reward_coef) == ("grpo", 0.1, 0.2, 0.01)
    dapo = load_config(GRPOJobConfig, [f"config={path}"]).algo
    assert (dapo.clip_eps_low, dapo.clip_eps_high) == (0.1, 0.28)  # DAPO's own clip-higher
    with pytest.raises(ConfigError, match=r"algo\.clip_eps_low=0\.1 is not read by algo\.name=sft \(it is by \["):
        load_config(GRPOJobConfig, [f"config={path}", "algo.name=sft"])
    with pytest.raises(ConfigError, match=r"unknown config key algo\.'nope'; valid keys with algo\.name=grpo"):
        cfg_of("algo.nope=1")
    cfg = GRPOJobConfig()
    cfg.algo.name = "dapo"  # set from Python on GRPO's options: refused, not silently GRPO
    with pytest.raises(ValueError, match="'algo.name': 'dapo' is not one of \\('grpo',\\)"):
        cfg.validate()


def test_advantage_mode_is_a_literal():
    with pytest.raises(ConfigError,
                       match=r"'algo.advantage.mode': 'groups' is not one of \('group', 'global', 'none'\)"):
        cfg_of("algo.advantage.mode=groups")


@pytest.mark.parametrize("old, new, value", [
    ("ray.buffer_episodes", "rollout.buffer_episodes", "64"), ("ray.call_timeout_s", "trainer.call_timeout_s", "30"),
])
def test_a_setting_both_backends_read_is_not_under_ray_and_its_old_key_names_the_new_one(old, new, value):
    with pytest.raises(ConfigError, match=f"config key '{old}' moved to '{new}'"):
        load_config(GRPOJobConfig, [f"{old}={value}"])
    from rayllm_rl.job.plan import make_plan

    local = make_plan(cfg_of("trainer.backend=local", "rollout.buffer_episodes=64", "trainer.call_timeout_s=30"))
    assert local.buffer_capacity == 64 and local.config.trainer.call_timeout_s == 30.0


@pytest.mark.parametrize("overrides, message", [
    (["trainer.backend=local", "ray.placement=colocated", "rollout.max_staleness=0"],
     "ray.placement=colocated is a placement of the Ray backend's actors: set trainer.backend=ray"),
    (["trainer.backend=local", "inference.engine=vllm"],
     "inference.engine=vllm runs in Ray replica actors: set trainer.backend=ray"),
])
def test_what_the_local_backend_cannot_run_is_the_configs_check(overrides, message):
    """The backend rules live in the config's checks: an engine's `check_job` no longer sees the backend."""
    import dataclasses

    from rayllm_rl.inference.registry import EngineJob

    assert "backend" not in {f.name for f in dataclasses.fields(EngineJob)}
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(".", r"\.")):
        cfg_of(*overrides)
    cfg_of(*[o for o in overrides if not o.startswith("trainer.backend")])  # the Ray backend runs it


@pytest.mark.parametrize("key, value, message", [
    ("rollout.max_new_tokens", 0, "rollout.max_new_tokens=0: must be > 0"),
    ("ray.replica_restarts", -1, "ray.replica_restarts=-1: must be >= 0"),
    ("trainer.keep_checkpoints", -2, "trainer.keep_checkpoints=-2: must be >= 0"),
    ("algo.kl_coef", -0.5, "algo.kl_coef=-0.5: must be >= 0"),
])
def test_field_limits_hold_from_the_command_line_and_from_python(key, value, message):
    with pytest.raises(ConfigError, match=message):
        load_config(GRPOJobConfig, [f"{key}={value}"])
    cfg = GRPOJobConfig()
    section, field = key.split(".")
    setattr(getattr(cfg, section), field, value)
    with pytest.raises(ConfigError, match=message):
        cfg.validate()
