"""The full PPO objective of one micro-batch (services/ppo/objective.py): each term's sign and
coefficient, masking, the GSPO fixed aggregation, the dual clip, and gradient accumulation over
micro-batches equal to one pass in every `loss_agg_mode`."""

import math
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from services.ppo import LOSS_AGG_MODES, AggNorm, agg_loss, compute_gspo_policy_loss, compute_policy_loss, kl_penalty
from services.ppo.objective import FIXED_AGG_MODES, ObjectiveSettings, ppo_objective

TOL = dict(rtol=1e-5, atol=1e-6)


def _close(a, b, **tol):
    torch.testing.assert_close(
        torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64), **(tol or TOL)
    )


def _two_by_three():
    """The 2x3 hand example: ratios, advantages and a mask with one padded position."""
    old = torch.zeros(2, 3)
    ratio = torch.tensor([[1.0, 1.5, 0.5], [2.0, 0.9, 100.0]])
    adv = torch.tensor([[1.0, 1.0, -1.0], [-1.0, 2.0, -1.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    return old, ratio.log(), adv, mask


# per-token losses with clip 0.2 and dual clip 3: -1, -1.2 (clipped), 0.8 (clipped), 2.0, -1.8; padded
# row sums -1.4 and 0.2 over 3 and 2 tokens
HAND_PG = {
    "token-mean": -1.2 / 5,
    "seq-mean-token-sum": (-1.4 + 0.2) / 2,
    "seq-mean-token-mean": (-1.4 / 3 + 0.2 / 2) / 2,
    "seq-mean-token-sum-norm": (-1.4 + 0.2) / 3,
}


def _batch(B=6, T=5, seed=0):
    """A mini-batch with varied lengths (right padding) and one row with no token."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([5, 2, 0, 3, 1, 4][:B])
    mask = (torch.arange(T).expand(B, T) < lengths.unsqueeze(1)).float()
    old = -torch.rand(B, T, generator=g) * 3
    log_prob = old + torch.randn(B, T, generator=g) * 0.3
    return dict(
        log_prob=log_prob,
        entropy=torch.rand(B, T, generator=g) * 2,
        old_log_prob=old,
        advantages=torch.randn(B, T, generator=g),
        mask=mask,
        ref_log_prob=old + torch.randn(B, T, generator=g) * 0.2,
        ptx_rows=torch.rand(B, generator=g) + 1.0,
    )  # each row's SFT example loss


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_loss_is_the_policy_loss_alone_when_other_terms_are_off(mode):
    old, log_prob, adv, mask = _two_by_three()
    entropy = torch.tensor([[0.5, 1.0, 2.0], [3.0, 4.0, 5.0]])
    ref = log_prob - 0.7
    # use_kl_loss False: kl_loss_coef has no effect; ptx_coef 0: a given ptx_loss has no effect
    s = ObjectiveSettings(loss_agg_mode=mode, entropy_coef=0.0, use_kl_loss=False, kl_loss_coef=0.5, ptx_coef=0.0)
    loss, metrics = ppo_objective(s, log_prob, entropy, old, adv, mask, ref_log_prob=ref, ptx_loss=torch.tensor(7.0))
    assert loss.item() == pytest.approx(HAND_PG[mode], rel=1e-5)
    expected, *_ = compute_policy_loss(old, log_prob, adv, mask, cliprange=0.2, clip_ratio_c=3.0, loss_agg_mode=mode)
    _close(loss, expected)
    assert metrics["ppo/pg_loss"][0] == pytest.approx(HAND_PG[mode], rel=1e-5)
    assert metrics["ppo/pg_loss"][1] == pytest.approx(1.0)  # the whole mini-batch
    assert "ppo/kl_loss" not in metrics


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_each_term_enters_with_its_sign_and_coefficient(mode):
    b = _batch()
    base_s = ObjectiveSettings(loss_agg_mode=mode, kl_penalty="kl")
    args = (b["log_prob"], b["entropy"], b["old_log_prob"], b["advantages"], b["mask"])
    kw = dict(ref_log_prob=b["ref_log_prob"], ptx_loss=torch.tensor(1.7), ptx_share=1.0)

    def loss(**changes):
        return ppo_objective(replace(base_s, **changes), *args, **kw)

    base, _ = loss()
    entropy_term = agg_loss(b["entropy"], b["mask"], mode)
    kl_term = agg_loss(b["log_prob"] - b["ref_log_prob"], b["mask"], mode)
    assert entropy_term.item() > 0.1 and abs(kl_term.item()) > 1e-3

    with_entropy, m = loss(entropy_coef=0.1)
    _close(with_entropy - base, -0.1 * entropy_term)
    assert m["ppo/entropy_loss"][0] == pytest.approx(entropy_term.item(), rel=1e-5)

    with_kl, m = loss(use_kl_loss=True, kl_loss_coef=0.25)
    _close(with_kl - base, 0.25 * kl_term)
    assert m["ppo/kl_loss"][0] == pytest.approx(kl_term.item(), rel=1e-5)

    with_ptx, m = loss(ptx_coef=0.3)
    _close(with_ptx - base, torch.tensor(0.3 * 1.7))
    assert m["ppo/ptx_loss"] == (pytest.approx(1.7), 1.0)

    everything, _ = loss(entropy_coef=0.1, use_kl_loss=True, kl_loss_coef=0.25, ptx_coef=0.3)
    _close(everything, base - 0.1 * entropy_term + 0.25 * kl_term + 0.3 * 1.7)


def test_terms_on_the_hand_example():
    old, log_prob, adv, mask = _two_by_three()
    entropy = torch.tensor([[0.5, 1.0, 2.0], [3.0, 4.0, 99.0]])  # 99 is padded
    ref = log_prob - torch.tensor([[0.1, 0.2, 0.3], [0.4, 0.5, 99.0]])  # k1 = log_prob - ref
    s = ObjectiveSettings(entropy_coef=0.01, use_kl_loss=True, kl_loss_coef=0.1, kl_penalty="kl", ptx_coef=0.5)
    loss, _ = ppo_objective(
        s, log_prob, entropy, old, adv, mask, ref_log_prob=ref, ptx_loss=torch.tensor(2.0), ptx_share=0.5
    )
    expected = -1.2 / 5 - 0.01 * (10.5 / 5) + 0.1 * (1.5 / 5) + 0.5 * 2.0 * 0.5
    assert loss.item() == pytest.approx(expected, rel=1e-5)


def test_full_kl_loss_uses_the_vocabulary_log_probs():
    g = torch.Generator().manual_seed(3)
    full = torch.log_softmax(torch.randn(2, 3, 7, generator=g), -1)
    ref_full = torch.log_softmax(torch.randn(2, 3, 7, generator=g), -1)
    labels = torch.randint(0, 7, (2, 3), generator=g)
    log_prob = full.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    args = (log_prob, torch.zeros(2, 3), log_prob.detach(), torch.ones(2, 3), mask)
    base, _ = ppo_objective(ObjectiveSettings(), *args)
    s = ObjectiveSettings(use_kl_loss=True, kl_loss_coef=0.2, kl_penalty="full")
    loss, metrics = ppo_objective(s, *args, ref_log_prob=ref_full, kl_input=full)
    kl = agg_loss(kl_penalty(full, ref_full, "full"), mask, "token-mean")
    assert kl.item() > 0
    _close(loss - base, 0.2 * kl)
    assert metrics["ppo/kl_loss"][0] == pytest.approx(kl.item(), rel=1e-5)


def test_rollout_is_weights_multiply_the_policy_loss():
    b = _batch(seed=4)
    w = torch.rand(6, 5, generator=torch.Generator().manual_seed(5)) + 0.5
    loss, _ = ppo_objective(
        ObjectiveSettings(),
        b["log_prob"],
        b["entropy"],
        b["old_log_prob"],
        b["advantages"],
        b["mask"],
        rollout_is_weights=w,
    )
    expected, *_ = compute_policy_loss(
        b["old_log_prob"], b["log_prob"], b["advantages"], b["mask"], cliprange=0.2, rollout_is_weights=w
    )
    unweighted, *_ = compute_policy_loss(b["old_log_prob"], b["log_prob"], b["advantages"], b["mask"], cliprange=0.2)
    _close(loss, expected)
    assert abs(loss.item() - unweighted.item()) > 1e-3


@pytest.mark.parametrize("policy_loss", ["vanilla", "gspo"])
@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_masked_positions_change_neither_loss_nor_gradient(mode, policy_loss):
    b = _batch(seed=1)
    s = ObjectiveSettings(
        policy_loss=policy_loss,
        loss_agg_mode=mode,
        entropy_coef=0.05,
        use_kl_loss=True,
        kl_loss_coef=0.1,
        kl_penalty="low_var_kl",
    )
    pad = ~b["mask"].bool()

    def run(junk: bool):
        def j(x, v):
            return torch.where(pad, torch.full_like(x, v), x) if junk else x.clone()

        log_prob = j(b["log_prob"], -1e4).requires_grad_()
        entropy = j(b["entropy"], 1e6).requires_grad_()
        loss, metrics = ppo_objective(
            s,
            log_prob,
            entropy,
            j(b["old_log_prob"], 50.0),
            j(b["advantages"], -1e3),
            b["mask"],
            ref_log_prob=j(b["ref_log_prob"], 60.0),
        )
        loss.backward()
        return loss, metrics, log_prob.grad, entropy.grad

    clean, junk = run(False), run(True)
    assert torch.isfinite(junk[0])
    _close(junk[0], clean[0])
    for k in clean[1]:
        assert junk[1][k][0] == pytest.approx(clean[1][k][0], rel=1e-5, abs=1e-6), k
    for grad_clean, grad_junk in zip(clean[2:], junk[2:]):
        assert torch.all(grad_junk[pad] == 0) and torch.all(grad_clean[pad] == 0)
        _close(grad_junk, grad_clean)
    assert clean[2].abs().sum() > 0 and clean[3].abs().sum() > 0  # the real positions do get gradient


def _nan_padded_run(policy_loss):
    b = _batch(seed=2)
    pad = ~b["mask"].bool()
    s = ObjectiveSettings(policy_loss=policy_loss, entropy_coef=0.05, use_kl_loss=True, kl_loss_coef=0.1)
    log_prob = torch.where(pad, torch.full_like(b["log_prob"], -math.inf), b["log_prob"]).requires_grad_()
    old = torch.where(pad, torch.full_like(b["old_log_prob"], math.nan), b["old_log_prob"])
    loss, _ = ppo_objective(s, log_prob, b["entropy"], old, b["advantages"], b["mask"], ref_log_prob=b["ref_log_prob"])
    loss.backward()
    return loss, log_prob.grad


def test_non_finite_padding_is_ignored_by_the_vanilla_objective():
    loss, grad = _nan_padded_run("vanilla")
    assert torch.isfinite(loss) and torch.all(torch.isfinite(grad))


def test_non_finite_padding_is_ignored_by_the_gspo_objective():
    loss, grad = _nan_padded_run("gspo")
    assert torch.isfinite(loss) and torch.all(torch.isfinite(grad))


MICRO_BATCHES = [[0, 1], [2, 3, 4], [5]]  # row 2 has no token; rows 1, 2, 4 give trimmed widths


@pytest.mark.parametrize("policy_loss", ["vanilla", "gspo"])
@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_micro_batches_sum_to_the_one_pass_loss_and_gradient(mode, policy_loss):
    b = _batch()
    s = ObjectiveSettings(
        policy_loss=policy_loss,
        loss_agg_mode=mode,
        entropy_coef=0.03,
        use_kl_loss=True,
        kl_loss_coef=0.2,
        kl_penalty="low_var_kl",
        ptx_coef=0.4,
    )
    B = b["mask"].shape[0]

    def leaves():
        return b["log_prob"].clone().requires_grad_(), b["entropy"].clone().requires_grad_()

    lp, ent = leaves()
    whole, whole_metrics = ppo_objective(
        s,
        lp,
        ent,
        b["old_log_prob"],
        b["advantages"],
        b["mask"],
        ref_log_prob=b["ref_log_prob"],
        ptx_loss=b["ptx_rows"].mean(),
        ptx_share=1.0,
    )
    whole.backward()
    whole_grads = (lp.grad, ent.grad)

    lp, ent = leaves()
    norm = AggNorm(b["mask"])
    total, sums = torch.zeros(()), {}
    for rows in MICRO_BATCHES:
        r = torch.tensor(rows)
        t = max(int(b["mask"][r].sum(-1).max()), 1)  # trimmed to the micro-batch's longest row

        def cut(x, r=r, t=t):
            return x[r, :t]

        loss, metrics = ppo_objective(
            s,
            cut(lp),
            cut(ent),
            cut(b["old_log_prob"]),
            cut(b["advantages"]),
            cut(b["mask"]),
            norm,
            ref_log_prob=cut(b["ref_log_prob"]),
            ptx_loss=b["ptx_rows"][r].mean(),
            ptx_share=len(rows) / B,
        )
        loss.backward()
        total = total + loss.detach()
        for k, (v, w) in metrics.items():
            sums[k] = sums.get(k, 0.0) + v * w
    assert len({int(b["mask"][torch.tensor(r)].sum(-1).max()) for r in MICRO_BATCHES}) > 1  # widths differ
    _close(total, whole.detach())
    _close(lp.grad, whole_grads[0])
    _close(ent.grad, whole_grads[1])
    assert whole_grads[0].abs().sum() > 0
    # each metric's sum over the micro-batches of value x weight (what the learner's Metrics adds up)
    # is its one-pass value (the weights need not sum to 1: seq-mean-token-sum-norm's are width shares)
    assert set(sums) == set(whole_metrics)
    for k, (v, w) in whole_metrics.items():
        assert w == pytest.approx(1.0), k
        assert sums[k] == pytest.approx(v, rel=1e-5, abs=1e-6), k


def test_gspo_aggregates_seq_mean_token_mean_whatever_the_mode():
    assert FIXED_AGG_MODES["gspo"] == "seq-mean-token-mean"
    # row 1: log-ratios 0.1, 0.3 -> s = e^0.2 > 1.2, A = 1: -1.2 per token; row 2: s = e^-0.05, A = -1
    old = torch.zeros(2, 2)
    log_prob = torch.tensor([[0.1, 0.3], [-0.05, 0.0]])
    adv = torch.tensor([[1.0, 1.0], [-1.0, -1.0]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    expected = (-1.2 + math.exp(-0.05)) / 2  # the token mean would be (-2.4 + e^-0.05) / 3
    for mode in LOSS_AGG_MODES:
        s = ObjectiveSettings(policy_loss="gspo", loss_agg_mode=mode)
        loss, metrics = ppo_objective(s, log_prob, torch.zeros(2, 2), old, adv, mask)
        assert loss.item() == pytest.approx(expected, rel=1e-5), mode
        assert metrics["ppo/pg_loss"][0] == pytest.approx(expected, rel=1e-5), mode
        direct, *_ = compute_gspo_policy_loss(old, log_prob, adv, mask, cliprange=0.2)
        _close(loss, direct)


def test_gspo_micro_batch_weight_is_its_sequence_share_not_its_token_share():
    # mini-batch: 2 sequences, 4 tokens; the micro-batch is row 1: 1 of 2 sequences, 1 of 4 tokens
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    norm = AggNorm(mask)
    old, log_prob = torch.zeros(1, 1), torch.zeros(1, 1)  # on-policy: loss -A
    entropy = torch.tensor([[2.0]])
    s = ObjectiveSettings(policy_loss="gspo", loss_agg_mode="token-mean", entropy_coef=0.1)
    loss, metrics = ppo_objective(s, log_prob, entropy, old, torch.tensor([[3.0]]), mask[1:, :1], norm)
    assert metrics["ppo/pg_loss"] == (pytest.approx(-3.0), pytest.approx(0.5))
    assert metrics["ppo/entropy_loss"] == (pytest.approx(2.0), pytest.approx(0.25))  # entropy keeps token-mean
    assert loss.item() == pytest.approx(-3.0 * 0.5 - 0.1 * 2.0 * 0.25, rel=1e-6)
    vanilla, _ = ppo_objective(
        replace(s, policy_loss="vanilla"), log_prob, entropy, old, torch.tensor([[3.0]]), mask[1:, :1], norm
    )
    assert vanilla.item() == pytest.approx(-3.0 * 0.25 - 0.1 * 2.0 * 0.25, rel=1e-6)


def _one_token(ratio, adv, **settings):
    log_prob = torch.tensor([[math.log(ratio)]], requires_grad=True)
    loss, metrics = ppo_objective(
        ObjectiveSettings(**settings),
        log_prob,
        torch.zeros(1, 1),
        torch.zeros(1, 1),
        torch.tensor([[adv]]),
        torch.ones(1, 1),
    )
    loss.backward()
    return loss.item(), metrics, log_prob.grad.item()


def test_dual_clip_bounds_a_negative_advantage_with_a_large_ratio():
    loss, metrics, grad = _one_token(100.0, -10.0)  # default dual_clip_c = 3
    assert loss == pytest.approx(30.0, rel=1e-5)
    assert metrics["ppo/pg_clipfrac_lower"][0] == pytest.approx(1.0)
    assert grad == 0.0  # the bound is a constant
    assert _one_token(100.0, -10.0, dual_clip_c=5.0)[0] == pytest.approx(50.0, rel=1e-5)
    loss, metrics, grad = _one_token(100.0, -10.0, dual_clip_c=None)
    assert loss == pytest.approx(1000.0, rel=1e-5)
    assert metrics["ppo/pg_clipfrac_lower"][0] == 0.0
    assert grad == pytest.approx(1000.0, rel=1e-5)  # d(-A * ratio)/dlog_prob = -A * ratio
    # below the bound, and for a positive advantage, the dual clip changes nothing
    assert _one_token(2.0, -1.0)[0] == pytest.approx(_one_token(2.0, -1.0, dual_clip_c=None)[0])
    assert _one_token(100.0, 10.0)[0] == pytest.approx(-12.0, rel=1e-5)


def test_asymmetric_clip_range_reaches_the_policy_loss():
    assert _one_token(1.5, 1.0, clip_low=0.2, clip_high=0.28)[0] == pytest.approx(-1.28, rel=1e-5)
    assert _one_token(0.5, -1.0, clip_low=0.1, clip_high=0.28)[0] == pytest.approx(0.9, rel=1e-5)


def test_gspo_ignores_the_dual_clip():
    loss, _, _ = _one_token(100.0, -10.0, policy_loss="gspo", dual_clip_c=3.0)
    assert loss == pytest.approx(1000.0, rel=1e-5)


def test_settings_from_config():
    cfg = SimpleNamespace(
        policy_loss="gspo",
        clip_low=0.2,
        clip_high=0.28,
        dual_clip_loss=False,
        dual_clip_c=3.0,
        loss_agg_mode="seq-mean-token-sum",
        entropy_coef=0.01,
        use_kl_loss=True,
        kl_loss_coef=0.1,
        kl_penalty="low_var_kl",
        ptx_coef=0.5,
        distill=SimpleNamespace(enabled=True, forward_kl_coef=0.25),
    )
    s = ObjectiveSettings.from_config(cfg)
    assert s.forward_kl_coef == 0.25
    assert s.dual_clip_c is None and s.clip_high == 0.28 and s.loss_agg_mode == "seq-mean-token-sum"
    assert ObjectiveSettings.from_config(replace_ns(cfg, dual_clip_loss=True, dual_clip_c=4.0)).dual_clip_c == 4.0


def replace_ns(ns, **changes):
    return SimpleNamespace(**{**vars(ns), **changes})
