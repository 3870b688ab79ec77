"""The Ray pipeline on a local Ray (CPU): sync equality, versions, staleness, resume."""
from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import ray  # a core dependency: missing ray is a failure, not a skip
from conftest import small_job_config
from rayllm_rl.config import load_config
from rayllm_rl.job.plan import make_plan
from rayllm_rl.job.config import GRPOJobConfig

pytestmark = [pytest.mark.ray, pytest.mark.slow]


@pytest.fixture(scope="module")
def local_ray():
    """A local Ray started the way a job starts it (`init_ray`: its dashboard on 127.0.0.1, token auth on),
    with 2 CPUs; yields what `init_ray` printed, what Ray logged meanwhile, and the driver's job id."""
    import contextlib
    import io
    import logging
    from types import SimpleNamespace

    from rayllm_rl.orchestration.ray.session import init_ray

    import leak_guard

    cfg = load_config(GRPOJobConfig, [f"ray.temp_dir=/tmp/rayllm-test-{os.getpid()}"])
    printed, logged = io.StringIO(), []
    handler = logging.Handler()
    handler.emit = lambda record: logged.append(record.getMessage())
    with leak_guard.holding_ray("test_ray_pipeline"):
        try:  # shut down whatever happens, also when starting it fails
            logging.getLogger("ray").addHandler(handler)
            try:
                with contextlib.redirect_stdout(printed):
                    init_ray(cfg, num_cpus=2)
                    init_ray(cfg, num_cpus=2)  # Ray is up: nothing is started or printed again
            finally:
                logging.getLogger("ray").removeHandler(handler)
            yield SimpleNamespace(printed=printed.getvalue(), logged=logged,
                                  job_id=ray.get_runtime_context().get_job_id())
        finally:
            ray.shutdown()


def small_cfg(tmp_path, *extra: str) -> GRPOJobConfig:
    """conftest's small job in `tmp_path` with a 1-minute sync timeout, validated."""
    return small_job_config("ray.sync_timeout_s=60", *extra, run_dir=tmp_path).validate()


def rl_records(summary) -> list[dict]:
    lines = (Path(summary["run_dir"]) / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["phase"] == "rl"]


SYNC_TRANSPORTS = ["object_store", "ray_channel", "shm", "gloo", "rdt_gloo"]
"""Every CPU transport of the registry, in the order one cluster forms their groups (rdt_gloo last: Ray's gloo
collective group takes learner rank 0's global torch.distributed group for the rest of its life)."""
SYNC_JOB = ("ray.num_replicas=2", "rollout.max_staleness=1", "ray.namespace=rayllm_sync_test")
"""Its own namespace: the module's jobs start their actors under the same names meanwhile."""


@pytest.fixture(scope="class")
def sync_cluster(local_ray, tmp_path_factory):
    """One job's learner and replicas (2) for every transport, a plan of those roles alone (`JobPlan.only`): each
    test forms its transport's group afresh on them, as a replica restart does (`rejoin_sync_group`), instead of
    starting a cluster of its own."""
    from rayllm_rl.models.tiny import ensure_tiny_model
    from rayllm_rl.orchestration.ray.cluster import build_cluster

    cfg = small_cfg(tmp_path_factory.mktemp("sync"), *SYNC_JOB, f"ray.sync_transport={SYNC_TRANSPORTS[0]}")
    path = ensure_tiny_model()
    plan = make_plan(cfg.validate()).only("learner", "replica")
    cluster = build_cluster(plan, path)  # no rollout roles: no task, no workflow
    try:
        yield SimpleNamespace(cluster=cluster, plan=plan, path=path, versions=iter(range(1, 100)))
    finally:
        cluster.shutdown()


@pytest.mark.fixture_owned("shm segments")  # each group's segments (shm) are the class's cluster's
class TestSync:
    """The transports' tests share one cluster, shut down after the last of them."""

    @pytest.mark.parametrize("transport", SYNC_TRANSPORTS)
    def test_sync_makes_replica_weights_equal(self, sync_cluster, tmp_path, transport):
        from transformers import AutoTokenizer

        from rayllm_rl.data.sft import make_sft_batch
        from rayllm_rl.objectives import SFTLoss
        from rayllm_rl.orchestration.ray.cluster import rejoin_sync_group

        cluster, path = sync_cluster.cluster, sync_cluster.path
        plan = make_plan(small_cfg(tmp_path, *SYNC_JOB, f"ray.sync_transport={transport}").validate())
        if cluster.transport is None or cluster.transport.name != transport:
            rejoin_sync_group(cluster, plan, [])
        assert cluster.transport.name == transport
        assert list(cluster.roles()) == [r.name for r in sync_cluster.plan.roles()]  # its plan's roles, by name
        # Perturb the learner with one SFT step, then sync the next version to both replicas.
        tok = AutoTokenizer.from_pretrained(path)
        batch = make_sft_batch(tok, [[{"role": "user", "content": "1+1="},
                                      {"role": "assistant", "content": "<answer>2</answer>"}]])
        cluster.learners.train_step(batch, SFTLoss())
        before = cluster.replicas.checksums()
        learner_sum = cluster.learners.checksums()[0]
        assert all(abs(b - learner_sum) > 1e-6 for b in before)
        version = next(sync_cluster.versions)
        stats = cluster.sync_weights(version)
        assert cluster.replicas.checksums() == [learner_sum, learner_sum]
        assert [held[-1] for held in cluster.replicas.versions_held()] == [version, version]
        assert stats["sync_bytes"] > 0 and stats["stall_s"] < stats["sync_s"] + stats["receive_s"]
        named = cluster.get(cluster.learners[0].policy_weights.remote())
        assert sum(t.numel() for t in named.values()) * 4 <= stats["sync_bytes"]
        assert isinstance(named[next(iter(named))], torch.Tensor)

    def test_a_plan_of_learners_and_replicas_alone_is_driven_from_python(self, sync_cluster):
        """What a user's own loop builds on (Tinker's primitives): the roles of `only("learner", "replica")` start
        and nothing else does; a train step on the learner, a sync, then a sample from a replica generated at that
        version, with the learner's weights."""
        from transformers import AutoTokenizer

        from rayllm_rl.data.sft import make_sft_batch
        from rayllm_rl.inference.protocol import LLMRequest, SamplingParams
        from rayllm_rl.objectives import SFTLoss

        cluster, plan = sync_cluster.cluster, sync_cluster.plan
        assert [r.kind for r in plan.roles()] == ["replica", "replica", "learner"]
        assert set(cluster.kinds.values()) == {"replica", "learner"}
        assert cluster.buffer is None and cluster.collector is None and len(cluster.env_workers) == 0
        tok = AutoTokenizer.from_pretrained(sync_cluster.path)
        batch = make_sft_batch(tok, [[{"role": "user", "content": "2+2="},
                                      {"role": "assistant", "content": "<answer>4</answer>"}]])
        metrics = cluster.learners.train_step(batch, SFTLoss())[0]
        assert metrics["loss"] > 0 and not metrics.get("skipped_nonfinite_steps")
        version = next(sync_cluster.versions)
        cluster.sync_weights(version)
        prompt = tok("3+4=")["input_ids"]
        request = LLMRequest(prompt, SamplingParams(max_new_tokens=5, temperature=1.0))
        out = cluster.get(cluster.replicas[1].agenerate.remote(request))
        assert len(out.output_tokens) > 0 and out.output_versions == [version] * len(out.output_tokens)
        assert cluster.replicas.checksums() == cluster.learners.checksums() * 2


def test_a_jobs_own_ray_gives_the_actors_their_environment_in_its_job_env(local_ray):
    """The Ray a job starts carries the actors' environment in its job env, so no actor needs a runtime env of its
    own (which would cost it a fresh worker process)."""
    from rayllm_rl.orchestration.ray.actors import ACTOR_ENV_VARS, ActorProcess, job_sets_actor_env, ray_actor

    @ray_actor
    class Probe(ActorProcess):
        def env(self, keys):
            return {k: os.environ.get(k) for k in keys}

    probe = Probe.remote()
    try:
        assert job_sets_actor_env()
        assert ray.get(probe.env.remote(list(ACTOR_ENV_VARS)), timeout=60) == ACTOR_ENV_VARS
    finally:
        ray.kill(probe)


def check_versions_and_staleness(summary: dict, eta: int, steps: int) -> None:
    """A Ray job's records: every step once, in order, each trained on tokens at most `eta` versions old that its
    replicas held; the summary's schema is the local backend's; the batches went from the buffer to the learners
    by reference. Asserted on jobs the tests below run anyway (eta 0: the GSM8K job the resume test resumes; 1: two
    FSDP learners), which saves two jobs of their own."""
    from rayllm_rl.orchestration.reporting import SUMMARY_KEYS

    assert set(summary) == SUMMARY_KEYS and summary["backend"] == "ray"  # the local backend's schema too
    assert summary["weight_transport"] == "object_store"  # the default on CPU: Ray's object store
    records = rl_records(summary)
    assert [r["step"] for r in records] == list(range(1, steps + 1))
    assert [r["version"] for r in records] == list(range(1, steps + 1))
    for r in records:
        assert r["staleness_max"] <= eta
        trained_at = r["version"] - 1  # the learner was at this version when it sampled the batch
        assert all(trained_at - v <= eta and v <= trained_at for v in r["token_versions"])
    assert summary["max_version_lag"] <= eta and summary["failed_episodes"] == 0
    held = summary["replica_versions_held"]
    assert all(h["in_order"] for h in held)  # each replica's versions never go back (v0 = load, then post-SFT sync)
    assert all(h["count"] == steps + 2 and h["last"][-1] == steps for h in held)  # load, post-SFT sync, one a step
    # `last` holds the newest 5: every version a step of these short jobs sampled with (v0 ... steps)
    assert all(set(r["token_versions"]) <= set().union(*(set(h["last"]) for h in held)) for r in records)
    assert summary["learner_checksums_equal_replicas"]
    if eta == 0:
        assert all(r["token_versions"] == [r["version"] - 1] for r in records)
    # the batch went from the buffer to the learner by reference: the driver saw metadata only
    # (step 1 also counts the SFT warm start's batches, which the driver makes and puts)
    for r in records[1:]:
        assert 0 < r["driver_bytes"] < min(16_384, r["batch_bytes"]), (r["driver_bytes"], r["batch_bytes"])


def test_the_reference_is_the_learners_policy_built_without_the_driver_and_kl_is_computed_by_the_buffer(
        local_ray, tmp_path):
    """start_frozen hands learner rank 0's weights to the reference actor by reference; the buffer's
    actor asks it for the logprobs and computes KL and advantages where the batch is."""
    from transformers import AutoTokenizer

    from rayllm_rl.models.tiny import ensure_tiny_model
    from rayllm_rl.orchestration.factories import build_task
    from rayllm_rl.orchestration.ray.backend import RayBackend

    cfg = small_cfg(tmp_path, "algo.kl_coef=0.05", "ray.namespace=rayllm_ref_test").validate()
    model_path = ensure_tiny_model()
    backend = RayBackend(make_plan(cfg.validate()), model_path, build_task(cfg),
                         AutoTokenizer.from_pretrained(model_path))
    try:
        nbytes = sum(t.numel() * t.element_size() for t in ray.get(
            backend.cluster.learners[0].policy_weights.remote(), timeout=60).values())
        assert backend.driver_bytes() == 0
        backend.start_frozen(None)
        assert backend.driver_bytes() == 0 < nbytes  # before: every learner rank's full weights came here
        backend.sync_weights(0)
        backend.start_collector()
        ref, meta = backend.next_batch(4, 0)
        fetched = backend.driver_bytes()
        assert isinstance(ref, ray.ObjectRef) and fetched < min(16_384, meta["batch_bytes"])
        batch = ray.get(ref, timeout=60)  # the test looks inside; the driver's loop never does
        assert batch.bytes() == meta["batch_bytes"] and sorted(set(batch["group_id"].tolist())) == meta["episode_ids"]
        from rayllm_rl.learner.frozen import FrozenModel  # the policy's full forward, in this process

        policy = FrozenModel(model_path, temperature=cfg.rollout.temperature, named_tensors=ray.get(
            backend.cluster.learners[0].policy_weights.remote(), timeout=60)).compute_logprobs(batch)
        mask = batch["loss_mask"].bool()
        assert mask.any() and "advantages" in batch.keys() and "kl" in batch.keys()
        torch.testing.assert_close(batch["ref_logprobs"][mask], policy[mask].to(batch["ref_logprobs"].dtype),
                                   rtol=1e-4, atol=1e-4)  # no step yet: the reference is the policy
    finally:
        backend.shutdown()


GSM8K_KL = ("task=gsm8k", f"data.path={Path(__file__).parent / 'fixtures' / 'gsm8k.jsonl'}", "data.eval_size=2",
            "rollout.prompts_per_step=2", "rollout.max_new_tokens=12", "trainer.steps=4", "rollout.max_staleness=0",
            "algo.kl_coef=0.05", "algo.kl_reward_coef=0.01", "optim.weight_decay=0.1")
"""A GSM8KEnv job with the reference actor serving KL to the loss (kl_coef) and to the reward (kl_reward_coef); weight
decay moves the policy away from the reference even when the tiny model's rewards (hence advantages) are all zero."""


@pytest.fixture(scope="module")
def gsm8k_kl_run(local_ray, tmp_path_factory):
    """The GSM8K job with reference KL, checkpointed every 2 steps: its own test and the resume test read it."""
    from job_helpers import run_job

    return run_job(small_cfg(tmp_path_factory.mktemp("gsm8k_kl"), *GSM8K_KL, "trainer.checkpoint_every=2"))


def test_resume_continues_same_step_version_and_data(local_ray, gsm8k_kl_run, tmp_path):
    """Resumed from the step-2 checkpoint, the job runs steps 3 and 4 on the same rows, as the same versions, and
    keeps the original reference."""
    from job_helpers import run_job

    from safetensors.torch import load_file

    first = gsm8k_kl_run
    check_versions_and_staleness(first, eta=0, steps=4)
    ckpt = Path(first["run_dir"]) / "checkpoints" / "step_2"
    assert ckpt.exists()
    resumed = run_job(small_cfg(tmp_path / "b", *GSM8K_KL, f"resume={ckpt}"))
    a, b = rl_records(first), rl_records(resumed)
    assert [r["step"] for r in b] == [3, 4] and [r["version"] for r in b] == [3, 4]
    assert [r["data_sha"] for r in b] == [r["data_sha"] for r in a[2:]]
    assert resumed["steps"] == 4 and resumed["version"] == 4
    ref_a, ref_b = (load_file(str(Path(s["checkpoint"]) / "reference.safetensors")) for s in (first, resumed))
    assert ref_a.keys() == ref_b.keys() and all(torch.equal(ref_a[k], ref_b[k]) for k in ref_a)
    policy = load_file(str(ckpt / "model.safetensors"))  # the step-2 policy has moved away from the reference
    shared = ref_a.keys() & policy.keys()
    assert shared and not all(torch.equal(ref_a[k], policy[k].to(ref_a[k].dtype)) for k in shared)


@pytest.fixture(scope="module")
def fsdp_agent_run(local_ray, tmp_path_factory):
    """One job for two tests: two FSDP learner ranks (eta 1), and an agent written with openai.AsyncOpenAI as the
    rollout workflow."""
    from job_helpers import run_job

    return run_job(small_cfg(tmp_path_factory.mktemp("fsdp_agent"), "trainer.steps=3", "ray.num_learners=2",
                           "rollout.max_staleness=1", "rollout.workflow=openai_agent",
                           "rollout.agent=rayllm_rl.agents.examples:answer_then_check"))


def test_two_fsdp_learner_actors_train_and_sync(fsdp_agent_run):
    summary = fsdp_agent_run
    assert summary["steps"] == 3 and summary["version"] == 3
    check_versions_and_staleness(summary, eta=1, steps=3)
    assert summary["learner_checksums_equal_replicas"]  # both FSDP ranks' full weights == every replica's
    assert summary["replica_versions_held"] == [{"count": 5, "last": [0, 0, 1, 2, 3], "in_order": True}]


def test_gsm8k_env_in_ray_env_workers_with_reference_kl(gsm8k_kl_run):
    """GSM8KEnv runs inside the env workers (ChatEnvWorkflow) through real training steps, with the
    reference actor serving KL both to the loss (kl_coef) and to the reward (kl_reward_coef)."""
    summary = gsm8k_kl_run
    assert summary["steps"] == 4 and summary["failed_episodes"] == 0
    components = ("reward_answer", "reward_think", "reward_right", "reward_contained", "success")
    for key in components:
        assert f"eval_{key}" in summary["eval_before"] and f"eval_{key}" in summary["eval_after"]
    assert summary["reward_failures"]["reward_calls"] >= 4 * 2 * 4  # steps x prompts x group
    assert summary["reward_failures"]["reward_errors"] == 0
    for rec in rl_records(summary):
        assert set(components) <= set(rec) and "num_turns" in rec
        assert "kl_ref" in rec and rec["kl_ref"] >= 0.0  # KL to the reference in the loss
        assert "kl_penalty" in rec  # KL in the reward, from the reference actor
        assert 0.0 < rec["entropy"] < 10.0
    first = rl_records(summary)[0]
    assert abs(first["kl_penalty"]) < 1e-3  # step 1 samples from the reference's own weights


def test_openai_sdk_agent_trains_in_ray_env_workers(fsdp_agent_run):
    """An agent written with openai.AsyncOpenAI runs in the env workers against the replicas; its two
    completions per episode become one token-exact trajectory that the learner trains on."""
    summary = fsdp_agent_run
    assert summary["steps"] == 3 and summary["failed_episodes"] == 0
    for rec in rl_records(summary):
        assert rec["num_completions"] == 2.0 and rec["seqs"] == 4 * 4
        assert rec["token_versions"] and max(rec["token_versions"]) <= rec["version"] - 1


@pytest.fixture(scope="module")
def learning_run(local_ray, tmp_path_factory):
    """The learning job of the test below, run once; meanwhile a headless Chromium, where there is one, opens
    the job's dashboard through the token and looks for its actors and the job (test_ray_dashboard.py)."""
    from types import SimpleNamespace

    from job_helpers import run_job
    from browser_helpers import BROWSER
    from test_ray_dashboard import JOB_ACTORS, URL_LINE, DashboardWatcher, token_from_line

    tmp_path = tmp_path_factory.mktemp("learning")
    url = URL_LINE.search(local_ray.printed)
    cfg = load_config(GRPOJobConfig, [
        "sft.steps=60", "sft.batch_size=32", "data.max_operand=4", "data.eval_size=5", "rollout.prompts_per_step=8",
        "rollout.group_size=8", "rollout.max_new_tokens=8", "trainer.steps=80", "trainer.eval_every=0",
        "trainer.log_every=1000", "optim.lr=3e-4", f"trainer.run_dir={tmp_path}", "trainer.call_timeout_s=120",
    ]).validate()
    watcher = None
    if BROWSER is not None and url is not None:
        watcher = DashboardWatcher(BROWSER, url.group(1), token_from_line(local_ray.printed), JOB_ACTORS,
                                   cfg.ray.namespace, local_ray.job_id, tmp_path)
    try:
        summary = run_job(cfg)
    finally:
        if watcher is not None:
            watcher.job_done.set()
    return SimpleNamespace(summary=summary, watcher=watcher, shots=tmp_path)


def test_ray_pipeline_learns_with_nonzero_advantages(learning_run):
    """A short warm start leaves the model right on some prompts, so groups disagree, advantages
    are non-zero and GRPO raises the training reward (measured: ~0.24 -> ~0.54 over 80 steps), by more
    than the run's own step-to-step noise (tests/learning_bounds.py)."""
    from learning_bounds import assert_advantages_every_step, assert_rises

    summary = learning_run.summary
    rl = rl_records(summary)
    assert len(rl) == 80 and summary["failed_episodes"] == 0
    assert_advantages_every_step(rl)
    assert_rises([r["reward"] for r in rl[:15]], [r["reward"] for r in rl[-15:]],
                 what="training reward, first 15 -> last 15 steps")


def test_the_dashboard_showed_the_running_jobs_actors_and_the_job_through_the_token(local_ray, learning_run):
    """The job's own Ray start (`init_ray`) printed the dashboard's URL once (127.0.0.1; Ray's own start-up
    line no longer carries it); while the learning job ran, a real headless Chromium opened that URL, was
    asked for the token, typed the one from where the printed line says it is, and then saw the job's five named
    actors ALIVE on the Actors page and the driver job RUNNING on the Jobs page."""
    from browser_helpers import browser_or_skip
    from test_ray_dashboard import JOB_ACTORS, URL_LINE

    lines = [line for line in local_ray.printed.splitlines() if line]
    assert len(lines) == 1 and URL_LINE.match(lines[0]), local_ray.printed
    url = URL_LINE.match(lines[0]).group(1)
    assert url.startswith("http://127.0.0.1:")
    assert "Started a local Ray instance." in local_ray.logged, local_ray.logged
    assert not [m for m in local_ray.logged if url.removeprefix("http://") in m], local_ray.logged
    browser_or_skip()
    seen = learning_run.watcher.result()
    assert seen["dialog"] and seen["dialog_gone"]  # token auth on, and the token passed it
    assert set(seen["actor_rows"]) == set(JOB_ACTORS), seen
    assert all(f" {local_ray.job_id} " in f" {row} " for row in seen["actor_rows"].values()), seen  # this driver's
    assert seen["job_row"].split()[0] == local_ray.job_id and " RUNNING " in f" {seen['job_row']} ", seen
    for page in ("actors", "jobs"):
        assert (learning_run.shots / f"ray_dashboard_{page}.png").stat().st_size > 10_000
    print(f"dashboard: the job's actors were up at {seen['actors_up_s']:.1f}s; the browser saw them ALIVE at "
          f"{seen['actors_s']:.1f}s and the job RUNNING at {seen['jobs_s']:.1f}s; "
          f"screenshots in {learning_run.shots}")


@pytest.mark.ray
def test_the_buffers_actor_scores_with_a_frozen_actor_a_test_added(local_ray, tiny_model_path):
    """tests/test_frozen_models.py's second teacher on Ray, without a whole job: a `FrozenActor` named after it, and
    the replay buffer's actor running `prepare_batch` with it: the KL it reports is the one the same spec's model
    gives here, in this process, on the same batch."""
    import sys

    import test_frozen_models as added
    from rayllm_rl.algorithm.batch_prep import BatchPipeline, make_batch_pipeline
    from rayllm_rl.api.entry import prepare
    from rayllm_rl.config import load_config
    from rayllm_rl.data.trajectory import concat_padded, make_trajectory
    from rayllm_rl.orchestration.ray.actors import FrozenActor
    from rayllm_rl.orchestration.ray.rollout_actors import ReplayBufferActor

    cfg = load_config(GRPOJobConfig, [f"teacher.path={tiny_model_path}", "trainer.backend=ray", *added.SMALL])
    plan = added.with_second_teacher(prepare(cfg)[0])
    spec = plan.frozen[1]
    # the stage goes to the buffer's actor by value (this test module is not importable there), as a user's would
    # from a script
    ray.cloudpickle.register_pickle_by_value(sys.modules[added.__name__])
    ns = "rayllm_frozen_test"
    teacher2 = FrozenActor.options(name="teacher2", namespace=ns).remote(spec)
    stages = BatchPipeline(make_batch_pipeline(plan.config).stages + (added.SecondTeacherKL(),))  # the second alone
    buffer = ReplayBufferActor.options(namespace=ns).remote(plan.buffer_spec(), stages)
    try:
        for gid in range(2):  # two episodes of two rows each, sampled by version 0
            rows = [make_trajectory([5, 6 + gid, 9 + r, 10, 11], [0.0, 0.0, -1.5, -0.5, -2.0], [0, 0, 1, 1, 1],
                                    [-1, -1, 0, 0, 0], reward=float(r), group_id=gid) for r in range(2)]
            ray.get(buffer.put.remote(concat_padded(rows), 30, gid), timeout=60)
        ref, meta = buffer.take_batch.remote(2, 0, 60, {"teacher2": teacher2})
        meta, batch = ray.get(meta, timeout=120), ray.get(ref, timeout=60)
        assert ray.get(ray.get_actor("teacher2", namespace=ns).pid.remote(), timeout=30) > 0
    finally:
        for actor in (teacher2, buffer):
            ray.kill(actor, no_restart=True)
    mask = batch["loss_mask"].float()
    here = spec.build().compute_logprobs(batch)  # the same spec's model, in this process
    want = float(((batch["logprobs"].float() - here) * mask).sum() / mask.sum())
    assert meta["teacher2_s"] > 0 and meta["teacher2_rescored"] == 0 and want != 0
    assert meta["teacher2_kl"] == pytest.approx(want, rel=added.SUM_ORDER_TOL)
    assert torch.equal(batch["teacher2_kl"], torch.full((4,), batch["teacher2_kl"][0]))
