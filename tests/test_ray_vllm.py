"""The Ray pipeline with vLLM replicas (vLLM's CPU build): weights synced into vLLM's worker
process give the learner's logprobs, and a short job trains through them."""
from __future__ import annotations

import functools

import pytest
import torch

from conftest import small_job_config
from rayllm_rl.job.plan import make_plan
from rayllm_rl.job.config import GRPOJobConfig
from budgets import VLLM_START_S
from ray_sessions import JOB_ENV, local_ray_session

pytestmark = [pytest.mark.vllm, pytest.mark.ray, pytest.mark.slow]


@pytest.fixture(scope="module")
def local_ray():
    with local_ray_session("test_ray_vllm", num_cpus=2, runtime_env={"env_vars": JOB_ENV}):
        yield


def vllm_cfg(tmp_path, *extra: str) -> GRPOJobConfig:
    """conftest's small job on vLLM in `tmp_path` (8 eval sums, a call timeout that covers vLLM's start), validated."""
    return small_job_config("inference.engine=vllm", "inference.options.kv_cache_mb=128", "data.eval_size=8",
                            f"trainer.call_timeout_s={VLLM_START_S}", "ray.sync_timeout_s=60", *extra,
                            run_dir=tmp_path).validate()


# One transport of each receive path into a vLLM replica actor: the object store (the actor fetches and stages
# into vLLM's workers), Ray's channels (read in place), and a group the vLLM workers join themselves (shm). Every
# CPU transport into the vLLM engine is in tests/test_engine_contract.py, and every one between the Ray actors in
# tests/test_ray_pipeline.py. The three share one cluster (one vLLM start): each forms its group afresh on it.
VLLM_TRANSPORTS = ["object_store", "ray_channel", "shm"]


@pytest.fixture(scope="class")
def vllm_cluster(local_ray, tmp_path_factory):
    from types import SimpleNamespace

    from rayllm_rl.models.tiny import ensure_tiny_model
    from rayllm_rl.orchestration.factories import build_task
    from rayllm_rl.orchestration.ray.backend import make_workflow
    from rayllm_rl.orchestration.ray.cluster import build_cluster

    cfg = vllm_cfg(tmp_path_factory.mktemp("vllm-sync"), f"ray.sync_transport={VLLM_TRANSPORTS[0]}")
    path = ensure_tiny_model()
    task = build_task(cfg)
    cluster = build_cluster(make_plan(cfg.validate()), path, task,
                            functools.partial(make_workflow, cfg, path, task.worker_part()))
    try:
        yield SimpleNamespace(cluster=cluster, path=path, versions=iter(range(1, 100)))
    finally:
        cluster.shutdown()


@pytest.mark.fixture_owned("shm segments")  # each group's segments (staging, shm) are the class's cluster's
class TestVLLMSync:
    @pytest.mark.parametrize("transport", VLLM_TRANSPORTS)
    def test_vllm_replica_logprobs_equal_learner_after_sync(self, vllm_cluster, tmp_path, transport):
        from transformers import AutoTokenizer

        from rayllm_rl.data.sft import make_sft_batch
        from rayllm_rl.data.trajectory import concat_padded, make_trajectory
        from rayllm_rl.inference.protocol import LLMRequest, SamplingParams
        from rayllm_rl.learner.frozen import FrozenModel  # a full forward of the learner's weights, here
        from rayllm_rl.objectives import SFTLoss
        from rayllm_rl.orchestration.ray.cluster import rejoin_sync_group

        cluster, path = vllm_cluster.cluster, vllm_cluster.path
        cfg = vllm_cfg(tmp_path, f"ray.sync_transport={transport}")
        if cluster.transport is None or cluster.transport.name != transport:
            rejoin_sync_group(cluster, make_plan(cfg.validate()), [])
        assert cluster.transport.name == transport
        (replica,) = cluster.replicas
        tok = AutoTokenizer.from_pretrained(path)
        demo = [[{"role": "user", "content": "1+1="}, {"role": "assistant", "content": "<answer>2</answer>"}]]
        cluster.learners.train_step(make_sft_batch(tok, demo), SFTLoss())
        learner_sum = cluster.get(cluster.learners[0].checksum.remote())
        assert abs(cluster.get(replica.checksum.remote()) - learner_sum) > 1e-6, "the SFT step changed the weights"
        version = next(vllm_cluster.versions)
        stats = cluster.sync_weights(version)
        assert cluster.get(replica.version_history.remote())[-1] == version
        assert cluster.get(replica.checksum.remote()) == learner_sum
        assert stats["stall_s"] >= 0 and stats["receive_s"] > 0

        prompts = [list(tok.apply_chat_template([{"role": "user", "content": f"{i}+{i + 2}="}],
                                                add_generation_prompt=True, tokenize=True, return_dict=False))
                   for i in range(4)]
        sampling = SamplingParams(max_new_tokens=8, temperature=1.0, ignore_eos=True)
        responses = cluster.get([replica.agenerate.remote(LLMRequest(input_ids=p, sampling=sampling)) for p in prompts])
        trajs = []
        for r in responses:
            assert r.output_versions == [version] * r.output_len
            n_in = r.input_len
            trajs.append(make_trajectory(r.input_tokens + r.output_tokens, [0.0] * n_in + r.output_logprobs,
                                         [0] * n_in + [1] * r.output_len, [-1] * n_in + r.output_versions, 0.0))
        batch = concat_padded(trajs)
        learner = FrozenModel(path, temperature=cfg.rollout.temperature,
                                 named_tensors=cluster.get(cluster.learners[0].policy_weights.remote()))
        learner_lp = learner.compute_logprobs(batch)
        mask = batch["loss_mask"]
        diff = (learner_lp[mask] - batch["logprobs"][mask]).abs().max().item()
        assert mask.sum() == 32 and diff <= 1e-4, diff


def test_grpo_job_trains_through_vllm_replicas(local_ray, tmp_path):
    from job_helpers import run_job

    summary = run_job(vllm_cfg(tmp_path, "trainer.steps=4", "rollout.max_staleness=1"))
    assert summary["steps"] == 4 and summary["version"] == 4
    assert summary["learner_checksums_equal_replicas"] is True
    assert summary["replica_versions_held"] == [{"count": 6, "last": [0, 1, 2, 3, 4], "in_order": True}]
    assert summary["max_version_lag"] <= 1
    assert summary["failed_episodes"] == 0
    for key in ("eval_reward_before", "eval_reward_after", "eval_reward_gain", "wall_seconds", "run_dir"):
        assert key in summary
    assert torch.isfinite(torch.tensor(summary["eval_reward_after"]))
