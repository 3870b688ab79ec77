"""On-policy distillation end to end on the tiny model (issue W): the untrained student distilled from a trained
tiny checkpoint learns the teacher's answer format on both backends (its teacher KL falls to a twelfth, it writes
the format about as often as the teacher, its answers spread like the training answers), but not the sums: its
chance of the right held-out sum is what it would score ignoring the question (the question-blind baseline, read
exactly from the model: `held_out_scores`); a run stopped and resumed on the single-process backend (the teacher,
in no checkpoint, is loaded again from its path and scores as before); on Ray a teacher actor SIGKILLed mid-run
(Ray restarts it; no rollback, no step lost; a short run: the learning is the local run's, the same loss and
code), and in the middle of a call."""
from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from job_helpers import run_job
from learning_bounds import assert_rises
from conftest import small_job_config
from rayllm_rl.config import load_config
from rayllm_rl.job.config import GRPOJobConfig

if TYPE_CHECKING:
    import torch

pytestmark = pytest.mark.slow


def rl_records(summary) -> list[dict]:
    lines = (Path(summary["run_dir"]) / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["phase"] == "rl"]


LEARN = ["data.eval_size=32", "data.max_operand=9", "rollout.prompts_per_step=8", "rollout.group_size=4",
         "rollout.max_new_tokens=10", "trainer.log_every=1000", "trainer.call_timeout_s=120", "trainer.eval_every=0"]
"""The learning runs' size: 32 held-out sums of two digits 0-9 (the 68 other pairs train), 32 samples a step."""
LEARN_STEPS = 200
KILLED_TEACHER_STEPS = 8
"""The Ray run through a killed teacher: killed after step 3, so steps 4-8 are scored by the restarted process.
What 200 steps teach is shown by the local run (the same loss and scorer code); here the KL only has to fall."""


@pytest.fixture(scope="module")
def trained_teacher(tiny_model_path, tmp_path_factory) -> tuple[str, dict]:
    """The tiny model after 100 steps of the arithmetic demo's SFT warm start (~10 s): its checkpoint and its
    `held_out_scores`. It must read the question: its chance of the right held-out sum beats the best any
    question-blind answer distribution can do (measured: 0.26 against 0.094, with AVX-512's and AVX2's kernels;
    its greedy score, 0.56 and 0.34, moves with the kernels and is not asserted)."""
    run = run_job(load_config(GRPOJobConfig, [f"model.path={tiny_model_path}", "trainer.backend=local", *LEARN,
                                              f"trainer.run_dir={tmp_path_factory.mktemp('teacher')}", "sft.steps=100",
                                              "trainer.steps=0", "trainer.max_recoveries=0"]))
    scores, blind = held_out_scores(run["checkpoint"]), question_blind_baselines()
    assert scores["right"] > blind["best_blind"], (scores, blind)
    return run["checkpoint"], scores


ANSWERS = range(19)
"""The sums of two digits 0-9: every answer a training row has."""


def answer_table(model_path: str) -> "torch.Tensor":
    """`[32, 19]` float64: the probability that the model at `model_path` samples exactly
    `<answer>{n}</answer><|im_end|>` at temperature 1 on each of the 32 held-out questions, for each n in ANSWERS.
    Teacher-forced through `from_pretrained` and the learner's scorer, so exact: no sampling noise."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rayllm_rl.learner.logprobs import token_logprobs

    tok = AutoTokenizer.from_pretrained(model_path)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    prompts, answers = [], [tok(f"<answer>{n}</answer><|im_end|>", add_special_tokens=False)["input_ids"]
                            for n in ANSWERS]
    for row in held_out_rows():
        text = tok.apply_chat_template(row["messages"], add_generation_prompt=True, tokenize=False)
        prompts.append(tok(text, add_special_tokens=False)["input_ids"])
    seqs = [p + a for p in prompts for a in answers]
    width = max(map(len, seqs))
    ids = torch.tensor([q + [0] * (width - len(q)) for q in seqs])
    mask = torch.tensor([[1] * len(q) + [0] * (width - len(q)) for q in seqs])
    with torch.no_grad():  # log p(x_t | x_<t) [B, T]: the answer's tokens follow each prompt
        logp = token_logprobs(model, ids, mask).double()
    out = torch.empty(len(prompts), len(answers), dtype=torch.float64)
    for i, p in enumerate(prompts):
        for j, a in enumerate(answers):
            out[i, j] = logp[i * len(answers) + j, len(p):len(p) + len(a)].sum().exp()
    return out


def held_out_rows() -> list[dict]:
    from rayllm_rl.envs.arithmetic import make_arithmetic_splits

    return list(make_arithmetic_splits(max_operand=9, eval_size=32, seed=0)[1])  # LEARN's split (trainer.seed 0)


def question_blind_baselines() -> dict[str, float]:
    """What a student that writes the format but ignores the question scores on the held-out sums (its expected
    reward, as `held_out_scores` measures the model's):
    - `train_answers`: the answer drawn from the training answers' distribution: the issue's baseline (0.063);
    - `best_blind`: the best any question-blind answer distribution can do on these 32 sums: always the most
      frequent held-out sum (3 of 32 = 0.094). A student above it must read the question: the margin over the
      training answers' baseline is derived from the held-out set itself, not tuned to a run."""
    from collections import Counter

    from rayllm_rl.envs.arithmetic import make_arithmetic_splits

    train = make_arithmetic_splits(max_operand=9, eval_size=32, seed=0)[0]
    freq = Counter(int(r["answer"]) for r in train)
    held = [int(r["answer"]) for r in held_out_rows()]
    return {"train_answers": sum(freq[s] / len(train) for s in held) / len(held),
            "best_blind": max(Counter(held).values()) / len(held)}


def held_out_scores(model_path: str) -> dict[str, float]:
    """From `answer_table`: `right`, the mean over the held-out sums of the probability of writing the right one
    (a lower bound of the expected held-out reward: any completion whose first answer tag holds the sum scores
    1); `format`, the mean probability of writing some answer 0-18 in the format; `blind`, what the model would
    score if it gave every question its average answer distribution (itself made question-blind)."""
    import torch

    table = answer_table(model_path)
    right = torch.tensor([int(r["answer"]) for r in held_out_rows()])
    rows = torch.arange(len(right))
    return {"right": float(table[rows, right].mean()), "format": float(table.sum(1).mean()),
            "blind": float(table.mean(0)[right].mean())}


def learning_cfg(run_dir, student: str, teacher: str, *extra: str, steps: int = LEARN_STEPS):
    """The untrained tiny `student` (random weights, no SFT: held-out 0) distilled from `teacher` alone, 2 optimizer
    steps a batch at lr 1e-3 (docs/distillation.md, "A tiny model learning from a teacher")."""
    return load_config(GRPOJobConfig, [f"model.path={student}", f"teacher.path={teacher}", f"trainer.run_dir={run_dir}",
                                       *LEARN, "sft.steps=0", "teacher.coef=1", "teacher.task_coef=0", "optim.lr=1e-3",
                                       "optim.warmup_steps=0", "optim.num_minibatches=2",
                                       f"trainer.steps={steps}", *extra])


def assert_learned_the_format(summary, student: str, teacher_scores: dict) -> None:
    """What 200 steps of distillation teach the untrained student, each bound taken from the run itself:
    - its teacher KL: the mean of the last 20 steps is under a quarter of step 1's (measured 4.0-4.4 -> 0.31-0.35,
      a twelfth, with AVX-512's and AVX2's kernels);
    - the teacher's format: the random student writes `<answer>n</answer><|im_end|>` (any n of the training sums)
      with probability < 1e-12; after the run at least half as often as the teacher does (measured 0.58-0.62
      against the teacher's 0.83);
    - its answers are not collapsed onto sums the held-out set lacks: its chance of the right sum is at least half
      of the question-blind baseline (the format, the answer drawn from the training answers' distribution: 0.063
      on these 32 sums) scaled by its own format mass (measured 1.0-1.2x). A weak check, and only that: answers
      spread evenly over 0-18 would pass it too (1/19 = 0.053 > 0.063 / 2), so it does not show that they are
      spread like the training answers.
    It does not assert the sums: the student's chance of the right sum equals what it would score ignoring the
    question (`blind`), and stays below the best question-blind score (0.094). In longer runs the sums came at
    300-500 steps with one CPU's kernels and not by 600 with another's (docs/distillation.md)."""
    kl = [r["teacher_kl_mean"] for r in rl_records(summary)]
    assert len(kl) == LEARN_STEPS and kl[0] > 0
    assert sum(kl[-20:]) / 20 < kl[0] / 4, (kl[0], kl[-20:])
    assert summary["eval_reward_before"] == 0.0
    before, after, blind = held_out_scores(student), held_out_scores(summary["checkpoint"]), question_blind_baselines()
    assert before["format"] < 1e-12, before
    assert after["format"] >= teacher_scores["format"] / 2, (after, teacher_scores)
    assert after["right"] >= after["format"] * blind["train_answers"] / 2, (after, blind)


def test_local_distillation_teaches_the_untrained_student_the_teachers_answer_format(tiny_model_path,
                                                                                    trained_teacher, tmp_path):
    teacher, teacher_scores = trained_teacher
    run = run_job(learning_cfg(tmp_path, tiny_model_path, teacher, "trainer.backend=local", "rollout.max_staleness=0"))
    assert_learned_the_format(run, tiny_model_path, teacher_scores)


def distill_cfg(run_dir, teacher: str, *extra: str):
    """The tiny student after 3 SFT steps, distilled from `teacher` alone (no task advantage)."""
    return small_job_config(f"teacher.path={teacher}", "rollout.max_new_tokens=8", "sft.steps=3", "teacher.coef=1",
                            "teacher.task_coef=0", "optim.lr=1e-3", *extra, run_dir=run_dir)


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
def test_ray_distillation_goes_on_through_a_killed_and_restarted_teacher_and_its_kl_falls(local_ray, tiny_model_path,
                                                                                         trained_teacher, tmp_path):
    """The distillation run on Ray, asynchronous (staleness 1), its teacher actor SIGKILLed after step 3: Ray
    restarts it (a new process answers under the same name while the run goes on), it loads its path again, the
    batch it was scoring (if any) is scored again, every step trains with its KL, no rollback, and the KL falls
    (the first three steps' against the last three's, by more than their own spread: the restarted teacher scores
    as the killed one did; the learning over 200 steps is the local test's)."""
    import ray

    steps, ns = KILLED_TEACHER_STEPS, "rayllm_distill_test"
    cfg = learning_cfg(tmp_path, tiny_model_path, trained_teacher[0], "trainer.backend=ray", f"ray.namespace={ns}",
                       "ray.sync_timeout_s=60", "rollout.max_staleness=1", steps=steps).validate()
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
    # the restart itself: the same named actor answers from a new process while the run goes on. A call that
    # reaches it while it restarts is refused as unavailable, or fails with the process it was sent to before Ray
    # saw it die (RayActorError, of which both are kinds), and is asked again; a dead actor without restarts
    # keeps failing, and the deadline ends the wait
    restarted_by = time.monotonic() + 120
    while True:
        try:
            new_pid = ray.get(actor.pid.remote(), timeout=30)
            break
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as exc:
            assert time.monotonic() < restarted_by, f"the killed teacher was not restarted within 120 s: {exc!r}"
            time.sleep(0.5)
    assert new_pid != old_pid and not out, (old_pid, new_pid)
    runner.join(timeout=400)
    assert "summary" in out, "the run did not finish after the teacher was killed"
    summary = out["summary"]
    assert summary["steps"] == steps and summary["recoveries"] == []
    records = rl_records(summary)
    assert [r["step"] for r in records] == list(range(1, steps + 1))
    assert all(r["teacher_kl_mean"] != 0 and r["teacher_s"] > 0 for r in records)
    kl = [r["teacher_kl_mean"] for r in records]  # measured: 8.6 and 6.5 SE in two runs
    assert_rises([-x for x in kl[:3]], [-x for x in kl[-3:]], what=f"minus the teacher KL, first 3 -> last 3: {kl}")
