"""DAPO, Dr.GRPO, CISPO, decoupled PPO, truncated IS and GSPO: values and gradients vs hand math.

Every expectation is derived in plain Python from the formulas in the loss docstrings; the
tensors only go through the loss under test.
"""
from __future__ import annotations

import math

import pytest
import torch

from rayllm_rl.objectives import (
    LOSSES, CISPOLoss, DAPOLoss, DecoupledPPOLoss, DrGRPOLoss, GRPOLoss, GRPOTISLoss, TruncatedIS, aggregate,
    loglinear_prox_logp, make_loss, overlong_reward_shaping,
)

NAN, INF = float("nan"), float("inf")
F64 = torch.float64
lg = math.log

# ---------------------------------------------------------------- shared fixture (B=2, T=5)
# Row 0: prompt t0, 3 generated tokens (t1..t3), pad t4; A=+2.  Row 1: prompt t0, 4 tokens; A=-1.
# old (behav or prox) = -1 on generated tokens; logp = -1 + log(r). Garbage off-mask.
R = [[1.5, 1.1, 0.5], [0.5, 1.5, 0.9, 1.0]]
A = [2.0, -1.0]
MASK = [[0, 1, 1, 1, 0], [0, 1, 1, 1, 1]]
N_TOK = 7


def _batch(ratios=R):
    logp = torch.tensor(
        [
            [30.0] + [-1 + lg(r) for r in ratios[0]] + [-INF],
            [NAN] + [-1 + lg(r) for r in ratios[1]],
        ],
        dtype=F64,
        requires_grad=True,
    )
    old = torch.tensor([[0.0, -1, -1, -1, 0.0], [0.0, -1, -1, -1, -1]], dtype=F64)
    adv = torch.tensor(A, dtype=F64)
    mask = torch.tensor(MASK, dtype=torch.bool)
    return logp, old, adv, mask


def _ppo(r, a, eps_low, eps_high):
    """PPO-clip per token in plain Python: (loss, d loss / d logp). d r / d logp = r."""
    c = min(max(r, 1 - eps_low), 1 + eps_high)
    if r * a <= c * a:  # unclipped branch is the min
        return -r * a, -a * r
    return -c * a, 0.0


def _pad(rows_vals):
    """Place per-generated-token values at their [B, T] positions (0 elsewhere)."""
    return [[0.0] + rows_vals[0] + [0.0], [0.0] + rows_vals[1]]


def _grad(loss, logp):
    (g,) = torch.autograd.grad(loss, logp)
    assert torch.isfinite(g).all()
    return g.tolist()


def _assert_rows(got, want):
    for got_row, want_row in zip(got, want):
        assert got_row == pytest.approx(want_row, abs=1e-12)


def _off(ratio_rows_logs):
    """Row-wise behaviour logprob offsets: behav = prox - d (so exp(prox - behav) = exp(d))."""
    return torch.tensor(_pad(ratio_rows_logs), dtype=F64)


# ---------------------------------------------------------------- DAPO
def test_dapo_defaults_value_and_grad():
    loss_fn = DAPOLoss()
    assert (loss_fn.clip_eps_low, loss_fn.clip_eps_high) == (0.2, 0.28)
    assert loss_fn.aggregation == "token-mean" and loss_fn.kl_coef == 0.0 and not loss_fn.needs_ref_logp
    assert not loss_fn.needs_prox_logp
    # clip range [0.8, 1.28]: row0 r=1.5, A=+2 -> clipped high at 1.28 (-2.56, zero grad);
    # row1 r=0.5, A=-1 -> clipped low at 0.8 (+0.8, zero grad); row1 r=1.5, A<0 -> unclipped.
    vals = [[-2.56, -2.2, -1.0], [0.8, 1.5, 0.9, 1.0]]
    grads = [[0.0, -2.2, -1.0], [0.0, 1.5, 0.9, 1.0]]
    for i in range(2):
        for j, r in enumerate(R[i]):
            v, g = _ppo(r, A[i], 0.2, 0.28)
            assert v == pytest.approx(vals[i][j]) and g == pytest.approx(grads[i][j])
    logp, old, adv, mask = _batch()
    out = loss_fn(logp, old, None, adv, mask)
    assert out.loss.item() == pytest.approx(sum(vals[0] + vals[1]) / N_TOK, abs=1e-12)
    assert out.loss.item() == pytest.approx(-1.56 / 7, abs=1e-12)
    _assert_rows(_grad(out.loss, logp), _pad([[g / N_TOK for g in grads[0]], [g / N_TOK for g in grads[1]]]))
    assert out.metrics["clip_fraction_high"] == pytest.approx(1 / 7)
    assert out.metrics["clip_fraction_low"] == pytest.approx(1 / 7)
    for k in ("clip_fraction", "approx_kl", "ess", "entropy_proxy", "loss"):
        assert k in out.metrics
    # DAPO drops the KL term: no kl_coef argument at all.
    with pytest.raises(TypeError):
        DAPOLoss(kl_coef=0.1)


def test_overlong_reward_shaping_values():
    # max_len=10, cache_len=4 -> window starts after 6 tokens; -(L-6)/4 inside, -1 beyond 10.
    lengths = torch.tensor([3, 6, 7, 8, 10, 11, 40])
    got = overlong_reward_shaping(lengths, max_len=10, cache_len=4)
    assert got.tolist() == pytest.approx([0.0, 0.0, -0.25, -0.5, -1.0, -1.0, -1.0])
    got = overlong_reward_shaping(lengths, max_len=10, cache_len=4, penalty=0.5)
    assert got.tolist() == pytest.approx([0.0, 0.0, -0.125, -0.25, -0.5, -0.5, -0.5])
    with pytest.raises(ValueError, match="cache_len"):
        overlong_reward_shaping(lengths, max_len=10, cache_len=0)


# ---------------------------------------------------------------- Dr.GRPO
def test_dr_grpo_constant_normaliser_value_and_grad():
    loss_fn = DrGRPOLoss(max_tokens=10)
    assert loss_fn.aggregation == "constant"
    vals, grads = [[], []], [[], []]
    for i in range(2):
        for r in R[i]:
            v, g = _ppo(r, A[i], 0.2, 0.2)
            vals[i].append(v)
            grads[i].append(g)
    denom = 2 * 10  # B * max_tokens, whatever the lengths (3 and 4 tokens)
    logp, old, adv, mask = _batch()
    out = loss_fn(logp, old, None, adv, mask)
    assert out.loss.item() == pytest.approx(sum(vals[0] + vals[1]) / denom, abs=1e-12)
    assert out.loss.item() == pytest.approx((-2.4 - 2.2 - 1.0 + 0.8 + 1.5 + 0.9 + 1.0) / 20, abs=1e-12)
    _assert_rows(_grad(out.loss, logp), _pad([[g / denom for g in grads[0]], [g / denom for g in grads[1]]]))


def test_dr_grpo_normaliser_independent_of_lengths():
    # Drop row1's last token (r=1.0, A=-1, loss +1.0): Dr.GRPO's loss falls by exactly 1.0/20 and
    # row0's gradients do not move; token-mean would renormalise by 6 instead of 7.
    logp, old, adv, mask = _batch()
    short = mask.clone()
    short[1, 4] = False
    dr = DrGRPOLoss(max_tokens=10)
    full, cut = dr(logp, old, None, adv, mask), dr(logp, old, None, adv, short)
    assert full.loss.item() - cut.loss.item() == pytest.approx(1.0 / 20, abs=1e-12)
    g_full, g_cut = _grad(full.loss, logp), _grad(cut.loss, logp)
    assert g_full[0] == pytest.approx(g_cut[0], abs=1e-15)
    assert g_cut[0][2] == pytest.approx(-2.2 / 20)
    tm = GRPOLoss()
    assert _grad(tm(logp, old, None, adv, short).loss, logp)[0][2] == pytest.approx(-2.2 / 6)


def test_dr_grpo_microbatch_weighting_by_rows_matches_full_batch():
    # The learner weights Dr.GRPO's micro-batches by rows (normalizer = B, empty rows included):
    # sum_k (B_k/B) * loss_k == full loss.
    logp, old, adv, mask = _batch()
    dr = DrGRPOLoss(max_tokens=10)
    assert dr.normalizer(mask) == 2.0 and dr.normalizer(torch.zeros_like(mask)) == 2.0
    full = dr(logp, old, None, adv, mask).loss.item()
    parts = [dr(logp[i:i + 1], old[i:i + 1], None, adv[i:i + 1], mask[i:i + 1]).loss.item() * 0.5 for i in range(2)]
    assert sum(parts) == pytest.approx(full, abs=1e-12)
    with pytest.raises(ValueError, match="max_tokens"):
        aggregate(torch.zeros(2, 3), torch.ones(2, 3), "constant")


# ---------------------------------------------------------------- dual-clip (verl's clip_ratio_c)
def _dual(r, a, eps_low, eps_high, c):
    """verl's dual-clip per token in plain Python: (loss, d loss / d logp)."""
    v, g = _ppo(r, a, eps_low, eps_high)
    if a < 0 and v > -c * a:  # capped at c * |A|: constant, no gradient
        return -c * a, 0.0
    return v, g


def test_dual_clip_caps_negative_advantage_tokens_value_and_grad():
    # Row 0 (A=+2) ratios 4.0, 1.1, 0.5: r=4 > c but A > 0 -> only the usual clip (1.2 * 2 = 2.4).
    # Row 1 (A=-1) ratios 0.5, 4.0, 0.9, 2.5 with c=3:
    #   r=0.5 -> clipped low to 0.8 (grad 0); r=4.0 -> PPO gives 4.0 > 3 -> capped at 3.0 (grad 0);
    #   r=0.9 -> 0.9 (grad -A*r = 0.9);     r=2.5 -> 2.5 < 3 -> unchanged (grad 2.5).
    ratios = [[4.0, 1.1, 0.5], [0.5, 4.0, 0.9, 2.5]]
    vals = [[-2.4, -2.2, -1.0], [0.8, 3.0, 0.9, 2.5]]
    grads = [[0.0, -2.2, -1.0], [0.0, 0.0, 0.9, 2.5]]
    for i in range(2):
        for j, r in enumerate(ratios[i]):
            v, g = _dual(r, A[i], 0.2, 0.2, 3.0)
            assert v == pytest.approx(vals[i][j]) and g == pytest.approx(grads[i][j])
    logp, old, adv, mask = _batch(ratios)
    loss_fn = GRPOLoss(clip_ratio_c=3.0)
    out = loss_fn(logp, old, None, adv, mask)
    assert out.loss.item() == pytest.approx(1.6 / 7, abs=1e-12)  # -2.4 - 2.2 - 1 + 0.8 + 3 + 0.9 + 2.5
    _assert_rows(_grad(out.loss, logp), _pad([[g / N_TOK for g in grads[0]], [g / N_TOK for g in grads[1]]]))
    assert out.metrics["clip_fraction_dual"] == pytest.approx(1 / 7)
    # Off by default: the r=4, A=-1 token costs 4.0 and pushes its gradient (-A*r = 4) through.
    logp, old, adv, mask = _batch(ratios)
    plain = GRPOLoss()(logp, old, None, adv, mask)
    assert plain.loss.item() == pytest.approx(2.6 / 7, abs=1e-12) and "clip_fraction_dual" not in plain.metrics
    assert _grad(plain.loss, logp)[1][2] == pytest.approx(4.0 / 7)
    # The same field reaches the PPO-clip family (DAPO clip-higher 0.28 does not change row 1 here)
    for name in ("dapo", "ppo_decoupled", "grpo_tis"):
        logp, old, adv, mask = _batch(ratios)
        got = make_loss(name, clip_ratio_c=3.0)(logp, old, old, adv, mask)
        assert got.metrics["clip_fraction_dual"] == pytest.approx(1 / 7), name
        assert _grad(got.loss, logp)[1][2] == 0.0, name
    for bad in (1.0, 0.5):
        with pytest.raises(ValueError, match="clip_ratio_c"):
            GRPOLoss(clip_ratio_c=bad)


# ---------------------------------------------------------------- CISPO
def test_cispo_value_and_grad_no_lower_bound():
    loss_fn = CISPOLoss()
    assert loss_fn.clip_eps_low is None and loss_fn.clip_eps_high == 0.28
    # weight = sg(min(r, 1.28)); loss_t = -w * A * logp_t; grad_t = -w * A / 7 (never 0).
    w = [[1.28, 1.1, 0.5], [0.5, 1.28, 0.9, 1.0]]
    logps = [[-1 + lg(r) for r in row] for row in R]
    vals = [[-w[i][j] * A[i] * logps[i][j] for j in range(len(R[i]))] for i in range(2)]
    grads = [[-w[i][j] * A[i] / N_TOK for j in range(len(R[i]))] for i in range(2)]
    logp, old, adv, mask = _batch()
    out = loss_fn(logp, old, None, adv, mask)
    assert out.loss.item() == pytest.approx(sum(vals[0] + vals[1]) / N_TOK, abs=1e-12)
    g = _grad(out.loss, logp)
    _assert_rows(g, _pad(grads))
    # The clipped token (row0 t1, r=1.5 > 1.28, A>0) still gets gradient -1.28 * 2 / 7.
    assert g[0][1] == pytest.approx(-2.56 / 7) and g[0][1] != 0.0
    assert out.metrics["clip_fraction_high"] == pytest.approx(2 / 7)  # the two r=1.5 tokens
    assert out.metrics["clip_fraction_low"] == 0.0


def test_cispo_with_lower_bound():
    # eps_low=0.2: the two r=0.5 tokens get weight 0.8; row1 t1 (A=-1) grad = +0.8/7, not 0.
    w = [[1.28, 1.1, 0.8], [0.8, 1.28, 0.9, 1.0]]
    grads = [[-w[i][j] * A[i] / N_TOK for j in range(len(R[i]))] for i in range(2)]
    logp, old, adv, mask = _batch()
    out = CISPOLoss(clip_eps_low=0.2)(logp, old, None, adv, mask)
    logps = [[-1 + lg(r) for r in row] for row in R]
    want = sum(-w[i][j] * A[i] * logps[i][j] for i in range(2) for j in range(len(R[i]))) / N_TOK
    assert out.loss.item() == pytest.approx(want, abs=1e-12)
    g = _grad(out.loss, logp)
    _assert_rows(g, _pad(grads))
    assert g[1][1] == pytest.approx(0.8 / 7)
    assert out.metrics["clip_fraction_low"] == pytest.approx(2 / 7)
    assert out.metrics["clip_fraction"] == pytest.approx(4 / 7)


# ---------------------------------------------------------------- decoupled PPO
# Raw behaviour weights exp(prox - behav): row0 [1, 2, 8], row1 [0.5, 1, 1, 6]; cap 5.
W_RAW = [[1.0, 2.0, 8.0], [0.5, 1.0, 1.0, 6.0]]
PG = [[-2.4, -2.2, -1.0], [0.8, 1.5, 0.9, 1.0]]  # PPO-clip eps 0.2 vs prox (see test_objectives)
PG_GRAD = [[0.0, -2.2, -1.0], [0.0, 1.5, 0.9, 1.0]]


def _assert_weighted_pg(out, logp, weights, weight_metrics, capped_frac):
    """`out` is the token-mean of `weights * PG` on the fixture batch: value, gradient (PG_GRAD
    scaled by the weights), the two weight metrics (names `weight_metrics`) and GRPO's clip
    fraction of the ratio vs prox."""
    want = sum(weights[i][j] * PG[i][j] for i in range(2) for j in range(len(PG[i]))) / N_TOK
    assert out.loss.item() == pytest.approx(want, abs=1e-12)
    grads = [[weights[i][j] * PG_GRAD[i][j] / N_TOK for j in range(len(PG[i]))] for i in range(2)]
    _assert_rows(_grad(out.loss, logp), _pad(grads))
    mean_key, capped_key = weight_metrics
    assert out.metrics[mean_key] == pytest.approx(sum(weights[0] + weights[1]) / N_TOK)
    assert out.metrics[capped_key] == pytest.approx(capped_frac)
    assert out.metrics["clip_fraction_high"] == pytest.approx(1 / 7)  # ratio vs prox, as in GRPO


def _decoupled_inputs():
    logp, prox, adv, mask = _batch()
    behav = prox - _off([[lg(w) for w in W_RAW[0]], [lg(w) for w in W_RAW[1]]])
    return logp, behav, prox, adv, mask


@pytest.mark.parametrize(
    "mode, weights, capped_frac",
    [
        ("cap", [[1.0, 2.0, 5.0], [0.5, 1.0, 1.0, 5.0]], 2 / 7),
        ("mask", [[1.0, 2.0, 0.0], [0.5, 1.0, 1.0, 0.0]], 2 / 7),
    ],
)
def test_decoupled_ppo_value_grad_and_cap(mode, weights, capped_frac):
    loss_fn = DecoupledPPOLoss(behav_weight_mode=mode)
    assert loss_fn.needs_prox_logp and loss_fn.behav_weight_cap == 5.0
    logp, behav, prox, adv, mask = _decoupled_inputs()
    out = loss_fn(logp, behav, prox, adv, mask)
    _assert_weighted_pg(out, logp, weights, ("behav_weight_mean", "behav_weight_capped_fraction"), capped_frac)


def test_decoupled_ppo_behaviour_weight_matters_and_prox_required():
    logp, behav, prox, adv, mask = _decoupled_inputs()
    loss_fn = DecoupledPPOLoss()
    same = loss_fn(logp, prox, prox, adv, mask)  # behav == prox -> w = 1 -> plain GRPO vs prox
    assert same.loss.item() == pytest.approx(-0.2, abs=1e-12)
    assert same.metrics["behav_weight_mean"] == pytest.approx(1.0)
    diff = loss_fn(logp, behav, prox, adv, mask)
    assert diff.loss.item() != pytest.approx(-0.2, abs=1e-3)
    # A raised cap lets the 8 and 6 weights through.
    wide = DecoupledPPOLoss(behav_weight_cap=10.0)(logp, behav, prox, adv, mask)
    want = sum(W_RAW[i][j] * PG[i][j] for i in range(2) for j in range(len(PG[i]))) / N_TOK
    assert wide.loss.item() == pytest.approx(want, abs=1e-12)
    assert wide.metrics["behav_weight_capped_fraction"] == 0.0
    with pytest.raises(ValueError, match="prox_logp"):
        loss_fn(logp, behav, None, adv, mask)
    with pytest.raises(ValueError, match="behav_weight_mode"):
        DecoupledPPOLoss(behav_weight_mode="clip")


@pytest.mark.parametrize(
    "mode, tis_mode, weights",
    [
        ("cap", "truncate", [[0.0, 1.0, 2.0, 5.0, 0.0], [0.0, 0.5, 1.0, 1.0, 5.0]]),
        ("mask", "mask", [[0.0, 1.0, 2.0, 0.0, 0.0], [0.0, 0.5, 1.0, 1.0, 0.0]]),
    ],
)
def test_decoupled_ppo_behaviour_weight_is_token_truncated_is(mode, tis_mode, weights):
    # Raw weights W_RAW (cap 5: the 8 and the 6 are over it); off-mask prox - behav = +50 / -50 / NaN,
    # which must neither leak into w nor count as over the cap.
    _, prox, _, mask = _batch()
    behav = prox - _off([[lg(w) for w in W_RAW[0]], [lg(w) for w in W_RAW[1]]])
    behav[0, 0], behav[0, 4], behav[1, 0] = -50.0, 50.0, NAN
    prox.requires_grad_(True)
    behav.requires_grad_(True)
    w, over = DecoupledPPOLoss(behav_weight_mode=mode).weights(prox, behav, mask)
    tis_w, tis_over = TruncatedIS(GRPOLoss(), level="token", mode=tis_mode, cap=5.0).weights(prox, behav, mask)
    assert torch.equal(w, tis_w) and torch.equal(over, tis_over)
    _assert_rows(w.tolist(), weights)
    assert over.tolist() == [[False, False, False, True, False], [False, False, False, False, True]]
    assert w.dtype == F64 and not w.requires_grad and w.grad_fn is None  # detached: no gradient


def test_loglinear_prox_logp_hand_case():
    # current_version 5 -> v_prox = 4; alpha = (4 - v) / (5 - v) for v < 4, else 0.
    behav = torch.tensor([[-2.0, -2.0, -1.0, -3.0]], dtype=F64)
    cur = torch.tensor([[-1.0, -1.0, -3.0, -1.0]], dtype=F64, requires_grad=True)
    versions = torch.tensor([[4, 3, 1, 5]])
    got = loglinear_prox_logp(behav, versions, 5, cur)
    # v=4: alpha 0 -> -2; v=3: alpha 1/2 -> -2 + 0.5*1 = -1.5; v=1: alpha 3/4 -> -1 + 0.75*(-2) = -2.5;
    # v=5: alpha 0 -> -3.
    assert got.tolist() == [pytest.approx([-2.0, -1.5, -2.5, -3.0])]
    assert not got.requires_grad
    with pytest.raises(ValueError, match="shape"):
        loglinear_prox_logp(behav, versions[:, :3], 5, cur)


# ---------------------------------------------------------------- truncated IS
# Raw token weights exp(prox - behav): row0 [1, 1.5, 3], row1 [0.5, 1, 1, 1.2]; cap 2.
# Sequence weights: row0 1*1.5*3 = 4.5, row1 0.5*1*1*1.2 = 0.6.
TIS_RAW = [[1.0, 1.5, 3.0], [0.5, 1.0, 1.0, 1.2]]


@pytest.mark.parametrize(
    "level, mode, weights, capped",
    [
        ("token", "truncate", [[1.0, 1.5, 2.0], [0.5, 1.0, 1.0, 1.2]], 1 / 7),
        ("token", "mask", [[1.0, 1.5, 0.0], [0.5, 1.0, 1.0, 1.2]], 1 / 7),
        ("sequence", "truncate", [[2.0, 2.0, 2.0], [0.6, 0.6, 0.6, 0.6]], 3 / 7),
        ("sequence", "mask", [[0.0, 0.0, 0.0], [0.6, 0.6, 0.6, 0.6]], 3 / 7),
    ],
)
def test_truncated_is_weights_value_and_grad(level, mode, weights, capped):
    logp, prox, adv, mask = _batch()
    behav = prox - _off([[lg(w) for w in TIS_RAW[0]], [lg(w) for w in TIS_RAW[1]]])
    loss_fn = TruncatedIS(GRPOLoss(), level=level, mode=mode, cap=2.0)
    assert loss_fn.needs_prox_logp and loss_fn.aggregation == "token-mean"
    out = loss_fn(logp, behav, prox, adv, mask)
    # The base ratio uses prox, not behav: the clip fractions are the plain GRPO ones.
    _assert_weighted_pg(out, logp, weights, ("tis_weight_mean", "tis_capped_fraction"), capped)


def test_truncated_is_wraps_cispo_and_registry_variant():
    logp, prox, adv, mask = _batch()
    behav = prox - _off([[lg(w) for w in TIS_RAW[0]], [lg(w) for w in TIS_RAW[1]]])
    w = [[1.0, 1.5, 2.0], [0.5, 1.0, 1.0, 1.2]]
    cw = [[1.28, 1.1, 0.5], [0.5, 1.28, 0.9, 1.0]]  # CISPO's own clipped weight vs prox
    out = TruncatedIS(CISPOLoss())(logp, behav, prox, adv, mask)
    grads = [[-w[i][j] * cw[i][j] * A[i] / N_TOK for j in range(len(R[i]))] for i in range(2)]
    _assert_rows(_grad(out.loss, logp), _pad(grads))
    reg = make_loss("grpo_tis", tis_level="sequence", tis_cap=2.0)
    assert isinstance(reg, GRPOTISLoss) and reg.level == "sequence"
    got = reg(logp, behav, prox, adv, mask).loss.item()
    assert got == pytest.approx((2.0 * sum(PG[0]) + 0.6 * sum(PG[1])) / N_TOK, abs=1e-12)
    with pytest.raises(ValueError, match="prox_logp"):
        TruncatedIS(GRPOLoss())(logp, behav, None, adv, mask)
    with pytest.raises(ValueError, match="level"):
        TruncatedIS(GRPOLoss(), level="batch")


# ---------------------------------------------------------------- GSPO (sequence-level ratio)
def test_gspo_sequence_ratio_value_and_grad():
    # B=3, T=5. Per-token log-ratios (logp - old) on masked tokens:
    #   row0 [0.3, 0.1, 0.2]        mean  0.2  -> s0 = e^0.2  = 1.2214, A=+2   -> clipped high
    #   row1 [-0.4, 0.1, -0.2, -0.3] mean -0.2 -> s1 = e^-0.2 = 0.8187, A=-1   -> clipped low
    #   row2 [0.02, -0.04]          mean -0.01 -> s2 = e^-0.01,         A=+1.5 -> unclipped
    # eps_low = eps_high = 0.1 -> clip range [0.9, 1.1]; GSPO default aggregation: seq-mean.
    lrs = [[0.3, 0.1, 0.2], [-0.4, 0.1, -0.2, -0.3], [0.02, -0.04]]
    adv_l = [2.0, -1.0, 1.5]
    logp = torch.tensor(
        [[9.0, -1 + 0.3, -1 + 0.1, -1 + 0.2, -INF],
         [NAN, -1 - 0.4, -1 + 0.1, -1 - 0.2, -1 - 0.3],
         [0.0, -1 + 0.02, -1 - 0.04, 50.0, 50.0]],
        dtype=F64, requires_grad=True,
    )
    old = torch.full((3, 5), -1.0, dtype=F64)
    mask = torch.tensor([[0, 1, 1, 1, 0], [0, 1, 1, 1, 1], [0, 1, 1, 0, 0]], dtype=torch.bool)
    loss_fn = GRPOLoss(clip_eps_low=0.1, clip_eps_high=0.1, ratio_level="sequence")
    assert loss_fn.aggregation == "seq-mean"
    out = loss_fn(logp, old, None, torch.tensor(adv_l, dtype=F64), mask)
    s = [math.exp(sum(row) / len(row)) for row in lrs]
    assert s[0] == pytest.approx(1.2214027581601699) and s[1] == pytest.approx(0.8187307530779818)
    per_seq = [-min(s[0] * 2.0, 1.1 * 2.0), -min(s[1] * -1.0, 0.9 * -1.0), -min(s[2] * 1.5, s[2] * 1.5)]
    assert per_seq[:2] == pytest.approx([-2.2, 0.9])
    assert out.loss.item() == pytest.approx(sum(per_seq) / 3, abs=1e-12)
    # Only row2 is unclipped: d/dlogp_t of (1/3) * (-s2 * A2) = -(1/3) * A2 * s2 / |y2|.
    g2 = -(1 / 3) * 1.5 * s[2] / 2
    _assert_rows(_grad(out.loss, logp), [[0.0] * 5, [0.0] * 5, [0.0, g2, g2, 0.0, 0.0]])
    assert out.metrics["clip_fraction_high"] == pytest.approx(3 / 9)
    assert out.metrics["clip_fraction_low"] == pytest.approx(4 / 9)
    # Token-level ratios differ: row0 t2 (r = e^0.1 < 1.1) is not clipped there.
    tok = GRPOLoss(clip_eps_low=0.1, clip_eps_high=0.1)(logp, old, None, torch.tensor(adv_l, dtype=F64), mask)
    assert tok.loss.item() != pytest.approx(out.loss.item(), abs=1e-3)
    with pytest.raises(ValueError, match="ratio_level"):
        GRPOLoss(ratio_level="batch")


# ---------------------------------------------------------------- registry
def test_registry_and_attributes():
    assert {"grpo", "sft", "dapo", "dr_grpo", "cispo", "ppo_decoupled", "grpo_tis"} <= set(LOSSES)
    assert isinstance(make_loss("dapo"), DAPOLoss) and make_loss("dapo").clip_eps_high == 0.28
    assert isinstance(make_loss("dr_grpo", max_tokens=64), DrGRPOLoss)
    assert make_loss("cispo").aggregation == "token-mean"
    assert make_loss("ppo_decoupled", behav_weight_mode="mask").needs_prox_logp
    assert not make_loss("cispo").needs_prox_logp and not make_loss("dr_grpo").needs_prox_logp
    with pytest.raises(ValueError, match="max_tokens"):
        DrGRPOLoss(max_tokens=0)


def test_job_config_selects_each_loss_with_its_own_defaults():
    from rayllm_rl.config import load_config
    from rayllm_rl.objectives import CISPOLoss, DAPOLoss, DecoupledPPOLoss, DrGRPOLoss
    from rayllm_rl.job.config import GRPOJobConfig

    def build(*args):
        cfg = load_config(GRPOJobConfig, list(args))
        return cfg.algo.build_loss(cfg.rollout.max_new_tokens)

    dapo = build("algo.name=dapo")
    assert isinstance(dapo, DAPOLoss) and dapo.clip_eps_high == 0.28 and dapo.clip_eps_low == 0.2
    assert build("algo.name=dapo", "algo.clip_eps_high=0.3").clip_eps_high == 0.3
    cispo = build("algo.name=cispo")
    assert isinstance(cispo, CISPOLoss) and cispo.clip_eps_low is None and cispo.clip_eps_high == 0.28
    dr = build("algo.name=dr_grpo", "rollout.max_new_tokens=12")
    assert isinstance(dr, DrGRPOLoss) and dr.max_tokens == 12
    ppo = build("algo.name=ppo_decoupled", "algo.behav_weight_cap=3", "algo.behav_weight_mode=mask")
    assert isinstance(ppo, DecoupledPPOLoss) and ppo.needs_prox_logp and ppo.behav_weight_cap == 3.0
    assert build("algo.ratio_level=sequence").ratio_level == "sequence"


# ---------------------------------------------------------------- KL to the inference policy
def test_kl_to_inference_policy_value_and_grad_with_prox_and_ref():
    """GRPO's penalty toward pi_behav: k3 in lr = behav - logp, added to the PG term and KL(ref).

    prox is given, so the PG ratio uses prox (r=R exactly); behav differs from prox by offsets d,
    so the behaviour KL is non-zero. ref = logp - 0.1 on generated tokens (k1 KL to ref = 0.1).
    """
    logp, prox, adv, mask = _batch()
    d = [[0.3, -0.2, 0.0], [0.5, 0.1, -0.4, 0.2]]
    behav = prox - _off(d)  # lr_behav = behav - logp = -1 - d - (-1 + ln r) = -d - ln r
    ref = torch.where(mask, logp.detach() - 0.1, torch.zeros_like(prox))
    c_ref, c_beh = 0.05, 0.3
    loss_fn = GRPOLoss(kl_coef=c_ref, kl_estimator="k3", kl_behav_coef=c_beh)
    out = loss_fn(logp, behav, prox, adv, mask, ref_logp=ref)
    vals, grads, kl_b = [], [], []
    for i in range(2):
        for j, r in enumerate(R[i]):
            v, g = _ppo(r, A[i], 0.2, 0.2)
            lr_b = -d[i][j] - lg(r)
            kb, dkb = math.exp(lr_b) - 1 - lr_b, -math.exp(lr_b) + 1  # d/dlogp of k3: lr' = -1
            kr, dkr = math.exp(-0.1) - 1 + 0.1, -math.exp(-0.1) + 1
            vals.append(v + c_beh * kb + c_ref * kr)
            grads.append(g + c_beh * dkb + c_ref * dkr)
            kl_b.append(kb)
    assert out.loss.item() == pytest.approx(sum(vals) / N_TOK, abs=1e-12)
    assert out.metrics["kl_behav"] == pytest.approx(sum(kl_b) / N_TOK, abs=1e-12)
    assert out.metrics["kl_ref"] == pytest.approx(math.exp(-0.1) - 0.9, abs=1e-12)
    want = [[g / N_TOK for g in grads[:3]], [g / N_TOK for g in grads[3:]]]
    _assert_rows(_grad(out.loss, logp), _pad(want))
    # Off by default, and the same field reaches the decoupled-PPO and TIS variants.
    logp2, prox2, adv2, mask2 = _batch()
    assert "kl_behav" not in GRPOLoss()(logp2, behav, prox2, adv2, mask2).metrics
    for name in ("ppo_decoupled", "grpo_tis", "dr_grpo"):
        m = make_loss(name, kl_behav_coef=c_beh)(logp2, behav, prox2, adv2, mask2).metrics
        assert m["kl_behav"] == pytest.approx(sum(kl_b) / N_TOK, abs=1e-12), name
    with pytest.raises(ValueError, match="kl_behav_coef"):
        GRPOLoss(kl_behav_coef=-1.0)
