"""One driver for both backends: the single-process backend runs the same loop as the Ray one,
with the same summary, resume, periodic checkpoints and policy versions."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from conftest import small_job_config
from rayllm_rl.config import load_config
from job_helpers import run_job
from learning_bounds import assert_advantages_every_step, assert_rises
from rayllm_rl.orchestration.reporting import SUMMARY_KEYS
from rayllm_rl.job.config import GRPOJobConfig


def local_cfg(tmp_path, *extra: str) -> GRPOJobConfig:
    """conftest's small job on the local backend in `tmp_path`, with 3 SFT steps and the default eval_every (100),
    validated."""
    return small_job_config("trainer.backend=local", "sft.steps=3", "trainer.eval_every=100", *extra,
                            run_dir=tmp_path).validate()


def rl_records(summary) -> list[dict]:
    lines = (Path(summary["run_dir"]) / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["phase"] == "rl"]


@pytest.mark.slow
def test_an_evaluation_during_rl_has_the_engine_to_itself(tmp_path, monkeypatch):
    """Asynchronous (staleness 1), an evaluation after every step: the collector is paused with no episode running
    while the evaluation runs (no training batch is made meanwhile, so `eval_s` is the evaluation's alone, as the
    vs_trl clock takes it off), and it resumes after: every step still gets its batch."""
    from rayllm_rl.orchestration.local.backend import LocalBackend

    seen, evaluate = [], LocalBackend.evaluate

    def watched(self, progress=None):
        c = self.collector
        before = (c.paused, len(c.running()), c.finished)
        out = evaluate(self, progress)
        seen.append((*before, c.finished))
        return out

    monkeypatch.setattr(LocalBackend, "evaluate", watched)
    summary = run_job(local_cfg(tmp_path, "trainer.steps=3", "trainer.eval_every=1", "rollout.max_staleness=1"))
    assert summary["steps"] == 3 and len(seen) == 1 + 3 + 1  # before RL, after each step, at the end
    for paused, running, finished, finished_after in seen[1:4]:
        assert paused and running == 0 and finished_after == finished, seen
    assert all(r["eval_s"] > 0 for r in rl_records(summary))


@pytest.mark.slow
@pytest.mark.parametrize("eta", [0, 1])
def test_local_backend_runs_the_shared_driver(tmp_path, eta):
    from transformers import AutoModelForCausalLM

    summary = run_job(local_cfg(tmp_path, "trainer.steps=3", "trainer.eval_every=2", f"rollout.max_staleness={eta}"))
    assert set(summary) == SUMMARY_KEYS
    assert summary["backend"] == "local" and summary["steps"] == 3 and summary["version"] == 3
    assert summary["failed_episodes"] == 0 and summary["budget_cuts"] == []
    records = rl_records(summary)
    assert [r["step"] for r in records] == [1, 2, 3] and [r["version"] for r in records] == [1, 2, 3]
    assert all(r["seqs"] == 16 for r in records) and "eval_reward" in records[1] and records[1]["eval_s"] > 0
    for r in records:  # tokens sampled at most eta versions before the step that trains on them
        assert all(r["version"] - 1 - eta <= v <= r["version"] - 1 for v in r["token_versions"])
        assert r["staleness_max"] <= eta
    if eta == 0:
        assert all(r["token_versions"] == [r["version"] - 1] for r in records)
    # the engine's load (v0), the sync after the SFT warm start (v0), one per step
    assert summary["replica_versions_held"] == [{"count": 5, "last": [0, 0, 1, 2, 3], "in_order": True}]
    assert summary["learner_checksums_equal_replicas"]
    assert summary["buffer"]["sampled"] == 3 * 4
    assert (Path(summary["run_dir"]) / "reward_curve.png").stat().st_size > 1000
    model = AutoModelForCausalLM.from_pretrained(summary["checkpoint"])
    assert sum(p.numel() for p in model.parameters()) > 0


@pytest.mark.slow
def test_local_resume_continues_same_step_version_data_and_reference(tmp_path):
    from safetensors.torch import load_file

    kl = ("algo.kl_coef=0.05", "optim.weight_decay=0.1", "rollout.max_staleness=0", "trainer.eval_every=0")
    first = run_job(local_cfg(tmp_path / "a", "trainer.steps=4", "trainer.checkpoint_every=2", *kl))
    ckpt = Path(first["run_dir"]) / "checkpoints" / "step_2"
    assert (ckpt / "model.safetensors").exists()
    resumed = run_job(local_cfg(tmp_path / "b", "trainer.steps=4", f"resume={ckpt}", *kl))
    a, b = rl_records(first), rl_records(resumed)
    assert [r["step"] for r in b] == [3, 4] and [r["version"] for r in b] == [3, 4]
    assert [r["data_sha"] for r in b] == [r["data_sha"] for r in a[2:]]
    assert [r["token_versions"] for r in b] == [[2], [3]]
    ref_a, ref_b = (load_file(str(Path(s["checkpoint"]) / "reference.safetensors")) for s in (first, resumed))
    assert ref_a.keys() == ref_b.keys() and all(torch.equal(ref_a[k], ref_b[k]) for k in ref_a)


@pytest.mark.slow
def test_time_budget_cuts_are_said_in_the_summary(tmp_path):
    summary = run_job(local_cfg(tmp_path, "trainer.steps=50", "trainer.time_budget_s=0.001", "trainer.eval_every=0",
                              "sft.steps=20", "sft.time_budget_s=0.001"))
    assert summary["steps"] == 1
    assert summary["budget_cuts"] == ["sft.time_budget_s=0.001 cut the SFT warm start at step 1 of 20",
                                      "trainer.time_budget_s=0.001 cut RL at step 1 of 50"]


@pytest.mark.slow
def test_local_backend_learns_with_nonzero_advantages(tmp_path):
    """The Ray learning test's workload on the single-process backend: the reward rises, by more than the run's
    own step-to-step noise (tests/learning_bounds.py)."""
    cfg = load_config(GRPOJobConfig, [
        "trainer.backend=local", "sft.steps=60", "sft.batch_size=32", "data.max_operand=4", "data.eval_size=5",
        "rollout.prompts_per_step=8", "rollout.group_size=8", "rollout.max_new_tokens=8", "trainer.steps=80",
        "trainer.eval_every=0", "trainer.log_every=1000", "optim.lr=3e-4", f"trainer.run_dir={tmp_path}",
    ]).validate()
    summary = run_job(cfg)
    rl = rl_records(summary)
    assert len(rl) == 80 and summary["failed_episodes"] == 0
    assert_advantages_every_step(rl)
    assert_rises([r["reward"] for r in rl[:15]], [r["reward"] for r in rl[-15:]],
                 what="training reward, first 15 -> last 15 steps")


@pytest.mark.slow
def test_periodic_checkpoints_are_pruned_to_the_newest(tmp_path):
    summary = run_job(local_cfg(tmp_path, "trainer.steps=4", "trainer.checkpoint_every=1", "trainer.keep_checkpoints=2",
                              "trainer.eval_every=0"))
    ckpts = sorted(p.name for p in (Path(summary["run_dir"]) / "checkpoints").iterdir())
    assert ckpts == ["step_2", "step_3", "step_4"]  # step_0 and step_1 pruned; the final one always kept
    with pytest.raises(ValueError, match="trainer.keep_checkpoints=-1"):
        local_cfg(tmp_path, "trainer.keep_checkpoints=-1")
