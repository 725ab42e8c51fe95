import pytest
import torch

from services.ppo import (
    agg_loss,
    compute_policy_loss,
    compute_sft_loss,
    compute_value_loss,
    entropy_from_logits,
    logprobs_from_logits,
    masked_mean,
    masked_whiten,
)


def _pl(ratio, adv, **kw):
    ratio, adv = torch.tensor([[ratio]]), torch.tensor([[adv]])
    old = torch.zeros(1, 1)
    kw.setdefault("cliprange", 0.2)
    return compute_policy_loss(old, ratio.log(), adv, torch.ones(1, 1), **kw)


@pytest.mark.parametrize(
    "ratio,adv,expected",
    [
        (1.0, 1.0, -1.0),  # on-policy: -A
        (1.5, 1.0, -1.2),  # A > 0: ratio clipped at 1 + eps
        (0.5, 1.0, -0.5),  # A > 0 below the range: unclipped (pessimistic min)
        (0.5, -1.0, 0.8),  # A < 0: ratio clipped at 1 - eps
        (2.0, -1.0, 2.0),  # A < 0 above the range: unclipped, below the dual clip bound 3
        (100.0, -10.0, 30.0),  # the seed's example: dual clip bounds -A*ratio=1000 at -A*c=30
    ],
)
def test_policy_loss_hand_cases(ratio, adv, expected):
    pg_loss, *_ = _pl(ratio, adv)
    assert pg_loss.item() == pytest.approx(expected, rel=1e-5)


def test_plain_clip_without_dual_clip_is_unbounded():
    pg_loss, _, _, lower = _pl(100.0, -10.0, clip_ratio_c=None)
    assert pg_loss.item() == pytest.approx(1000.0, rel=1e-5) and lower.item() == 0.0


def test_asymmetric_clip_range():
    assert _pl(1.5, 1.0, cliprange_low=0.2, cliprange_high=0.28)[0].item() == pytest.approx(-1.28)
    assert _pl(0.5, -1.0, cliprange_low=0.1, cliprange_high=0.28)[0].item() == pytest.approx(0.9)


def test_clip_fractions_and_ppo_kl():
    old = torch.zeros(1, 4)
    ratio = torch.tensor([[1.0, 1.5, 0.5, 10.0]])
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0]])
    pg, clipfrac, ppo_kl, lower = compute_policy_loss(old, ratio.log(), adv, torch.ones(1, 4), cliprange=0.2)
    assert clipfrac.item() == pytest.approx(0.5)  # tokens 2 and 3 clipped
    assert lower.item() == pytest.approx(0.25)  # token 4 hits the dual clip
    assert ppo_kl.item() == pytest.approx(-ratio.log().mean().item(), rel=1e-5)


def test_clipping_zeroes_the_gradient_outside_the_trust_region():
    adv = torch.tensor([[1.0, -1.0]])
    log_prob = torch.tensor([[1.5, 0.5]]).log().requires_grad_()
    pg, *_ = compute_policy_loss(torch.zeros(1, 2), log_prob, adv, torch.ones(1, 2), cliprange=0.2)
    pg.backward()
    assert torch.all(log_prob.grad == 0)


def test_dual_clip_bounds_the_loss_for_any_ratio():
    torch.manual_seed(0)
    old = torch.randn(64, 8)
    new = old + torch.randn(64, 8) * 5  # wildly off-policy
    adv = torch.randn(64, 8) * 3
    mask = torch.ones(64, 8)
    for mode in ("token-mean", "seq-mean-token-mean"):
        pg, *_ = compute_policy_loss(old, new, adv, mask, cliprange=0.2, clip_ratio_c=3.0, loss_agg_mode=mode)
        bound = agg_loss(3.0 * adv.abs(), mask, mode)
        assert pg.item() <= bound.item() + 1e-5


def test_masked_tokens_do_not_change_policy_loss():
    torch.manual_seed(1)
    old, new, adv = torch.randn(3, 5), torch.randn(3, 5), torch.randn(3, 5)
    m = torch.tensor([[1, 1, 1, 0, 0], [1, 0, 0, 0, 0], [1, 1, 1, 1, 1]], dtype=torch.float)
    a = compute_policy_loss(old, new, adv, m, cliprange=0.2, loss_agg_mode="seq-mean-token-sum")
    junk = torch.where(m.bool(), new, torch.full_like(new, 50.0))
    b = compute_policy_loss(
        old, junk, torch.where(m.bool(), adv, -adv * 1e3), m, cliprange=0.2, loss_agg_mode="seq-mean-token-sum"
    )
    for x, y in zip(a, b):
        assert torch.allclose(x, y)


def test_dual_clip_constant_must_exceed_one():
    with pytest.raises(ValueError, match="greater than 1.0"):
        _pl(1.0, 1.0, clip_ratio_c=1.0)


def test_agg_loss_modes_hand_computed():
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    assert agg_loss(loss, mask, "token-mean").item() == pytest.approx(10 / 4)
    assert agg_loss(loss, mask, "seq-mean-token-sum").item() == pytest.approx((6 + 4) / 2)
    assert agg_loss(loss, mask, "seq-mean-token-mean").item() == pytest.approx((2 + 4) / 2)
    assert agg_loss(loss, mask, "seq-mean-token-sum-norm").item() == pytest.approx((6 + 4) / 3)
    with pytest.raises(ValueError, match="token-mean"):
        agg_loss(loss, mask, "sum")


def test_agg_loss_ignores_empty_sequences_in_sequence_means():
    loss = torch.tensor([[2.0, 2.0], [7.0, 7.0]])
    mask = torch.tensor([[1.0, 1.0], [0.0, 0.0]])
    assert agg_loss(loss, mask, "seq-mean-token-mean").item() == pytest.approx(2.0)


def test_value_loss_unclipped_and_clipped():
    vpreds = torch.tensor([[1.0, 3.0]])
    returns = torch.tensor([[0.0, 0.0]])
    values = torch.tensor([[0.0, 0.0]])
    m = torch.ones(1, 2)
    loss, frac = compute_value_loss(vpreds, returns, values, m, None, "token-mean")
    assert loss.item() == pytest.approx(0.5 * (1 + 9) / 2) and frac.item() == 0
    # clipped prediction: values + clip(vpreds - values, -0.5, 0.5) = [0.5, 0.5]; max keeps the unclipped
    loss_c, frac_c = compute_value_loss(vpreds, returns, values, m, 0.5, "token-mean")
    assert loss_c.item() == pytest.approx(loss.item()) and frac_c.item() == 0
    # returns far away: the clipped term is larger and wins
    loss_c, frac_c = compute_value_loss(vpreds, torch.tensor([[5.0, 5.0]]), values, m, 0.5, "token-mean")
    assert loss_c.item() == pytest.approx(0.5 * ((5 - 0.5) ** 2 + (5 - 0.5) ** 2) / 2)
    assert frac_c.item() == 1.0


def test_entropy_and_logprobs():
    logits = torch.zeros(1, 1, 4)
    assert entropy_from_logits(logits).item() == pytest.approx(torch.log(torch.tensor(4.0)).item())
    peaked = torch.tensor([[[100.0, 0.0, 0.0]]])
    assert entropy_from_logits(peaked).item() == pytest.approx(0.0, abs=1e-6)
    lp = logprobs_from_logits(torch.tensor([[[0.0, 0.0]]]), torch.tensor([[1]]))
    assert lp.item() == pytest.approx(-0.6931, abs=1e-4)


def test_sft_loss_is_masked_negative_log_likelihood():
    lp = torch.tensor([[-1.0, -3.0, -50.0]])
    assert compute_sft_loss(lp, torch.tensor([[1.0, 1.0, 0.0]])).item() == pytest.approx(2.0)


def test_masked_whiten():
    x = torch.tensor([[1.0, 2.0, 3.0, 100.0]])
    m = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    w = masked_whiten(x, m)
    assert abs(masked_mean(w, m).item()) < 1e-6
    assert w[0, 3] == 0
    assert torch.allclose(w[0, :3], torch.tensor([-1.0, 0.0, 1.0]), atol=1e-4)
