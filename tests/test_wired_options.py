"""Config options that reach the job: `rollout.keep_top_k` (TopKRewardSelector in
the batch pipeline), `algo.prox_logp_method=loglinear` (the learner's recompute-free
proximal logprobs), `algo.clip_ratio_c` and `algo.advantage.std_estimator`, against hand-derived
numbers."""
from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from tensordict import TensorDict

from rayllm_rl.config import load_config
from rayllm_rl.job.plan import make_plan
from rayllm_rl.learner.learner import Learner, OptimConfig
from rayllm_rl.objectives import DecoupledPPOLoss, GRPOLoss, GRPOTISLoss
from rayllm_rl.algorithm.batch_prep import make_batch_pipeline
from rayllm_rl.job.config import GRPOJobConfig

EPS = 1e-6  # AdvantageConfig.eps


def _job(*argv: str) -> GRPOJobConfig:
    return load_config(GRPOJobConfig, list(argv))


def rewards_to_advantages(batch: TensorDict, cfg: GRPOJobConfig, version: int = 0) -> TensorDict:
    """The job's batch pipeline (no reference) on a rollout batch trained from `version`."""
    return make_batch_pipeline(cfg)(batch, version)


# ---------------------------------------------------------------- rollout.keep_top_k
# Two interleaved groups of 4; input_ids hold the row index so kept rows can be identified.
# TorchRL's rule: only rewards strictly above the group's lower median are eligible.
#   group 7 = rows 0, 2, 4, 6 with rewards 1, 0, 3, 2  (median 1)  -> eligible: rows 4 (3) and 6 (2)
#   group 9 = rows 1, 3, 5, 7 with rewards .5, 1, 1, 0 (median .5) -> eligible: rows 3 and 5 (the two 1s)
GIDS = [7, 9, 7, 9, 7, 9, 7, 9]
REWARDS = [1.0, 0.5, 0.0, 1.0, 3.0, 1.0, 2.0, 0.0]


def _rollout_batch() -> TensorDict:
    n, t = len(REWARDS), 3
    return TensorDict({
        "input_ids": torch.arange(n).unsqueeze(-1).repeat(1, t),
        "attention_mask": torch.ones(n, t, dtype=torch.bool),
        "loss_mask": torch.tensor([[0, 1, 1]] * n, dtype=torch.bool),
        "logprobs": torch.full((n, t), -0.5),
        "versions": torch.tensor([[-1, 0, 0]] * n),
        "rewards": torch.tensor(REWARDS),
        "group_id": torch.tensor(GIDS),
    }, batch_size=[n])


def test_keep_top_k_selects_before_advantages():
    cfg = _job("rollout.group_size=4", "rollout.keep_top_k=2")
    out = rewards_to_advantages(_rollout_batch(), cfg, version=5)
    assert out.batch_size[0] == 4
    assert out["input_ids"][:, 0].tolist() == [3, 4, 5, 6]  # kept rows, in their original order
    assert out["rewards"].tolist() == [1.0, 3.0, 1.0, 2.0]
    # group 7 keeps rewards 3 and 2: mean 2.5, population std 0.5 -> +-0.5 / (0.5 + eps);
    # group 9 keeps 1 and 1: std 0 -> 0 / (0 + eps) = 0.
    a = 0.5 / (0.5 + EPS)
    assert out["advantages"].tolist() == pytest.approx([0.0, a, 0.0, -a], abs=1e-7)
    assert out["prox_version"].tolist() == [5, 5, 5, 5]
    # without selection the same groups have 4 members: group 7 rewards 1, 0, 3, 2 -> mean 1.5,
    # population std sqrt(1.25); row 4 (reward 3) gets 1.5 / (sqrt(1.25) + eps)
    full = rewards_to_advantages(_rollout_batch(), _job("rollout.group_size=4"))
    assert full.batch_size[0] == 8 and full["prox_version"].tolist() == [0] * 8
    assert float(full["advantages"][4]) == pytest.approx(1.5 / (math.sqrt(1.25) + EPS), abs=1e-6)


def test_keep_top_k_keeps_at_most_the_rows_above_the_median():
    out = rewards_to_advantages(
        _rollout_batch(), _job("rollout.group_size=4", "rollout.keep_top_k=3", "algo.advantage.std=false"))
    # k=3 but only two rows per group are above the median (plain top-3 would add rows 0 and 1):
    # group 7 keeps 3, 2 (rows 4, 6; mean 2.5); group 9 keeps 1, 1 (rows 3, 5; mean 1)
    assert out["input_ids"][:, 0].tolist() == [3, 4, 5, 6]
    assert out["advantages"].tolist() == pytest.approx([0.0, 0.5, 0.0, -0.5], abs=1e-12)


def test_keep_top_k_on_uniform_groups_gives_an_empty_batch_and_no_step():
    batch = _rollout_batch()
    batch["rewards"] = torch.tensor([1.0, 0.0] * 4)  # group 7 all 1, group 9 all 0
    out = rewards_to_advantages(batch, _job("rollout.group_size=4", "rollout.keep_top_k=2"), version=0)
    assert out.batch_size[0] == 0 and out["advantages"].shape == (0,)
    model = UniformLM()
    before = model.bias.detach().clone()
    assert _learner(model).train_step(out, GRPOLoss()) == {"empty_batch": 1.0}
    assert model.forwards == 0 and torch.equal(model.bias.detach(), before)


@pytest.mark.parametrize("argv", [
    ["rollout.keep_top_k=9"],  # group_size 8
    ["rollout.keep_top_k=-1"],
    ["rollout.group_size=2", "rollout.keep_top_k=3"],
])
def test_keep_top_k_out_of_range_names_the_key(argv):
    with pytest.raises(ValueError, match=r"rollout\.keep_top_k"):
        _job(*argv)


# ---------------------------------------------------------------- algo.advantage.std_estimator
def test_std_estimator_reaches_the_advantages():
    # group 7 rewards 1, 0, 3, 2: mean 1.5, squared deviations .25 + 2.25 + 2.25 + .25 = 5
    # population std sqrt(5/4), unbiased (Bessel) std sqrt(5/3); row 4 (reward 3) has A = 1.5 / (std + eps)
    pop = rewards_to_advantages(_rollout_batch(), _job("rollout.group_size=4"))
    unb = rewards_to_advantages(_rollout_batch(), _job("rollout.group_size=4", "algo.advantage.std_estimator=unbiased"))
    assert float(pop["advantages"][4]) == pytest.approx(1.5 / (math.sqrt(5 / 4) + EPS), rel=1e-7)
    assert float(unb["advantages"][4]) == pytest.approx(1.5 / (math.sqrt(5 / 3) + EPS), rel=1e-7)
    # group 9 rewards .5, 1, 1, 0: mean .625, squared deviations .015625 + 2 * .140625 + .390625 = .6875
    assert float(unb["advantages"][1]) == pytest.approx(-0.125 / (math.sqrt(0.6875 / 3) + EPS), rel=1e-6)
    with pytest.raises(ValueError, match=r"algo\.advantage\.std_estimator.*population.*unbiased"):
        _job("algo.advantage.std_estimator=bessel")


# ---------------------------------------------------------------- algo.clip_ratio_c
@pytest.mark.parametrize("name", ["grpo", "dapo", "dr_grpo", "ppo_decoupled", "grpo_tis"])
def test_clip_ratio_c_reaches_every_ppo_clip_loss(name):
    def clipping_loss(*argv):
        loss = _job(f"algo.name={name}", *argv).algo.build_loss(10)
        return getattr(loss, "base", loss)  # the TIS wrappers hold the GRPOLoss that clips

    assert clipping_loss("algo.clip_ratio_c=3").clip_ratio_c == 3.0
    assert clipping_loss().clip_ratio_c is None  # off by default


def test_clip_ratio_c_validation_names_the_key():
    with pytest.raises(ValueError, match=r"algo\.clip_ratio_c=1\.0: must be > 1"):
        _job("algo.clip_ratio_c=1")
    with pytest.raises(ValueError, match=r"algo\.clip_ratio_c.*algo\.name=cispo"):
        _job("algo.name=cispo", "algo.clip_ratio_c=3").algo.build_loss()


# ---------------------------------------------------------------- algo.prox_logp_method
def test_prox_logp_method_reaches_the_losses_that_use_prox():
    ppo = _job("algo.name=ppo_decoupled", "algo.prox_logp_method=loglinear").algo.build_loss()
    assert isinstance(ppo, DecoupledPPOLoss) and ppo.prox_logp_method == "loglinear"
    tis = _job("algo.name=grpo_tis", "algo.prox_logp_method=loglinear").algo.build_loss()
    assert isinstance(tis, GRPOTISLoss) and tis.prox_logp_method == "loglinear"
    assert _job("algo.name=ppo_decoupled").algo.build_loss().prox_logp_method == "recompute"
    with pytest.raises(ValueError, match=r"algo\.prox_logp_method=loglinear is not read by algo\.name=grpo "
                                         r"\(it is by \['grpo_tis', 'ppo_decoupled'\]\)"):
        _job("algo.name=grpo", "algo.prox_logp_method=loglinear")  # by type, when the config is read
    with pytest.raises(ValueError, match=r"algo\.prox_logp_method"):
        _job("algo.prox_logp_method=linear")
    stamped = rewards_to_advantages(_rollout_batch(),
                                    _job("algo.name=ppo_decoupled", "algo.prox_logp_method=loglinear"), 3)
    assert stamped["prox_version"].tolist() == [3] * 8  # every batch carries the version it trains from


class UniformLM(torch.nn.Module):
    """A 4-token LM whose logits are one learnable bias at every position: log pi = log(1/4) for
    every token at init. Counts its forward passes."""

    def __init__(self):
        super().__init__()
        self.bias = torch.nn.Parameter(torch.zeros(4))
        self.forwards = 0

    def forward(self, input_ids, attention_mask):
        self.forwards += 1
        return SimpleNamespace(logits=self.bias.expand(*input_ids.shape, 4))


class RecordingPPO(DecoupledPPOLoss):
    """DecoupledPPOLoss that keeps the prox_logp the learner handed it."""

    def terms(self, logp, behav_logp, prox_logp, advantages, mask, ref_logp):
        self.seen = prox_logp.detach().clone()
        return super().terms(logp, behav_logp, prox_logp, advantages, mask, ref_logp)


def _train_batch() -> TensorDict:
    # token versions on generated tokens: row 0 [3, 2, 0], row 1 [1, 3]; the batch trains from v=3
    return TensorDict({
        "input_ids": torch.tensor([[0, 1, 2, 3], [0, 2, 1, 0]]),
        "attention_mask": torch.ones(2, 4, dtype=torch.bool),
        "loss_mask": torch.tensor([[0, 1, 1, 1], [0, 1, 1, 0]], dtype=torch.bool),
        "logprobs": torch.tensor([[0.0, -1.0, -2.0, -0.5], [0.0, -1.5, -1.0, 0.0]]),
        "versions": torch.tensor([[-1, 3, 2, 0], [-1, 1, 3, -1]]),
        "advantages": torch.tensor([1.0, -1.0]),
        "prox_version": torch.tensor([3, 3]),
    }, batch_size=[2])


def _learner(model):
    return Learner("", OptimConfig(lr=1e-3, micro_batch_size=8), model=model)


def test_loglinear_prox_in_the_learner_skips_the_recompute_pass():
    model = UniformLM()
    loss = RecordingPPO(prox_logp_method="loglinear")
    _learner(model).train_step(_train_batch(), loss)
    assert model.forwards == 1  # the training forward only
    # current policy logp = log(1/4); the update produces v = 4, v_prox = 3:
    # alpha = (3 - v_t) / (4 - v_t), prox = behav + alpha * (log(1/4) - behav)
    cur = math.log(0.25)

    def prox(behav, v):
        return behav + (3 - v) / (4 - v) * (cur - behav)

    want = {(0, 1): -1.0,  # v=3: alpha 0, the behaviour logprob itself
            (0, 2): prox(-2.0, 2),  # alpha 1/2
            (0, 3): prox(-0.5, 0),  # alpha 3/4
            (1, 1): prox(-1.5, 1),  # alpha 2/3
            (1, 2): -1.0}
    assert want[(0, 2)] == pytest.approx(-2.0 + 0.5 * (cur + 2.0))
    for (i, t), v in want.items():
        assert float(loss.seen[i, t]) == pytest.approx(v, abs=1e-6), (i, t)


def test_recompute_prox_in_the_learner_runs_one_extra_pass():
    model = UniformLM()
    loss = RecordingPPO()
    batch = _train_batch()
    del batch["prox_version"]
    _learner(model).train_step(batch, loss)
    assert model.forwards == 2  # recompute + training forward
    mask = batch["loss_mask"]
    assert torch.allclose(loss.seen[mask], torch.full((5,), math.log(0.25)))


def test_loglinear_without_prox_version_raises():
    batch = _train_batch()
    del batch["prox_version"]
    with pytest.raises(ValueError, match="prox_version"):
        _learner(UniformLM()).train_step(batch, RecordingPPO(prox_logp_method="loglinear"))


# ---------------------------------------------------------------- optim.* batching reaches the reference
def test_the_reference_model_takes_the_learners_token_budget_and_chunk(tiny_model_path):
    """optim.max_tokens_per_micro_batch / optim.logprob_chunk_size reach the frozen reference too (it
    used to get FrozenModel's defaults whatever the job said)."""
    from transformers import AutoTokenizer

    from rayllm_rl.orchestration.factories import build_task
    from rayllm_rl.orchestration.local.backend import LocalBackend

    cfg = _job("trainer.backend=local", "optim.max_tokens_per_micro_batch=777", "optim.logprob_chunk_size=33",
               "algo.kl_coef=0.1", "data.eval_size=8").validate()
    backend = LocalBackend(make_plan(cfg.validate()), tiny_model_path, build_task(cfg),
                           AutoTokenizer.from_pretrained(tiny_model_path))
    try:
        backend.start_frozen(None)
        reference = backend.frozen["reference"]
        assert (reference.max_tokens_per_micro_batch, reference.logprob_chunk_size) == (777, 33)
    finally:
        backend.shutdown()


# ---------------------------------------------------------------- inference.options reach the local engine
def test_engine_options_reach_the_local_backends_engine(tiny_model_path):
    """`inference.options.max_batch_size` / `batch_wait_s` reach the single-process engine: the local backend
    builds it from the plan's `EngineSpec`, as a replica actor does (it used to build `TransformersEngine` itself,
    with 512 and 0 s whatever the job said). Five requests sent together decode in batches of at most 2: 3 batches;
    under the old default of 512 they all went in one or two."""
    import asyncio

    from transformers import AutoTokenizer

    from rayllm_rl.inference.protocol import LLMRequest, SamplingParams
    from rayllm_rl.orchestration.factories import build_task
    from rayllm_rl.orchestration.local.backend import LocalBackend

    cfg = _job("trainer.backend=local", "inference.options.max_batch_size=2", "inference.options.batch_wait_s=0.05",
               "data.eval_size=8").validate()
    backend = LocalBackend(make_plan(cfg), tiny_model_path, build_task(cfg),
                           AutoTokenizer.from_pretrained(tiny_model_path))
    try:
        engine = backend.engine
        assert (engine.max_batch_size, engine.batch_wait_s, engine.device.type) == (2, 0.05, "cpu")
        requests = [LLMRequest([1 + i, 2, 3], SamplingParams(max_new_tokens=3, greedy=True)) for i in range(5)]

        async def together():
            return await asyncio.gather(*(engine.agenerate(r) for r in requests))

        before = engine.stats.batches
        outs = backend.loop.call(together(), 120, "5 requests")
        assert len(outs) == 5 and engine.stats.batches - before == 3
    finally:
        backend.shutdown()


def test_the_local_backend_refuses_a_gpu_engine_device():
    with pytest.raises(ValueError, match="inference.options.device=cuda with trainer.backend=local"):
        _job("trainer.backend=local", "inference.options.device=cuda", "data.eval_size=8").validate()
