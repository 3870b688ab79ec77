"""On-policy distillation end to end on the tiny model (issue W): a run stopped and resumed on the single-process
backend (the teacher, in no checkpoint, is loaded again from its path and scores as before), and on Ray a teacher
actor SIGKILLed mid-run (Ray restarts it; no rollback, no step lost), and in the middle of a call."""
from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest

from job_helpers import run_job
from rayllm_rl.config import load_config
from rayllm_rl.job.config import GRPOJobConfig

pytestmark = pytest.mark.slow

SMALL = ["data.eval_size=16", "data.max_operand=9", "rollout.prompts_per_step=4", "rollout.group_size=4",
         "rollout.max_new_tokens=8", "trainer.log_every=100", "trainer.call_timeout_s=120", "trainer.eval_every=0"]


def rl_records(summary) -> list[dict]:
    lines = (Path(summary["run_dir"]) / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["phase"] == "rl"]


def distill_cfg(run_dir, teacher: str, *extra: str):
    """The tiny student after 3 SFT steps, distilled from `teacher` alone (no task advantage)."""
    return load_config(GRPOJobConfig, [f"teacher.path={teacher}", f"trainer.run_dir={run_dir}", *SMALL, "sft.steps=3",
                                       "teacher.coef=1", "teacher.task_coef=0", "optim.lr=1e-3", *extra])


def test_local_distillation_resumes_with_the_teacher_loaded_again_from_its_path(tiny_model_path, tmp_path):
    """The teacher (here the untrained tiny model) is in no checkpoint: the resumed run loads it from teacher.path,
    and it scores the first resumed step's samples as the first run's teacher did."""
    steps, half = 6, 3
    kw = ("trainer.backend=local", f"trainer.steps={steps}", "rollout.max_staleness=0")
    first = run_job(distill_cfg(tmp_path / "a", tiny_model_path, *kw, f"trainer.checkpoint_every={half}"))
    records = rl_records(first)
    kl = [r["teacher_kl_mean"] for r in records]
    assert all(k != 0 for k in kl)  # the student moved off the teacher in its 3 SFT steps
    assert all(r["teacher_kl_p10"] <= r["teacher_kl_p50"] <= r["teacher_kl_p90"] for r in records)
    assert all(r["teacher_s"] > 0 and 0 < r["teacher_share"] < 1 for r in records)
    ckpt = Path(first["run_dir"]) / "checkpoints" / f"step_{half}"
    assert not any("teacher" in p.name for p in ckpt.iterdir())  # frozen: loaded again from teacher.path, not saved
    resumed = run_job(distill_cfg(tmp_path / "b", tiny_model_path, *kw, f"resume={ckpt}"))
    again = rl_records(resumed)
    assert [r["step"] for r in again] == list(range(half + 1, steps + 1))
    assert [r["data_sha"] for r in again] == [r["data_sha"] for r in records[half:]]
    # the first resumed step samples the same batch from the checkpoint's weights and RNG: the teacher loaded again
    # scores it as the first run's did (later steps' samples may differ: the resumed run's sampling is not replayed)
    assert again[0]["teacher_kl_mean"] == pytest.approx(kl[half], rel=1e-6)
    assert all(r["teacher_kl_mean"] != 0 for r in again)


@pytest.fixture(scope="module")
def local_ray():
    from ray_sessions import JOB_ENV, local_ray_session

    with local_ray_session("test_distill_jobs", num_cpus=2, runtime_env={"env_vars": JOB_ENV}):
        yield


@pytest.mark.ray
@pytest.mark.parametrize("restarts", [1, 0])
def test_a_scorer_killed_while_scoring_scores_the_batch_again_once_ray_restarted_it(local_ray, restarts):
    """`score_with_restarts` against a real actor SIGKILLed in the middle of a call (a scorer that takes a second,
    so the kill lands inside it): with a restart left it answers, having scored the batch twice; without, the
    actor's death is raised."""
    import asyncio

    import ray
    import torch

    from rayllm_rl.orchestration.ray.rollout_actors import score_with_restarts

    @ray.remote(num_cpus=0)
    class SlowScorer:
        def pid(self) -> int:
            return os.getpid()

        def compute_logprobs(self, batch):
            time.sleep(1.0)
            return -torch.ones(batch["n"], 3)

    actor = SlowScorer.options(max_restarts=restarts).remote()
    pid = ray.get(actor.pid.remote(), timeout=60)

    async def score_and_kill():
        task = asyncio.ensure_future(score_with_restarts(actor, {"n": 2}, timeout_s=60))
        await asyncio.sleep(0.4)
        os.kill(pid, signal.SIGKILL)
        return await task

    if restarts:
        out, rescored = asyncio.run(score_and_kill())
        assert out.tolist() == [[-1.0] * 3] * 2 and rescored == 1
        assert ray.get(actor.pid.remote(), timeout=60) != pid  # a new process answered
    else:
        with pytest.raises(ray.exceptions.ActorDiedError):
            asyncio.run(score_and_kill())
    ray.kill(actor)


@pytest.mark.ray
def test_ray_distillation_survives_a_killed_teacher_without_a_rollback(local_ray, tiny_model_path, tmp_path):
    """The teacher actor SIGKILLed after step 3 of an asynchronous run (staleness 1): Ray restarts it, it loads its
    path again, the batch it was scoring (if any) is scored again, and every step trains with its KL."""
    import ray

    steps, ns = 8, "rayllm_distill_test"
    cfg = distill_cfg(tmp_path, tiny_model_path, "trainer.backend=ray", f"trainer.steps={steps}", f"ray.namespace={ns}",
                      "ray.sync_timeout_s=60", "rollout.max_staleness=1").validate()
    out: dict = {}
    runner = threading.Thread(target=lambda: out.update(summary=run_job(cfg)), daemon=True)
    runner.start()
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and not out:  # kill the teacher once step 3 is logged
        runs = [p for p in tmp_path.iterdir() if p.is_dir()]
        path = runs[0] / "metrics.jsonl" if runs else None
        if path is not None and path.exists() and path.read_text().count('"phase": "rl"') >= 3:
            break
        time.sleep(0.2)
    assert not out, "the run ended before the teacher could be killed"
    actor = ray.get_actor("teacher", namespace=ns)
    old_pid = ray.get(actor.pid.remote(), timeout=30)
    os.kill(old_pid, signal.SIGKILL)
    runner.join(timeout=400)
    assert "summary" in out, "the run did not finish after the teacher was killed"
    summary = out["summary"]
    assert summary["steps"] == steps and summary["recoveries"] == []
    records = rl_records(summary)
    assert [r["step"] for r in records] == list(range(1, steps + 1))
    assert all(r["teacher_kl_mean"] != 0 and r["teacher_s"] > 0 for r in records)
