"""A frozen model added by a test alone (issue AA): a second teacher is one `FrozenSpec` in the plan and one batch
stage that needs it. Both backends start it (on Ray as an actor named after it), score every batch with it
(`teacher2_s` in each step record), and its KL reaches the step records; nothing in the package names it. The Ray
path (a `FrozenActor` of that name, the buffer's actor scoring with it) is in tests/test_ray_pipeline.py, on that
file's Ray.

The second teacher is a copy of the job's teacher's spec under another name, so it scores each batch exactly as the
teacher does: its KL must equal the teacher stage's `teacher_kl_mean` of the same step (and be nonzero, the student
having left the teacher in its 3 SFT steps)."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import ClassVar, Mapping

import pytest

from rayllm_rl.algorithm.batch_prep import BatchPipeline
from rayllm_rl.api.entry import prepare
from conftest import small_job_config
from rayllm_rl.orchestration import driver

SMALL = ("data.eval_size=8", "rollout.max_new_tokens=8", "sft.steps=3", "trainer.steps=3", "rollout.max_staleness=0",
         "trainer.max_recoveries=0", "teacher.coef=1", "teacher.task_coef=0")
"""What these runs change of conftest's small job: 3 RL steps on-policy, distilled from the teacher alone."""

SUM_ORDER_TOL = 1e-5
"""Relative: the two means of the same float32 per-token KLs, summed in another order (the teacher stage's mean
in float64 over the masked tokens, this one's in float32)."""


@dataclasses.dataclass(frozen=True)
class SecondTeacherKL:
    """`teacher2_kl` `[N]`: the batch's mean of log pi_student - log pi_teacher2 over its sampled tokens, on every
    row. A `[N]` figure, so the step's metadata averages it with the other per-row figures (`step_metadata`)."""

    name = "teacher2_kl"
    needs: ClassVar[Mapping[str, str]] = {"teacher2": "teacher2_logprobs"}

    def __call__(self, batch, version: int):
        mask = batch["loss_mask"].float()
        kl = (batch["logprobs"].float() - batch["teacher2_logprobs"]) * mask
        batch["teacher2_kl"] = (kl.sum() / mask.sum()).expand(mask.shape[0]).clone()
        del batch["teacher2_logprobs"]
        return batch


def with_second_teacher(plan):
    """The plan with one more frozen model and the stage that needs it: all a new frozen model takes."""
    (teacher,) = [spec for spec in plan.frozen if spec.name == "teacher"]
    spec = dataclasses.replace(teacher, name="teacher2", restarts=1, role="a second teacher (test only)")
    stages = BatchPipeline(plan.batch_pipeline.stages + (SecondTeacherKL(),))
    return dataclasses.replace(plan, frozen=plan.frozen + (spec,), batch_pipeline=stages)


def rl_records(summary) -> list[dict]:
    lines = (Path(summary["run_dir"]) / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["phase"] == "rl"]


def run_with_second_teacher(tmp_path, tiny_model_path, *extra: str, callbacks=None) -> list[dict]:
    cfg = small_job_config(f"teacher.path={tiny_model_path}", *SMALL, *extra, run_dir=tmp_path)
    plan, inputs = prepare(cfg)
    assert plan.frozen_names() == ("teacher",) and "teacher2" not in plan.batch_pipeline.needs()
    plan = with_second_teacher(plan)
    assert plan.frozen_names() == ("teacher", "teacher2")
    assert plan.batch_pipeline.needs() == {"teacher": "teacher_logprobs", "teacher2": "teacher2_logprobs"}
    summary = driver.train(plan, inputs, callbacks=callbacks)
    ckpt = Path(summary["checkpoint"])
    assert ckpt.is_dir() and not (ckpt / "teacher2.safetensors").exists()  # a model of its own path: in no checkpoint
    return rl_records(summary)


def check_the_second_teachers_figures(records: list[dict]) -> None:
    assert [r["step"] for r in records] == [1, 2, 3]
    assert all(r["teacher2_s"] > 0 and 0 < r["teacher2_share"] < 1 and r["teacher2_rescored"] == 0 for r in records)
    kl, want = [r["teacher2_kl"] for r in records], [r["teacher_kl_mean"] for r in records]
    assert all(w != 0 for w in want), want
    assert kl == pytest.approx(want, rel=SUM_ORDER_TOL)


def test_a_second_teacher_added_in_a_test_scores_every_local_batch(tiny_model_path, tmp_path):
    check_the_second_teachers_figures(run_with_second_teacher(tmp_path, tiny_model_path, "trainer.backend=local"))
