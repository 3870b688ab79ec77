"""Config mistakes fail before any actor starts, naming the key, the value and what is allowed."""
from __future__ import annotations

import pytest

from rayllm_rl.config import ConfigError, load_config
from rayllm_rl.orchestration.job_config import GRPOJobConfig


def cfg_of(*overrides: str) -> GRPOJobConfig:
    return load_config(GRPOJobConfig, list(overrides)).validate()


@pytest.mark.parametrize("override,key", [("rollout.workflow=rlvx", "rollout.workflow"),
                                          ("trainer.backend=lcoal", "trainer.backend"), ("task=gsm9k", "task"),
                                          ("ray.sync_transport=tcp", "ray.sync_transport")])
def test_enum_typos_name_key_value_and_allowed(override, key):
    value = override.split("=")[1]
    with pytest.raises(ConfigError, match=rf"{key}.*{value}.*not one of"):
        cfg_of(override)


def test_enum_set_in_python_is_checked_too():
    cfg = GRPOJobConfig()
    cfg.rollout.workflow = "multiturn"
    with pytest.raises(ConfigError, match=r"'rollout.workflow': 'multiturn' is not one of \('auto', 'rlvr'"):
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
    import typing

    from rayllm_rl.objectives import LOSSES
    from rayllm_rl.orchestration.job_config import AlgoConfig

    assert set(typing.get_args(typing.get_type_hints(AlgoConfig)["name"])) == set(LOSSES)
    with pytest.raises(ConfigError, match="'algo.name': 'grpoo' is not one of"):
        cfg_of("algo.name=grpoo")
    cfg = GRPOJobConfig()
    cfg.algo.kl_estimator = "k4"
    with pytest.raises(ConfigError, match=r"'algo.kl_estimator': 'k4' is not one of \('k1', 'k2', 'k3', None\)"):
        cfg.validate()


def test_advantage_mode_is_a_literal():
    with pytest.raises(ConfigError, match=r"'algo.advantage.mode': 'groups' is not one of \('group', 'global', 'none'\)"):
        cfg_of("algo.advantage.mode=groups")
