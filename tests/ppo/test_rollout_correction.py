"""Rollout correction modes (`rollout_correction`): the weights each mode gives on hand-made
ratios, the drift metrics against closed forms, and the config keys that choose a mode."""

import math
import typing

import pytest
import torch
from torch.testing import assert_close

from services.common.config import Config, ConfigError, config_from_dict
from services.ppo import (
    DRIFT_METRICS,
    ROLLOUT_CORRECTIONS,
    agg_loss,
    compute_policy_loss,
    rollout_correction,
    rollout_importance_weights,
)

MODES = ("none", "token_tis", "seq_tis", "seq_mask", "icepop")


def _from_ratios(ratios, mask=None):
    """(old_log_prob, rollout_log_prob, mask) whose token ratios pi_old / mu are `ratios`."""
    ratio = torch.tensor(ratios, dtype=torch.float32)
    rollout = -torch.rand(ratio.shape, generator=torch.Generator().manual_seed(0)) * 3
    mask = torch.ones_like(ratio) if mask is None else torch.tensor(mask, dtype=torch.float32)
    return rollout + torch.log(ratio), rollout, mask


def test_the_registry_holds_the_modes():
    assert ROLLOUT_CORRECTIONS.names() == MODES
    with pytest.raises(ValueError, match="unknown rollout_correction 'bogus'; valid: none, token_tis"):
        rollout_correction(torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1, 2), "bogus")


def test_none_gives_no_weights_and_still_the_drift():
    old, rollout, mask = _from_ratios([[2.0, 0.5]])
    w, m = rollout_correction(old, rollout, mask, "none")
    assert w is None
    assert m["rollout_correction/masked_token_frac"] == 0.0 and m["rollout_correction/weight_mean"] == 1.0
    assert m["rollout_correction/kl"] > 0 and set(DRIFT_METRICS) <= set(m)


def test_token_tis_truncates_each_token_at_the_cap():
    old, rollout, mask = _from_ratios([[0.5, 1.5, 3.0, 10.0], [1.0, 2.5, 9.0, 9.0]], [[1, 1, 1, 1], [1, 1, 0, 0]])
    w, m = rollout_correction(old, rollout, mask, "token_tis", threshold=2.0)
    assert_close(w, torch.tensor([[0.5, 1.5, 2.0, 2.0], [1.0, 2.0, 0.0, 0.0]]), rtol=1e-5, atol=1e-6)
    # the same weights and older metrics as `rollout_importance_weights` (rollout_is: true)
    legacy_w, legacy_m = rollout_importance_weights(old, rollout, mask, 2.0)
    assert_close(w, legacy_w)
    assert {k: m[k] for k in legacy_m} == legacy_m
    assert m["rollout_correction/masked_token_frac"] == pytest.approx(3 / 6)
    assert m["rollout_correction/masked_seq_frac"] == pytest.approx(1.0)  # each sequence has one
    assert m["rollout_correction/weight_mean"] == pytest.approx((0.5 + 1.5 + 2 + 2 + 1 + 2) / 6, rel=1e-5)


def test_seq_tis_weights_every_token_by_the_truncated_sequence_ratio():
    # sequence ratios: 1.2 * 1.25 = 1.5 (under the cap), 2 * 3 = 6 (capped at 2), 0.5 * 0.8 = 0.4
    old, rollout, mask = _from_ratios(
        [[1.2, 1.25, 7.0], [2.0, 3.0, 1.0], [0.5, 0.8, 1.0]], [[1, 1, 0], [1, 1, 1], [1, 1, 0]]
    )
    w, m = rollout_correction(old, rollout, mask, "seq_tis", threshold=2.0)
    assert_close(w, torch.tensor([[1.5, 1.5, 0.0], [2.0, 2.0, 2.0], [0.4, 0.4, 0.0]]), rtol=1e-5, atol=1e-6)
    assert m["rollout_correction/masked_seq_frac"] == pytest.approx(1 / 3)
    assert m["rollout_correction/masked_token_frac"] == pytest.approx(3 / 7)
    # the cap is the threshold's
    w, _ = rollout_correction(old, rollout, mask, "seq_tis", threshold=1.0)
    assert_close(w, torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0], [0.4, 0.4, 0.0]]), rtol=1e-5, atol=1e-6)


def test_seq_mask_keeps_the_sequences_whose_geometric_mean_ratio_is_in_the_band():
    old, rollout, mask = _from_ratios(
        [
            [1.005, 0.998, 1.0],  # geometric mean 1.0010: kept
            [1.02, 0.99, 1.0],  # 1.0049 (one token outside the band, the mean inside): kept
            [1.05, 1.05, 1.05],  # 1.05: dropped
            [0.95, 1.0, 1.0],  # 0.95 on its only valid token: dropped
        ],
        [[1, 1, 1], [1, 1, 0], [1, 1, 1], [1, 0, 0]],
    )
    w, m = rollout_correction(old, rollout, mask, "seq_mask")  # default band [0.99, 1.01]
    assert_close(w, torch.tensor([[1.0, 1, 1], [1, 1, 0], [0, 0, 0], [0, 0, 0]]))
    assert m["rollout_correction/masked_seq_frac"] == pytest.approx(2 / 4)
    assert m["rollout_correction/masked_token_frac"] == pytest.approx(4 / 9)
    assert m["rollout_correction/weight_mean"] == pytest.approx(5 / 9)
    # a wider band keeps them all, a narrower one only the first
    w, _ = rollout_correction(old, rollout, mask, "seq_mask", low=0.9, high=1.1)
    assert_close(w, mask)
    w, _ = rollout_correction(old, rollout, mask, "seq_mask", low=0.999, high=1.002)
    assert_close(w, torch.tensor([[1.0, 1, 1], [0, 0, 0], [0, 0, 0], [0, 0, 0]]))


def test_icepop_masks_the_tokens_whose_ratio_is_outside_the_band():
    old, rollout, mask = _from_ratios([[0.4, 0.6, 1.0, 1.9], [2.1, 30.0, 1.2, 0.1]], [[1, 1, 1, 1], [1, 1, 1, 0]])
    w, m = rollout_correction(old, rollout, mask, "icepop")  # default band [0.5, 2.0]
    assert_close(w, torch.tensor([[0.0, 1, 1, 1], [0, 0, 1, 0]]))
    assert m["rollout_correction/masked_token_frac"] == pytest.approx(3 / 7)
    assert m["rollout_correction/masked_seq_frac"] == pytest.approx(1.0)
    w, _ = rollout_correction(old, rollout, mask, "icepop", low=0.3, high=1.5)
    assert_close(w, torch.tensor([[1.0, 1, 1, 0], [0, 0, 1, 0]]))
    # one bound given: the other is the mode's default
    w, _ = rollout_correction(old, rollout, mask, "icepop", high=40.0)
    assert_close(w, torch.tensor([[0.0, 1, 1, 1], [1, 1, 1, 0]]))


@pytest.mark.parametrize("mode", ["seq_mask", "icepop"])
def test_a_band_that_is_empty_is_refused(mode):
    with pytest.raises(ValueError, match="low < high"):
        rollout_correction(torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1, 2), mode, low=0.9, high=0.8)


@pytest.mark.parametrize("mode", MODES[1:])
def test_padding_holds_anything_and_changes_nothing(mode):
    torch.manual_seed(1)
    old, rollout = -torch.rand(3, 5) * 3, -torch.rand(3, 5) * 3
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 0, 0, 0, 0], [1, 1, 1, 1, 1]], dtype=torch.float)
    w, m = rollout_correction(old, rollout, mask, mode)
    junk_old = torch.where(mask.bool(), old, torch.full_like(old, 40.0))
    junk_rollout = torch.where(mask.bool(), rollout, torch.full_like(rollout, float("nan")))
    w2, m2 = rollout_correction(junk_old, junk_rollout, mask, mode)
    assert_close(w, w2)
    assert torch.all(w[mask == 0] == 0)
    assert m2.keys() == m.keys() and all(math.isfinite(v) for v in m2.values())
    for k in m:
        assert m2[k] == pytest.approx(m[k], rel=1e-6, abs=1e-7), k


@pytest.mark.parametrize("mode", MODES[1:])
def test_weights_are_detached_float32(mode):
    old = (-torch.rand(2, 3)).to(torch.bfloat16).requires_grad_(True)
    w, _ = rollout_correction(old, old.detach().float() - 0.001, torch.ones(2, 3), mode)
    assert w.dtype == torch.float32 and not w.requires_grad


def test_log_ratios_are_clamped():
    w, m = rollout_correction(torch.tensor([[0.0, 500.0]]), torch.tensor([[0.0, -500.0]]), torch.ones(1, 2), "seq_tis")
    assert_close(w, torch.tensor([[2.0, 2.0]]))
    assert m["rollout_correction/log_ratio_abs_max"] == pytest.approx(20.0)
    assert all(math.isfinite(v) for v in m.values())


# --- the drift metrics against closed forms --------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
def test_identical_distributions_show_no_drift(mode):
    torch.manual_seed(0)
    lp = -torch.rand(4, 6) * 4
    mask = torch.ones(4, 6)
    mask[1, 3:] = 0
    w, m = rollout_correction(lp, lp.clone(), mask, mode)
    for key in ("kl", "kl_k1", "chi2_token", "chi2_seq", "log_ratio_abs_max", "masked_token_frac", "masked_seq_frac"):
        assert m[f"rollout_correction/{key}"] == pytest.approx(0.0, abs=1e-7), key
    for key in ("ess_token", "ess_seq", "weight_mean"):
        assert m[f"rollout_correction/{key}"] == pytest.approx(1.0, abs=1e-7), key
    if w is not None:
        assert_close(w, mask)


@pytest.mark.parametrize("d", [0.1, -0.3])
def test_a_constant_shift_gives_the_closed_form(d):
    """Every token's log-ratio d (pi_old = e^d mu on the sampled tokens), sequences of L tokens:
    k3 = e^d - 1 - d, k1 = -d, chi2 = e^(2d) - 1 per token and e^(2Ld) - 1 per sequence; every ratio
    equal, so both ESS are 1."""
    L = 3
    rollout = -torch.rand(4, L, generator=torch.Generator().manual_seed(3))
    _, m = rollout_correction(rollout + d, rollout, torch.ones(4, L), "none")
    assert m["rollout_correction/kl"] == pytest.approx(math.exp(d) - 1 - d, rel=1e-4)
    assert m["rollout_correction/kl_k1"] == pytest.approx(-d, rel=1e-5)
    assert m["rollout_correction/chi2_token"] == pytest.approx(math.exp(2 * d) - 1, rel=1e-5)
    assert m["rollout_correction/chi2_seq"] == pytest.approx(math.exp(2 * L * d) - 1, rel=1e-5)
    assert m["rollout_correction/ess_token"] == pytest.approx(1.0, rel=1e-6)
    assert m["rollout_correction/ess_seq"] == pytest.approx(1.0, rel=1e-6)


def test_the_metrics_are_expectations_under_the_sampler():
    """mu = (1/2, 1/4, 1/4), pi_old = (1/4, 1/4, 1/2) over three tokens, sampled in mu's exact
    proportions (token 0 twice, 1 and 2 once): the means are the exact expectations under mu.
    KL(mu || pi_old) = 1/2 ln 2 - 1/4 ln 2 = ln(2) / 4 (k1 and k3 alike: E_mu[rho] = 1);
    chi2 = sum pi^2 / mu - 1 = 3/8; normalised ESS of the ratios = 1 / (1 + chi2) = 8/11."""
    mu = torch.tensor([0.5, 0.25, 0.25])
    pi = torch.tensor([0.25, 0.25, 0.5])
    tokens = torch.tensor([[0, 0, 1, 2]])
    _, m = rollout_correction(pi.log()[tokens], mu.log()[tokens], torch.ones(1, 4), "none")
    assert m["rollout_correction/kl"] == pytest.approx(math.log(2) / 4, rel=1e-5)
    assert m["rollout_correction/kl_k1"] == pytest.approx(math.log(2) / 4, rel=1e-5)
    assert m["rollout_correction/chi2_token"] == pytest.approx(3 / 8, rel=1e-5)
    assert m["rollout_correction/ess_token"] == pytest.approx(8 / 11, rel=1e-5)
    # one sequence: its ratio is the product 1/2 * 1/2 * 1 * 2 = 1/2, chi2_seq = 1/4 - 1
    assert m["rollout_correction/chi2_seq"] == pytest.approx(-0.75, rel=1e-5)
    assert m["rollout_correction/ess_seq"] == pytest.approx(1.0)


def test_one_dominating_ratio_drives_the_ess_towards_one_over_n():
    n = 8
    ratios = [[1e-4] * (n - 1) + [1.0]]
    _, m = rollout_correction(*_from_ratios(ratios), "none")
    assert m["rollout_correction/ess_token"] == pytest.approx(1 / n, rel=1e-2)
    # per sequence: two sequences, ratios 1 and e^-10
    old, rollout, mask = _from_ratios([[1.0, 1.0], [math.exp(-5), math.exp(-5)]])
    _, m = rollout_correction(old, rollout, mask, "none")
    assert m["rollout_correction/ess_seq"] == pytest.approx(0.5, rel=1e-3)


def test_an_empty_mask_gives_zero_metrics():
    w, m = rollout_correction(torch.zeros(2, 3), torch.ones(2, 3), torch.zeros(2, 3), "seq_mask")
    assert_close(w, torch.zeros(2, 3))
    assert all(v == 0.0 for v in m.values())


# --- the weights in the loss ------------------------------------------------------------------


def test_a_masked_sequence_gets_no_gradient():
    torch.manual_seed(4)
    old = -torch.rand(2, 4) * 2
    new = (old + 0.1 * torch.randn(2, 4)).requires_grad_(True)
    adv = torch.randn(2, 4)
    mask = torch.ones(2, 4)
    rollout = old.clone()
    rollout[1] -= 0.2  # sequence 1's geometric-mean ratio e^0.2: outside [0.99, 1.01]
    w, _ = rollout_correction(old, rollout, mask, "seq_mask")
    loss, *_ = compute_policy_loss(old, new, adv, mask, cliprange=0.2, loss_agg_mode="token-mean", rollout_is_weights=w)
    loss.backward()
    assert torch.all(new.grad[1] == 0) and torch.any(new.grad[0] != 0)
    per_token = torch.maximum(
        -adv * torch.exp(new.detach() - old), -adv * torch.exp(new.detach() - old).clamp(0.8, 1.2)
    )
    per_token = torch.where(adv < 0, torch.minimum(per_token, -adv * 3.0), per_token)
    assert_close(loss.detach(), agg_loss(per_token * w, mask, "token-mean"))


# --- the config -------------------------------------------------------------------------------


def test_the_config_choices_are_the_registry_names():
    ann = Config.model_fields["rollout_correction"].annotation
    assert typing.get_args(typing.get_args(ann)[0]) == ROLLOUT_CORRECTIONS.names()


@pytest.mark.parametrize("mode", MODES)
def test_each_preset_name_validates(mode):
    cfg = config_from_dict({"rollout_correction": mode})
    assert cfg.rollout_correction_mode == mode
    assert cfg.uses_sampler_log_probs == (mode != "none")


def test_an_unknown_mode_is_refused_by_name_with_the_list():
    with pytest.raises(ConfigError) as e:
        config_from_dict({"rollout_correction": "seq_tiss"})
    msg = str(e.value)
    assert "rollout_correction: got 'seq_tiss'" in msg
    assert all(repr(mode) in msg for mode in MODES), msg


def test_rollout_is_true_is_token_tis_unless_rollout_correction_says_otherwise():
    assert config_from_dict({}).rollout_correction_mode == "none"
    assert config_from_dict({"rollout_is": True}).rollout_correction_mode == "token_tis"
    assert config_from_dict({"rollout_is": False}).rollout_correction_mode == "none"
    both = config_from_dict({"rollout_is": True, "rollout_correction": "seq_mask"})
    assert both.rollout_correction_mode == "seq_mask"  # the newer key, when set, wins
    assert config_from_dict({"rollout_is": True, "rollout_correction": "none"}).rollout_correction_mode == "none"


def test_the_metrics_switch_and_the_band_bounds():
    cfg = config_from_dict({"rollout_correction_metrics": True})
    assert cfg.rollout_correction_mode == "none" and cfg.uses_sampler_log_probs
    cfg = config_from_dict({"rollout_correction": "icepop", "rollout_mask_low": 0.3, "rollout_mask_high": 3.0})
    assert (cfg.rollout_mask_low, cfg.rollout_mask_high) == (0.3, 3.0)
    with pytest.raises(ConfigError, match="rollout_mask_low"):
        config_from_dict({"rollout_mask_low": 1.0})
    with pytest.raises(ConfigError, match="rollout_mask_high"):
        config_from_dict({"rollout_mask_high": 0.9})
