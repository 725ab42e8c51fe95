"""Truncated importance sampling between the sampler's and the learner's log-probs: the weights,
their metrics, and the policy losses that take them."""

import math

import pytest
import torch

from services.ppo import (
    agg_loss,
    compute_gspo_policy_loss,
    compute_policy_loss,
    masked_mean,
    rollout_importance_weights,
)


def test_weights_are_one_when_the_log_probs_agree():
    torch.manual_seed(0)
    lp = -torch.rand(3, 6) * 4
    mask = torch.ones(3, 6)
    mask[1, 4:] = 0
    w, m = rollout_importance_weights(lp, lp.clone(), mask, 2.0)
    assert torch.equal(w, mask)
    assert m == {
        "ppo/is_ratio_mean": 1.0,
        "ppo/is_ratio_max": 1.0,
        "ppo/is_clipped_frac": 0.0,
        "ppo/is_weight_mean": 1.0,
    }


def test_weights_are_the_ratio_truncated_at_the_threshold():
    rollout = torch.zeros(1, 4)
    old = torch.log(torch.tensor([[0.5, 1.5, 3.0, 10.0]]))
    w, m = rollout_importance_weights(old, rollout, torch.ones(1, 4), 2.0)
    assert torch.allclose(w, torch.tensor([[0.5, 1.5, 2.0, 2.0]]))
    assert m["ppo/is_ratio_mean"] == pytest.approx((0.5 + 1.5 + 3.0 + 10.0) / 4, rel=1e-6)
    assert m["ppo/is_ratio_max"] == pytest.approx(10.0, rel=1e-6)
    assert m["ppo/is_clipped_frac"] == pytest.approx(0.5)
    assert m["ppo/is_weight_mean"] == pytest.approx((0.5 + 1.5 + 2.0 + 2.0) / 4, rel=1e-6)
    # a lower threshold truncates more; the log-ratio is clamped, so huge gaps stay finite
    w, m = rollout_importance_weights(
        torch.tensor([[0.0, 500.0]]), torch.tensor([[0.0, -500.0]]), torch.ones(1, 2), 0.8
    )
    assert torch.allclose(w, torch.tensor([[0.8, 0.8]]))
    assert m["ppo/is_ratio_max"] == pytest.approx(math.exp(20.0), rel=1e-5)
    assert m["ppo/is_clipped_frac"] == 1.0


def test_weights_are_detached():
    old = torch.zeros(2, 3, requires_grad=True)
    w, _ = rollout_importance_weights(old, torch.full((2, 3), -0.1), torch.ones(2, 3), 2.0)
    assert not w.requires_grad


def test_padding_gets_zero_weight_and_does_not_change_the_metrics():
    torch.manual_seed(1)
    old, rollout = -torch.rand(3, 5) * 3, -torch.rand(3, 5) * 3
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 0, 0, 0, 0], [1, 1, 1, 1, 1]], dtype=torch.float)
    w, m = rollout_importance_weights(old, rollout, mask, 1.5)
    assert torch.all(w[mask == 0] == 0) and torch.all(w[mask == 1] > 0)
    # junk on the padded positions (huge ratios, NaN) changes neither the weights nor the metrics
    junk_old = torch.where(mask.bool(), old, torch.full_like(old, 40.0))
    junk_rollout = torch.where(mask.bool(), rollout, torch.full_like(rollout, float("nan")))
    junk_rollout[2, 4] = rollout[2, 4]
    w2, m2 = rollout_importance_weights(junk_old, junk_rollout, mask, 1.5)
    assert torch.equal(w, w2) and m == m2
    ratio = torch.exp(old - rollout)
    assert m["ppo/is_ratio_mean"] == pytest.approx(ratio[mask == 1].mean().item(), rel=1e-6)
    assert m["ppo/is_ratio_max"] == pytest.approx(ratio[mask == 1].max().item(), rel=1e-6)
    assert m["ppo/is_weight_mean"] == pytest.approx(ratio[mask == 1].clamp(max=1.5).mean().item(), rel=1e-6)


def test_clipped_share_counts_valid_tokens_only():
    rollout = torch.zeros(2, 4)
    # ratios 3 (clipped), 1, 2.5 (clipped), pad(5) | 0.5, 2.0 (at the cap: not clipped), pad, pad
    old = torch.log(torch.tensor([[3.0, 1.0, 2.5, 5.0], [0.5, 2.0, 9.0, 9.0]]))
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]], dtype=torch.float)
    w, m = rollout_importance_weights(old, rollout, mask, 2.0)
    assert m["ppo/is_clipped_frac"] == pytest.approx(2 / 5)
    assert torch.allclose(w, torch.tensor([[2.0, 1.0, 2.0, 0.0], [0.5, 2.0, 0.0, 0.0]]), atol=1e-6)


def test_an_empty_mask_gives_zero_metrics():
    w, m = rollout_importance_weights(torch.zeros(2, 3), torch.ones(2, 3), torch.zeros(2, 3), 2.0)
    assert torch.equal(w, torch.zeros(2, 3))
    assert all(v == 0.0 for v in m.values())


def test_bad_threshold_and_shapes_raise():
    with pytest.raises(ValueError, match="threshold"):
        rollout_importance_weights(torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1, 2), 0.0)
    with pytest.raises(ValueError, match="shapes"):
        rollout_importance_weights(torch.zeros(1, 2), torch.zeros(1, 3), torch.ones(1, 2), 2.0)


def _batch(seed=2):
    torch.manual_seed(seed)
    old = -torch.rand(3, 5) * 3
    new = old + 0.4 * torch.randn(3, 5)
    adv = torch.randn(3, 5)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 0], [1, 1, 1, 1, 1]], dtype=torch.float)
    weights = torch.rand(3, 5) * 2
    return old, new, adv, mask, weights


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_weighted_policy_loss_equals_the_hand_computed_one(mode):
    old, new, adv, mask, weights = _batch()
    new = new.requires_grad_(True)
    loss, clipfrac, kl, lower = compute_policy_loss(
        old, new, adv, mask, cliprange=0.2, clip_ratio_c=3.0, loss_agg_mode=mode, rollout_is_weights=weights
    )
    ratio = torch.exp(new.detach() - old)
    clipped = torch.maximum(-adv * ratio, -adv * ratio.clamp(0.8, 1.2))
    per_token = torch.where(adv < 0, torch.minimum(clipped, -adv * 3.0), clipped)
    expected = agg_loss(per_token * weights, mask, mode)
    assert loss.item() == pytest.approx(expected.item(), rel=1e-6)
    assert loss.item() != pytest.approx(agg_loss(per_token, mask, mode).item(), rel=1e-3)  # weights matter
    # the clip statistics do not depend on the weights
    plain = compute_policy_loss(old, new.detach(), adv, mask, cliprange=0.2, clip_ratio_c=3.0, loss_agg_mode=mode)
    assert torch.equal(clipfrac, plain[1]) and torch.equal(kl, plain[2]) and torch.equal(lower, plain[3])
    # the gradient of each token is scaled by its weight
    loss.backward()
    g_weighted = new.grad.clone()
    new.grad = None
    compute_policy_loss(old, new, adv, mask, cliprange=0.2, clip_ratio_c=3.0, loss_agg_mode=mode)[0].backward()
    assert torch.allclose(g_weighted, new.grad * weights * mask, atol=1e-6)


def test_weighted_gspo_loss_equals_the_hand_computed_one():
    old, new, adv, mask, weights = _batch(3)
    loss, *_ = compute_gspo_policy_loss(old, new, adv, mask, cliprange=0.2, rollout_is_weights=weights)
    seq_ratio = torch.exp(((new - old) * mask).sum(-1) / mask.sum(-1)).unsqueeze(-1).expand_as(new)
    per_token = torch.maximum(-adv * seq_ratio, -adv * seq_ratio.clamp(0.8, 1.2))
    expected = agg_loss(per_token * weights, mask, "seq-mean-token-mean")
    assert loss.item() == pytest.approx(expected.item(), rel=1e-6)
    assert loss.item() != pytest.approx(agg_loss(per_token, mask, "seq-mean-token-mean").item(), rel=1e-3)


@pytest.mark.parametrize(
    "loss_fn,kw",
    [
        (compute_policy_loss, {"clip_ratio_c": 3.0}),
        (compute_policy_loss, {"clip_ratio_c": None}),
        (compute_gspo_policy_loss, {}),
    ],
)
def test_no_weights_reproduce_the_old_loss_exactly(loss_fn, kw):
    old, new, adv, mask, _ = _batch(4)
    default = loss_fn(old, new, adv, mask, cliprange=0.2, **kw)
    explicit = loss_fn(old, new, adv, mask, cliprange=0.2, rollout_is_weights=None, **kw)
    ones = loss_fn(old, new, adv, mask, cliprange=0.2, rollout_is_weights=torch.ones(3, 5), **kw)
    for a, b, c in zip(default, explicit, ones):
        assert torch.equal(a, b) and torch.equal(a, c)


def test_weights_from_agreeing_log_probs_leave_the_loss_unchanged():
    old, new, adv, mask, _ = _batch(5)
    w, _ = rollout_importance_weights(old, old.clone(), mask, 2.0)
    a = compute_policy_loss(old, new, adv, mask, cliprange=0.2)
    b = compute_policy_loss(old, new, adv, mask, cliprange=0.2, rollout_is_weights=w)
    assert torch.equal(a[0], b[0])
    assert masked_mean(w, mask).item() == 1.0
