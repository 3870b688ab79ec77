"""The distillation teacher's role (issue W): the `teacher_kl` batch stage and its step figures, the plan's teacher
actor (placed like the reference, restartable), and a teacher whose tokenizer is not the student's refused before
any actor starts, naming both."""
from __future__ import annotations

import asyncio
import json
import shutil

import pytest
import torch
from tensordict import TensorDict

from rayllm_rl.config import load_config
from rayllm_rl.job.config import GRPOJobConfig
from rayllm_rl.job.plan import TEACHER, make_plan
from rayllm_rl.learner.frozen import tokenizer_mismatch
from rayllm_rl.objectives.distill import distill_advantages, teacher_kl
from rayllm_rl.algorithm.batch_prep import make_batch_pipeline, prepare_batch


def rollout_batch() -> TensorDict:
    """Two groups of two rows, 4 positions (column 0 the prompt), behaviour logprobs and rewards chosen by hand."""
    mask = torch.tensor([[0, 1, 1, 1], [0, 1, 1, 0], [0, 1, 0, 0], [0, 1, 1, 1]], dtype=torch.bool)
    logp = torch.tensor([[0.0, -0.5, -1.0, -0.2], [0.0, -2.0, -0.1, 0.0], [0.0, -0.3, 0.0, 0.0],
                         [0.0, -1.5, -0.7, -0.9]])
    return TensorDict({"input_ids": torch.ones(4, 4, dtype=torch.long), "loss_mask": mask, "logprobs": logp,
                       "versions": torch.where(mask, 0, -1), "rewards": torch.tensor([1.0, 0.0, 0.0, 1.0]),
                       "group_id": torch.tensor([0, 0, 1, 1])}, batch_size=[4])


TEACHER_LOGP = torch.tensor([[0.0, -0.4, -1.5, -0.2], [0.0, -0.5, -0.3, 0.0], [0.0, -1.3, 0.0, 0.0],
                             [0.0, -1.0, -0.7, -2.9]])


@pytest.mark.parametrize("task_coef", [0.0, 0.5])
def test_the_teacher_stage_makes_per_token_advantages_and_reports_the_kl(task_coef):
    cfg = load_config(GRPOJobConfig, ["teacher.path=some/teacher", "teacher.coef=2", f"teacher.task_coef={task_coef}"])
    pipeline = make_batch_pipeline(cfg, ["teacher"])
    assert pipeline.names == ["advantages", "teacher_kl", "prox_version"]
    batch = rollout_batch()
    group_adv = make_batch_pipeline(load_config(GRPOJobConfig, []))(rollout_batch(), 3)["advantages"]
    asked = []

    async def score(name, td):
        asked.append(name)
        return TEACHER_LOGP, 0

    out, meta = asyncio.run(prepare_batch(pipeline, batch, 3, score))
    assert asked == ["teacher"] and meta["teacher_rescored"] == 0 and meta["teacher_s"] >= 0
    mask = batch["loss_mask"]
    kl = torch.where(mask, batch["logprobs"] - TEACHER_LOGP, 0.0)
    # by hand: row 0 (-0.1, 0.5, 0), row 1 (-1.5, 0.2), row 2 (1.0), row 3 (-0.5, 0, 2.0)
    assert torch.allclose(kl[mask], torch.tensor([-0.1, 0.5, 0.0, -1.5, 0.2, 1.0, -0.5, 0.0, 2.0]), atol=1e-6)
    assert torch.equal(out["teacher_kl"], teacher_kl(batch["logprobs"], TEACHER_LOGP, mask))
    want = -2.0 * kl + (task_coef * group_adv[:, None] if task_coef else 0.0)
    assert torch.allclose(out["advantages"], torch.where(mask, want, 0.0), atol=1e-6)
    assert torch.equal(out["advantages"],
                       distill_advantages(kl, mask, 2.0, group_adv if task_coef else None, task_coef))
    assert out["advantages"].shape == (4, 4) and torch.equal(out["prox_version"], torch.full((4,), 3))
    # the step's figures: the mean and per-token quantiles over the 9 sampled tokens (torch's linear interpolation)
    vals = sorted([-0.1, 0.5, 0.0, -1.5, 0.2, 1.0, -0.5, 0.0, 2.0])
    assert meta["teacher_kl_mean"] == pytest.approx(sum(vals) / 9)
    assert meta["teacher_kl_p50"] == pytest.approx(vals[4])
    assert meta["teacher_kl_p10"] == pytest.approx(vals[0] + 0.8 * (vals[1] - vals[0]))
    assert meta["teacher_kl_p90"] == pytest.approx(vals[7] + 0.2 * (vals[8] - vals[7]))


def test_a_batch_without_the_teachers_logprobs_is_refused():
    cfg = load_config(GRPOJobConfig, ["teacher.path=some/teacher"])
    with pytest.raises(ValueError, match="without the teacher's logprobs"):
        make_batch_pipeline(cfg, ["teacher"])(rollout_batch(), 0)


def test_teacher_settings_that_cannot_train_fail_naming_the_keys():
    with pytest.raises(ValueError, match="teacher.coef=0 and teacher.task_coef=0"):
        load_config(GRPOJobConfig, ["teacher.path=x", "teacher.coef=0"])
    with pytest.raises(ValueError, match="teacher.coef"):
        load_config(GRPOJobConfig, ["teacher.path=x", "teacher.coef=-1"])


def test_the_plan_places_the_teacher_like_the_reference_and_lets_ray_restart_it(capsys, tiny_model_path):
    from rayllm_rl.job.describe import plan_decisions
    from rayllm_rl.job.plan_text import dry_run

    gpus = ["ray.gpus_per_learner=1", "ray.gpus_per_replica=1", "ray.teacher_restarts=2", "teacher.path=org/teacher"]
    plan = make_plan(load_config(GRPOJobConfig, gpus + ["algo.kl_coef=0.01"]), environment=False)
    assert plan.frozen_names() == ("reference", TEACHER)
    teacher, ref, learner = plan.actor(TEACHER), plan.actor("reference"), plan.actor("learner-0")
    # a tenth of learner-0's GPU each: the three ask exactly the bundle's one GPU
    assert (teacher.num_gpus, ref.num_gpus, learner.num_gpus) == (0.1, 0.1, pytest.approx(0.8))
    assert teacher.bundle == ref.bundle == learner.bundle and teacher.restarts == 2 and ref.restarts == 0
    decided = plan_decisions(plan)
    assert decided["teacher"]["placement"] == "0.1 GPU of learner-0's bundle"
    assert "teacher_kl" in decided["batch_stages"]
    cpu = make_plan(load_config(GRPOJobConfig, ["teacher.path=org/teacher"]), environment=False)
    assert (cpu.actor(TEACHER).num_gpus, cpu.actor(TEACHER).bundle, cpu.actor("learner-0").num_gpus) == (0.0, None, 0.0)
    local = make_plan(load_config(GRPOJobConfig, [f"teacher.path={tiny_model_path}", "trainer.backend=local"]),
                      environment=False)
    assert local.actors == () and plan_decisions(local)["teacher"]["placement"] == "CPU, in this process"
    off = make_plan(load_config(GRPOJobConfig, []), environment=False)
    assert (off.frozen_names() == () and "teacher" not in plan_decisions(off)
            and TEACHER not in [a.name for a in off.actors])
    described = dry_run(local, as_json=False)  # the text a user reads
    text = capsys.readouterr().out
    assert (f"distillation teacher: {tiny_model_path} (CPU, in this process); advantage = 0 x task - 1 x "
            "(log pi_student - log pi_teacher) per sampled token") in text
    # its cost from its config.json: the tiny model's weights in float32, and a forward over the batch's tokens
    t, arch = described["teacher"], described["model"]["architecture"]  # the teacher is the student's model here
    assert t["params"] == arch["params"] and t["memory_bytes"]["weights"] == 4 * arch["params"]
    assert t["flops_per_batch"] == 2 * arch["params"] * t["tokens_per_batch"]
    # each group's prompt once (optim.share_prompts, the default): the padded rows' tokens less (G - 1) prompts a group
    from rayllm_rl.job.describe import teacher_cost

    padded_cfg = [f"teacher.path={tiny_model_path}", "trainer.backend=local", "optim.share_prompts=false"]
    padded = teacher_cost(make_plan(load_config(GRPOJobConfig, padded_cfg), environment=False))
    r = local.config.rollout
    rows = r.prompts_per_step * r.group_size
    prompt = (padded["tokens_per_batch"] - rows * r.max_new_tokens) // rows
    assert t["tokens_per_batch"] == padded["tokens_per_batch"] - r.prompts_per_step * (r.group_size - 1) * prompt > 0
    assert f"  teacher: {arch['params'] / 1e9:.3f}B parameters" in text


def test_tokenizers_that_give_other_ids_are_told_apart(tokenizer, tiny_model_path, tmp_path):
    from transformers import AutoTokenizer

    assert tokenizer_mismatch(tokenizer, AutoTokenizer.from_pretrained(tiny_model_path)) == ""
    grown = AutoTokenizer.from_pretrained(tiny_model_path)
    grown.add_tokens(["<tool_call_x>"])
    assert "vocabulary" in tokenizer_mismatch(tokenizer, grown)


def teacher_with_another_tokenizer(tiny_model_path, tmp_path) -> str:
    """The tiny model's weights and config beside a tokenizer with one more token and another eos."""
    from transformers import AutoTokenizer

    out = tmp_path / "other-teacher"
    shutil.copytree(tiny_model_path, out)
    other = AutoTokenizer.from_pretrained(tiny_model_path)
    other.add_tokens(["<other_token>"])
    other.eos_token = "<other_token>"
    other.save_pretrained(out)
    return str(out)


def test_a_teacher_with_another_tokenizer_fails_before_any_actor_starts(tiny_model_path, tmp_path, monkeypatch):
    from rayllm_rl import train
    from rayllm_rl.orchestration import driver

    teacher = teacher_with_another_tokenizer(tiny_model_path, tmp_path)
    opened = []  # the backend is what starts actors (and Ray): it must not be reached
    monkeypatch.setattr(driver, "open_backend", lambda *a, **k: opened.append(a) or pytest.fail("backend opened"))
    with pytest.raises(ValueError) as err:
        train(None, ["trainer.backend=local", "sft.steps=0", f"teacher.path={teacher}",
                     f"trainer.run_dir={tmp_path / 'runs'}"])
    msg = str(err.value)
    assert f"teacher.path={teacher!r}" in msg and tiny_model_path in msg and "other-teacher" in msg
    assert "vocabulary" in msg and "eos_token_id" in msg
    assert opened == []
    config = json.loads(next((tmp_path / "runs").glob("*/config.json")).read_text())
    assert config["teacher"]["path"] == teacher  # the run's record says what was asked
