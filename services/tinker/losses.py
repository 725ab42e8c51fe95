"""The losses a forward_backward names (`loss_fn`), as the Tinker SDK defines them: each a sum over
every token of every datum (no mean), from the training model's log-probs of the target tokens
and the datum's loss inputs.

    cross_entropy        -w * logp                                  target_tokens, weights (default 1)
    importance_sampling  -exp(logp - q) * A                         target_tokens, logprobs (q), advantages (A)
    ppo                  -min(r * A, clip(r, lo, hi) * A)           the same; r = exp(logp - q)
    cispo                -clip(r, lo, hi).detach() * logp * A       the same
    dro                  -(logp * A - beta/2 * (logp - q)^2)        the same; beta (default 0.05)
    gspo                 -min(s * A, clip(s, lo, hi) * A)           the same, and sequence_ratio_mask (m);
                         s = exp(mean_m(logp - q)) per datum, its gradient the token's own:
                         s_t = exp(sg(mean_m(logp - q)) + logp_t - sg(logp_t)) (GSPO-token)

ppo, cispo and gspo read `clip_low_threshold` (lo) and `clip_high_threshold` (hi) from
loss_fn_config, or per token from the datum's loss inputs of those names (the SDK's Datum knows
them): 0.8 and 1.2 for ppo and cispo; for gspo, whose ratio is a sequence's geometric mean, the
GSPO paper's 1 - 3e-4 and 1 + 4e-4. gspo's mean runs over the tokens whose sequence_ratio_mask is
nonzero (the SDK's cookbook sets it on the sampled tokens); without the mask, over the tokens with a
nonzero advantage (the sampled ones, as the SDK's datums carry them). `LOSSES` is the one list of
names: `loss_for` refuses any other with the list."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from ..ppo.losses import gspo_ratio
from .protocol import ApiError

Elementwise = Callable[[torch.Tensor, dict[str, torch.Tensor], dict[str, float]], torch.Tensor]


@dataclass(frozen=True)
class Loss:
    name: str
    inputs: frozenset[str]  # every datum carries these
    optional: frozenset[str]  # and may carry these
    fn: Elementwise  # (logp (n,), inputs, config) -> the per-token loss (n,)
    config: dict[str, float] = field(default_factory=dict)  # its loss_fn_config keys, with defaults

    def settings(self, given: dict[str, float | str]) -> dict[str, float]:
        """loss_fn_config read against this loss's keys: an unknown key or a non-number is refused."""
        unknown = sorted(set(given) - set(self.config))
        if unknown:
            allowed = ", ".join(self.config) or "none"
            raise ApiError(
                400, f"loss_fn_config: {unknown[0][:64]!r} is no setting of {self.name} (its settings: {allowed})"
            )
        out = dict(self.config)
        for k, v in given.items():
            if not isinstance(v, float):
                raise ApiError(400, f"loss_fn_config.{k}: a number, not text", param=f"loss_fn_config.{k}")
            out[k] = v
        return out


def _cross_entropy(logp, inputs, config):
    return -inputs.get("weights", torch.ones_like(logp)) * logp


def _ratio(logp, inputs):
    return torch.exp(logp - inputs["logprobs"])


def _importance_sampling(logp, inputs, config):
    return -_ratio(logp, inputs) * inputs["advantages"]


def _clip(ratio, inputs, config):
    """The ratio clipped to [lo, hi]: per token from the datum's inputs, else the config's."""
    low, high = (
        inputs.get(k, torch.full_like(ratio, config[k])) for k in ("clip_low_threshold", "clip_high_threshold")
    )
    return torch.minimum(torch.maximum(ratio, low), high)


def _ppo(logp, inputs, config):
    ratio, advantages = _ratio(logp, inputs), inputs["advantages"]
    return -torch.minimum(ratio * advantages, _clip(ratio, inputs, config) * advantages)


def _cispo(logp, inputs, config):
    return -_clip(_ratio(logp, inputs), inputs, config).detach() * logp * inputs["advantages"]


def _dro(logp, inputs, config):
    gap = logp - inputs["logprobs"]
    return -(logp * inputs["advantages"] - 0.5 * config["beta"] * gap * gap)


def _gspo(logp, inputs, config):
    advantages = inputs["advantages"]
    mask = inputs["sequence_ratio_mask"] != 0 if "sequence_ratio_mask" in inputs else advantages != 0
    ratio = gspo_ratio(logp, inputs["logprobs"], mask)
    return -torch.minimum(ratio * advantages, _clip(ratio, inputs, config) * advantages)


_RL = frozenset({"target_tokens", "logprobs", "advantages"})
_CLIP = {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}
_GSPO_CLIP = {"clip_low_threshold": 1 - 3e-4, "clip_high_threshold": 1 + 4e-4}
_PER_TOKEN_CLIP = frozenset(_CLIP)
LOSSES = {
    loss.name: loss
    for loss in (
        Loss("cross_entropy", frozenset({"target_tokens"}), frozenset({"weights"}), _cross_entropy),
        Loss("importance_sampling", _RL, frozenset(), _importance_sampling),
        Loss("ppo", _RL, _PER_TOKEN_CLIP, _ppo, dict(_CLIP)),
        Loss("cispo", _RL, _PER_TOKEN_CLIP, _cispo, dict(_CLIP)),
        Loss("dro", _RL, frozenset(), _dro, {"beta": 0.05}),
        Loss("gspo", _RL, _PER_TOKEN_CLIP | {"sequence_ratio_mask"}, _gspo, dict(_GSPO_CLIP)),
    )
}
# what to use instead of a loss of the SDK's list that this server does not compute
_INSTEAD = {
    "stable_reinforce": (
        " (it needs the sampler's per-sequence stability records; for RL, loss_fn=importance_sampling, ppo or gspo)"
    )
}


def loss_for(name: str, config: dict[str, float | str]) -> tuple[Loss, dict[str, float]]:
    """The loss `name` names and its settings; an unknown name is a 400 listing the supported ones."""
    loss = LOSSES.get(name)
    if loss is None:
        raise ApiError(
            400,
            f"loss_fn {name[:64]!r} is not supported here{_INSTEAD.get(name, '')}; supported: {', '.join(LOSSES)}",
            param="loss_fn",
            code="unsupported_loss",
        )
    settings = loss.settings(config)
    if "clip_low_threshold" in settings and not (
        0 <= settings["clip_low_threshold"] <= 1 <= settings["clip_high_threshold"]
    ):
        raise ApiError(400, "loss_fn_config: needs 0 <= clip_low_threshold <= 1 <= clip_high_threshold")
    if "beta" in settings and not 0 <= settings["beta"] <= 1e6:
        raise ApiError(400, "loss_fn_config.beta: needs 0 <= beta <= 1e6", param="loss_fn_config.beta")
    return loss, settings


def check_inputs(loss: Loss, i: int, names: set[str]) -> None:
    """Datum `i`'s loss inputs are those `loss` takes: every required one, no other."""
    missing = sorted(loss.inputs - names)
    if missing:
        raise ApiError(400, f"data[{i}].loss_fn_inputs: {loss.name} needs {', '.join(missing)}", param="data")
    extra = sorted(names - loss.inputs - loss.optional)
    if extra:
        takes = ", ".join(sorted(loss.inputs | loss.optional))
        raise ApiError(
            400, f"data[{i}].loss_fn_inputs: {extra[0][:64]!r} is no input of {loss.name} (it takes {takes})", "data"
        )
