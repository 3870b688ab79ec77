"""On-policy distillation end to end on the tiny model (issue W): the untrained student distilled from a trained
tiny checkpoint learns on both backends (its teacher KL falls, its expected held-out reward rises from ~1e-21 to
a few in a hundred); a run stopped and
resumed on the single-process backend (the teacher, in no checkpoint, is loaded again from its path and scores as
before); on Ray a teacher actor SIGKILLed mid-run (Ray restarts it; no rollback, no step lost), and in the middle
of a call."""
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


LEARN = ["data.eval_size=32", "data.max_operand=9", "rollout.prompts_per_step=8", "rollout.group_size=4",
         "rollout.max_new_tokens=10", "trainer.log_every=1000", "trainer.call_timeout_s=120", "trainer.eval_every=0"]
"""The learning runs' size: 32 held-out sums of two digits 0-9 (the 68 other pairs train), 32 samples a step."""
LEARN_STEPS = 200


@pytest.fixture(scope="module")
def trained_teacher(tiny_model_path, tmp_path_factory) -> tuple[str, float]:
    """The tiny model after 100 steps of the arithmetic demo's SFT warm start (~10 s): its checkpoint and greedy
    held-out score (0.5-0.6 on the 32 sums)."""
    run = run_job(load_config(GRPOJobConfig, [f"model.path={tiny_model_path}", "trainer.backend=local", *LEARN,
                                              f"trainer.run_dir={tmp_path_factory.mktemp('teacher')}", "sft.steps=100",
                                              "trainer.steps=0", "trainer.max_recoveries=0"]))
    assert run["eval_reward_after"] >= 0.4, run["eval_reward_after"]
    return run["checkpoint"], run["eval_reward_after"]


def held_out_answer_probability(model_path: str) -> float:
    """The mean, over the 32 held-out sums, of the probability that the model at `model_path` samples exactly
    `<answer>{a+b}</answer><|im_end|>` at temperature 1: teacher-forced, so exact, and a lower bound of its expected
    held-out reward (1 for any completion whose first answer tag holds the sum). Unlike the greedy score it moves
    smoothly, where the greedy score of a student that has learnt the format but not the sums is whichever
    held-out sums its near-constant answer happens to hit (0 to 5 of 32)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rayllm_rl.envs.arithmetic import make_arithmetic_splits, sft_target
    from rayllm_rl.learner.logprobs import token_logprobs

    tok = AutoTokenizer.from_pretrained(model_path)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    _, held_out = make_arithmetic_splits(max_operand=9, eval_size=32, seed=0)  # LEARN's split (trainer.seed 0)
    probs = []
    for row in held_out:
        text = tok.apply_chat_template(row["messages"], add_generation_prompt=True, tokenize=False)
        prompt = tok(text, add_special_tokens=False)["input_ids"]
        answer = tok(sft_target(row) + "<|im_end|>", add_special_tokens=False)["input_ids"]
        ids = torch.tensor([prompt + answer])
        with torch.no_grad():  # the learner's scorer: log p(x_t | x_<t) [1, T], the answer's tokens at the end
            logp = token_logprobs(model, ids, torch.ones_like(ids))
        probs.append(float(logp[0, len(prompt):].double().sum().exp()))
    return sum(probs) / len(probs)


def learning_cfg(run_dir, student: str, teacher: str, *extra: str):
    """The untrained tiny `student` (random weights, no SFT: held-out 0) distilled from `teacher` alone, 2 optimizer
    steps a batch at lr 1e-3 (docs/distillation.md, "A tiny model learning from a teacher")."""
    return load_config(GRPOJobConfig, [f"model.path={student}", f"teacher.path={teacher}", f"trainer.run_dir={run_dir}",
                                       *LEARN, "sft.steps=0", "teacher.coef=1", "teacher.task_coef=0", "optim.lr=1e-3",
                                       "optim.warmup_steps=0", "optim.num_minibatches=2",
                                       f"trainer.steps={LEARN_STEPS}", *extra])


def assert_learned(summary, student: str) -> None:
    """The student's teacher KL fell to under a quarter of its first step's, and its expected held-out reward rose
    from ~1e-21 (the random `student`) to at least 0.005: it writes the teacher's `<answer>n</answer>` on sums it
    never saw, with answers spread as the teacher's are. Measured over 3 seeds: 0.037-0.054 after 200 steps, the KL
    5.4 -> 0.7-0.8; the right sum no likelier than its neighbours, so the sums themselves are not learnt yet
    (docs/distillation.md, "A tiny model learning from a teacher")."""
    kl = [r["teacher_kl_mean"] for r in rl_records(summary)]
    assert len(kl) == LEARN_STEPS and kl[0] > 4.0  # nats a token: the random student and the teacher disagree
    assert sum(kl[-20:]) / 20 < kl[0] / 4, (kl[0], kl[-20:])
    assert summary["eval_reward_before"] == 0.0
    before, after = held_out_answer_probability(student), held_out_answer_probability(summary["checkpoint"])
    assert before < 1e-12 and after >= 0.005, (before, after)


def test_local_distillation_raises_the_untrained_students_held_out_reward(tiny_model_path, trained_teacher, tmp_path):
    teacher, _ = trained_teacher
    run = run_job(learning_cfg(tmp_path, tiny_model_path, teacher, "trainer.backend=local", "rollout.max_staleness=0"))
    assert_learned(run, tiny_model_path)


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
def test_ray_distillation_raises_the_students_reward_through_a_killed_teacher(local_ray, tiny_model_path,
                                                                            trained_teacher, tmp_path):
    """The learning run on Ray, asynchronous (staleness 1), its teacher actor SIGKILLed after step 3: Ray restarts
    it, it loads its path again, the batch it was scoring (if any) is scored again, every step trains with its KL,
    no rollback, and the student learns as on the local backend."""
    import ray

    steps, ns = LEARN_STEPS, "rayllm_distill_test"
    cfg = learning_cfg(tmp_path, tiny_model_path, trained_teacher[0], "trainer.backend=ray", f"ray.namespace={ns}",
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
    assert_learned(summary, tiny_model_path)
