"""Rollout correction: what the loss does about a sampler that differs from the learner, and how far
apart the two are.

The sampler draws the response tokens from `mu` (a bf16 vLLM engine, a policy a few versions behind
with `max_staleness` >= 1); PPO's ratio pi / pi_old assumes they came from the learner's `pi_old`.
Each mode turns the log-ratio log pi_old - log mu of the sampled tokens into per-token loss weights:

- `none`: no weights (the loss as if mu were pi_old);
- `token_tis`: min(pi_old / mu, C) per token (truncated importance sampling; Yao et al. 2025,
  https://fengyao.notion.site/off-policy-rl; verl's `rollout_is: token`);
- `seq_tis`: the sequence's weight min(prod_t pi_old / mu, C) = min(exp(sum_t log-ratio), C) on
  every token of the sequence (verl's `rollout_is: sequence`);
- `seq_mask`: 1 on every token of a sequence whose geometric-mean ratio exp(mean_t log-ratio) lies
  in [low, high] (default [0.99, 1.01]), 0 on every token of the others (SkyRL's and verl's
  geometric rejection mask);
- `icepop`: 1 on a token whose ratio lies in [low, high] (default [0.5, 2.0]), 0 on the others
  (the token masking of IcePop, Ling Team 2025, the Ring-1T report "Every Step Evolves"; IcePop
  also keeps the ratio itself as the weight inside the band, which this pure mask does not).

Whatever the mode, `rollout_correction` also measures the drift between mu and pi_old
(`drift_metrics`). A mode is a function in `ROLLOUT_CORRECTIONS`; its name is a valid
`rollout_correction` in the config.

Shapes: `B` sequences, `T` response positions; `response_mask` (B, T) is 1 on sampled tokens and 0
on padding (padding may hold anything, NaN included: it never reaches a weight or a metric).
"""

from __future__ import annotations

import torch

from .core import masked_mean
from .registry import Registry
from .rollout_is import LOG_RATIO_CLAMP, rollout_importance_weights

ROLLOUT_CORRECTIONS = Registry("rollout_correction")

# the band a masking mode keeps when its bounds are not given
SEQ_MASK_BOUNDS = (0.99, 1.01)
ICEPOP_BOUNDS = (0.5, 2.0)


def _bounds(low: float | None, high: float | None, default: tuple[float, float], mode: str) -> tuple[float, float]:
    lo = default[0] if low is None else low
    hi = default[1] if high is None else high
    if not 0 <= lo < hi:
        raise ValueError(f"rollout_correction {mode} needs 0 <= low < high, got low={lo}, high={hi}")
    return lo, hi


def _per_sequence(token_mask: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """(B,) -> (B, T): a per-sequence boolean spread onto the sequence's valid tokens."""
    return token_mask.unsqueeze(-1) & valid


# Each mode: (old_log_prob, rollout_log_prob, log_ratio, valid, threshold, low, high) ->
# (weights, corrected, metrics). log_ratio (B, T) float32 is log pi_old - log mu clamped to
# +-LOG_RATIO_CLAMP, 0 on padding; valid (B, T) bool. weights: (B, T) float32, 0 on padding, or
# None (no weights); corrected: (B, T) bool, the valid tokens whose weight the mode masked to 0 or
# truncated below their ratio; metrics: the mode's own (float).


@ROLLOUT_CORRECTIONS.register("none")
def _none(old_log_prob, rollout_log_prob, log_ratio, valid, threshold, low=None, high=None):
    return None, torch.zeros_like(valid), {}


@ROLLOUT_CORRECTIONS.register("token_tis")
def _token_tis(old_log_prob, rollout_log_prob, log_ratio, valid, threshold, low=None, high=None):
    """min(exp(log_ratio), C) per token; with the metrics of `rollout_importance_weights`
    (ppo/is_ratio_mean, ppo/is_ratio_max, ppo/is_clipped_frac, ppo/is_weight_mean)."""
    weights, metrics = rollout_importance_weights(old_log_prob, rollout_log_prob, valid, threshold)
    return weights, (torch.exp(log_ratio) > threshold) & valid, metrics


@ROLLOUT_CORRECTIONS.register("seq_tis")
def _seq_tis(old_log_prob, rollout_log_prob, log_ratio, valid, threshold, low=None, high=None):
    """min(exp(clamp(sum_t log_ratio, +-20)), C) on every valid token of the sequence."""
    if not threshold > 0:
        raise ValueError(f"rollout_correction seq_tis needs a threshold > 0, got {threshold}")
    seq_ratio = _sequence_ratio(log_ratio)
    weights = torch.where(valid, torch.clamp(seq_ratio, max=threshold).unsqueeze(-1), 0.0)
    return weights, _per_sequence(seq_ratio > threshold, valid), {}


@ROLLOUT_CORRECTIONS.register("seq_mask")
def _seq_mask(old_log_prob, rollout_log_prob, log_ratio, valid, threshold, low=None, high=None):
    """1 on the tokens of a sequence whose exp(mean_t log_ratio) lies in [low, high], else 0."""
    lo, hi = _bounds(low, high, SEQ_MASK_BOUNDS, "seq_mask")
    geo = torch.exp(masked_mean(log_ratio, valid, dim=-1))
    keep = (geo >= lo) & (geo <= hi)
    return _per_sequence(keep, valid).float(), _per_sequence(~keep, valid), {}


@ROLLOUT_CORRECTIONS.register("icepop")
def _icepop(old_log_prob, rollout_log_prob, log_ratio, valid, threshold, low=None, high=None):
    """1 on a token whose exp(log_ratio) lies in [low, high], else 0."""
    lo, hi = _bounds(low, high, ICEPOP_BOUNDS, "icepop")
    ratio = torch.exp(log_ratio)
    keep = (ratio >= lo) & (ratio <= hi) & valid
    return keep.float(), valid & ~keep, {}


def _sequence_ratio(log_ratio: torch.Tensor) -> torch.Tensor:
    """(B, T) clamped token log-ratios, 0 on padding -> (B,) exp(clamp(sum_t, +-20))."""
    return torch.exp(torch.clamp(log_ratio.sum(-1), -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))


def _normalised_ess(w: torch.Tensor, keep: torch.Tensor) -> float:
    """(sum w)^2 / (n sum w^2) over the `keep` entries (n of them): 1 when every w is equal, 1/n
    when one dominates; 0 when there is none."""
    n = int(keep.sum())
    if n == 0:
        return 0.0
    w = torch.where(keep, w.double(), 0.0)
    return (w.sum() ** 2 / (n * (w**2).sum()).clamp(min=1e-300)).item()


DRIFT_METRICS = (
    "rollout_correction/kl",
    "rollout_correction/kl_k1",
    "rollout_correction/chi2_token",
    "rollout_correction/chi2_seq",
    "rollout_correction/ess_token",
    "rollout_correction/ess_seq",
    "rollout_correction/log_ratio_abs_max",
)


def drift_metrics(log_ratio: torch.Tensor, valid: torch.Tensor) -> dict[str, float]:
    """How far the sampler's mu is from the learner's pi_old, from the sampled tokens' clamped
    log-ratios r = log pi_old - log mu (B, T) (0 on padding) and `valid` (B, T) bool. The tokens
    were drawn from mu, so a mean over them is an expectation under mu:

    - rollout_correction/kl: k3 estimate of KL(mu || pi_old) per token, mean of exp(r) - 1 - r
      (unbiased, >= 0; Schulman 2020, "Approximating KL divergence");
    - rollout_correction/kl_k1: k1 estimate of the same, mean of -r (unbiased, may be < 0);
    - rollout_correction/chi2_token: E_mu[rho^2] - 1 with rho = exp(r) per token, the chi-square
      divergence of pi_old from mu (0 when they agree; the IS weights' variance);
    - rollout_correction/chi2_seq: the same with the sequence's ratio exp(clamp(sum_t r, +-20));
    - rollout_correction/ess_token, ess_seq: normalised effective sample size of the untruncated
      ratios, (sum rho)^2 / (n sum rho^2), over the valid tokens / over the sequences with a valid
      token: 1 when every ratio is equal, near 1/n when one dominates;
    - rollout_correction/log_ratio_abs_max: the largest |r| (a spike: one token far off).
    With no valid token every one is 0."""
    n = int(valid.sum())
    if n == 0:
        return dict.fromkeys(DRIFT_METRICS, 0.0)
    ratio = torch.exp(log_ratio)
    has_tokens = valid.any(-1)
    seq_ratio = _sequence_ratio(log_ratio).double()
    return {
        "rollout_correction/kl": masked_mean(ratio - 1 - log_ratio, valid).item(),
        "rollout_correction/kl_k1": masked_mean(-log_ratio, valid).item(),
        "rollout_correction/chi2_token": masked_mean(ratio.double() ** 2, valid).item() - 1.0,
        "rollout_correction/chi2_seq": masked_mean(seq_ratio**2, has_tokens).item() - 1.0,
        "rollout_correction/ess_token": _normalised_ess(ratio, valid),
        "rollout_correction/ess_seq": _normalised_ess(seq_ratio, has_tokens),
        "rollout_correction/log_ratio_abs_max": log_ratio.abs()[valid].max().item(),
    }


def rollout_correction(
    old_log_prob: torch.Tensor,
    rollout_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    mode: str = "token_tis",
    threshold: float = 2.0,
    low: float | None = None,
    high: float | None = None,
) -> tuple[torch.Tensor | None, dict[str, float]]:
    """The loss weights of correction `mode` (a name in `ROLLOUT_CORRECTIONS`) and the step's
    metrics.

    old_log_prob: (B, T) the learner's log-probs of the sampled tokens (pi_old); rollout_log_prob:
    (B, T) the sampler's (mu); response_mask: (B, T). log-ratio = clamp(old_log_prob -
    rollout_log_prob, -20, 20) on the valid tokens. threshold: the cap C of `token_tis` and
    `seq_tis`; low, high: the band of `seq_mask` and `icepop` (None: the mode's default,
    `SEQ_MASK_BOUNDS`, `ICEPOP_BOUNDS`).
    Returns (weights, metrics): weights (B, T) float32, detached, 0 on padding, that multiply the
    per-token policy loss, or None with `none`; metrics: `drift_metrics`, the mode's own, and
    rollout_correction/masked_token_frac (share of valid tokens the mode masked to 0 or truncated),
    rollout_correction/masked_seq_frac (share of sequences with a valid token that hold such a
    token) and rollout_correction/weight_mean (mean weight over the valid tokens; 1 with `none`).
    """
    if old_log_prob.shape != rollout_log_prob.shape or old_log_prob.shape != response_mask.shape:
        raise ValueError(
            f"shapes differ: old_log_prob {tuple(old_log_prob.shape)}, rollout_log_prob "
            f"{tuple(rollout_log_prob.shape)}, response_mask {tuple(response_mask.shape)}"
        )
    fn = ROLLOUT_CORRECTIONS.get(mode)
    with torch.no_grad():
        valid = response_mask.bool()
        old = old_log_prob.detach().float()
        rollout = rollout_log_prob.detach().float().to(old.device)
        log_ratio = torch.clamp(old - rollout, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        log_ratio = torch.where(valid, log_ratio, 0.0)  # padding may hold anything, NaN included
        weights, corrected, own = fn(old, rollout, log_ratio, valid, threshold, low, high)
        has_tokens = valid.any(-1)
        used = valid.float() if weights is None else weights
        metrics = {
            **drift_metrics(log_ratio, valid),
            **own,
            "rollout_correction/masked_token_frac": masked_mean(corrected.float(), valid).item(),
            "rollout_correction/masked_seq_frac": masked_mean(corrected.any(-1).float(), has_tokens).item(),
            "rollout_correction/weight_mean": masked_mean(used, valid).item(),
        }
    if weights is not None:
        weights = weights.detach().float()
    return weights, metrics
