"""Multi-node on one machine: a Ray cluster of several raylets (`ray.cluster_utils.Cluster`), each
its own node with its own object store, so weights really take Ray's cross-node path.

Roles are pinned with node labels (`ray.replica_node_labels`, `ray.learner_node_labels`,
`ray.env_worker_node_labels`): the head node (the driver's) carries `rayllm-role=learner` and
hosts the learner, buffer and collector; an `rayllm-role=inference` node hosts the replica and the
env worker. The node-loss test removes that node mid-run and adds another with the same label: the
run must finish on restarts alone (no rollback), every episode trained once.
"""
from __future__ import annotations

import json
import shutil
import tempfile
import threading
import time
from pathlib import Path

import pytest

from conftest import small_job_config
from rayllm_rl.config import load_config
from rayllm_rl.job.plan import make_plan
from rayllm_rl.job.config import GRPOJobConfig

B, LEARNER, INFERENCE = 4, {"rayllm-role": "learner"}, {"rayllm-role": "inference"}
NODE_ARGS = {"num_cpus": 1, "object_store_memory": 80 * 1024 * 1024}


# ------------------------------------------------------------------ config checks (no Ray)
@pytest.mark.parametrize("override,message", [
    ("ray.replica_node_labels={gpu: 1}", r"ray.replica_node_labels: label 'gpu': 1 must map a string to a string"),
    ("ray.learner_node_labels={-bad: x}", r"ray.learner_node_labels: '-bad' is not a valid node label name"),
    ("ray.env_worker_node_labels={zone: 'in(a,'}",
     r"ray.env_worker_node_labels: zone='in\(a,' is not a label selector"),
    ("ray.replica_node_labels=inference", r"config key .ray.replica_node_labels.: expected a mapping, got .inference."),
])
def test_bad_node_labels_fail_naming_the_key(override, message):
    with pytest.raises(ValueError, match=message):
        load_config(GRPOJobConfig, [override]).validate()


def test_node_label_selectors_match_as_ray_does():
    from rayllm_rl.job.placement_rules import check_node_labels, node_matches

    cfg = load_config(GRPOJobConfig, ["ray.replica_node_labels={rayllm-role: inference, zone: 'in(a, b)'}",
                                      "ray.learner_node_labels={ray.io/node-id: abc123}"]).validate()
    assert cfg.ray.replica_node_labels == {"rayllm-role": "inference", "zone": "in(a, b)"}
    sel = check_node_labels("replica_node_labels", cfg.ray.replica_node_labels)
    assert node_matches(sel, {"rayllm-role": "inference", "zone": "b"})
    assert not node_matches(sel, {"rayllm-role": "inference", "zone": "c"})
    assert not node_matches(sel, {"zone": "a"})  # a label the node lacks does not match a value
    assert node_matches({"rayllm-role": "!learner"}, {}) and not node_matches({"r": "!in(x, y)"}, {"r": "y"})


# ------------------------------------------------------------------ the cluster
class Nodes:
    """A `Cluster` of a learner head node and one inference node (replaced after a node loss)."""

    def __init__(self, temp_dir: str):
        import os

        from ray._private.utils import get_ray_address_file
        from ray.cluster_utils import Cluster

        # Cluster writes the head's address to Ray's default temp dir (/tmp/ray) whatever temp_dir says,
        # and fails if that directory does not exist (a machine where no Ray ran with the default yet).
        os.makedirs(os.path.dirname(get_ray_address_file(None)), exist_ok=True)
        self.cluster = Cluster(initialize_head=True, head_node_args={
            **NODE_ARGS, "labels": LEARNER, "temp_dir": temp_dir, "include_dashboard": False})
        self.inference = self.add_inference_node()

    def add_inference_node(self):
        return self.cluster.add_node(**NODE_ARGS, labels=INFERENCE)

    @property
    def head_id(self) -> str:
        return self.cluster.head_node.node_id


@pytest.fixture(scope="module")
def nodes():
    import ray

    import leak_guard
    from ray_sessions import JOB_ENV, with_actor_env

    temp = tempfile.mkdtemp(prefix="/tmp/rayllm-mn-")
    nodes = None
    with leak_guard.holding_ray("test_multinode"):
        try:  # torn down whatever happens, also when a node fails to start
            nodes = Nodes(temp)
            ray.init(**with_actor_env({"address": nodes.cluster.address, "runtime_env": {"env_vars": JOB_ENV}}))
            yield nodes
        finally:
            ray.shutdown()
            if nodes is not None:
                nodes.cluster.shutdown()
            shutil.rmtree(temp, ignore_errors=True)


def job_cfg(tmp_path, nodes: Nodes, ns: str, *extra: str) -> GRPOJobConfig:
    """conftest's small job on the cluster: the learner on the head node, the replica and env worker on an
    inference node; weights over the object store, whichever node the replica is on."""
    return small_job_config(
        "data.eval_size=8", f"rollout.prompts_per_step={B}", f"ray.address={nodes.cluster.address}",
        f"ray.namespace={ns}", "ray.sync_timeout_s=60", "ray.sync_transport=auto",
        "ray.learner_node_labels={rayllm-role: learner}", "ray.replica_node_labels={rayllm-role: inference}",
        "ray.env_worker_node_labels={rayllm-role: inference}",
        # the tiny model's rewards are all 0 (zero advantages, zero gradients): decoupled weight decay
        # still moves every weight by 1e-3 a step, so each sync carries new weights
        "optim.lr=1e-3", "optim.weight_decay=1.0", "optim.warmup_steps=0", *extra, run_dir=tmp_path).validate()


def rl_records(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    text = path.read_text() if path.exists() else ""  # the run may be writing: only whole lines
    return [r for r in map(json.loads, text[:text.rfind("\n") + 1].splitlines()) if r.get("phase") == "rl"]


def node_of(name: str, ns: str, timeout_s: float = 120.0) -> str:
    """The node id of the job's actor `name`, once it answers (a restarting one is waited for)."""
    import ray

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            actor = ray.get_actor(name, namespace=ns)
            return ray.get(actor.__ray_call__.remote(lambda self: ray.get_runtime_context().get_node_id()),
                           timeout=10)
        except (ValueError, ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


class NodeWatch:
    """Samples, every `period_s` while a job runs, where each of its named actors is (a short job's
    actors may be gone before a one-off question is answered): `seen[name]` lists each
    (node id, sender class) in the order first seen."""

    def __init__(self, ns: str, names: tuple[str, ...], period_s: float = 0.3):
        self.ns, self.period_s = ns, period_s
        self.seen: dict[str, list[tuple[str, str]]] = {name: [] for name in names}
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import ray

        def where(actor) -> tuple[str, str]:
            """Inside an actor (defined here so Ray ships it by value: workers cannot import this
            module): its node id, and the class of its weight-sync sender (learners)."""
            return ray.get_runtime_context().get_node_id(), type(getattr(actor, "sender", None)).__name__

        handles: dict = {}  # a handle stays valid while Ray restarts its actor
        asked: dict = {}  # name -> [(when sent, call)]: answered as soon as the actor can
        while not self._stop.is_set():
            try:
                self._sample(handles, asked, where)
            except Exception as exc:  # noqa: BLE001 - keep watching; said in the test's failure message
                self.errors.append(repr(exc))
                time.sleep(self.period_s)

    def _sample(self, handles: dict, asked: dict, where) -> None:
        """One round: ask each actor whose last question is older than `period_s` again (a call sent
        to a process on a lost node may take long to fail: it must not hold up the next one)."""
        import ray

        for name in self.seen.keys() - handles.keys():
            try:
                handles[name] = ray.get_actor(name, namespace=self.ns)
            except ValueError:  # not created yet
                pass
        now = time.monotonic()
        for name, handle in handles.items():
            calls = asked.setdefault(name, [])
            if len(calls) < 50 and (not calls or now - calls[-1][0] > self.period_s):
                calls.append((now, handle.__ray_call__.remote(where)))
        refs = [ref for calls in asked.values() for _, ref in calls]
        ready = set(ray.wait(refs, num_returns=len(refs), timeout=self.period_s)[0]) if refs else set()
        if not refs:
            time.sleep(self.period_s)
        for name, calls in asked.items():
            for call in [c for c in calls if c[1] in ready]:
                calls.remove(call)
                try:
                    found = ray.get(call[1])
                except ray.exceptions.RayError:  # restarting, or gone
                    continue
                if found not in self.seen[name]:
                    self.seen[name].append(found)

    def nodes(self, name: str) -> list[str]:
        """The nodes `name` was seen on, in order."""
        return list(dict.fromkeys(node for node, _ in self.seen[name]))

    def wait_seen(self, names: tuple[str, ...], timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not all(self.seen[n] for n in names):
            assert time.monotonic() < deadline, f"no answer from {names} in {timeout_s:g}s: {self.seen}"
            time.sleep(0.1)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)


class Job:
    """`driver.train` in a thread (the test's thread watches it and acts on the cluster)."""

    def __init__(self, cfg: GRPOJobConfig, tmp_path: Path):
        from job_helpers import run_job

        self.tmp_path, self.out = tmp_path, {}
        self.thread = threading.Thread(target=lambda: self.out.update(summary=run_job(cfg)), daemon=True)
        self.thread.start()

    def wait_step(self, step: int, timeout_s: float = 240.0) -> Path:
        """Block until RL step `step` is in metrics.jsonl; the run directory."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and self.thread.is_alive():
            dirs = [p for p in self.tmp_path.iterdir() if p.is_dir()]
            if dirs and len(rl_records(dirs[0])) >= step:
                return dirs[0]
            time.sleep(0.2)
        raise AssertionError(f"RL step {step} was not logged (the run ended or took over {timeout_s:g}s)")

    def summary(self, timeout_s: float = 300.0) -> dict:
        self.thread.join(timeout=timeout_s)
        assert "summary" in self.out, "the run did not finish"
        return self.out["summary"]


def assert_every_episode_once(summary: dict, steps: int) -> list[dict]:
    records = rl_records(Path(summary["run_dir"]))
    assert [r["step"] for r in records] == list(range(1, steps + 1))
    assert [r["version"] for r in records] == list(range(1, steps + 1))
    trained = [gid for r in records for gid in r["episode_ids"]]
    assert len(trained) == steps * B and len(set(trained)) == len(trained), "an episode lost or trained twice"
    assert summary["failed_episodes"] == 0 and summary["episodes_lost"] == 0
    return records


@pytest.mark.ray
@pytest.mark.slow
def test_no_node_with_the_labels_fails_in_time_naming_the_key(nodes):
    from rayllm_rl.job.placement_rules import gpu_layout
    from rayllm_rl.orchestration.ray.placement import PlacementError, plan_placement

    layout = gpu_layout(1, 1, 0, 0, 1, 1.0)
    t0 = time.monotonic()
    with pytest.raises(PlacementError, match=r"no live node carries ray.replica_node_labels=\{'rayllm-role': "
                                             r"'gpu'\} within 1s \(the live nodes' labels: .*'rayllm-role': 'learner'"):
        plan_placement(layout, 1.0, replica_labels={"rayllm-role": "gpu"}, learner_labels=LEARNER)
    assert time.monotonic() - t0 < 10
    placement = plan_placement(layout, 1.0, replica_labels=INFERENCE, learner_labels=LEARNER,
                               env_worker_labels=INFERENCE)
    assert placement.replica_options == [{"num_cpus": 0, "label_selector": INFERENCE}]
    assert placement.learner_options == [{"num_cpus": 0, "label_selector": LEARNER}]
    assert placement.env_worker_options == {"label_selector": INFERENCE}
    assert placement.frozen_options == {"label_selector": LEARNER}


# ------------------------------------------------------------------ the jobs
@pytest.mark.ray
@pytest.mark.slow
def test_two_nodes_weights_cross_nodes_and_losing_the_replicas_node_costs_restarts_not_the_run(nodes, tmp_path):
    """The learner (and the reference model, KL on) on the head node, the replica and env worker on the inference
    node. That node is removed after RL step 2 and a new node with the same label is added: Ray restarts both
    there, the replica rejoins the weight sync and gets the current version, the collector re-runs the env
    worker's in-flight episodes, and the run finishes with no rollback, every episode trained once and the
    weights equal at the end. eta = 0: each batch is sampled with exactly the weights the learner trains from, so
    the loss's ratio replica -> learner is 1 on every token iff the synced weights (and so the replica's logprobs,
    before and after the restart) equal the learner's: approx_kl (mean of r - 1 - log r) and every clip fraction
    are ~0. (One job for both: each costs a cluster start and a full run.)"""
    steps, ns, lost_after = 6, "rayllm_mn_two", 2
    job = Job(job_cfg(tmp_path, nodes, ns, f"trainer.steps={steps}", "rollout.max_staleness=0", "algo.kl_coef=0.05"),
              tmp_path)
    watch = NodeWatch(ns, ("learner-0", "inference-0", "env-0", "collector", "replay-buffer", "reference"))
    try:
        job.wait_step(lost_after)
        watch.wait_seen(("inference-0", "env-0", "learner-0", "collector", "replay-buffer", "reference"))
        lost, head = nodes.inference, nodes.head_id
        assert lost.node_id != head
        nodes.cluster.remove_node(lost)
        nodes.inference = nodes.add_inference_node()
        summary = job.summary()
    finally:
        watch.stop()
    # the same actors (Ray restarted them, names and handles kept) on the new node; the driver's side stayed
    assert watch.nodes("inference-0") == watch.nodes("env-0") == [lost.node_id, nodes.inference.node_id], \
        (watch.seen, watch.errors)
    assert watch.nodes("learner-0") == [head]
    assert watch.nodes("collector") == watch.nodes("replay-buffer") == [head]  # with the driver
    assert watch.nodes("reference") == [head]  # with the learners' labels
    # ray.sync_transport=auto on CPUs: Ray's object store, across nodes
    assert (head, "ObjectStoreSender") in watch.seen["learner-0"], watch.seen["learner-0"]
    assert summary["steps"] == steps and summary["version"] == steps
    assert summary["recoveries"] == [], "a lost node must cost restarts, not a rollback"
    assert summary["restarts"]["inference"] == 1 and summary["restarts"]["env"] == 1
    assert summary["weight_transport"] == "object_store" and summary["learner_checksums_equal_replicas"]
    held = summary["replica_versions_held"][0]  # the new process: the base weights, then current ones only
    # (the load, then versions >= lost_after: at most steps - lost_after + 2 of them, never going back)
    assert held["in_order"] and held["last"][-1] == steps and 2 <= held["count"] <= steps - lost_after + 2, held
    records = assert_every_episode_once(summary, steps)
    for r in records:
        assert r["token_versions"] == [r["version"] - 1] and r["staleness_max"] == 0, r
        assert r["approx_kl"] < 1e-9 and r["clip_fraction"] == 0.0, r  # replica logprobs == learner's
        assert abs(r["ess"] - 1.0) < 1e-6, r


@pytest.mark.ray
@pytest.mark.slow
def test_a_node_lost_after_the_last_sync_gets_the_weights_for_the_drain_and_the_eval(nodes, tmp_path):
    """No sync follows the last step, so nothing would send the restarted replica the weights it
    needs to serve the episodes the final drain waits for, or the final eval: the backend's wait
    for them sends the version last synced to a replica Ray restarted (before, the eval failed with
    ReplicaTimeout after trainer.call_timeout_s)."""
    from transformers import AutoTokenizer

    from rayllm_rl.models.tiny import ensure_tiny_model
    from rayllm_rl.orchestration.factories import build_task
    from rayllm_rl.orchestration.ray.backend import RayBackend

    ns = "rayllm_mn_late"
    cfg = job_cfg(tmp_path, nodes, ns, "rollout.max_staleness=1",
                  "trainer.call_timeout_s=60")
    model_path = ensure_tiny_model()
    backend = RayBackend(make_plan(cfg.validate()), model_path, build_task(cfg),
                         AutoTokenizer.from_pretrained(model_path))
    try:
        backend.live.every_s = 1.0
        backend.sync_weights(0)
        backend.start_collector()
        batch, _ = backend.next_batch(B, 0)
        backend.train_step(batch)
        backend.sync_weights(1)  # the last sync
        lost = nodes.inference
        nodes.cluster.remove_node(lost)
        nodes.inference = nodes.add_inference_node()
        t0 = time.monotonic()
        backend.drain()
        evaluation = backend.evaluate()
        waited = time.monotonic() - t0
        assert evaluation["eval_n"] == 8 and waited < cfg.trainer.call_timeout_s, waited  # not after a timeout
        assert node_of("inference-0", ns) == nodes.inference.node_id != lost.node_id
        stats = backend.summary_stats()
        assert stats["restarts"]["inference"] == 1 and stats["failed_episodes"] == 0
        # the new process: base weights, then version 1
        assert stats["replica_versions_held"] == [{"count": 2, "last": [0, 1], "in_order": True}]
        assert stats["learner_checksums_equal_replicas"]
    finally:
        backend.shutdown()
