"""The Tinker API's losses as functions of one datum's log-probs (services/tinker/losses.py): dro's
value and first-order gradient, gspo's sequence-level ratio (a geometric mean over the masked
tokens), its token-level gradient and its clipping; the loss the server does not compute refused
with what to use instead."""

from __future__ import annotations

import math

import pytest
import torch

from services.tinker.losses import loss_for
from services.tinker.protocol import ApiError


def _grad(name: str, logp: list[float], config=None, **inputs: list[float]):
    loss, settings = loss_for(name, config or {})
    x = torch.tensor(logp, dtype=torch.float64, requires_grad=True)
    values = loss.fn(x, {k: torch.tensor(v, dtype=torch.float64) for k, v in inputs.items()}, settings)
    values.sum().backward()
    return values.detach(), x.grad


def test_dro_is_the_advantage_weighted_log_prob_with_a_quadratic_pull_to_the_sampler():
    logp, q, adv = [-1.0, -2.0, -0.5], [-1.0, -1.5, -0.7], [1.0, -2.0, 0.5]
    values, grad = _grad("dro", logp, {"beta": 0.1}, logprobs=q, advantages=adv)
    for v, g, lp, lq, a in zip(values, grad, logp, q, adv):
        assert math.isclose(float(v), -(lp * a - 0.05 * (lp - lq) ** 2), rel_tol=1e-9)
        assert math.isclose(float(g), -(a - 0.1 * (lp - lq)), rel_tol=1e-9)
    # on the sampler's own log-probs its gradient is the policy gradient's, -A per token
    _, on_policy = _grad("dro", q, logprobs=q, advantages=adv)
    assert torch.allclose(on_policy, -torch.tensor(adv, dtype=torch.float64))


def test_gspos_ratio_is_the_masked_geometric_mean_and_its_gradient_the_tokens_own():
    # a prompt position (mask 0, advantage 0) whose log-prob is far from the sampler's changes nothing
    logp, q = [-3.0, -1.0, -1.0001, -0.9999], [0.0, -1.0, -1.0, -1.0]
    mask, adv = [0.0, 1.0, 1.0, 1.0], [0.0, 2.0, 2.0, 2.0]
    values, grad = _grad("gspo", logp, logprobs=q, advantages=adv, sequence_ratio_mask=mask)
    s = math.exp(((-1.0 + 1.0) + (-1.0001 + 1.0) + (-0.9999 + 1.0)) / 3)  # inside the clip
    assert [round(float(v), 9) for v in values] == [0.0] + [round(-s * 2.0, 9)] * 3
    assert torch.allclose(grad, torch.tensor([0.0, -s * 2.0, -s * 2.0, -s * 2.0], dtype=torch.float64))
    # without the mask, the tokens with an advantage are the sequence: the same loss
    unmasked, _ = _grad("gspo", logp, logprobs=q, advantages=adv)
    assert torch.allclose(unmasked, values)


def test_gspo_clips_the_sequence_ratio():
    # the sequence moved 1% above the sampler: past GSPO's 1 + 4e-4 for a positive advantage, so no gradient
    logp, q, adv = [math.log(1.01) - 1.0] * 3, [-1.0] * 3, [1.0] * 3
    values, grad = _grad("gspo", logp, logprobs=q, advantages=adv)
    assert torch.allclose(values, torch.full((3,), -(1 + 4e-4), dtype=torch.float64))
    assert torch.count_nonzero(grad) == 0
    # a negative advantage is not clipped on that side: the gradient pushes the tokens down
    _, pushed = _grad("gspo", logp, logprobs=q, advantages=[-1.0] * 3)
    assert bool((pushed > 0).all())
    # wider thresholds from the config let it through
    _, wide = _grad("gspo", logp, {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}, logprobs=q, advantages=adv)
    assert bool((wide < 0).all())


@pytest.mark.parametrize(
    "name, config, words",
    [
        ("stable_reinforce", {}, "importance_sampling, ppo or gspo"),
        ("dro", {"beta": -1.0}, "0 <= beta"),
        ("gspo", {"clip_low_threshold": 1.1}, "clip_low_threshold <= 1"),
        ("dro", {"clip_low_threshold": 0.8}, "no setting of dro (its settings: beta)"),
    ],
)
def test_what_the_losses_refuse(name, config, words):
    with pytest.raises(ApiError) as e:
        loss_for(name, config)
    assert e.value.status == 400 and words in e.value.message
