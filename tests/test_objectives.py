"""Loss and advantage tests against values derived by hand, token by token, in plain Python."""
from __future__ import annotations

import math
import re

import pytest
import torch

from rayllm_rl.objectives import (
    LOSSES,
    AdvantageConfig,
    GRPOLoss,
    SFTLoss,
    aggregate,
    compute_advantages,
    global_advantages,
    group_advantages,
    make_loss,
    masked_normalize,
)

NAN, INF = float("nan"), float("inf")
F64 = torch.float64

# ---------------------------------------------------------------- GRPO fixture (B=2, T=5)
# Row 0: prompt at t0, 3 generated tokens (t1..t3), pad at t4; sequence advantage A=+2.
# Row 1: prompt at t0, 4 generated tokens (t1..t4);               sequence advantage A=-1.
# behav_logp = -1 on generated tokens, logp = -1 + log(r) with the ratios below.
# Off-mask entries hold garbage (30, -inf, nan) that must never reach the loss or gradient.
R0 = [1.5, 1.1, 0.5]
R1 = [0.5, 1.5, 0.9, 1.0]
MASK = [[0, 1, 1, 1, 0], [0, 1, 1, 1, 1]]
# Per-token loss -min(r*A, clip(r, 0.8, 1.2)*A), eps_low = eps_high = 0.2:
#   row0 A=+2: r=1.5 -> min(3.0, 2.4) = 2.4 -> -2.4 (clipped high, zero grad)
#              r=1.1 -> min(2.2, 2.2)       -> -2.2 (unclipped)
#              r=0.5 -> min(1.0, 1.6) = 1.0 -> -1.0 (low side, A>0: not clipped)
#   row1 A=-1: r=0.5 -> min(-0.5, -0.8)     ->  0.8 (clipped low, zero grad)
#              r=1.5 -> min(-1.5, -1.2)     ->  1.5 (high side, A<0: not clipped)
#              r=0.9 ->                      ->  0.9
#              r=1.0 ->                      ->  1.0
LOSS0 = [-2.4, -2.2, -1.0]  # row sum -5.6
LOSS1 = [0.8, 1.5, 0.9, 1.0]  # row sum  4.2
# d(per-token loss)/d logp = -A*r when unclipped (d r/d logp = r), 0 when clipped.
GRAD0 = [0.0, -2.0 * 1.1, -2.0 * 0.5]
GRAD1 = [0.0, 1.0 * 1.5, 1.0 * 0.9, 1.0 * 1.0]


def _grpo_batch():
    lg = math.log
    logp = torch.tensor(
        [
            [30.0, -1 + lg(1.5), -1 + lg(1.1), -1 + lg(0.5), -INF],
            [NAN, -1 + lg(0.5), -1 + lg(1.5), -1 + lg(0.9), -1 + lg(1.0)],
        ],
        dtype=F64,
        requires_grad=True,
    )
    behav = torch.tensor([[0.0, -1, -1, -1, 0.0], [0.0, -1, -1, -1, -1]], dtype=F64)
    adv = torch.tensor([2.0, -1.0], dtype=F64)
    mask = torch.tensor(MASK, dtype=torch.bool)
    return logp, behav, adv, mask


def _expected_grad(denom0: float, denom1: float) -> list[list[float]]:
    row0 = [0.0] + [g / denom0 for g in GRAD0] + [0.0]
    row1 = [0.0] + [g / denom1 for g in GRAD1]
    return [row0, row1]


@pytest.mark.parametrize(
    "mode, expected, denoms",
    [
        # sum over all 7 masked tokens / 7
        ("token-mean", (-2.4 - 2.2 - 1.0 + 0.8 + 1.5 + 0.9 + 1.0) / 7, (7.0, 7.0)),
        # mean over 2 rows of the row means (3 and 4 tokens)
        ("seq-mean", ((-2.4 - 2.2 - 1.0) / 3 + (0.8 + 1.5 + 0.9 + 1.0) / 4) / 2, (3.0 * 2, 4.0 * 2)),
        # mean over 2 rows of the row sums
        ("seq-sum", ((-2.4 - 2.2 - 1.0) + (0.8 + 1.5 + 0.9 + 1.0)) / 2, (2.0, 2.0)),
    ],
)
def test_grpo_loss_and_grad_per_aggregation(mode, expected, denoms):
    logp, behav, adv, mask = _grpo_batch()
    out = GRPOLoss(aggregation=mode)(logp, behav, None, adv, mask)
    assert out.loss.item() == pytest.approx(expected, abs=1e-12)
    (grad,) = torch.autograd.grad(out.loss, logp)
    assert torch.isfinite(grad).all()
    for got_row, want_row in zip(grad.tolist(), _expected_grad(*denoms)):
        assert got_row == pytest.approx(want_row, abs=1e-12)


def test_grpo_token_mean_literal_value():
    logp, behav, adv, mask = _grpo_batch()
    assert GRPOLoss()(logp, behav, None, adv, mask).loss.item() == pytest.approx(-0.2, abs=1e-12)


def test_grpo_metrics():
    logp, behav, adv, mask = _grpo_batch()
    m = GRPOLoss()(logp, behav, None, adv, mask).metrics
    assert all(isinstance(v, float) for v in m.values())
    assert m["clip_fraction_high"] == pytest.approx(1 / 7)  # row0 t1 (r=1.5, A>0)
    assert m["clip_fraction_low"] == pytest.approx(1 / 7)  # row1 t1 (r=0.5, A<0)
    assert m["clip_fraction"] == pytest.approx(2 / 7)
    rs = R0 + R1
    # k3 of KL(old || new) on tokens sampled by old: r - 1 - log r with r = exp(logp - old)
    approx_kl = 0.0
    for r in rs:
        approx_kl += r - 1 - math.log(r)
    assert m["approx_kl"] == pytest.approx(approx_kl / 7)
    # ess = (sum r)^2 / (n sum r^2) = 7.0^2 / (7 * 8.02)
    assert m["ess"] == pytest.approx(49.0 / (7 * 8.02))
    ent = 0.0
    for r in rs:
        ent += -(-1 + math.log(r))
    assert m["entropy_proxy"] == pytest.approx(ent / 7)
    assert m["loss"] == pytest.approx(-0.2)
    assert "kl_ref" not in m


def test_approx_kl_is_kl_old_to_new_exactly_on_a_categorical():
    # Old policy q = [1/2, 1/4, 1/4] over 3 tokens, new policy p = [0.2, 0.5, 0.3]. Four tokens
    # sampled in exactly q's proportions (token 0 twice, 1 once, 2 once) make the masked mean of an
    # unbiased per-token estimator equal its expectation under q.
    q, p = [0.5, 0.25, 0.25], [0.2, 0.5, 0.3]
    kl_old_new = sum(qi * math.log(qi / pi) for qi, pi in zip(q, p))  # KL(q || p) = 0.2393
    kl_new_old = sum(pi * math.log(pi / qi) for qi, pi in zip(q, p))  # KL(p || q) = 0.2180
    assert kl_old_new == pytest.approx(0.23928, abs=1e-5) and kl_new_old == pytest.approx(0.21801, abs=1e-5)
    tokens = [0, 0, 1, 2]
    logp = torch.tensor([[0.0] + [math.log(p[t]) for t in tokens]], dtype=F64)
    old = torch.tensor([[0.0] + [math.log(q[t]) for t in tokens]], dtype=F64)
    mask = torch.tensor([[0, 1, 1, 1, 1]], dtype=torch.bool)
    m = GRPOLoss()(logp, old, None, torch.ones(1, dtype=F64), mask).metrics
    assert m["approx_kl"] == pytest.approx(kl_old_new, abs=1e-12)
    assert abs(m["approx_kl"] - kl_new_old) > 0.02  # not the other direction
    # the formula logged before, exp(old - logp) - 1 - (old - logp), is neither on these samples
    swapped = sum(math.exp(math.log(q[t] / p[t])) - 1 - math.log(q[t] / p[t]) for t in tokens) / 4
    assert abs(swapped - kl_old_new) > 0.1 and abs(swapped - kl_new_old) > 0.1


def test_grpo_zero_advantage_is_never_clipped():
    # Row 0 now has A=0: its loss terms are 0 and its r=1.5 / r=0.5 tokens do not count as clipped.
    logp, behav, _, mask = _grpo_batch()
    out = GRPOLoss()(logp, behav, None, torch.tensor([0.0, -1.0], dtype=F64), mask)
    assert out.loss.item() == pytest.approx((0.8 + 1.5 + 0.9 + 1.0) / 7)
    assert out.metrics["clip_fraction_high"] == 0.0
    assert out.metrics["clip_fraction_low"] == pytest.approx(1 / 7)  # row1 t1 only


def test_grpo_decoupled_clip_bounds():
    # eps_low = eps_high = 0.6 -> clip range [0.4, 1.6]: nothing is clipped any more.
    # row0: r=1.5 -> -3.0, r=1.1 -> -2.2, r=0.5 -> -1.0; row1: 0.5 + 1.5 + 0.9 + 1.0 = 3.9
    logp, behav, adv, mask = _grpo_batch()
    out = GRPOLoss(clip_eps_low=0.6, clip_eps_high=0.6)(logp, behav, None, adv, mask)
    assert out.loss.item() == pytest.approx((-3.0 - 2.2 - 1.0 + 3.9) / 7)
    assert out.metrics["clip_fraction"] == 0.0
    # Only the high bound widened: row1 t1 (r=0.5 < 0.8, A<0) is still clipped to 0.8.
    out = GRPOLoss(clip_eps_low=0.2, clip_eps_high=0.6)(logp, behav, None, adv, mask)
    assert out.loss.item() == pytest.approx((-3.0 - 2.2 - 1.0 + 4.2) / 7)
    assert out.metrics["clip_fraction_high"] == 0.0
    assert out.metrics["clip_fraction_low"] == pytest.approx(1 / 7)


def test_grpo_uses_prox_logp_over_behav_logp():
    logp, behav, adv, mask = _grpo_batch()
    stale_behav = behav - 0.7  # would change every ratio by e^0.7 if it were used
    out = GRPOLoss()(logp, stale_behav, behav, adv, mask)
    assert out.loss.item() == pytest.approx(-0.2, abs=1e-12)
    assert out.metrics["clip_fraction_high"] == pytest.approx(1 / 7)
    without_prox = GRPOLoss()(logp, stale_behav, None, adv, mask)
    assert without_prox.loss.item() != pytest.approx(-0.2, abs=1e-3)


def test_grpo_per_token_advantages():
    logp, behav, _, mask = _grpo_batch()
    # Same as the [B] advantages except row0 t2 gets A=-3: r=1.1 -> min(-3.3, -3.6) = -3.3 -> +3.3.
    adv = torch.tensor([[NAN, 2.0, -3.0, 2.0, NAN], [NAN, -1.0, -1.0, -1.0, -1.0]], dtype=F64)
    out = GRPOLoss()(logp, behav, None, adv, mask)
    assert out.loss.item() == pytest.approx((-2.4 + 3.3 - 1.0 + 4.2) / 7)
    (grad,) = torch.autograd.grad(out.loss, logp)
    assert grad[0, 2].item() == pytest.approx(3.0 * 1.1 / 7)  # -A*r/7 with A=-3


def _kl_batch():
    # Row 0: 2 generated tokens, row 1: 1 generated token. lr = ref - logp = 0.5, -0.3, 1.0.
    logp = torch.tensor([[0.0, -1.0, -2.0], [0.0, -0.5, 0.0]], dtype=F64, requires_grad=True)
    ref = torch.tensor([[0.0, -0.5, -2.3], [0.0, 0.5, 0.0]], dtype=F64)
    mask = torch.tensor([[0, 1, 1], [0, 1, 0]], dtype=torch.float32)  # 0/1 float mask
    return logp, ref, mask


LRS = [0.5, -0.3, 1.0]


@pytest.mark.parametrize(
    "est, kl_of, dkl_of",  # per-token KL value and d/dlogp as functions of lr = ref - logp
    [
        ("k1", lambda lr: -lr, lambda lr: 1.0),
        ("k2", lambda lr: 0.5 * lr * lr, lambda lr: -lr),
        ("k3", lambda lr: math.exp(lr) - 1 - lr, lambda lr: 1.0 - math.exp(lr)),
    ],
)
def test_grpo_kl_estimators(est, kl_of, dkl_of):
    logp, ref, mask = _kl_batch()
    # r = 1 and A = 0: the policy-gradient term is exactly 0, leaving kl_coef * mean KL.
    behav, adv = logp.detach().clone(), torch.zeros(2, dtype=F64)
    loss_fn = GRPOLoss(kl_coef=0.5, kl_estimator=est)
    assert loss_fn.needs_ref_logp
    out = loss_fn(logp, behav, None, adv, mask, ref_logp=ref)
    kl_vals = [kl_of(lr) for lr in LRS]
    assert out.metrics["kl_ref"] == pytest.approx(sum(kl_vals) / 3)
    assert out.loss.item() == pytest.approx(0.5 * sum(kl_vals) / 3)
    (grad,) = torch.autograd.grad(out.loss, logp)
    want = [[0.0, 0.5 * dkl_of(0.5) / 3, 0.5 * dkl_of(-0.3) / 3], [0.0, 0.5 * dkl_of(1.0) / 3, 0.0]]
    for got_row, want_row in zip(grad.tolist(), want):
        assert got_row == pytest.approx(want_row, abs=1e-12)


def test_grpo_kl_adds_to_pg_loss():
    logp, behav, adv, mask = _grpo_batch()
    ref = behav.clone()  # lr = behav - logp = -log r on every generated token
    out = GRPOLoss(kl_coef=0.1, kl_estimator="k1")(logp, behav, None, adv, mask, ref_logp=ref)
    k1_sum = 0.0
    for r in R0 + R1:
        k1_sum += math.log(r)  # k1 = -lr = log r
    assert out.loss.item() == pytest.approx((-1.4 + 0.1 * k1_sum) / 7)


def test_aggregate_skips_empty_sequences_and_offmask_garbage():
    per_token = torch.tensor([[1.0, 2.0, INF], [NAN, NAN, NAN], [3.0, -INF, 0.0]])
    mask = torch.tensor([[1, 1, 0], [0, 0, 0], [1, 0, 0]])
    assert aggregate(per_token, mask, "token-mean").item() == pytest.approx((1 + 2 + 3) / 3)
    # the empty middle row is excluded from the mean over sequences
    assert aggregate(per_token, mask, "seq-mean").item() == pytest.approx((1.5 + 3.0) / 2)
    assert aggregate(per_token, mask, "seq-sum").item() == pytest.approx((3.0 + 3.0) / 2)
    empty = torch.zeros_like(mask)
    for mode in ("token-mean", "seq-mean", "seq-sum"):
        assert aggregate(per_token, empty, mode).item() == 0.0
    with pytest.raises(ValueError, match="token-mean"):
        aggregate(per_token, mask, "mean")


def test_grpo_empty_row_gives_finite_loss_and_grad():
    logp, behav, adv, _ = _grpo_batch()
    mask = torch.tensor([[0, 1, 1, 1, 0], [0, 0, 0, 0, 0]], dtype=torch.bool)
    out = GRPOLoss(aggregation="seq-mean")(logp, behav, None, adv, mask)
    assert out.loss.item() == pytest.approx((-2.4 - 2.2 - 1.0) / 3)  # only row 0 counts
    (grad,) = torch.autograd.grad(out.loss, logp)
    assert torch.isfinite(grad).all() and grad[1].abs().sum().item() == 0.0


@pytest.mark.parametrize(
    "bad, name",
    [
        ({"behav_logp": torch.zeros(2, 4)}, "behav_logp"),
        ({"prox_logp": torch.zeros(5, 2)}, "prox_logp"),
        ({"advantages": torch.zeros(3)}, "advantages"),
        ({"mask": torch.ones(2, 5, 1)}, "mask"),
        ({"ref_logp": torch.zeros(2, 6)}, "ref_logp"),
        ({"logp": torch.zeros(10)}, "logp"),
    ],
)
def test_grpo_shape_errors_name_the_tensor(bad, name):
    args = {
        "logp": torch.zeros(2, 5),
        "behav_logp": torch.zeros(2, 5),
        "prox_logp": None,
        "advantages": torch.zeros(2),
        "mask": torch.ones(2, 5),
        "ref_logp": None,
    }
    args.update(bad)
    with pytest.raises(ValueError, match=re.escape(name) + ".*" + re.escape(str(tuple(bad[name].shape)))):
        GRPOLoss()(**args)


def test_missing_ref_logp_errors():
    logp, behav, adv, mask = _grpo_batch()
    with pytest.raises(ValueError, match="ref_logp"):
        GRPOLoss(kl_coef=0.1)(logp, behav, None, adv, mask)
    assert not GRPOLoss().needs_ref_logp
    with pytest.raises(ValueError, match="ref_logp"):
        SFTLoss(loss_function="minor_sft")(logp, None, None, None, mask)
    with pytest.raises(ValueError, match="ref_logp"):
        SFTLoss(kl_to_ref_coeff=0.1)(logp, None, None, None, mask)


def test_bad_constructor_args():
    with pytest.raises(ValueError, match="aggregation"):
        GRPOLoss(aggregation="mean")
    with pytest.raises(ValueError, match="kl_estimator"):
        GRPOLoss(kl_estimator="k4")
    with pytest.raises(ValueError, match="loss_function"):
        SFTLoss(loss_function="dpo")


# ---------------------------------------------------------------- SFT (B=2, T=5)
# Row 0: 3 target tokens logp -1, -2, -0.5 (sum -3.5); row 1: 2 target tokens -3, -1 (sum -4).
def _sft_batch():
    logp = torch.tensor(
        [[NAN, -1.0, -2.0, -0.5, 9.0], [0.0, -3.0, -1.0, 0.0, 0.0]], dtype=F64, requires_grad=True
    )
    ref = torch.tensor([[100.0, -1.5, -2.0, -1.0, 100.0], [100.0, -2.0, -1.5, 100.0, 100.0]], dtype=F64)
    mask = torch.tensor([[0, 1, 1, 1, 0], [0, 1, 1, 0, 0]], dtype=torch.bool)
    return logp, ref, mask


@pytest.mark.parametrize(
    "mode, expected",
    [
        ("token-mean", (1 + 2 + 0.5 + 3 + 1) / 5),
        ("seq-mean", ((1 + 2 + 0.5) / 3 + (3 + 1) / 2) / 2),
        ("seq-sum", ((1 + 2 + 0.5) + (3 + 1)) / 2),
    ],
)
def test_sft_nll(mode, expected):
    logp, _, mask = _sft_batch()
    out = SFTLoss(aggregation=mode)(logp, None, None, None, mask)
    assert out.loss.item() == pytest.approx(expected)
    assert out.metrics["nll"] == pytest.approx(7.5 / 5)
    if mode == "token-mean":
        (grad,) = torch.autograd.grad(out.loss, logp)
        want = [[0.0, -0.2, -0.2, -0.2, 0.0], [0.0, -0.2, -0.2, 0.0, 0.0]]
        for got_row, want_row in zip(grad.tolist(), want):
            assert got_row == pytest.approx(want_row)


def test_minor_sft_unnormalised_value_and_grad():
    logp, ref, mask = _sft_batch()
    loss_fn = SFTLoss(loss_function="minor_sft", beta=0.1, normalize_by_seq_length=False)
    out = loss_fn(logp, None, None, None, mask, ref_logp=ref)
    # row0: sum logp -3.5, sum ref -4.5 -> x = 0.1 * 1.0;   -logsigmoid(x) = log(1 + e^-x)
    # row1: sum logp -4.0, sum ref -3.5 -> x = 0.1 * -0.5
    x0, x1 = 0.1, -0.05
    assert out.loss.item() == pytest.approx((math.log(1 + math.exp(-x0)) + math.log(1 + math.exp(-x1))) / 2)
    # d/dlogp_t = -beta * sigmoid(-x) / 2 (mean over 2 sequences) for each target token
    g0, g1 = -0.1 / (1 + math.exp(x0)) / 2, -0.1 / (1 + math.exp(x1)) / 2
    (grad,) = torch.autograd.grad(out.loss, logp)
    want = [[0.0, g0, g0, g0, 0.0], [0.0, g1, g1, 0.0, 0.0]]
    for got_row, want_row in zip(grad.tolist(), want):
        assert got_row == pytest.approx(want_row)


def test_minor_sft_length_normalised_by_default_value_and_grad():
    logp, ref, mask = _sft_batch()
    loss_fn = SFTLoss(loss_function="minor_sft", beta=0.1)
    assert loss_fn.normalize_by_seq_length  # TorchRL's default
    out = loss_fn(logp, None, None, None, mask, ref_logp=ref)
    # row0: (sum logp - sum ref) / |y| = (-3.5 + 4.5) / 3 -> x0 = 0.1 / 3
    # row1: (-4.0 + 3.5) / 2 = -0.25                     -> x1 = -0.025
    x0, x1 = 0.1 / 3, -0.025
    assert out.loss.item() == pytest.approx((math.log(1 + math.exp(-x0)) + math.log(1 + math.exp(-x1))) / 2)
    # d/dlogp_t = -beta * sigmoid(-x_i) / |y_i| / 2 (mean over 2 sequences)
    g0, g1 = -0.1 / (1 + math.exp(x0)) / 3 / 2, -0.1 / (1 + math.exp(x1)) / 2 / 2
    (grad,) = torch.autograd.grad(out.loss, logp)
    want = [[0.0, g0, g0, g0, 0.0], [0.0, g1, g1, 0.0, 0.0]]
    for got_row, want_row in zip(grad.tolist(), want):
        assert got_row == pytest.approx(want_row, abs=1e-15)
    # reported, not trained: k3(logp, ref) on the 5 target tokens (lr = ref - logp)
    k3 = sum(math.exp(lr) - 1 - lr for lr in [-0.5, 0.0, -0.5, 1.0, -0.5])
    assert out.metrics["kl_ref"] == pytest.approx(k3 / 5)
    # minor_sft averages over the non-empty rows, whatever `aggregation` says
    empty_row = torch.tensor([[0, 1, 1, 1, 0], [0, 0, 0, 0, 0]], dtype=torch.bool)
    assert loss_fn.normalizer(empty_row) == 1.0 and SFTLoss().normalizer(empty_row) == 3.0
    with pytest.raises(ValueError, match="kl_to_ref_coeff.*minor_sft"):
        SFTLoss(loss_function="minor_sft", kl_to_ref_coeff=0.1)


def test_sft_with_kl_to_ref():
    logp, ref, mask = _sft_batch()
    out = SFTLoss(kl_to_ref_coeff=0.2)(logp, None, None, None, mask, ref_logp=ref)
    k3 = 0.0
    for lr in [-0.5, 0.0, -0.5, 1.0, -0.5]:  # ref - logp on the 5 target tokens
        k3 += math.exp(lr) - 1 - lr
    assert out.metrics["kl_ref"] == pytest.approx(k3 / 5)
    assert out.loss.item() == pytest.approx(1.5 + 0.2 * k3 / 5)


# ---------------------------------------------------------------- advantages
# groups (non-contiguous, interleaved ids): 7 -> idx 0,2,5 rewards 1,1,4 (mean 2, var 6/3 = 2)
#                                          3 -> idx 1,3,6 rewards 0,2,4 (mean 2, var 8/3)
#                                  1_000_000_007 -> idx 4, reward 5 (singleton)
REWARDS = [1.0, 0.0, 1.0, 2.0, 5.0, 4.0, 4.0]
GIDS = [7, 3, 7, 3, 1_000_000_007, 7, 3]
EPS = 1e-6
S7, S3 = math.sqrt(2.0) + EPS, math.sqrt(8 / 3) + EPS


def _adv(**kw):
    return group_advantages(torch.tensor(REWARDS), torch.tensor(GIDS), **kw).tolist()


def test_group_advantages_mean_only():
    assert _adv(std=False) == pytest.approx([-1.0, -2.0, -1.0, 0.0, 0.0, 2.0, 2.0])


def test_group_advantages_mean_and_std():
    want = [-1 / S7, -2 / S3, -1 / S7, 0.0, 0.0, 2 / S7, 2 / S3]
    assert _adv() == pytest.approx(want, rel=1e-6)


def test_group_advantages_leave_one_out():
    # idx0: 1 - mean(1, 4) = -1.5; idx2 same; idx5: 4 - mean(1, 1) = 3
    # idx1: 0 - mean(2, 4) = -3;  idx3: 2 - mean(0, 4) = 0; idx6: 4 - mean(0, 2) = 3; singleton -> 0
    want = [-1.5, -3.0, -1.5, 0.0, 0.0, 3.0, 3.0]
    assert _adv(std=False, leave_one_out=True) == pytest.approx(want)
    want_std = [-1.5 / S7, -3.0 / S3, -1.5 / S7, 0.0, 0.0, 3.0 / S7, 3.0 / S3]
    assert _adv(leave_one_out=True) == pytest.approx(want_std, rel=1e-6)


def test_group_advantages_std_only():
    keep = [0, 1, 2, 3, 5, 6]  # drop the singleton (std 0 would give r / eps)
    got = group_advantages(torch.tensor([REWARDS[i] for i in keep]), torch.tensor([GIDS[i] for i in keep]), mean=False)
    assert got.tolist() == pytest.approx([1 / S7, 0.0, 1 / S7, 2 / S3, 4 / S7, 4 / S3], rel=1e-6)


def test_group_advantages_unbiased_std_value_and_grad():
    # Bessel's correction: group 7 (1, 1, 4) squared deviations 6 -> var 6/2 = 3;
    # group 3 (0, 2, 4) squared deviations 8 -> var 8/2 = 4, std 2; the singleton keeps std 0.
    u7, u3 = math.sqrt(3.0) + EPS, 2.0 + EPS
    want = [-1 / u7, -2 / u3, -1 / u7, 0.0, 0.0, 2 / u7, 2 / u3]
    got = _adv(std_estimator="unbiased")  # float32 rewards -> float32 advantages
    assert got == pytest.approx(want, rel=1e-6)
    # unbiased std = population std * sqrt(G / (G - 1)): advantages shrink by sqrt(2/3) at G = 3
    assert got[5] / _adv()[5] == pytest.approx(math.sqrt(2 / 3), rel=1e-6)
    # G = 8, rewards six 0s and two 1s: population std sqrt(3/16), unbiased sqrt(3/14); ratio 1.069
    r8 = torch.tensor([0.0] * 6 + [1.0] * 2, dtype=F64)
    pop = group_advantages(r8, torch.zeros(8, dtype=torch.long), eps=0.0)
    unb = group_advantages(r8, torch.zeros(8, dtype=torch.long), eps=0.0, std_estimator="unbiased")
    assert float(unb[7]) == pytest.approx(0.75 / math.sqrt(3 / 14), rel=1e-12)
    assert float(pop[7] / unb[7]) == pytest.approx(math.sqrt(8 / 7), rel=1e-12)
    assert math.sqrt(8 / 7) == pytest.approx(1.069, abs=1e-3)
    # gradient: one token per row at ratio 1 (no clip) -> token-mean loss -mean_i A_i, d/dlogp_i = -A_i / 8
    logp = torch.zeros(8, 2, dtype=F64, requires_grad=True)
    mask = torch.tensor([[0, 1]] * 8, dtype=torch.bool)
    out = GRPOLoss()(logp, logp.detach(), None, unb, mask)
    (grad,) = torch.autograd.grad(out.loss, logp)
    s14 = math.sqrt(3 / 14)
    assert grad[:, 1].tolist() == pytest.approx([0.25 / s14 / 8] * 6 + [-0.75 / s14 / 8] * 2, rel=1e-12)
    # global: rewards 1, 2, 3, 6 -> squared deviations 14, unbiased var 14/3
    s = math.sqrt(14 / 3) + EPS
    r = torch.tensor([1.0, 2.0, 3.0, 6.0])
    want_global = [-2 / s, -1 / s, 0.0, 3 / s]
    assert global_advantages(r, std_estimator="unbiased").tolist() == pytest.approx(want_global, rel=1e-6)
    cfg = AdvantageConfig(std_estimator="unbiased")
    assert compute_advantages(torch.tensor(REWARDS), torch.tensor(GIDS), cfg).tolist() == pytest.approx(want, rel=1e-6)
    with pytest.raises(ValueError, match="std_estimator"):
        AdvantageConfig(std_estimator="bessel")
    with pytest.raises(ValueError, match="std_estimator"):
        _adv(std_estimator="sample")


def test_group_advantages_errors():
    with pytest.raises(ValueError, match="group_ids"):
        group_advantages(torch.zeros(3), torch.zeros(4, dtype=torch.long))
    with pytest.raises(ValueError, match="integer"):
        group_advantages(torch.zeros(3), torch.zeros(3))


def test_global_advantages():
    r = torch.tensor([1.0, 2.0, 3.0, 6.0])  # mean 3, population var (4 + 1 + 0 + 9) / 4 = 3.5
    s = math.sqrt(3.5) + EPS
    assert global_advantages(r).tolist() == pytest.approx([-2 / s, -1 / s, 0.0, 3 / s], rel=1e-6)
    assert global_advantages(r, std=False).tolist() == pytest.approx([-2.0, -1.0, 0.0, 3.0])
    assert global_advantages(r, mean=False).tolist() == pytest.approx([1 / s, 2 / s, 3 / s, 6 / s], rel=1e-6)


def test_masked_normalize():
    values = torch.tensor([[1.0, 2.0, 9.0], [3.0, 100.0, NAN]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    s = math.sqrt(2 / 3) + 1e-5  # masked values 1, 2, 3: mean 2, population var 2/3
    out = masked_normalize(values, mask, eps=1e-5)
    assert out.tolist()[0] == pytest.approx([-1 / s, 0.0, 0.0])
    assert out.tolist()[1] == pytest.approx([1 / s, 0.0, 0.0])


def test_compute_advantages_modes():
    r, g = torch.tensor(REWARDS), torch.tensor(GIDS)
    loo = compute_advantages(r, g, AdvantageConfig(std=False, leave_one_out=True))
    assert loo.tolist() == pytest.approx([-1.5, -3.0, -1.5, 0.0, 0.0, 3.0, 3.0])
    glob = compute_advantages(r, None, AdvantageConfig(mode="global", std=False))
    assert glob.tolist() == pytest.approx([x - 17 / 7 for x in REWARDS])
    assert compute_advantages(r, None, AdvantageConfig(mode="none")).tolist() == REWARDS
    with pytest.raises(ValueError, match="group_ids"):
        compute_advantages(r, None, AdvantageConfig())
    with pytest.raises(ValueError, match="mode"):
        AdvantageConfig(mode="batch")


# ---------------------------------------------------------------- registry
def test_make_loss():
    assert set(LOSSES) >= {"grpo", "sft", "dapo", "dr_grpo", "cispo", "ppo_decoupled"}
    loss = make_loss("grpo", clip_eps_high=0.28, kl_coef=0.01)
    assert isinstance(loss, GRPOLoss) and loss.clip_eps_high == 0.28 and loss.needs_ref_logp
    sft = make_loss("sft", loss_function="minor_sft")
    assert isinstance(sft, SFTLoss) and sft.needs_ref_logp
    with pytest.raises(ValueError, match=r"ppo.*grpo.*sft"):
        make_loss("ppo")
