"""The job plan: decided once from the validated config, and the same decisions the dry run showed
before the plan existed (tests/data/plan_before/*.json, the `--dry-run --json` output at ca962e1 of
every recipe, the default job and six placements; only the plan's decision sections are kept)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from rayllm_rl.config import load_config
from rayllm_rl.job.config import GRPOJobConfig
from rayllm_rl.job.plan import make_plan
from rayllm_rl.job.describe import plan_decisions

ROOT = Path(__file__).resolve().parents[1]
BEFORE = sorted((ROOT / "tests" / "data" / "plan_before").glob("*.json"))


def _missing_or_changed(before, after, path="") -> list[str]:
    """Every value of `before` that `after` lacks or holds differently, by path (fields `after` adds are fine)."""
    if isinstance(before, dict):
        if not isinstance(after, dict):
            return [f"{path}: {after!r} is not a mapping"]
        return [p for k, v in before.items()
                for p in (_missing_or_changed(v, after[k], f"{path}.{k}") if k in after else [f"{path}.{k}: missing"])]
    if isinstance(before, list):
        if not isinstance(after, list) or len(after) != len(before):
            return [f"{path}: {len(before)} items before, {after!r} now"]
        return [p for i, (b, a) in enumerate(zip(before, after)) for p in _missing_or_changed(b, a, f"{path}[{i}]")]
    return [] if before == after else [f"{path}: {before!r} before, {after!r} now"]


def test_the_snapshots_cover_every_recipe():
    names = {p.stem for p in BEFORE}
    assert {p.stem for p in (ROOT / "recipes").glob("*.yaml")} <= names and len(BEFORE) >= 12


@pytest.mark.parametrize("snapshot", BEFORE, ids=[p.stem for p in BEFORE])
def test_the_plan_decides_what_the_dry_run_showed_before(snapshot, monkeypatch):
    monkeypatch.chdir(ROOT)  # recipes name their files from the checkout's root
    recorded = json.loads(snapshot.read_text())
    plan = make_plan(load_config(GRPOJobConfig, recorded["args"]).validate(environment=False))
    now = plan_decisions(plan)
    assert _missing_or_changed(recorded["plan"], now) == []
    # the plan's own fields agree with what it shows
    assert [a["name"] for a in now["actors"]] == [a.name for a in plan.actors]
    assert now["total_gpus"] == pytest.approx(sum(b.get("GPU", 0.0) for b in plan.layout.bundles()))
    if plan.actors:  # every GPU the bundles hold is asked for by exactly the actors in them
        asked = sum(a.num_gpus for a in plan.actors if a.bundle is not None)
        assert asked == pytest.approx(now["total_gpus"])


def test_a_wrong_snapshot_value_is_reported():
    """The comparison itself fails on a changed value, a missing key and a shorter list."""
    before = {"actors": [{"name": "learner-0", "num_gpus": 1.0}], "placement": {"bundles": [1, 2]}}
    after = {"actors": [{"name": "learner-0", "num_gpus": 0.9, "max_restarts": 0}], "placement": {"bundles": [1]}}
    assert _missing_or_changed(before, after) == [".actors[0].num_gpus: 1.0 before, 0.9 now",
                                                 ".placement.bundles: 2 items before, [1] now"]
    assert _missing_or_changed({"a": 1}, {}) == [".a: missing"]


def test_the_plan_is_the_validation_of_a_raw_config_and_leaves_it_as_it_was():
    """make_plan fills the presets itself: a raw config plans as its validated copy does, and stays raw."""
    raw = GRPOJobConfig()
    plan = make_plan(raw, environment=False)
    assert raw.rollout.max_new_tokens is None and raw.model.dtype == "auto"  # untouched
    assert plan.config == raw.validate(environment=False) == make_plan(plan.config, environment=False).config
    assert plan.config.rollout.max_new_tokens is not None and plan.config.model.dtype == "float32"


@pytest.mark.parametrize("overrides, match", [
    (["algo.clip_eps_low=1.5"], "clip_eps_low"),  # the loss: decided (built) once, in the plan
    (["ray.num_replicas=0"], r"ray\.num_replicas"),  # the GPU layout
    (["inference.options.no_such_option=1"], r"inference\.options\.no_such_option"),  # the engine's options
    (["ray.sync_transport=nccl"], r"ray\.sync_transport=nccl needs GPUs"),  # the weight transport
    (["trainer.backend=local", "ray.sync_transport=shm"], r"ray\.sync_transport=shm is the Ray backend's"),
])
def test_each_decision_refuses_in_the_plan_naming_the_key(overrides, match):
    from rayllm_rl.job.checks import check_job

    cfg = load_config(GRPOJobConfig, overrides)
    with pytest.raises(ValueError, match=match):
        make_plan(cfg, environment=False)
    # and the rules left in job/checks.py do not decide these again: they pass on the resolved config
    if overrides[0] != "trainer.backend=local":
        from rayllm_rl.job.presets import resolve_presets

        check_job(resolve_presets(cfg), environment=False)


def test_the_driver_takes_the_plan_alone():
    from rayllm_rl.orchestration import driver

    with pytest.raises(TypeError, match=r"train\(make_plan\(cfg\)\), not a GRPOJobConfig"):
        driver.train(GRPOJobConfig().validate(environment=False))


def test_one_loss_decides_the_reference_and_the_buffer_holds_two_batches_per_version():
    cfg = load_config(GRPOJobConfig, ["algo.kl_coef=0.05", "rollout.max_staleness=2",
                                      "rollout.prompts_per_step=4"]).validate(environment=False)
    plan = make_plan(cfg)
    assert plan.frozen_names() == ("reference",) and plan.loss.needs_ref_logp
    assert plan.frozen[0].saved and plan.frozen[0].restarts == 0  # from the policy: in every checkpoint
    assert plan.buffer_capacity == 2 * (2 + 1) * 4
    assert plan.actor("reference").threads == cfg.ray.threads_per_actor
    lora = make_plan(load_config(GRPOJobConfig, ["algo.kl_coef=0.05", "model.lora.rank=8"]).validate(environment=False))
    assert lora.frozen == () and "reference" not in [a.name for a in lora.actors]
    with pytest.raises(KeyError, match="no actor 'reference'"):
        lora.actor("reference")


def test_colocated_roles_on_labelled_nodes_must_share_the_labels():
    with pytest.raises(ValueError, match="ray.replica_node_labels .* and ray.learner_node_labels .* must be equal"):
        load_config(GRPOJobConfig, ["ray.placement=colocated", "rollout.max_staleness=0",
                                    "ray.replica_node_labels={rayllm-role: a}"]).validate(environment=False)


def test_the_backend_is_chosen_by_the_plan():
    local = make_plan(load_config(GRPOJobConfig, ["trainer.backend=local"]).validate(environment=False))
    ray_job = make_plan(GRPOJobConfig().validate(environment=False))
    assert local.backend_class().__name__ == "LocalBackend" and local.actors == ()
    assert ray_job.backend_class().__name__ == "RayBackend"
    assert [a.name for a in ray_job.actors] == ["inference-0", "learner-0", "env-0", "replay-buffer", "collector"]


@pytest.mark.parametrize("argv, stages", [
    ([], ["advantages", "prox_version"]),
    (["algo.kl_coef=0.05"], ["reference_kl", "advantages", "prox_version"]),
    (["rollout.keep_top_k=2"], ["top_k_selection", "advantages", "prox_version"]),
    (["algo.kl_reward_coef=0.1", "model.lora.rank=0", "algo.overlong_buffer_len=4"],
     ["overlong_shaping", "reference_kl", "advantages", "prox_version"]),
])
def test_the_batch_pipeline_has_the_stages_the_config_asks_for(argv, stages):
    plan = make_plan(load_config(GRPOJobConfig, argv).validate(environment=False))
    assert plan.batch_pipeline.names == stages == plan_decisions(plan)["batch_stages"]
    assert ("reference_kl" in stages) == ("reference" in plan.frozen_names())


def test_the_learner_threads_come_from_the_backend_that_runs_the_learner():
    """`ray.threads_per_actor` is the Ray actors' setting, `trainer.num_threads` the local process's: the plan
    picks one (the LoRA demo's base warm-up runs with it), so nothing below reads ray.* on the local backend."""
    ray_plan = make_plan(load_config(GRPOJobConfig, ["ray.threads_per_actor=3"]).validate(environment=False))
    assert ray_plan.learner_threads == 3 == ray_plan.actor("learner-0").threads
    local = make_plan(load_config(GRPOJobConfig, ["trainer.backend=local", "ray.threads_per_actor=3",
                                                  "trainer.num_threads=2"]).validate(environment=False))
    assert local.learner_threads == 2


def test_the_role_list_starts_every_actor_once_in_its_phase_with_its_spec(tmp_path):
    """`JobPlan.roles()`: every actor the dry run lists, once, in start order (reward services, replicas, buffer, env
    workers, learners, collector, frozen models), each with the spec it is built from; `only` keeps some kinds."""
    from rayllm_rl.models.tiny import ensure_tiny_model

    rm = ensure_tiny_model()  # any local model directory: the plan only names it
    plan = make_plan(load_config(GRPOJobConfig, [
        "ray.num_replicas=2", "ray.num_env_workers=2", "algo.kl_coef=0.1", f"reward.model.path={rm}",
        "rollout.workflow=python_tool"]).validate())
    roles = plan.roles("/models/policy")
    assert sorted(r.name for r in roles) == sorted(a.name for a in plan.actors)
    assert [r.name for r in roles] == ["reward-model-0", "inference-0", "inference-1", "replay-buffer", "env-0",
                                       "env-1", "learner-0", "collector", "reference", "python-executor"]
    assert [r.phase for r in roles] == ["services"] + ["roles"] * 7 + ["frozen", "on demand"]
    assert [r.name for r in plan.roles(phase="frozen")] == ["reference"]
    replicas = [r.spec for r in roles if r.kind == "replica"]
    assert [(s.model_path, s.seed) for s in replicas] == [("/models/policy", 0), ("/models/policy", 1)]
    assert {r.kind: type(r.spec).__name__ for r in roles if r.spec is not None} == {
        "reward-model": "RewardModelSpec", "replica": "EngineSpec", "buffer": "BufferSpec",
        "learner": "LearnerSpec", "collector": "CollectorSpec", "frozen": "FrozenSpec"}
    assert roles[0].spec.path == rm and roles[-2].spec == plan.frozen_spec("reference")
    assert [r.name for r in plan.only("learner", "replica").roles()] == ["inference-0", "inference-1", "learner-0"]
    assert plan.names("replica") == ["inference-0", "inference-1"] and plan.names("buffer") == ["replay-buffer"]
    with pytest.raises(ValueError, match=r"unknown role kinds \['learners'\]; the kinds are"):
        plan.only("learners")
