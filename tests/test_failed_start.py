"""A job's start that fails at any stage removes what it started and raises its own error; the next `train()`
in the same process (a notebook's Ray kept running), after all of them, then succeeds.

The stages: an inference engine not ready in time, a weight-sync group that fails to form after learner rank 0
made its shared-memory segments, a reward service that cannot load (with a placement group reserved on Ray's
logical GPUs). The first two are faults injected into Ray's workers (tests/start_faults.py), the third is a bad
config value; the actors, placement group, segments and orphaned processes are what a user would be left with.
"""
from __future__ import annotations

import os

import pytest

import leak_guard
from budgets import ACTOR_START_S
from ray_sessions import JOB_ENV, local_ray_session
from conftest import small_job_config
from rayllm_rl.job.config import GRPOJobConfig
from start_faults import FAULT_FILE_VAR

pytestmark = [pytest.mark.ray, pytest.mark.slow]

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(scope="module")
def fault_file(tmp_path_factory):
    return tmp_path_factory.mktemp("faults") / "fault"


@pytest.fixture(scope="module")
def notebook_ray(fault_file):
    """A Ray the user started (as in a notebook): `train` leaves it running, so what a failed start leaves is
    still there to find. Its workers run `start_faults.install` and read `fault_file`; 2 logical GPUs."""
    pythonpath = os.pathsep.join(filter(None, [TESTS_DIR, os.environ.get("PYTHONPATH")]))
    env = {**JOB_ENV, "PYTHONPATH": pythonpath, FAULT_FILE_VAR: str(fault_file)}
    with local_ray_session("test_failed_start", actor_env=False, num_cpus=2, num_gpus=2,
                           runtime_env={"env_vars": env, "worker_process_setup_hook": "start_faults.install"}):
        yield


def test_actors_on_a_ray_the_user_started_still_get_their_environment(notebook_ray):
    """A Ray a user started lacks the actors' environment in its job env: each actor then carries it itself."""
    import ray

    from rayllm_rl.orchestration.ray.actors import ACTOR_ENV_VARS, ActorProcess, job_sets_actor_env, ray_actor

    @ray_actor
    class Probe(ActorProcess):
        def env(self, keys):
            return {k: os.environ.get(k) for k in keys}

    probe = Probe.remote()
    try:
        assert not job_sets_actor_env()
        assert ray.get(probe.env.remote(list(ACTOR_ENV_VARS)), timeout=ACTOR_START_S) == ACTOR_ENV_VARS
    finally:
        ray.kill(probe)


def job(tmp_path, *extra: str) -> GRPOJobConfig:
    """conftest's small job cut to one RL step of 4 short samples, no SFT, short timeouts, the default log_every (5),
    in `tmp_path`; as loaded (not validated)."""
    return small_job_config(
        "sft.steps=0", "data.eval_size=4", "rollout.prompts_per_step=2", "rollout.group_size=2",
        "rollout.max_new_tokens=4", "trainer.steps=1", "trainer.log_every=5", "trainer.call_timeout_s=60",
        "ray.sync_timeout_s=30", "ray.namespace=failed-start", *extra, run_dir=tmp_path)


def what_is_left(before: "leak_guard.Snapshot") -> dict[str, list]:
    """Named actors, placement groups not removed, and the product's shm segments made since `before`: /dev/shm
    is the node's, and another job's segments, or those a SIGKILLed process tree left there before this test
    (what failed CI once: a killed benchmark's), are not this start's."""
    import ray
    from ray.util import placement_group_table

    groups = [pg for pg in placement_group_table().values() if pg["state"] != "REMOVED"]
    return {"named actors": sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True)),
            "placement groups": groups,
            "segments": sorted(n for n in before.new_segments() if n.startswith("rayllm_"))}


CASES = {
    # the engines' own start bound: short, since the fault makes it run out whatever the machine's load
    "engine not ready in time": (("ray.engine_start_timeout_s=2",), "engine_never_ready", TimeoutError,
                                 r"inference replica\(s\): load the model and start the engine.*"
                                 r"ray\.engine_start_timeout_s=2s; raise ray\.engine_start_timeout_s"),
    "group formation failing": (("ray.sync_transport=shm",), "receiver_fails", Exception,
                                r"injected fault: this replica's shm receiver failed"),
    "a bad reward service": (("reward.model.path={bad}", "ray.gpus_per_replica=1",
                              "ray.gpus_per_learner=1"), "", RuntimeError,
                             r"reward-model-0 failed to start \(reward\.model\.path="),
}


@pytest.mark.parametrize("stage", list(CASES))
def test_a_failed_start_raises_its_own_error_and_leaves_nothing(notebook_ray, fault_file, tmp_path, stage):
    from rayllm_rl.api.entry import train

    overrides, fault, error, message = CASES[stage]
    bad = tmp_path / "not-a-model"  # a directory without a model
    bad.mkdir()
    fault_file.write_text(fault)
    before = leak_guard.Snapshot.take(leak_guard.own_start_ticks())
    try:
        with pytest.raises(error, match=message):
            train(job(tmp_path / "failed", *(o.format(bad=bad) for o in overrides)))
    finally:
        fault_file.write_text("")
    assert what_is_left(before) == {"named actors": [], "placement groups": [], "segments": []}


def test_the_next_train_after_the_failed_starts_succeeds(notebook_ray, tmp_path):
    """After the failed starts above, in the same process and on the same Ray (a notebook's): one train that
    succeeds shows none of them left anything in its way (run alone, it trains on a Ray nothing failed on)."""
    from rayllm_rl.api.entry import train

    before = leak_guard.Snapshot.take(leak_guard.own_start_ticks())
    summary = train(job(tmp_path / "next"))
    assert summary["steps"] == 1 and summary["version"] == 1
    assert summary["learner_checksums_equal_replicas"] is True
    assert what_is_left(before)["named actors"] == []
