import math

import pytest
import torch

from services.ppo import (
    AdaptiveKLController,
    FixedKLController,
    apply_kl_penalty,
    kl_penalty,
    make_kl_controller,
    mix_reference_log_probs,
    reference_log_probs,
)


def test_kl_estimators_hand_values():
    lp, ref = torch.tensor([[-1.0]]), torch.tensor([[-1.5]])
    assert kl_penalty(lp, ref, "kl").item() == pytest.approx(0.5)
    assert kl_penalty(ref, lp, "abs").item() == pytest.approx(0.5)
    assert kl_penalty(lp, ref, "mse").item() == pytest.approx(0.125)
    assert kl_penalty(lp, ref, "low_var_kl").item() == pytest.approx(math.exp(-0.5) + 0.5 - 1)
    assert kl_penalty(lp, ref, "k3").item() == kl_penalty(lp, ref, "low_var_kl").item()
    with pytest.raises(ValueError, match="low_var_kl"):
        kl_penalty(lp, ref, "kl2")


def test_k3_is_nonnegative_and_unbiased_on_samples():
    torch.manual_seed(0)
    p = torch.softmax(torch.randn(6), -1)
    q = torch.softmax(torch.randn(6), -1)
    true_kl = (p * (p.log() - q.log())).sum()
    samples = torch.multinomial(p, 200000, replacement=True)
    k1 = kl_penalty(p.log()[samples], q.log()[samples], "kl")
    k3 = kl_penalty(p.log()[samples], q.log()[samples], "low_var_kl")
    assert torch.all(k3 >= 0)
    assert k1.mean().item() == pytest.approx(true_kl.item(), abs=0.02)
    assert k3.mean().item() == pytest.approx(true_kl.item(), abs=0.02)
    assert k3.var() < k1.var()


def test_full_kl_matches_torch():
    torch.manual_seed(1)
    lp = torch.log_softmax(torch.randn(2, 3, 5), -1)
    ref = torch.log_softmax(torch.randn(2, 3, 5), -1)
    expected = torch.nn.functional.kl_div(ref, lp, log_target=True, reduction="none").sum(-1)
    assert torch.allclose(kl_penalty(lp, ref, "full"), expected, atol=1e-6)
    assert torch.all(kl_penalty(lp, lp, "full").abs() < 1e-6)
    with pytest.raises(ValueError, match="full"):
        kl_penalty(lp[..., 0], ref[..., 0], "full")


def test_token_level_kl_reward():
    scores = torch.tensor([1.0, 2.0])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    kl = torch.tensor([[0.1, 0.2, 9.0], [0.0, 0.5, 1.0]])
    r = apply_kl_penalty(scores, mask, kl, kl_coef=0.5)
    expected = torch.tensor([[-0.05, 1.0 - 0.1, 0.0], [0.0, -0.25, 2.0 - 0.5]])
    assert torch.allclose(r, expected)
    assert torch.equal(apply_kl_penalty(scores, mask), torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 2.0]]))
    empty = apply_kl_penalty(torch.tensor([3.0]), torch.zeros(1, 2))
    assert torch.all(empty == 0)


def test_adaptive_kl_controller_moves_towards_target():
    c = AdaptiveKLController(init_kl_coef=0.2, target_kl=0.1, horizon=1000)
    c.update(current_kl=1.0, n_steps=100)  # far above target: error clipped at +0.2
    assert c.value == pytest.approx(0.2 * (1 + 0.2 * 100 / 1000))
    v = c.value
    c.update(current_kl=0.0, n_steps=100)  # below target: error clipped at -0.2
    assert c.value == pytest.approx(v * (1 - 0.2 * 0.1))
    v = c.value
    c.update(current_kl=0.11, n_steps=50)  # slightly above: error 0.1
    assert c.value == pytest.approx(v * (1 + 0.1 * 0.05))
    state = c.state_dict()
    d = AdaptiveKLController(1.0, 0.1, 1000)
    d.load_state_dict(state)
    assert d.value == c.value


def test_fixed_controller_and_factory():
    f = make_kl_controller(0.3, None, 10)
    assert isinstance(f, FixedKLController)
    f.update(100.0, 100)
    assert f.value == 0.3
    assert isinstance(make_kl_controller(0.3, 6.0, 10), AdaptiveKLController)


def test_reference_choices():
    sft, old = torch.tensor([[-1.0]]), torch.tensor([[-2.0]])
    assert reference_log_probs("sft", sft, old).item() == -1.0
    assert reference_log_probs("policy", None, old).item() == -2.0
    mix = reference_log_probs("mixture", sft, old, 0.25)
    assert mix.item() == pytest.approx(math.log(0.25 * math.exp(-1) + 0.75 * math.exp(-2)))
    assert mix_reference_log_probs(sft, old, 1.0).item() == -1.0
    with pytest.raises(ValueError, match="sft, policy, mixture"):
        reference_log_probs("ema", sft, old)
