"""Each loss reads one options object (objectives/options.py): keyword overrides build it, an object is taken as
it is, both at once is refused; the losses built on another read the fields they lack at that one's defaults."""
from __future__ import annotations

import dataclasses

import pytest

from rayllm_rl.objectives import (
    LOSSES, CISPOLoss, DAPOLoss, DAPOOptions, DecoupledPPOLoss, DecoupledPPOOptions, DrGRPOLoss, GRPOLoss,
    GRPOOptions, GRPOTISLoss, GRPOTISOptions, KLPenalty, SFTLoss, SFTOptions, make_loss,
)
from rayllm_rl.objectives.options import CLIP_HIGHER, DR_GRPO_MAX_TOKENS


def test_an_options_object_and_keyword_overrides_build_the_same_loss():
    for name, cls in LOSSES.items():
        options = cls.options_class()
        assert repr(cls(options)) == repr(cls()) == repr(make_loss(name, options)), name
        assert cls(options).options is options
    by_kw = GRPOLoss(clip_eps_low=0.1, kl_coef=0.05, ratio_level="sequence")
    by_options = GRPOLoss(GRPOOptions(clip_eps_low=0.1, kl_coef=0.05, ratio_level="sequence"))
    assert repr(by_kw) == repr(by_options) and by_kw.aggregation == "seq-mean" and by_kw.needs_ref_logp


def test_both_an_options_object_and_overrides_is_a_value_error_and_a_wrong_key_or_class_a_type_error():
    with pytest.raises(ValueError, match=r"GRPOLoss takes an options object or keyword overrides, not both: got a "
                                         r"GRPOOptions and \['clip_eps_low'\]"):
        GRPOLoss(GRPOOptions(), clip_eps_low=0.1)
    with pytest.raises(ValueError, match="not both"):
        make_loss("sft", SFTOptions(), beta=0.2)
    with pytest.raises(TypeError, match=r"DAPOLoss takes no option kl_coef; its options \(DAPOOptions\)"):
        DAPOLoss(kl_coef=0.1)
    with pytest.raises(TypeError, match="CISPOLoss reads a CISPOOptions, got a GRPOOptions"):
        CISPOLoss(GRPOOptions())
    with pytest.raises(TypeError, match="GRPOTISLoss reads a GRPOTISOptions, got a DAPOOptions"):
        GRPOTISLoss(DAPOOptions())


def test_the_losses_keep_their_own_checks_for_options_built_by_hand():
    with pytest.raises(ValueError, match="clip_eps_low < 1"):
        GRPOLoss(GRPOOptions(clip_eps_low=1.0))
    with pytest.raises(ValueError, match="kl_estimator"):
        DrGRPOLoss(kl_estimator="k4")
    with pytest.raises(ValueError, match="behav_weight_cap must be > 0"):
        DecoupledPPOLoss(DecoupledPPOOptions(behav_weight_cap=0.0))
    with pytest.raises(ValueError, match="cap must be > 0"):
        GRPOTISLoss(GRPOTISOptions(tis_cap=-1.0))
    with pytest.raises(ValueError, match="minor_sft"):
        SFTLoss(loss_function="minor_sft", kl_to_ref_coeff=0.1)


def test_losses_built_on_grpo_read_what_their_options_lack_at_its_defaults():
    dapo = DAPOLoss()
    assert (dapo.clip_eps_high, dapo.aggregation, dapo.ratio_level) == (CLIP_HIGHER, "token-mean", "token")
    assert (dapo.kl_coef, dapo.kl_behav_coef, dapo.kl_estimator) == (0.0, 0.0, KLPenalty().kl_estimator)
    assert not dapo.needs_ref_logp and isinstance(dapo.options, DAPOOptions)
    assert CISPOLoss().clip_eps_high == CLIP_HIGHER
    assert DrGRPOLoss().max_tokens == DR_GRPO_MAX_TOKENS and DrGRPOLoss(max_tokens=7).max_tokens == 7
    ppo = DecoupledPPOLoss(behav_weight_mode="mask", kl_coef=0.1, clip_ratio_c=3.0)
    assert (ppo.level, ppo.mode, ppo.cap) == ("token", "mask", DecoupledPPOOptions().behav_weight_cap)
    assert ppo.base.kl_coef == 0.1 and ppo.base.clip_ratio_c == 3.0 and ppo.needs_ref_logp
    assert isinstance(ppo.base.options, GRPOOptions) and ppo.base.aggregation == "token-mean"
    tis = GRPOTISLoss(tis_level="sequence", tis_cap=3.0, prox_logp_method="loglinear")
    assert (tis.level, tis.mode, tis.cap, tis.prox_logp_method) == ("sequence", "truncate", 3.0, "loglinear")


def test_sft_options_hold_more_than_the_job_exposes():
    sft = SFTLoss(SFTOptions(loss_function="minor_sft", beta=0.5, normalize_by_seq_length=False))
    assert (sft.loss_function, sft.beta, sft.normalize_by_seq_length, sft.needs_ref_logp) == ("minor_sft", 0.5,
                                                                                            False, True)
    assert {f.name for f in dataclasses.fields(SFTOptions)} == {
        "aggregation", "loss_function", "beta", "kl_to_ref_coeff", "normalize_by_seq_length"}
