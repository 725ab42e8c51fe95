"""The algorithm's registries: lookup, aliases, errors, and the config's choices coming from them."""

import typing

import pytest
import torch

from services.common.config import Config, ConfigError, config_from_dict
from services.ppo import (
    ADV_ESTIMATORS,
    KL_ESTIMATORS,
    POLICY_LOSSES,
    Registry,
    compute_gspo_policy_loss,
    compute_policy_loss,
    kl_penalty,
)


def test_registry_lookup_aliases_and_errors():
    reg = Registry("widget")

    @reg.register("a", "alpha")
    def fa():
        return "A"

    assert reg.get("a") is fa and reg.get("alpha") is fa
    assert reg.names() == ("a",) and reg.choices() == ("a", "alpha")
    with pytest.raises(ValueError, match="unknown widget 'b'; valid: a, alpha"):
        reg.get("b")
    with pytest.raises(ValueError, match="registered twice"):
        reg.register("alpha")(fa)


def _choices(field: str) -> tuple:
    ann = Config.model_fields[field].annotation
    return typing.get_args(ann)


@pytest.mark.parametrize(
    "field,registry_names",
    [
        ("adv_estimator", ADV_ESTIMATORS.names()),
        ("kl_penalty", KL_ESTIMATORS.choices()),
        ("policy_loss", POLICY_LOSSES.names()),
    ],
)
def test_config_choices_are_the_registry_names(field, registry_names):
    assert _choices(field) == registry_names
    with pytest.raises(ConfigError, match=field):
        config_from_dict({field: "no-such-variant"})


def test_a_newly_registered_kl_estimator_is_used_by_kl_penalty():
    lp, ref = torch.zeros(1, 2), torch.ones(1, 2)
    assert torch.equal(kl_penalty(lp, ref, "k1"), kl_penalty(lp, ref, "kl"))
    assert torch.equal(kl_penalty(lp, ref, "k3"), KL_ESTIMATORS.get("low_var_kl")(lp, ref))


def test_gspo_uses_one_ratio_per_sequence():
    torch.manual_seed(0)
    old = torch.randn(3, 5)
    new = (old + 0.3 * torch.randn(3, 5)).requires_grad_(True)
    adv = torch.tensor([[1.0] * 5, [-1.0] * 5, [0.5] * 5])
    mask = torch.ones(3, 5)
    mask[2, 3:] = 0
    loss, clipfrac, kl, lower = compute_gspo_policy_loss(old, new, adv, mask, cliprange=0.2)
    # the clip decision is per sequence: every valid token of a sequence shares it
    seq_ratio = torch.exp(((new - old) * mask).sum(-1) / mask.sum(-1)).detach()
    clipped = ((seq_ratio < 0.8) & (adv[:, 0] < 0)) | ((seq_ratio > 1.2) & (adv[:, 0] > 0))
    per_seq = torch.where(clipped, torch.ones(3), torch.zeros(3))
    assert clipfrac.item() == pytest.approx(((per_seq.unsqueeze(-1) * mask).sum() / mask.sum()).item())
    # the value equals -A * clip(s_i) averaged per sequence, then over sequences
    s = torch.clamp(seq_ratio, 0.8, 1.2)
    expected = torch.stack([torch.maximum(-adv[i, 0] * seq_ratio[i], -adv[i, 0] * s[i]) for i in range(3)]).mean()
    assert loss.item() == pytest.approx(expected.item(), rel=1e-5)
    loss.backward()
    assert torch.all(new.grad[2, 3:] == 0)  # masked tokens get no gradient
    assert lower.item() == 0


def test_vanilla_is_compute_policy_loss():
    assert POLICY_LOSSES.get("vanilla") is compute_policy_loss
