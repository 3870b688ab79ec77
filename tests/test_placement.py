"""GPU placement of replicas and learner ranks, checked on CPU with Ray's logical GPU resources.

Ray starts with num_gpus=4 on a machine without GPUs: it then hands out GPU ids 0..3 and sets
CUDA_VISIBLE_DEVICES exactly as it would on a 4-GPU node, so which actor got which device (and
which bundle) is real even though no device exists. Probe actors stand in for InferenceReplica
and LearnerWorker, which would load models.
"""
from __future__ import annotations

import os
import time
from typing import Any

import pytest

import ray  # noqa: E402  (a core dependency: missing ray is a failure, not a skip)

from rayllm_rl.orchestration.ray.placement import (  # noqa: E402
    Placement,
    PlacementError,
    plan_placement,
    visible_devices,
)
from rayllm_rl.job.placement_rules import gpu_layout  # noqa: E402
from ray_sessions import local_ray_session

pytestmark = [pytest.mark.ray]


def _reserve(num_replicas, num_learners, gpus_per_replica, gpus_per_learner, tensor_parallel_size, timeout_s, *,
             replica_labels=None, learner_labels=None, env_worker_labels=None, colocated=False, frozen=0):
    """The job's two steps: decide the layout (checks the settings), then reserve it."""
    layout = gpu_layout(num_replicas, num_learners, gpus_per_replica, gpus_per_learner, tensor_parallel_size,
                        timeout_s, colocated=colocated, frozen=frozen)
    return plan_placement(layout, timeout_s, replica_labels=replica_labels, learner_labels=learner_labels,
                          env_worker_labels=env_worker_labels)


@pytest.fixture(scope="module")
def gpu_ray():
    # A Ray as a user starts it: these tests probe what Ray itself gives each actor (a job's own Ray carries the
    # actors' environment in its runtime env, which sets CUDA_VISIBLE_DEVICES="" for 0-GPU actors).
    with local_ray_session("gpu_ray", actor_env=False, num_cpus=2, num_gpus=4):
        yield


def _probe_class() -> Any:
    """Stand-in actor reporting what Ray gave it (defined locally so Ray ships it by value:
    this test module is not importable on the workers)."""

    class Probe:
        def devices(self) -> dict[str, Any]:
            return visible_devices()

    return ray.remote(Probe)


def _probe_all(placement: Placement) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Start one probe per planned replica and learner with the planned options; return their reports."""
    probe = _probe_class()
    replicas = [probe.options(**opts).remote() for opts in placement.replica_options]
    learners = [probe.options(**opts).remote() for opts in placement.learner_options]
    reports = ray.get([a.devices.remote() for a in replicas + learners], timeout=60)
    return reports[:len(replicas)], reports[len(replicas):]


def _live_placement_groups() -> set[str]:
    return {pg_id for pg_id, info in ray.util.placement_group_table().items() if info["state"] != "REMOVED"}


def _check_in_planned_bundles(placement: Placement, reports: list[dict[str, Any]]) -> None:
    """Each actor sits in the planned group, at bundle i for options i (replicas first, then learners)."""
    assert placement.placement_group is not None
    pg_id = placement.placement_group.id.hex()
    opts = placement.replica_options + placement.learner_options
    for i, (o, report) in enumerate(zip(opts, reports)):
        assert o["scheduling_strategy"].placement_group_bundle_index == i
        assert report["placement_group_id"] == pg_id
        assert report["bundle_index"] == i


def test_whole_gpus_give_distinct_devices(gpu_ray):
    placement = _reserve(2, 2, gpus_per_replica=1, gpus_per_learner=1, tensor_parallel_size=1, timeout_s=30)
    try:
        replicas, learners = _probe_all(placement)
        reports = replicas + learners
        assert all(len(r["gpu_ids"]) == 1 for r in reports)
        assert sorted(r["gpu_ids"][0] for r in reports) == [0, 1, 2, 3]
        for r in reports:
            assert r["cuda_visible_devices"] == str(r["gpu_ids"][0])
        _check_in_planned_bundles(placement, reports)
        table = ray.util.placement_group_table(placement.placement_group)
        assert table["strategy"] == "PACK"
        assert list(table["bundles"].values()) == [{"GPU": 1.0}] * 4
    finally:
        placement.remove()


def test_colocated_pairs_share_one_gpu_each_and_pairs_do_not_share(gpu_ray):
    """ray.placement=colocated: bundle i = one GPU for replica i and learner rank i, each asking half of it;
    Ray hands both the same device (one CUDA_VISIBLE_DEVICES), and the two pairs different ones."""
    placement = _reserve(2, 2, gpus_per_replica=1, gpus_per_learner=1, tensor_parallel_size=1, timeout_s=30,
                               colocated=True)
    try:
        assert [o["num_gpus"] for o in placement.replica_options + placement.learner_options] == [0.5] * 4
        replicas, learners = _probe_all(placement)
        pg_id = placement.placement_group.id.hex()
        for i, (rep, lrn) in enumerate(zip(replicas, learners)):
            assert rep["gpu_ids"] == lrn["gpu_ids"] and len(rep["gpu_ids"]) == 1
            assert rep["cuda_visible_devices"] == lrn["cuda_visible_devices"] == str(rep["gpu_ids"][0])
            assert rep["bundle_index"] == lrn["bundle_index"] == i
            assert rep["placement_group_id"] == lrn["placement_group_id"] == pg_id
        assert replicas[0]["gpu_ids"] != replicas[1]["gpu_ids"]
        assert list(ray.util.placement_group_table(placement.placement_group)["bundles"].values()) == [{"GPU": 1.0}] * 2
        assert ray.available_resources().get("GPU", 0) == 2  # two GPUs for two pairs, not four
    finally:
        placement.remove()


@pytest.mark.parametrize("colocated", [False, True])
def test_the_reference_takes_a_share_of_learner_rank_0s_gpu(gpu_ray, colocated):
    """With a reference model and one-GPU learner ranks, the reference goes into learner rank 0's bundle with
    0.1 of its GPU (taken from the learner's share): Ray gives it learner rank 0's device."""
    placement = _reserve(1, 1, gpus_per_replica=1, gpus_per_learner=1, tensor_parallel_size=1, timeout_s=30,
                               colocated=colocated, frozen=1)
    try:
        assert placement.learner_options[0]["num_gpus"] == pytest.approx(0.4 if colocated else 0.9)
        assert placement.frozen_options["num_gpus"] == 0.1
        probe = _probe_class()
        learner = probe.options(**placement.learner_options[0]).remote()
        reference = probe.options(**placement.frozen_options).remote()
        rep = probe.options(**placement.replica_options[0]).remote()
        lrn, ref, rpl = ray.get([learner.devices.remote(), reference.devices.remote(), rep.devices.remote()],
                                timeout=60)
        assert ref["gpu_ids"] == lrn["gpu_ids"] and ref["cuda_visible_devices"] == lrn["cuda_visible_devices"]
        assert ref["bundle_index"] == lrn["bundle_index"] == (0 if colocated else 1)
        assert (rpl["gpu_ids"] == lrn["gpu_ids"]) is colocated
        assert ray.available_resources().get("GPU", 0) == (3 if colocated else 2)
    finally:
        placement.remove()


def test_tensor_parallel_replica_holds_all_its_gpus(gpu_ray):
    placement = _reserve(1, 2, gpus_per_replica=2, gpus_per_learner=1, tensor_parallel_size=2, timeout_s=30)
    try:
        replicas, learners = _probe_all(placement)
        assert len(replicas[0]["gpu_ids"]) == 2
        assert [len(r["gpu_ids"]) for r in learners] == [1, 1]
        ids = [g for r in replicas + learners for g in r["gpu_ids"]]
        assert sorted(ids) == [0, 1, 2, 3]
        for r in replicas + learners:
            assert r["cuda_visible_devices"] == ",".join(str(g) for g in r["gpu_ids"])
        _check_in_planned_bundles(placement, replicas + learners)
    finally:
        placement.remove()


def test_cpu_learners_stay_in_the_group_without_gpus(gpu_ray):
    placement = _reserve(1, 2, gpus_per_replica=1, gpus_per_learner=0, tensor_parallel_size=1, timeout_s=30)
    try:
        replicas, learners = _probe_all(placement)
        assert len(replicas[0]["gpu_ids"]) == 1
        assert [r["gpu_ids"] for r in learners] == [[], []]
        # Ray leaves CUDA_VISIBLE_DEVICES alone for 0-GPU actors: they inherit whatever the node had.
        assert [r["cuda_visible_devices"] for r in learners] == [os.environ.get("CUDA_VISIBLE_DEVICES")] * 2
        _check_in_planned_bundles(placement, replicas + learners)
        assert [o["num_gpus"] for o in placement.learner_options] == [0, 0]
    finally:
        placement.remove()


def test_too_many_gpus_fails_in_time_and_leaves_no_group(gpu_ray):
    before = _live_placement_groups()
    start = time.monotonic()
    with pytest.raises(PlacementError, match=r"could not reserve 6 GPUs within ray\.sync_timeout_s=2s.*GPU=4 in total"):
        _reserve(2, 2, gpus_per_replica=2, gpus_per_learner=1, tensor_parallel_size=1, timeout_s=2)
    assert time.monotonic() - start < 15
    assert _live_placement_groups() == before


def test_all_zero_gpus_need_no_group(gpu_ray):
    before = _live_placement_groups()
    placement = _reserve(2, 3, gpus_per_replica=0, gpus_per_learner=0, tensor_parallel_size=1, timeout_s=5)
    assert placement.placement_group is None
    assert placement.replica_options == [{"num_cpus": 0}] * 2
    assert placement.learner_options == [{"num_cpus": 0}] * 3
    assert _live_placement_groups() == before
    placement.remove()  # no-op


def test_remove_releases_the_gpus(gpu_ray):
    placement = _reserve(2, 2, gpus_per_replica=1, gpus_per_learner=1, tensor_parallel_size=1, timeout_s=30)
    pg_id = placement.placement_group.id.hex()
    placement.remove()
    placement.remove()  # idempotent
    assert placement.placement_group is None
    assert ray.util.placement_group_table()[pg_id]["state"] == "REMOVED"
    again = _reserve(2, 2, gpus_per_replica=1, gpus_per_learner=1, tensor_parallel_size=1, timeout_s=30)
    again.remove()


_GOOD: dict[str, Any] = dict(num_replicas=1, num_learners=1, gpus_per_replica=1, gpus_per_learner=1,
                             tensor_parallel_size=1, timeout_s=5)


@pytest.mark.parametrize("changes, message", [
    ({"gpus_per_replica": 1, "tensor_parallel_size": 2}, r"ray\.gpus_per_replica must be >= ray\.tensor_parallel_size"),
    ({"gpus_per_replica": -1}, r"ray\.gpus_per_replica must be >= 0"),
    ({"gpus_per_learner": -0.5}, r"ray\.gpus_per_learner must be >= 0"),
    ({"gpus_per_replica": 2.5, "tensor_parallel_size": 2}, r"ray\.gpus_per_replica must be a whole number"),
    ({"gpus_per_replica": 0.5}, r"ray\.gpus_per_replica must be a whole number"),
    ({"gpus_per_learner": 0.5}, r"ray\.gpus_per_learner must be a whole number"),
    ({"gpus_per_learner": float("nan")}, r"ray\.gpus_per_learner must be >= 0"),
    ({"num_replicas": -1}, r"ray\.num_replicas must be an integer >= 1"),
    ({"num_learners": 0}, r"ray\.num_learners must be an integer >= 1"),
    ({"tensor_parallel_size": 0}, r"ray\.tensor_parallel_size must be an integer >= 1"),
    ({"timeout_s": 0}, r"timeout_s must be > 0"),
    ({"colocated": True, "num_learners": 2}, r"ray\.num_learners \(2\) must equal ray\.num_replicas \(1\)"),
    ({"colocated": True, "gpus_per_learner": 0}, r"set ray\.gpus_per_replica and ray\.gpus_per_learner both to 1"),
    ({"colocated": True, "gpus_per_replica": 2, "gpus_per_learner": 2}, r"both to 1"),
    ({"colocated": True, "gpus_per_replica": 0, "gpus_per_learner": 0, "tensor_parallel_size": 2},
     r"ray\.placement=colocated needs ray\.tensor_parallel_size=1"),
])
def test_bad_settings_name_the_key(changes, message):
    with pytest.raises(ValueError, match=message):
        _reserve(**{**_GOOD, **changes})


def test_an_actor_with_no_gpu_sees_none_on_a_gpu_node(gpu_ray):
    """The job's actors run with ACTOR_ENV_VARS: one given 0 GPUs gets CUDA_VISIBLE_DEVICES="" (Ray 2.60 would
    leave it unset, and a CPU replica on a GPU node would then pick GPU 0 by itself)."""
    from rayllm_rl.orchestration.ray.actors import ACTOR_ENV_VARS

    probe = _probe_class()
    job_env = probe.options(num_gpus=0, runtime_env={"env_vars": ACTOR_ENV_VARS}).remote()
    bare = probe.options(num_gpus=0).remote()
    with_job_env, without = ray.get([job_env.devices.remote(), bare.devices.remote()], timeout=60)
    assert with_job_env["cuda_visible_devices"] == "" and with_job_env["gpu_ids"] == []
    assert without["cuda_visible_devices"] == os.environ.get("CUDA_VISIBLE_DEVICES")  # Ray leaves it as it was
