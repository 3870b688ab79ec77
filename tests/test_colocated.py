"""`ray.placement=colocated`: the config checks, and the turn order on CPU (sleep -> train -> hand-over -> wake).

On CPU nothing is freed (no GPU memory), but the turns are the same calls in the same order; each actor
notes its turns in `turn_log()` on one monotonic clock, which this test merges. The placement itself (one
bundle, half a GPU each, one CUDA_VISIBLE_DEVICES per pair) is checked with Ray's logical GPUs in
tests/test_placement.py.
"""
from __future__ import annotations

import pytest

from rayllm_rl.config import load_config
from rayllm_rl.job.plan import make_plan
from rayllm_rl.job.config import GRPOJobConfig
from budgets import VLLM_START_S
from ray_sessions import JOB_ENV, local_ray_session

COLOCATED = ("ray.placement=colocated", "rollout.max_staleness=0")


def _cfg(*extra: str) -> GRPOJobConfig:
    return load_config(GRPOJobConfig, ["sft.steps=0", "data.eval_size=8", "rollout.prompts_per_step=2",
                                       "rollout.group_size=2", "rollout.max_new_tokens=4", *extra])


@pytest.mark.parametrize("extra, message", [
    (("ray.placement=colocated",), r"ray\.placement=colocated needs rollout\.max_staleness=0 \(got 1\)"),
    ((*COLOCATED, "ray.num_learners=2"), r"ray\.num_learners \(2\) must equal ray\.num_replicas \(1\)"),
    ((*COLOCATED, "ray.gpus_per_replica=1"), r"set ray\.gpus_per_replica and ray\.gpus_per_learner both to 1"),
    ((*COLOCATED, "ray.gpus_per_replica=1", "ray.gpus_per_learner=1", "model.dtype=bfloat16", "inference.engine=vllm",
      "ray.sync_transport=nccl"), r"ray\.sync_transport=nccl cannot run with ray\.placement=colocated"),
    ((*COLOCATED, "ray.gpus_per_replica=1", "ray.gpus_per_learner=1", "model.dtype=bfloat16", "inference.engine=vllm",
      "ray.sync_transport=rdt_nccl"), r"ray\.sync_transport=rdt_nccl cannot run with ray\.placement=colocated"),
    ((*COLOCATED, "trainer.backend=local"), r"ray\.placement=colocated is a placement of the Ray backend"),
    (("ray.placement=shared",), r"ray\.placement"),
])
def test_colocated_settings_that_cannot_work_are_refused_naming_the_key(extra, message):
    with pytest.raises(ValueError, match=message):
        _cfg(*extra).validate(environment=False)


def test_colocated_on_gpus_plans_cuda_ipc_and_vllm_sleep_mode_with_half_the_gpu():
    from rayllm_rl.inference.registry import engine_options, placed_options
    from rayllm_rl.weight_sync.registry import plan_transport

    cfg = _cfg(*COLOCATED, "ray.gpus_per_replica=1", "ray.gpus_per_learner=1", "inference.engine=vllm")
    cfg = cfg.validate(environment=False)
    assert cfg.model.dtype == "bfloat16"  # auto, with GPUs on both sides
    assert plan_transport("auto", learner_gpus=True, replica_gpus=True, learner_node="a", replica_nodes=["a"],
                          colocated=True) == "cuda_ipc"  # the weights stay on the GPU they share
    assert plan_transport("auto", learner_gpus=True, replica_gpus=True, learner_node="a", replica_nodes=["a"]) == "nccl"
    opts = engine_options("vllm", placed_options("vllm", {}, colocated=True))
    assert (opts.gpu_memory_utilization, opts.enable_sleep_mode) == (0.5, True)
    opts = engine_options("vllm", placed_options("vllm", {}, colocated=False))
    assert (opts.gpu_memory_utilization, opts.enable_sleep_mode) == (0.9, False)
    mine = engine_options("vllm", placed_options("vllm", {"gpu_memory_utilization": 0.6}, colocated=True))
    assert mine.gpu_memory_utilization == 0.6  # the job's value wins over the placement's


def _merged(backend) -> list[tuple[float, str]]:
    """Every turn event of the replica and the learner, on the node's monotonic clock, in order."""
    import ray

    c = backend.cluster
    logs = ray.get([c.replicas[0].turn_log.remote(), c.learners[0].turn_log.remote()], timeout=60)
    return sorted((t, f"{who}:{event}") for who, log in zip(("replica", "learner"), logs) for event, t in log)


@pytest.fixture(scope="module")
def local_ray():
    with local_ray_session("test_colocated", num_cpus=2, runtime_env={"env_vars": JOB_ENV}):
        yield


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.parametrize("engine", ["transformers", pytest.param("vllm", marks=pytest.mark.vllm)])
def test_colocated_turns_sleep_train_hand_over_wake_and_nothing_generates_while_asleep(engine, tmp_path, local_ray):
    from transformers import AutoTokenizer

    from rayllm_rl.models.tiny import ensure_tiny_model
    from rayllm_rl.orchestration.factories import build_task
    from rayllm_rl.orchestration.ray.backend import RayBackend

    cfg = _cfg(*COLOCATED, f"inference.engine={engine}", f"trainer.run_dir={tmp_path}",
               f"trainer.call_timeout_s={VLLM_START_S}", "ray.namespace=rayllm_colo").validate()
    model_path = ensure_tiny_model()
    backend = RayBackend(make_plan(cfg.validate()), model_path, build_task(cfg),
                         AutoTokenizer.from_pretrained(model_path))
    try:
        assert backend.cluster.turns.colocated
        backend.sync_weights(0)
        backend.start_collector()
        steps = 3
        for v in range(steps):
            batch, meta = backend.next_batch(cfg.rollout.prompts_per_step, v)
            assert meta["token_versions"] == [v]  # max_staleness 0: the current policy only
            backend.train_step(batch)
            backend.sync_weights(v + 1)
        events = _merged(backend)
        names = [e for _, e in events]
        cycle = ["replica:sleep", "learner:onload", "learner:train start", "learner:train end", "replica:wake:weights",
                 "replica:weights received", "learner:offload", "replica:wake:kv_cache"]
        turns = [e for e in names if e in cycle]
        # the first sync (v0) is a hand-over with nothing asleep: weights received, offload, then the steps' cycles
        assert turns[:4] == ["replica:wake:weights", "replica:weights received", "learner:offload",
                             "replica:wake:kv_cache"]
        assert turns[4:] == cycle * steps, turns
        asleep, generated_asleep, generated = False, 0, 0
        for _, e in events:
            asleep = True if e == "replica:sleep" else False if e == "replica:wake:kv_cache" else asleep
            if e == "replica:generated":
                generated += 1
                generated_asleep += asleep
        assert generated >= steps * cfg.rollout.prompts_per_step * cfg.rollout.group_size and generated_asleep == 0
        assert backend.summary_stats()["learner_checksums_equal_replicas"]
    finally:
        backend.shutdown()


@pytest.mark.parametrize("placement, learner, bundle", [("separate", 0.9, 1), ("colocated", 0.4, 0)])
def test_the_plan_puts_the_reference_on_learner_0s_gpu_in_the_learners_dtype(placement, learner, bundle):
    from rayllm_rl.job.describe import placement_plan

    staleness = "rollout.max_staleness=0" if placement == "colocated" else "rollout.max_staleness=1"
    cfg = _cfg(f"ray.placement={placement}", staleness, "ray.gpus_per_replica=1", "ray.gpus_per_learner=1",
               "inference.engine=vllm", "algo.kl_coef=0.05")
    job = make_plan(cfg.validate(environment=False))
    plan = placement_plan(job)
    actors = {a.name: a.describe() for a in job.actors}
    assert (actors["reference"]["num_gpus"] == 0.1
            and actors["reference"]["bundle"] == actors["learner-0"]["bundle"] == bundle)
    assert actors["learner-0"]["num_gpus"] == pytest.approx(learner) and "bfloat16" in actors["reference"]["note"]
    assert sum(a["num_gpus"] for a in actors.values()) == pytest.approx(plan["total_gpus"])
