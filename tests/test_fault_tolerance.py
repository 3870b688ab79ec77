"""A crashed role costs a restart, not the run. An env worker: Ray restarts it, the collector runs
its in-flight episodes again and the buffer stores each episode once. An inference replica: Ray
restarts it and it rejoins the weight-sync group with the current weights. A learner, collector or
buffer: the driver rolls every role back to the last checkpoint and goes on."""
from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest
import ray

from conftest import small_job_config
from rayllm_rl.config import load_config
from rayllm_rl.job.plan import make_plan
from rayllm_rl.job.config import GRPOJobConfig
from ray_sessions import JOB_ENV, local_ray_session

pytestmark = [pytest.mark.ray, pytest.mark.slow]


@pytest.fixture(scope="module")
def local_ray():
    with local_ray_session("test_fault_tolerance", num_cpus=2, runtime_env={"env_vars": JOB_ENV}):
        yield


def all_records(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    text = path.read_text()  # the run may be writing: a last line without its newline is not whole yet
    return list(map(json.loads, text[:text.rfind("\n") + 1].splitlines()))


def rl_records(run_dir: Path) -> list[dict]:
    return [r for r in all_records(run_dir) if r.get("phase") == "rl"]


STEPS, B, NS = 8, 4, "rayllm_ft_test"


def job_cfg(tmp_path, *extra: str, steps: int = STEPS) -> GRPOJobConfig:
    """conftest's small job in `tmp_path`, `steps` RL steps one version stale, short timeouts and the default
    log_every (5), validated: `run_and_kill`'s job. The call timeout covers a learner restarted in a rollback
    (load the model, join the group): over 60 s once on a 2-core AMD EPYC with the suite's other worker busy
    (2026-12-07); a crash is found by Ray's actor errors, not by this bound."""
    return small_job_config("data.eval_size=8", f"rollout.prompts_per_step={B}", f"trainer.steps={steps}",
                            "rollout.max_staleness=1", "trainer.log_every=5", "trainer.call_timeout_s=120",
                            "ray.sync_timeout_s=30", f"ray.namespace={NS}", *extra, run_dir=tmp_path).validate()


def run_and_kill(tmp_path, role: str, after_step: int, *extra: str, then: tuple = (), steps: int = STEPS,
                 rollbacks: bool = True) -> dict:
    """Run a short job in a thread, SIGKILL `role`'s process once RL step `after_step` is logged. `then`: more
    (role, steps) kills, each once the previous kill's rollback is logged and `steps` RL steps after it; with
    `rollbacks=False` (kills that cost no rollback), once RL step `steps` is logged."""
    from job_helpers import run_job

    cfg = job_cfg(tmp_path, *extra, steps=steps)
    out: dict = {}
    runner = threading.Thread(target=lambda: out.update(summary=run_job(cfg)), daemon=True)
    runner.start()
    for kill, (who, wait_steps) in enumerate([(role, after_step), *then]):
        recoveries = kill if rollbacks else 0
        run_dirs: list[Path] = []
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and not out:  # `recoveries` logged, then `wait_steps` RL steps
            run_dirs = [p for p in tmp_path.iterdir() if p.is_dir()]
            records = all_records(run_dirs[0]) if run_dirs else []
            cuts = [i for i, r in enumerate(records) if r.get("phase") == "recovery"]
            since = records[cuts[-1] + 1:] if cuts else records
            if len(cuts) == recoveries and sum(r.get("phase") == "rl" for r in since) >= wait_steps:
                break
            time.sleep(0.2)
        assert not out and run_dirs, f"the run ended (or never started) before {who} could be killed"
        assert time.monotonic() < deadline, f"no {wait_steps} RL steps after rollback {recoveries} in time"
        actor = ray.get_actor(who, namespace=NS)  # found by name from another driver's point of view
        os.kill(ray.get(actor.pid.remote(), timeout=30), signal.SIGKILL)
    runner.join(timeout=400)
    assert "summary" in out, f"the run did not finish after {role} was killed"
    return out["summary"]


def test_env_worker_restarts_after_the_driver_dropped_its_constructor_arguments(local_ray, tmp_path, capfd):
    """Ray re-runs a restarted actor's constructor with the arguments of its creation task; an
    argument kept in the object store is gone once the driver drops it, and the restart then fails
    (ray-project/ray#53727). The env worker takes names and small inlined arguments only, so after the
    driver has dropped everything it passed, a SIGKILLed worker comes back and runs episodes again."""
    import functools
    import gc

    from rayllm_rl.models.tiny import ensure_tiny_model
    from rayllm_rl.orchestration.ray.cluster import build_cluster, check_inlined
    from rayllm_rl.orchestration.factories import build_task
    from rayllm_rl.orchestration.fault_ledger import FaultLedger
    from rayllm_rl.orchestration.ray.backend import make_workflow

    ns = f"{NS}_args"
    cfg = load_config(GRPOJobConfig, [f"rollout.prompts_per_step={B}", "rollout.group_size=4",
                                      "rollout.max_new_tokens=6", "rollout.max_staleness=1", "ray.num_replicas=1",
                                      "ray.num_env_workers=1", "trainer.call_timeout_s=120", "ray.sync_timeout_s=60",
                                      f"ray.namespace={ns}"]).validate()
    model_path = ensure_tiny_model()
    task = build_task(cfg)
    factory = functools.partial(make_workflow, cfg, model_path, task.worker_part())
    cluster = build_cluster(make_plan(cfg.validate()), model_path, task, factory)
    try:
        del factory, task  # the driver keeps nothing it passed to a constructor (it holds no ObjectRef either)
        gc.collect()
        # handles are refused up front
        with pytest.raises(TypeError, match=r"argument 1 holds a Ray reference \(ActorHandle\)"):
            check_inlined("env worker", (None, [None, cluster.replicas[0]]))
        c, worker = cluster, cluster.env_workers[0]
        c.get(c.collector.set_version.remote(0))
        c.get(c.collector.start.remote())  # eta=1: 2B episodes admitted at version 0
        first = c.get(c.buffer.get_batch.remote(B, 0, 120), timeout_s=150)[0]
        old_pid = c.get(worker.pid.remote())
        os.kill(old_pid, signal.SIGKILL)
        deadline = time.monotonic() + 120
        while True:  # until Ray has restarted it: its constructor ran again, with nothing from the driver
            try:
                if ray.get(worker.pid.remote(), timeout=5) != old_pid:
                    break
            except ray.exceptions.ActorDiedError as exc:  # its restart failed (e.g. a constructor argument was lost)
                pytest.fail(f"the env worker did not come back: {exc}")
            except ray.exceptions.RayActorError:
                pass
            assert time.monotonic() < deadline, "Ray did not restart the env worker"
            time.sleep(0.2)
        c.get(c.collector.set_version.remote(1))  # B more episodes admitted: only the new process can run them
        rest = [c.get(c.buffer.get_batch.remote(B, 1, 120), timeout_s=150)[0] for _ in range(2)]
        ids = [gid for b in [first, *rest] for gid in sorted(set(b["group_id"].tolist()))]
        assert len(ids) == 3 * B and len(set(ids)) == 3 * B, f"episodes lost or stored twice: {ids}"
        assert c.get(worker.stats.remote())["episodes"] >= B  # counted in the restarted process
        ledger = FaultLedger(["env"])  # what the backend's ledger makes of the collector's reports
        ledger.record(c.get(c.collector.take_fault_events.remote()))  # env workers' process ids asked now
        assert ledger.env_worker_restarts() == [1] and ledger.episodes_lost == 0
    finally:
        cluster.shutdown(namespace=ns)
    time.sleep(2)  # Ray forwards actor output to the driver asynchronously
    out = capfd.readouterr()
    console = out.out + out.err
    # Ray logs this once per process: the check bites when this test is the process's first to start a job
    assert "constructor arguments in the object store" not in console
    assert "Loading weights" not in console, "an HF progress bar reached the driver's console from an actor"


@pytest.mark.parametrize("transport", ["auto", "ray_channel"])  # the object store; Ray's channels, made anew
def test_env_worker_and_replica_sigkilled_restart_without_a_rollback_and_lose_no_episode(
        local_ray, tmp_path, transport):
    """One job, two crashes that cost no rollback. Ray restarts the env worker (after step 2); the collector runs
    the episodes it had in flight again and the buffer stores each once. Ray restarts the replica (after step 4);
    it refuses requests (the router waits) until the next sync, which fails, re-forms the sync group with the new
    process and sends the current weights again."""
    summary = run_and_kill(tmp_path, "env-0", 2, f"ray.sync_transport={transport}", then=[("inference-0", 4)],
                           rollbacks=False)
    assert summary["steps"] == STEPS and summary["version"] == STEPS
    assert summary["restarts"]["env"] >= 1 and summary["restarts"]["inference"] == 1 and summary["recoveries"] == []
    assert summary["episodes_lost"] == 0 and summary["failed_episodes"] == 0
    records = rl_records(Path(summary["run_dir"]))
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    trained = [gid for r in records for gid in r["episode_ids"]]
    assert len(trained) == STEPS * B and len(set(trained)) == len(trained), "an episode lost or trained twice"
    assert summary["learner_checksums_equal_replicas"]
    held = summary["replica_versions_held"][0]  # the new process's history: base weights, then current ones only
    # (killed after step 4: the load, then versions >= 4, so at most STEPS - 4 + 2 of them, never going back)
    assert held["in_order"] and held["last"][-1] == STEPS and 2 <= held["count"] <= STEPS - 4 + 2, held


ROLLBACKS = [("learner-0", "learner"), ("collector", "collector"), ("replay-buffer", "replay-buffer"),
             ("env-0", "env")]  # the env worker with no restart budget (ray.env_worker_restarts=0): dead for good


def test_each_stateful_role_sigkilled_in_turn_rolls_back_to_the_last_checkpoint(local_ray, tmp_path):
    """One job, four crashes, one role at a time: each is SIGKILLed a few RL steps after the previous rollback (the
    first after step 3), costs one rollback to the last checkpoint (every 2 steps), and the run ends with every
    step's version once, in order, and every episode trained once."""
    kills, steps = [(role, 2) for role, _ in ROLLBACKS[1:]], 24  # steps: room for 4 kills, each a few steps late
    summary = run_and_kill(tmp_path, ROLLBACKS[0][0], 3, "trainer.checkpoint_every=2", "ray.env_worker_restarts=0",
                           f"trainer.max_recoveries={len(ROLLBACKS)}", then=kills, steps=steps)
    assert summary["steps"] == steps and summary["version"] == steps
    assert len(summary["recoveries"]) == len(ROLLBACKS), summary["recoveries"]
    assert all(role in rec["roles"] for (role, _), rec in zip(ROLLBACKS, summary["recoveries"])), summary["recoveries"]
    assert {kind: summary["restarts"][kind] for _, kind in ROLLBACKS} == {kind: 1 for _, kind in ROLLBACKS}
    # Steps logged before a crash survive up to the checkpoint it resumed from; the rest are redone after it.
    # (The checkpoint may be the last step logged, so the steps need not repeat; a loaded machine lags.)
    history: list[dict] = []
    for record in all_records(Path(summary["run_dir"])):
        if record.get("phase") == "recovery":
            assert record["resumed_from"].rsplit("_", 1)[0].endswith("step"), record
            resumed_at = int(record["resumed_from"].rsplit("_", 1)[1])
            assert resumed_at % 2 == 0 and resumed_at >= 2, record  # a checkpoint of trainer.checkpoint_every=2
            history = [h for h in history if h["step"] <= resumed_at]
        elif record.get("phase") == "rl":
            history.append(record)
    assert [r["step"] for r in history] == list(range(1, steps + 1))  # the same version sequence, once
    assert [r["version"] for r in history] == list(range(1, steps + 1))
    trained = [gid for r in history for gid in r["episode_ids"]]
    assert len(trained) == steps * B and len(set(trained)) == len(trained), "an episode lost or trained twice"
    assert summary["learner_checksums_equal_replicas"] and summary["failed_episodes"] == 0
    # No episode is lost in the end: any the dead env worker held were run again after the rollback (it may hold
    # none: killed while the collector waited at the staleness bound, the liveness check finds it).
    assert summary["episodes_lost"] == 0


def test_a_lone_replica_restarted_while_the_driver_waits_gets_the_weights_in_that_wait(local_ray):
    """The restarted replica serves nothing until the current weights reach it, and no sync comes
    while the driver waits for a batch that only this replica can generate: the wait's liveness
    check must send them (else the episodes time out and the run fails)."""
    from transformers import AutoTokenizer

    from rayllm_rl.models.tiny import ensure_tiny_model
    from rayllm_rl.orchestration.factories import build_task
    from rayllm_rl.orchestration.ray.backend import RayBackend

    cfg = load_config(GRPOJobConfig, [f"rollout.prompts_per_step={B}", "rollout.group_size=4",
                                      "rollout.max_new_tokens=6", "rollout.max_staleness=0", "ray.num_replicas=1",
                                      "trainer.call_timeout_s=60", "ray.sync_timeout_s=30",
                                      f"ray.namespace={NS}"]).validate()
    model_path = ensure_tiny_model()
    backend = RayBackend(make_plan(cfg.validate()), model_path, build_task(cfg),
                         AutoTokenizer.from_pretrained(model_path))
    try:
        backend.live.every_s = 1.0
        backend.sync_weights(0)
        replica = backend.cluster.replicas[0]
        old_pid = ray.get(replica.pid.remote(), timeout=30)
        os.kill(old_pid, signal.SIGKILL)
        deadline = time.monotonic() + 120
        while True:  # until Ray has restarted it
            try:
                if ray.get(replica.pid.remote(), timeout=5) != old_pid:
                    break
            except ray.exceptions.RayActorError:
                pass
            assert time.monotonic() < deadline, "Ray did not restart the replica"
            time.sleep(0.2)
        backend.start_collector()
        t0 = time.monotonic()
        _, meta = backend.next_batch(B, 0)
        waited = time.monotonic() - t0
        assert len(meta["episode_ids"]) == B
        assert waited < cfg.trainer.call_timeout_s, waited  # not after the episodes' timeout
        stats = backend.summary_stats()
        assert stats["restarts"]["inference"] == 1 and stats["failed_episodes"] == 0
        # the new process: base weights, then the sent ones
        assert stats["replica_versions_held"] == [{"count": 2, "last": [0, 0], "in_order": True}]
        assert stats["learner_checksums_equal_replicas"]
    finally:
        backend.shutdown()
