"""Reward models (`reward.model`): batching, failures, combination with the rule, `reward-model-<i>` actors
and their placement on Ray's logical GPUs, and a job that learns the arithmetic task from a reward model
alone (a classifier trained here on completions labelled by the task's rule)."""
from __future__ import annotations

import asyncio
import json
import statistics
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from rayllm_rl.config import load_config
from rayllm_rl.data.failures import code_of
from rayllm_rl.envs.arithmetic import arithmetic_reward
from rayllm_rl.job.config import GRPOJobConfig
from rayllm_rl.job.plan import make_plan
from rayllm_rl.rewards.combined import CombinedReward
from rayllm_rl.rewards.reward_model import RewardModelOutputError, RewardModelScorer, rm_sample
from rayllm_rl.workflows.rewards import RewardCaller
from reward_model_helpers import build_tiny_reward_model
from ray_sessions import JOB_ENV, local_ray_session

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def row(a: int, b: int) -> dict:
    return {"messages": [{"role": "user", "content": f"{a}+{b}="}], "answer": str(a + b)}


def samples(n: int) -> list[dict]:
    """`n` completions of different lengths (so a batch is padded)."""
    return [rm_sample("", f"<answer>{k}</answer>" + " the" * (k % 4), row(k % 5, 2)) for k in range(n)]


@pytest.fixture(scope="module")
def rm_path(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("tiny-rm")
    build_tiny_reward_model(path)
    return str(path)


@pytest.fixture()
def scorer(rm_path):
    s = RewardModelScorer(rm_path, batch_size=8, batch_wait_s=0.05)
    yield s
    s.close()


async def score_each(scorer, items) -> list[float]:
    """One request per sample, all in flight at once (as concurrent episodes send them)."""
    return [x[0] for x in await asyncio.gather(*[scorer.ascore([s]) for s in items])]


# ---------------------------------------------------------------- batching
def test_concurrent_requests_share_one_forward_and_equal_unbatched_scores(scorer):
    items = samples(8)
    scores = asyncio.run(score_each(scorer, items))
    assert scorer.stats.forwards == 1 and scorer.stats.largest_batch == 8 and scorer.stats.scored == 8
    lengths = {len(scorer.tokenizer(scorer.text(s))["input_ids"]) for s in items}
    assert len(lengths) > 1  # the batch was padded
    unbatched = [scorer.forward([scorer.text(s)])[0] for s in items]
    assert scores == pytest.approx(unbatched, abs=1e-5)
    assert max(scores) - min(scores) > 1e-3  # distinct inputs, distinct scores: the comparison means something


def test_a_batch_holds_at_most_batch_size_requests(scorer):
    scores = asyncio.run(score_each(scorer, samples(20)))
    assert len(scores) == 20 and scorer.stats.scored == 20
    assert scorer.stats.largest_batch == 8 and scorer.stats.forwards == 3  # 8 + 8 + 4


def test_the_rm_reads_the_rows_conversation_in_its_chat_template(scorer):
    text = scorer.text(rm_sample("ignored", "<answer>5</answer>", row(2, 3)))
    assert text == "<|im_start|>user\n2+3=<|im_end|>\n<|im_start|>assistant\n<answer>5</answer><|im_end|>\n"
    assert scorer.text(rm_sample("Q: 2+3=", " 5", {})) == "Q: 2+3= 5"  # no messages: prompt text + completion


def test_a_model_with_two_labels_is_refused(tmp_path):
    from transformers import AutoConfig, AutoModelForSequenceClassification

    build_tiny_reward_model(tmp_path)
    config = AutoConfig.from_pretrained(tmp_path)
    config.num_labels = 2
    AutoModelForSequenceClassification.from_config(config).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="num_labels=2"):
        RewardModelScorer(str(tmp_path))


# ---------------------------------------------------------------- failures: 0, a warning and a counter
class BrokenRM(torch.nn.Module):
    """A stand-in reward model whose forward misbehaves (reaches the failure paths a real RM can hit)."""

    def __init__(self, logits_of):
        super().__init__()
        self.logits_of = logits_of
        self.config = SimpleNamespace(pad_token_id=0, max_position_embeddings=64)

    def forward(self, input_ids, attention_mask):
        return SimpleNamespace(logits=self.logits_of(input_ids))


def _raise(ids):
    raise RuntimeError("CUDA error: device-side assert triggered")


def _hang(ids):
    time.sleep(0.8)
    return torch.zeros(ids.shape[0], 1)


@pytest.mark.parametrize("logits_of, counter", [
    (lambda ids: torch.full((ids.shape[0], 1), float("nan")), "reward_model_nonfinite"),
    (lambda ids: torch.zeros(ids.shape[0], 2), "reward_model_errors"),
    (_raise, "reward_model_errors"),
    (_hang, "reward_model_timeouts"),
], ids=["nan", "wrong_shape", "raises", "hangs"])
def test_a_failing_rm_scores_zero_and_counts_never_crashing(rm_path, logits_of, counter):
    scorer = RewardModelScorer(rm_path, model=BrokenRM(logits_of), batch_wait_s=0.0)
    reward = RewardCaller(CombinedReward(arithmetic_reward, 0.5, {"model": (2.0, scorer, 0.3)}))
    try:
        out = asyncio.run(reward.score("", "<answer>5</answer>", [], [], **row(2, 3)))
    finally:
        scorer.close(timeout_s=3)
    cause = {"reward_model_nonfinite": "reward_nonfinite", "reward_model_errors": "reward_raised",
             "reward_model_timeouts": "reward_timeout"}[counter]  # the sample failed: rollout.on_failure decides
    assert out == {"reward": 0.5, "reward_rule": 1.0, "reward_model": 0.0, "reward_model_failed": 1.0,
                   "failed": code_of(cause)}
    counters = reward.counters()
    assert counters[counter] == 1 and counters["reward_model_calls"] == 1 and counters["reward_errors"] == 0
    assert sum(v for k, v in counters.items() if k.startswith("reward_model_") and k != "reward_model_calls") == 1


def test_wrong_shape_names_the_shape(rm_path):
    scorer = RewardModelScorer(rm_path, model=BrokenRM(lambda ids: torch.zeros(ids.shape[0], 3)))
    with pytest.raises(RewardModelOutputError, match=r"shape \(2, 3\) for 2 sequences; expected \(2, 1\)"):
        scorer.forward(["a", "b"])


# ---------------------------------------------------------------- combination and the workflow
def test_rlvr_group_is_scored_by_rule_and_rm_by_weights_in_one_batch(rm_path, engine, tokenizer):
    """The local backend's scorers through `build_workflow`: the group's four completions go to the RM in
    one forward, and each reward is 0.25 * rule + 2 * rm, with both components on the trajectory."""
    from rayllm_rl.orchestration.factories import build_task, build_workflow
    from rayllm_rl.orchestration.local.reward_scorers import local_reward_scorers

    cfg = load_config(GRPOJobConfig, ["rollout.group_size=4", "rollout.workflow=rlvr", f"reward.model.path={rm_path}",
                                      "reward.rule_weight=0.25", "reward.model.weight=2",
                                      "reward.model.batch_wait_s=0.05"])
    cfg = cfg.validate()
    scorers = local_reward_scorers(make_plan(cfg))
    try:
        workflow = build_workflow(cfg, build_task(cfg), tokenizer, reward_scorers=scorers)
        traj = asyncio.run(workflow.arun_episode(engine, row(2, 3)))
        assert scorers["model"].stats.scored == 4 and scorers["model"].stats.forwards == 1
    finally:
        scorers["model"].close()
    expected = 0.25 * traj["reward_rule"] + 2.0 * traj["reward_model"]
    assert torch.allclose(traj["rewards"], expected, atol=1e-6)
    assert traj["reward_model_failed"].tolist() == [0.0] * 4
    assert traj["reward_model"].abs().sum() > 0


def test_a_task_env_scores_with_the_combined_reward(rm_path, engine, tokenizer):
    """task=gsm8k's ChatEnv (the env workflow: its reward transform runs in a worker thread on a loop of its
    own) scores with rule + RM; GSM8K's own components ride along with reward_rule and reward_model."""
    from rayllm_rl.orchestration.factories import build_task, build_workflow
    from rayllm_rl.orchestration.local.reward_scorers import local_reward_scorers

    gsm8k = Path(__file__).parent / "fixtures" / "gsm8k.jsonl"
    cfg = load_config(GRPOJobConfig, ["task=gsm8k", f"data.path={gsm8k}", "data.eval_size=1", "rollout.group_size=2",
                                      "rollout.max_new_tokens=5", f"reward.model.path={rm_path}",
                                      "reward.rule_weight=0.5"]).validate()
    task = build_task(cfg)
    scorers = local_reward_scorers(make_plan(cfg))
    try:
        workflow = build_workflow(cfg, task, tokenizer, reward_scorers=scorers)
        assert type(workflow).__name__ == "ChatEnvWorkflow"
        out = asyncio.run(workflow.arun_episode(engine, {**task.train[0], "group_id": 3}))
        assert scorers["model"].stats.scored == 2
    finally:
        scorers["model"].close()
    assert {"reward_answer", "success", "reward_rule", "reward_model", "reward_model_failed"} <= set(out.keys())
    assert torch.allclose(out["rewards"], 0.5 * out["reward_rule"] + out["reward_model"], atol=1e-6)
    assert out["reward_model"].abs().sum() > 0 and out["reward_model_failed"].tolist() == [0.0, 0.0]


# ---------------------------------------------------------------- configuration
@pytest.mark.parametrize("overrides, message", [
    (["reward.model.batch_size=4"], "reward.model.batch_size is read only when reward.model.path is set"),
    (["reward.rule_weight=0"], "reward.rule_weight=0.0 weighs the rule against reward.model or reward.judge"),
    (["reward.model.path=/m", "reward.model.batch_size=0"], "reward.model.batch_size=0: must be > 0"),
    (["reward.model.path=/m", "reward.model.timeout_s=0"], "reward.model.timeout_s=0.0: must be > 0"),
    (["reward.model.path=/m", "reward.model.gpus_per_actor=1.5"], "reward.model.gpus_per_actor=1.5: must be 0"),
    (["reward.model.path=/m", "reward.model.weight=0", "reward.rule_weight=0"], "every reward weight is 0"),
    (["reward.model.path=/m", "reward.model.weight=nan"], "reward.model.weight=nan: must be a finite number"),
    (["reward.model.path=/m", "trainer.backend=local", "reward.model.num_actors=2"],
     "reward.model.num_actors=2 needs trainer.backend=ray"),
    (["reward.model.path=/m", "trainer.backend=local", "reward.model.gpus_per_actor=1"],
     "reward.model.gpus_per_actor=1.0 needs trainer.backend=ray"),
])
def test_bad_reward_model_settings_fail_validation_naming_the_key(overrides, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)").replace(".", r"\.")):
        load_config(GRPOJobConfig, overrides).validate()


def test_wrong_literal_fails_before_validation():
    from rayllm_rl.config import ConfigError

    with pytest.raises(ConfigError, match="reward.model.activation"):
        load_config(GRPOJobConfig, ["reward.model.activation=tanh"])


def test_the_default_job_trains_on_its_rule_alone(rm_path, tokenizer):
    """Off by default: the workflow's reward is the task's own function, as before this section existed."""
    from rayllm_rl.orchestration.factories import build_task, build_workflow

    cfg = load_config(GRPOJobConfig, []).validate()
    assert not cfg.reward.enabled
    assert build_workflow(cfg, build_task(cfg), tokenizer).reward.reward_fn is arithmetic_reward


@pytest.mark.slow
def test_a_local_job_trains_on_rule_rm_and_judge(rm_path, tmp_path):
    """trainer.backend=local: the in-process RM and judge (a tiny judge SFT'd here to say 'Score: 7') score
    every rollout through the real driver; each step logs the components, the summary the counters."""
    from job_helpers import run_job
    from reward_model_helpers import tiny_judge

    judge = tiny_judge("Score: 7")
    cfg = load_config(GRPOJobConfig, [
        "trainer.backend=local", "sft.steps=2", "data.eval_size=4", "data.max_operand=4", "rollout.prompts_per_step=2",
        "rollout.group_size=2", "rollout.max_new_tokens=6", "trainer.steps=2", "trainer.eval_every=0",
        f"trainer.run_dir={tmp_path / 'run'}", f"reward.model.path={rm_path}", f"reward.judge.path={judge}",
        "reward.rule_weight=0.5", "reward.judge.weight=2"]).validate()
    summary = run_job(cfg)
    rl = [r for r in map(json.loads, (Path(summary["run_dir"]) / "metrics.jsonl").read_text().splitlines())
          if r["phase"] == "rl"]
    assert len(rl) == 2 and summary["failed_episodes"] == 0
    for r in rl:
        assert r["reward_judge"] == pytest.approx(0.7) and r["reward_judge_failed"] == 0 == r["reward_model_failed"]
        assert r["reward"] == pytest.approx(0.5 * r["reward_rule"] + r["reward_model"] + 2 * 0.7, abs=1e-5)
    failures = summary["reward_failures"]
    assert failures["reward_model_calls"] == failures["reward_judge_calls"] >= 8
    assert failures["reward_model_errors"] == failures["reward_judge_errors"] == failures["reward_judge_unparsed"] == 0
    assert summary["reward_services"]["reward-model"]["scored"] == failures["reward_model_calls"]


# ---------------------------------------------------------------- Ray: actors, placement, learning
@pytest.fixture(scope="module")
def ray_with_two_gpus():
    """A local Ray with 2 logical GPUs (no real ones: actors asking for GPUs get ids, torch stays on the CPU)."""
    with local_ray_session("ray_with_two_gpus", num_cpus=2, num_gpus=2, runtime_env={"env_vars": JOB_ENV}):
        yield


def _kill(actors: dict, namespace: str) -> None:
    import ray

    from rayllm_rl.orchestration.ray.cluster import wait_names_free

    for handle in actors.values():
        ray.kill(handle, no_restart=True)
    wait_names_free(list(actors), namespace)


@pytest.mark.ray
@pytest.mark.slow
def test_reward_model_actors_get_a_gpu_each_and_batch_concurrent_requests(ray_with_two_gpus, rm_path, scorer):
    import ray

    from rayllm_rl.orchestration.ray.reward_actors import ray_reward_scorers, start_reward_actors

    cfg = load_config(GRPOJobConfig, [f"reward.model.path={rm_path}", "reward.model.num_actors=2",
                                      "reward.model.gpus_per_actor=1", "reward.model.batch_wait_s=0.05",
                                      "ray.namespace=rm-actors"]).validate()
    actors = start_reward_actors(make_plan(cfg))
    try:
        assert sorted(actors) == ["reward-model-0", "reward-model-1"]
        devices = ray.get([a.devices.remote() for a in actors.values()], timeout=60)
        assert sorted(str(d["gpu_ids"][0]) for d in devices) == ["0", "1"]  # one logical GPU each, not the same
        assert all(len(d["gpu_ids"]) == 1 and d["cuda_visible_devices"] == str(d["gpu_ids"][0]) for d in devices)
        assert {d["device"] for d in devices} == {"cpu"}  # Ray's GPUs are logical here: torch sees none

        remote = ray_reward_scorers(cfg)["model"]
        items = samples(16)

        async def go():
            return await asyncio.gather(*[remote.score(s["prompt"], s["completion"], {"messages": s["messages"]})
                                          for s in items])

        scores = asyncio.run(go())
        stats = ray.get([a.stats.remote() for a in actors.values()], timeout=60)
        assert sum(s["scored"] for s in stats) == 16 and all(s["scored"] > 0 for s in stats)  # both used
        assert sum(s["forwards"] for s in stats) < 16 and max(s["largest_batch"] for s in stats) > 1
        assert scores == pytest.approx([scorer.forward([scorer.text(s)])[0] for s in items], abs=1e-5)
    finally:
        _kill(actors, "rm-actors")


@pytest.mark.ray
@pytest.mark.slow
def test_reward_model_actors_that_cannot_get_their_gpus_fail_naming_the_key(ray_with_two_gpus, rm_path):
    import ray

    from rayllm_rl.orchestration.ray.reward_actors import start_reward_actors

    cfg = load_config(GRPOJobConfig, [f"reward.model.path={rm_path}", "reward.model.num_actors=2",
                                      "reward.model.gpus_per_actor=2", "ray.namespace=rm-gpus",
                                      "trainer.call_timeout_s=2"]).validate()
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match=r"reward-model-[01] did not start within trainer\.call_timeout_s=2s "
                                           r".*reward\.model\.gpus_per_actor=2; the cluster has GPU=2 in total"):
        start_reward_actors(make_plan(cfg))
    assert time.monotonic() - t0 < 30
    from rayllm_rl.orchestration.ray.cluster import wait_names_free

    wait_names_free(["reward-model-0", "reward-model-1"], "rm-gpus", timeout_s=30)  # killed, names free
    with pytest.raises(ValueError):
        ray.get_actor("reward-model-0", namespace="rm-gpus")


@pytest.mark.ray
@pytest.mark.slow
def test_judge_replicas_are_frozen_actors_on_logical_gpus(ray_with_two_gpus):
    """`judge-<i>`: InferenceReplica actors of a tiny judge SFT'd here to answer 'Score: 7', one logical GPU each,
    reached by env workers through a router; they never take a weight update."""
    import ray

    from rayllm_rl.orchestration.ray.reward_actors import ray_reward_scorers, start_reward_actors
    from reward_model_helpers import tiny_judge

    judge_path = tiny_judge("Score: 7")
    cfg = load_config(GRPOJobConfig, [f"reward.judge.path={judge_path}", "reward.judge.num_replicas=2",
                                      "reward.judge.gpus_per_replica=1", "ray.namespace=judges"]).validate()
    actors = start_reward_actors(make_plan(cfg))
    try:
        assert sorted(actors) == ["judge-0", "judge-1"]
        judge = ray_reward_scorers(cfg)["judge"]

        async def go():
            return await asyncio.gather(*[judge.score("", f"<answer>{n}</answer>", row(2, 3)) for n in range(6)])

        assert asyncio.run(go()) == pytest.approx([0.7] * 6)
        gpu_ids = ray.get([a.__ray_call__.remote(lambda self: ray.get_gpu_ids()) for a in actors.values()], timeout=60)
        assert sorted(str(g[0]) for g in gpu_ids) == ["0", "1"] and all(len(g) == 1 for g in gpu_ids)
        assert ray.get([a.version_history.remote() for a in actors.values()], timeout=60) == [[0], [0]]  # never synced
    finally:
        _kill(actors, "judges")


@pytest.mark.ray
@pytest.mark.slow
def test_a_reward_model_that_cannot_load_fails_the_start_naming_its_path(ray_with_two_gpus, tmp_path):
    from rayllm_rl.orchestration.ray.reward_actors import start_reward_actors

    cfg = load_config(GRPOJobConfig, [f"reward.model.path={tmp_path}", "ray.namespace=rm-missing",
                                      "trainer.call_timeout_s=60"]).validate()  # a directory without a model
    with pytest.raises(RuntimeError, match=f"reward-model-0 failed to start \\(reward.model.path='{tmp_path}'\\)"):
        start_reward_actors(make_plan(cfg))


@pytest.mark.ray
@pytest.mark.slow
def test_policy_learns_arithmetic_from_a_reward_model_alone(ray_with_two_gpus, tmp_path):
    """rule weight 0: after the demo's SFT warm start (done here), the policy trains on the score of a tiny
    classifier trained here on completions the task's rule labelled (an answer table, format noise and the
    SFT'd policy's own samples). The rule (logged as reward_rule, never optimised) rises on the training
    rollouts and on the greedy training prompts; the held-out eval is reported (docs/reward-models.md:
    rule 0.21 -> 0.40-0.44, greedy 0.25 -> 0.55-0.75, held-out 0.0 -> 0.2 on 5 prompts). Every bound is derived
    from the run (tests/learning_bounds.py): the RM's accuracy against each set's majority-class rate, the rises
    against the windows' own noise, the greedy gain by a sign test over the 20 prompts."""

    from rayllm_rl.envs.arithmetic import make_arithmetic_splits
    from job_helpers import run_job
    from learning_bounds import assert_beats_majority, assert_greedy_gain, assert_moves_together, assert_rises
    from reward_model_helpers import (RM_AVOIDS, answer_table, format_noise, policy_samples, sft_arithmetic_policy,
                                      train_reward_classifier)

    train_rows, _ = make_arithmetic_splits(max_operand=4, eval_size=5, seed=0)  # the job's own split (trainer.seed=0)
    pairs = [(r["a"], r["b"]) for r in train_rows]
    # the SFT warm start, done here: the RM's data needs it
    policy = sft_arithmetic_policy(tmp_path / "sft", train_rows)
    samples = policy_samples(policy, train_rows, per_prompt=32)
    groups = {"answer table": answer_table(pairs), "format noise": format_noise(pairs), "policy samples": samples}
    accuracy = train_reward_classifier(tmp_path / "rm", list(groups.values()), [0.5, 0.2, 0.3])
    # a precondition, not what the test shows: the RM encodes the answer check (and the format) on the sets it
    # trained on. Training stops when this holds, so it fails only when train_reward_classifier's cap runs out
    for (name, group), acc in zip(groups.items(), accuracy):
        assert_beats_majority(acc, [label for _, _, label in group], avoid=RM_AVOIDS,
                              what=f"RM accuracy on the {name}")

    cfg = load_config(GRPOJobConfig, [
        f"model.path={policy}", "sft.steps=0", "data.max_operand=4", "data.eval_size=5", "rollout.prompts_per_step=8",
        "rollout.group_size=8", "rollout.max_new_tokens=8", "trainer.steps=80", "trainer.eval_every=0",
        "trainer.log_every=1000", "optim.lr=3e-4", f"trainer.run_dir={tmp_path / 'run'}", "trainer.call_timeout_s=120",
        f"reward.model.path={tmp_path / 'rm'}", "reward.rule_weight=0", "reward.model.activation=sigmoid",
        "reward.model.batch_wait_s=0.01", "ray.namespace=rm-learning",
    ]).validate()
    summary = run_job(cfg)
    lines = (Path(summary["run_dir"]) / "metrics.jsonl").read_text().splitlines()
    rl = [r for r in map(json.loads, lines) if r["phase"] == "rl"]
    assert len(rl) == 80 and summary["failed_episodes"] == 0
    failures = summary["reward_failures"]
    assert failures["reward_model_calls"] >= 80 * 64
    assert (failures["reward_model_errors"] == failures["reward_model_timeouts"]
            == failures["reward_model_nonfinite"] == 0)
    assert all(r["reward"] == pytest.approx(r["reward_model"], abs=1e-6) for r in rl)  # trained on the RM alone
    assert all(r["reward_model_failed"] == 0 for r in rl)
    services = summary["reward_services"]["reward-model-0"]
    assert services["largest_batch"] > 1 and services["forwards"] < services["scored"]  # batched in the job
    rule = [r["reward_rule"] for r in rl]
    rm_gap = statistics.fmean(abs(r["reward_model"] - r["reward_rule"]) for r in rl)
    checkpoints = Path(summary["run_dir"]) / "checkpoints"
    greedy_train = {step: greedy_rule_rewards(checkpoints / f"step_{step}", train_rows) for step in (0, 80)}
    trained = [r["reward"] for r in rl]  # the RM's score, what the policy optimises
    print(json.dumps({"rm_accuracy": accuracy, "train_rule_first15": statistics.fmean(rule[:15]),
                      "train_rule_last15": statistics.fmean(rule[-15:]), "rm_minus_rule_mean_abs": rm_gap,
                      "greedy_train_prompts_before": statistics.fmean(greedy_train[0]),
                      "greedy_train_prompts_after": statistics.fmean(greedy_train[80]),
                      "eval_reward_before": summary["eval_reward_before"],
                      "eval_reward_after": summary["eval_reward_after"],
                      "eval_reward_gain": summary["eval_reward_gain"],
                      "rl_seconds": summary["rl_seconds"]}))
    # The RM's score tracks the rule on the policy's own rollouts: each step's two batch means are taken over the
    # same 64 completions, so they share that batch's sampling noise only if the RM follows the rule completion by
    # completion (an RM the policy games would rise on noise of its own).
    assert_moves_together([r["reward_model"] for r in rl], rule, what="RM batch mean vs the rule's, per step")
    assert_rises(trained[:15], trained[-15:], what="the RM's score (trained on), first 15 -> last 15 steps")
    # Nine runs (docs/reward-models.md): the rule on sampled (temperature 1) rollouts 0.19-0.23 -> 0.25-0.47;
    # greedy answers to the training prompts 0.25 -> 0.55-0.75.
    assert_rises(rule[:15], rule[-15:], what="the rule on the rollouts (never trained on), first 15 -> last 15 steps")
    assert_greedy_gain(greedy_train[0], greedy_train[80], what="the rule on greedy answers to the 20 training prompts")


def greedy_rule_rewards(checkpoint: Path, rows) -> list[float]:
    """The rule reward of the greedy answer of a saved policy to each of `rows`, in order (`evaluate_greedy`, in
    process: its rewards are awaited in the rows' order)."""
    from rayllm_rl.inference.transformers.engine import TransformersEngine
    from rayllm_rl.workflows.evaluation import evaluate_greedy

    scores: list[float] = []

    def recorded(*args, **row):
        scores.append(arithmetic_reward(*args, **row))
        return scores[-1]

    engine = TransformersEngine(str(checkpoint), device="cpu")
    mean = asyncio.run(evaluate_greedy(engine, engine.tokenizer, rows, recorded, 8))["eval_reward"]
    assert len(scores) == len(rows) and statistics.fmean(scores) == pytest.approx(mean)
    return scores
