import math

import pytest
import torch

from services.ppo import (
    compute_advantages,
    compute_gae_advantage_return,
    compute_grpo_outcome_advantage,
    compute_reinforce_plus_plus_advantage,
    compute_reinforce_return,
    compute_rloo_outcome_advantage,
    masked_mean,
)


def reference_gae(rewards, values, gamma, lam):
    """Textbook GAE on one unpadded sequence, written independently of the library."""
    T = len(rewards)
    adv = [0.0] * T
    last = 0.0
    for t in reversed(range(T)):
        nv = values[t + 1] if t + 1 < T else 0.0
        delta = rewards[t] + gamma * nv - values[t]
        last = delta + gamma * lam * last
        adv[t] = last
    return adv, [a + v for a, v in zip(adv, values)]


def test_gae_hand_computed():
    # r = [0, 0, 1], V = [0.5, 0.6, 0.7], gamma = 0.9, lam = 0.5
    r = torch.tensor([[0.0, 0.0, 1.0]])
    v = torch.tensor([[0.5, 0.6, 0.7]])
    m = torch.ones(1, 3)
    adv, ret = compute_gae_advantage_return(r, v, m, gamma=0.9, lam=0.5)
    d2 = 1.0 - 0.7  # last step: no bootstrap
    d1 = 0.0 + 0.9 * 0.7 - 0.6
    d0 = 0.0 + 0.9 * 0.6 - 0.5
    a2 = d2
    a1 = d1 + 0.45 * a2
    a0 = d0 + 0.45 * a1
    assert torch.allclose(adv, torch.tensor([[a0, a1, a2]]), atol=1e-6)
    assert torch.allclose(ret, adv + v, atol=1e-6)


def test_gae_lambda_one_is_monte_carlo_and_lambda_zero_is_td():
    r = torch.tensor([[0.1, -0.2, 1.0, 0.5]])
    v = torch.tensor([[0.3, 0.2, 0.9, 0.4]])
    m = torch.ones(1, 4)
    _, ret = compute_gae_advantage_return(r, v, m, gamma=1.0, lam=1.0)
    mc = torch.tensor([[1.4, 1.3, 1.5, 0.5]])  # reward-to-go
    assert torch.allclose(ret, mc, atol=1e-6)
    adv, _ = compute_gae_advantage_return(r, v, m, gamma=0.8, lam=0.0)
    td = torch.tensor([[0.1 + 0.8 * 0.2 - 0.3, -0.2 + 0.8 * 0.9 - 0.2, 1.0 + 0.8 * 0.4 - 0.9, 0.5 - 0.4]])
    assert torch.allclose(adv, td, atol=1e-6)


def test_gae_matches_reference_on_random_padded_batch():
    torch.manual_seed(0)
    B, T = 6, 9
    r, v = torch.randn(B, T), torch.randn(B, T)
    lengths = [9, 1, 4, 7, 2, 5]
    m = torch.zeros(B, T)
    for i, n in enumerate(lengths):
        m[i, :n] = 1
    adv, ret = compute_gae_advantage_return(r, v, m, gamma=0.97, lam=0.9)
    for i, n in enumerate(lengths):
        ra, rr = reference_gae(r[i, :n].tolist(), v[i, :n].tolist(), 0.97, 0.9)
        assert torch.allclose(adv[i, :n], torch.tensor(ra), atol=1e-5)
        assert torch.allclose(ret[i, :n], torch.tensor(rr), atol=1e-5)
        assert torch.all(adv[i, n:] == 0) and torch.all(ret[i, n:] == 0)


def test_masked_rewards_and_values_change_no_output():
    torch.manual_seed(1)
    B, T = 4, 6
    r, v = torch.randn(B, T), torch.randn(B, T)
    m = (torch.rand(B, T) > 0.3).float()  # holes in the middle too (multi-turn masks)
    adv1, ret1 = compute_gae_advantage_return(r, v, m, 0.9, 0.8)
    noise_r = torch.where(m.bool(), r, torch.randn(B, T) * 100)
    noise_v = torch.where(m.bool(), v, torch.full((B, T), float("nan")))
    adv2, ret2 = compute_gae_advantage_return(noise_r, noise_v, m, 0.9, 0.8)
    assert torch.equal(adv1, adv2) and torch.equal(ret1, ret2)


def test_gae_skips_a_hole_as_if_it_were_not_there():
    r = torch.tensor([[0.0, 9.0, 1.0]])
    v = torch.tensor([[0.2, 5.0, 0.4]])
    adv, _ = compute_gae_advantage_return(r, v, torch.tensor([[1.0, 0.0, 1.0]]), 0.9, 0.7)
    dense, _ = compute_gae_advantage_return(
        torch.tensor([[0.0, 1.0]]), torch.tensor([[0.2, 0.4]]), torch.ones(1, 2), 0.9, 0.7
    )
    assert torch.allclose(adv[:, [0, 2]], dense) and adv[0, 1] == 0


def test_grpo_group_normalisation():
    r = torch.zeros(4, 3)
    r[:, -1] = torch.tensor([1.0, 0.0, 3.0, 5.0])
    m = torch.ones(4, 3)
    adv, ret = compute_grpo_outcome_advantage(r, m, index=["a", "a", "b", "b"])
    s = math.sqrt(0.5)  # std of {0, 1} (unbiased) = 0.7071
    expected = torch.tensor([0.5 / s, -0.5 / s, -1 / math.sqrt(2), 1 / math.sqrt(2)])
    assert torch.allclose(adv[:, 0], expected, atol=1e-4)
    assert torch.equal(adv, ret)
    adv_nostd, _ = compute_grpo_outcome_advantage(r, m, ["a", "a", "b", "b"], norm_adv_by_std=False)
    assert torch.allclose(adv_nostd[:, 0], torch.tensor([0.5, -0.5, -1.0, 1.0]))


def test_grpo_advantages_are_zero_mean_within_each_group_and_masked():
    torch.manual_seed(2)
    r = torch.randn(8, 5)
    m = torch.ones(8, 5)
    m[3, 2:] = 0
    index = [0, 0, 0, 0, 1, 1, 1, 1]
    adv, _ = compute_grpo_outcome_advantage(r, m, index)
    per_seq = adv[:, 0]
    assert abs(per_seq[:4].sum()) < 1e-5 and abs(per_seq[4:].sum()) < 1e-5
    assert torch.all(adv[3, 2:] == 0)


def test_rloo_leave_one_out_baseline():
    r = torch.zeros(3, 2)
    r[:, -1] = torch.tensor([1.0, 2.0, 6.0])
    adv, _ = compute_rloo_outcome_advantage(r, torch.ones(3, 2), [7, 7, 7])
    assert torch.allclose(adv[:, 0], torch.tensor([1 - 4.0, 2 - 3.5, 6 - 1.5]))


def test_reinforce_return_to_go_with_discount():
    r = torch.tensor([[1.0, 0.0, 2.0, 9.0]])
    m = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    adv, ret = compute_reinforce_return(r, m, gamma=0.5)
    assert torch.allclose(ret, torch.tensor([[1.5, 1.0, 2.0, 0.0]]))
    assert torch.equal(adv, ret)


def test_reinforce_plus_plus_is_whitened():
    torch.manual_seed(3)
    r = torch.randn(5, 4)
    m = torch.ones(5, 4)
    adv, _ = compute_reinforce_plus_plus_advantage(r, m, gamma=1.0)
    assert abs(masked_mean(adv, m).item()) < 1e-5


def test_dispatch_names_and_errors():
    r, m = torch.ones(2, 2), torch.ones(2, 2)
    with pytest.raises(
        ValueError, match="unknown adv_estimator 'ppo2'; valid: gae, reinforce, grpo, rloo, reinforce_plus_plus"
    ):
        compute_advantages("ppo2", r, m)
    with pytest.raises(ValueError, match="critic"):
        compute_advantages("gae", r, m)
    with pytest.raises(ValueError, match="group index"):
        compute_advantages("grpo", r, m)
