"""CISPO (`policy_loss: cispo`): -A * sg(clip(ratio)) * log_prob per token, the gradient through the
log-prob only, and how it composes with loss_agg_mode, the rollout correction's weights and the
config."""

import pytest
import torch
from torch.testing import assert_close

from services.common.config import config_from_dict
from services.ppo import POLICY_LOSSES, agg_loss, compute_cispo_policy_loss, compute_policy_loss
from services.ppo.objective import ObjectiveSettings, ppo_objective

MODES = ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]


def _batch(seed=0, spread=0.5):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(3, 5, generator=g) * 3
    new = old + spread * torch.randn(3, 5, generator=g)
    adv = torch.randn(3, 5, generator=g)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 0], [1, 1, 1, 1, 1]], dtype=torch.float)
    return old, new, adv, mask


def test_cispo_is_registered():
    assert POLICY_LOSSES.get("cispo") is compute_cispo_policy_loss


def test_the_value_is_minus_advantage_times_clipped_weight_times_log_prob():
    old, new, adv, mask = _batch()
    loss, *_ = compute_cispo_policy_loss(old, new, adv, mask, cliprange_low=0.2, cliprange_high=0.3)
    w = torch.exp(new - old).clamp(0.8, 1.3)
    assert_close(loss, agg_loss(-adv * w * new, mask, "token-mean"))


def test_the_gradient_flows_through_the_log_prob_only():
    """d loss / d log_prob = -A * w / n (token-mean over n valid tokens): the clipped weight w is a
    constant, so a token whose ratio is beyond the clip still gets its gradient (PPO's clip drops
    it), scaled by the clipped weight."""
    old, new, adv, mask = _batch(1, spread=0.6)
    new = new.requires_grad_(True)
    loss, clipfrac, *_ = compute_cispo_policy_loss(old, new, adv, mask, cliprange_low=0.2, cliprange_high=0.2)
    loss.backward()
    ratio = torch.exp(new.detach() - old)
    w = ratio.clamp(0.8, 1.2)
    assert_close(new.grad, -adv * w * mask / mask.sum())
    assert clipfrac.item() > 0  # some tokens are clipped ...
    clipped = ((ratio < 0.8) | (ratio > 1.2)) & mask.bool()
    assert torch.all(new.grad[clipped] != 0)  # ... and still trained
    new.grad = None
    compute_policy_loss(old, new, adv, mask, cliprange=0.2, clip_ratio_c=None)[0].backward()
    ppo_drops = clipped & (((ratio > 1.2) & (adv > 0)) | ((ratio < 0.8) & (adv < 0)))
    assert ppo_drops.any() and torch.all(new.grad[ppo_drops] == 0)


def test_the_old_log_prob_changes_the_value_and_scales_the_gradient():
    """Another old log-prob changes the weights, so the loss value, but the gradient stays
    -A * w / n: the two gradients differ token by token by the ratio of their weights, and where
    both weights sit at the clip the gradients are equal."""
    old, new, adv, mask = _batch(2, spread=0.3)
    new = new.requires_grad_(True)
    grads, losses, weights = [], [], []
    for o in (old, old - 0.15):
        new.grad = None
        loss, *_ = compute_cispo_policy_loss(o, new, adv, mask, cliprange_low=1.0, cliprange_high=0.28)
        loss.backward()
        grads.append(new.grad.clone())
        losses.append(loss.item())
        weights.append(torch.exp(new.detach() - o).clamp(0.0, 1.28))
    assert losses[0] != pytest.approx(losses[1], rel=1e-3)
    valid = mask.bool()
    for g, w in zip(grads, weights):
        assert_close(g, -adv * w * mask / mask.sum())
    assert_close(grads[1][valid], (grads[0] * weights[1] / weights[0])[valid])
    capped = (weights[0] == 1.28) & (weights[1] == 1.28) & valid
    assert capped.any()
    assert_close(grads[1][capped], grads[0][capped])


@pytest.mark.parametrize("mode", MODES)
def test_it_composes_with_loss_agg_mode_and_the_correction_weights(mode):
    old, new, adv, mask = _batch(3)
    new = new.requires_grad_(True)
    rw = torch.rand(3, 5, generator=torch.Generator().manual_seed(9)) * 2
    loss, *_ = compute_cispo_policy_loss(
        old, new, adv, mask, cliprange_low=1.0, cliprange_high=0.2, loss_agg_mode=mode, rollout_is_weights=rw
    )
    w = torch.exp(new.detach() - old).clamp(0.0, 1.2)
    c = -adv * w * rw  # each token's gradient coefficient before the aggregation's share
    assert_close(loss, agg_loss(c * new.detach(), mask, mode))
    loss.backward()
    # the aggregation is linear: its gradient is agg_loss of the coefficients at one token each
    x = torch.zeros(3, 5, requires_grad=True)
    agg_loss(c * x, mask, mode).backward()
    assert_close(new.grad, x.grad)
    if mode == "seq-mean-token-mean":
        assert_close(new.grad, c * mask / mask.sum(-1, keepdim=True) / 3)


def test_no_lower_bound_with_cliprange_low_one_and_the_clip_fractions():
    old = torch.zeros(1, 4)
    new = torch.log(torch.tensor([[0.1, 0.9, 1.1, 5.0]]))
    adv = torch.ones(1, 4)
    mask = torch.ones(1, 4)
    _, clipfrac, kl, lower = compute_cispo_policy_loss(old, new, adv, mask, cliprange_low=1.0, cliprange_high=0.2)
    assert clipfrac.item() == pytest.approx(1 / 4) and lower.item() == 0.0  # only 5.0, above 1.2
    _, clipfrac, _, lower = compute_cispo_policy_loss(old, new, adv, mask, cliprange_low=0.2, cliprange_high=0.2)
    assert clipfrac.item() == pytest.approx(2 / 4) and lower.item() == pytest.approx(1 / 4)
    assert kl.item() == pytest.approx(-new.mean().item(), rel=1e-6)


def test_the_config_chooses_cispo_and_its_bounds():
    cfg = config_from_dict({"policy_loss": "cispo", "pg_clip_high": 0.28})
    s = ObjectiveSettings.from_config(cfg)
    assert (s.policy_loss, s.clip_low, s.clip_high) == ("cispo", 1.0, 0.28)
    s = ObjectiveSettings.from_config(config_from_dict({"policy_loss": "cispo", "cispo_clip_low": 0.5}))
    assert (s.clip_low, s.clip_high) == (0.5, 0.2)  # the upper bound: pg_clip when pg_clip_high is null
    s = ObjectiveSettings.from_config(config_from_dict({"pg_clip_low": 0.1}))
    assert (s.clip_low, s.clip_high) == (0.1, 0.2)  # the other losses keep pg_clip_low


def test_the_objective_runs_cispo_with_loss_agg_mode():
    old, new, adv, mask = _batch(5)
    new = new.requires_grad_(True)
    s = ObjectiveSettings(policy_loss="cispo", clip_low=1.0, clip_high=0.2, loss_agg_mode="seq-mean-token-mean")
    loss, metrics = ppo_objective(s, new, torch.zeros(3, 5), old, adv, mask)
    expected = agg_loss(-adv * torch.exp(new.detach() - old).clamp(0, 1.2) * new.detach(), mask, "seq-mean-token-mean")
    assert_close(loss.detach(), expected)
    loss.backward()
    assert torch.all(new.grad[mask == 0] == 0)
    assert set(metrics) >= {"ppo/pg_loss", "ppo/pg_clipfrac", "ppo/pg_clipfrac_lower", "ppo/approx_kl"}
