"""KL between the policy and the reference: estimators, the KL coefficient controllers, the
token-level KL penalty in the reward, and the choice of reference (seed 003).

Shapes: `B` sequences, `T` response positions, `V` vocabulary.
"""
from __future__ import annotations

import math

import torch

KL_ESTIMATORS = ("kl", "abs", "mse", "low_var_kl", "full")
KL_ALIASES = {"k1": "kl", "k2": "mse", "k3": "low_var_kl"}


def kl_penalty(log_prob: torch.Tensor, ref_log_prob: torch.Tensor, kl_penalty: str) -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from the sampled tokens (Schulman, "Approximating
    KL divergence", 2020).

    log_prob, ref_log_prob: (B, T) log-probs of the sampled tokens, or (B, T, V) full
    log-probability tensors for `full`. Returns (B, T).
    - kl  (k1): log p - log q
    - abs:      |log p - log q|
    - mse (k2): 1/2 (log p - log q)^2
    - low_var_kl (k3): q/p - log(q/p) - 1, clamped to [-10, 10] (non-negative, low variance)
    - full: sum_v p(v) (log p(v) - log q(v)), exact over the vocabulary
    """
    name = KL_ALIASES.get(kl_penalty, kl_penalty)
    if name == "kl":
        return log_prob - ref_log_prob
    if name == "abs":
        return (log_prob - ref_log_prob).abs()
    if name == "mse":
        return 0.5 * (log_prob - ref_log_prob).square()
    if name == "low_var_kl":
        log_ratio = torch.clamp(ref_log_prob - log_prob, min=-20, max=20)
        return torch.clamp(log_ratio.exp() - log_ratio - 1, min=-10, max=10)
    if name == "full":
        if log_prob.dim() < 3 or log_prob.shape != ref_log_prob.shape:
            raise ValueError("kl_penalty 'full' needs full (B, T, V) log-probability tensors of one shape")
        return (log_prob.exp() * (log_prob - ref_log_prob)).sum(dim=-1)
    raise ValueError(f"unknown kl_penalty {kl_penalty!r}; valid: {', '.join(KL_ESTIMATORS + tuple(KL_ALIASES))}")


def mix_reference_log_probs(sft_log_prob: torch.Tensor, policy_log_prob: torch.Tensor,
                            sft_weight: float) -> torch.Tensor:
    """Log-probability under the mixture w * pi_SFT + (1 - w) * pi_old (seed 003's "mixed
    reference"). Both inputs (B, T) or (B, T, V); returns the same shape."""
    if not 0.0 <= sft_weight <= 1.0:
        raise ValueError(f"sft_weight must be in [0, 1], got {sft_weight}")
    if sft_weight == 1.0:
        return sft_log_prob
    if sft_weight == 0.0:
        return policy_log_prob
    return torch.logaddexp(sft_log_prob + math.log(sft_weight), policy_log_prob + math.log(1 - sft_weight))


REFERENCE_CHOICES = ("sft", "policy", "mixture")


def reference_log_probs(choice: str, sft_log_prob: torch.Tensor | None, old_log_prob: torch.Tensor,
                        sft_weight: float = 0.5) -> torch.Tensor:
    """The reference the KL is measured against (seed 003): the frozen SFT model (`sft`), the
    policy before this update (`policy`), or the mixture of both (`mixture`)."""
    if choice == "policy":
        return old_log_prob
    if sft_log_prob is None:
        raise ValueError(f"reference {choice!r} needs log-probs from the SFT model")
    if choice == "sft":
        return sft_log_prob
    if choice == "mixture":
        return mix_reference_log_probs(sft_log_prob, old_log_prob, sft_weight)
    raise ValueError(f"unknown reference {choice!r}; valid: {', '.join(REFERENCE_CHOICES)}")


def apply_kl_penalty(scores: torch.Tensor, response_mask: torch.Tensor, kl: torch.Tensor | None = None,
                     kl_coef: float = 0.0) -> torch.Tensor:
    """Token-level rewards: the outcome score at the last valid response token minus the
    token-level KL penalty (Ziegler et al. 2019; seed 004):
        r_t = 1[t = last] * score - kl_coef * KL_t
    scores: (B,); response_mask: (B, T); kl: (B, T) or None. Returns (B, T), 0 where masked.
    A sequence with an empty mask gets no reward.
    """
    B, T = response_mask.shape
    mask = response_mask.to(scores.dtype)
    positions = torch.arange(T, device=mask.device).expand(B, T)
    last = torch.where(mask.bool(), positions, torch.full_like(positions, -1)).max(dim=-1).values
    rewards = torch.zeros(B, T, dtype=scores.dtype, device=scores.device)
    has = last >= 0
    rewards[has.nonzero(as_tuple=True)[0], last[has]] = scores[has]
    if kl is not None and kl_coef:
        rewards = rewards - kl_coef * torch.where(mask.bool(), kl, torch.zeros_like(kl))
    return rewards * mask


class FixedKLController:
    """A constant KL coefficient (`target_kl: null`)."""

    def __init__(self, kl_coef: float):
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        pass

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.value = float(state["value"])


class AdaptiveKLController:
    """Adaptive KL coefficient of Ziegler et al. 2019 (arXiv:1909.08593, section 2.2):

        e = clip(KL / target - 1, -0.2, 0.2);   beta <- beta * (1 + e * n_steps / horizon)

    KL above the target raises beta, below lowers it, at most 20% of n_steps/horizon per update.
    """

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: int):
        if target_kl <= 0 or horizon <= 0:
            raise ValueError("target_kl and horizon must be positive")
        self.value, self.target, self.horizon = float(init_kl_coef), float(target_kl), int(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        proportional_error = min(max(current_kl / self.target - 1, -0.2), 0.2)
        self.value *= 1 + proportional_error * n_steps / self.horizon

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.value = float(state["value"])


def make_kl_controller(init_kl_coef: float, target_kl: float | None, kl_horizon: int):
    """The adaptive controller when `target_kl` is set, else the fixed one."""
    if target_kl is None:
        return FixedKLController(init_kl_coef)
    return AdaptiveKLController(init_kl_coef, target_kl, kl_horizon)
