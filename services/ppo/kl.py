"""KL between the policy and the reference: estimators, the KL coefficient controllers, the
token-level KL penalty in the reward, and the choice of reference (SFT model, previous policy, or their mixture).

Shapes: `B` sequences, `T` response positions, `V` vocabulary.
"""

from __future__ import annotations

import math

import torch

from .registry import Registry

KL_ESTIMATORS = Registry("kl_penalty")


@KL_ESTIMATORS.register("kl", "k1")
def kl_k1(log_prob: torch.Tensor, ref_log_prob: torch.Tensor) -> torch.Tensor:
    """log p - log q: unbiased, high variance, can be negative."""
    return log_prob - ref_log_prob


@KL_ESTIMATORS.register("abs")
def kl_abs(log_prob: torch.Tensor, ref_log_prob: torch.Tensor) -> torch.Tensor:
    """|log p - log q|."""
    return (log_prob - ref_log_prob).abs()


@KL_ESTIMATORS.register("mse", "k2")
def kl_k2(log_prob: torch.Tensor, ref_log_prob: torch.Tensor) -> torch.Tensor:
    """1/2 (log p - log q)^2: biased, low variance, non-negative."""
    return 0.5 * (log_prob - ref_log_prob).square()


@KL_ESTIMATORS.register("low_var_kl", "k3")
def kl_k3(log_prob: torch.Tensor, ref_log_prob: torch.Tensor) -> torch.Tensor:
    """q/p - log(q/p) - 1, the log-ratio clamped to [-20, 20] and the result to [-10, 10]:
    unbiased, non-negative, low variance."""
    log_ratio = torch.clamp(ref_log_prob - log_prob, min=-20, max=20)
    return torch.clamp(log_ratio.exp() - log_ratio - 1, min=-10, max=10)


@KL_ESTIMATORS.register("full")
def kl_full(log_prob: torch.Tensor, ref_log_prob: torch.Tensor) -> torch.Tensor:
    """sum_v p(v) (log p(v) - log q(v)): exact over the vocabulary; inputs (B, T, V)."""
    if log_prob.dim() < 3 or log_prob.shape != ref_log_prob.shape:
        raise ValueError("kl_penalty 'full' needs full (B, T, V) log-probability tensors of one shape")
    return (log_prob.exp() * (log_prob - ref_log_prob)).sum(dim=-1)


def kl_penalty(log_prob: torch.Tensor, ref_log_prob: torch.Tensor, kl_penalty: str) -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) (Schulman, "Approximating KL divergence", 2020) by
    the estimator registered as `kl_penalty` in `KL_ESTIMATORS` (kl/k1, abs, mse/k2,
    low_var_kl/k3, full).

    log_prob, ref_log_prob: (B, T) log-probs of the sampled tokens, or (B, T, V) full
    log-probability tensors for `full`. Returns (B, T).
    """
    return KL_ESTIMATORS.get(kl_penalty)(log_prob, ref_log_prob)


def mix_reference_log_probs(
    sft_log_prob: torch.Tensor, policy_log_prob: torch.Tensor, sft_weight: float
) -> torch.Tensor:
    """Log-probability under the mixture w * pi_SFT + (1 - w) * pi_old (the "mixed
    reference"). Both inputs (B, T) or (B, T, V); returns the same shape."""
    if not 0.0 <= sft_weight <= 1.0:
        raise ValueError(f"sft_weight must be in [0, 1], got {sft_weight}")
    if sft_weight == 1.0:
        return sft_log_prob
    if sft_weight == 0.0:
        return policy_log_prob
    return torch.logaddexp(sft_log_prob + math.log(sft_weight), policy_log_prob + math.log(1 - sft_weight))


REFERENCE_CHOICES = ("sft", "policy", "mixture")


def reference_log_probs(
    choice: str, sft_log_prob: torch.Tensor | None, old_log_prob: torch.Tensor, sft_weight: float = 0.5
) -> torch.Tensor:
    """The reference the KL is measured against (the reference choice of PPO-RLHF): the frozen SFT model (`sft`), the
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


def apply_kl_penalty(
    scores: torch.Tensor, response_mask: torch.Tensor, kl: torch.Tensor | None = None, kl_coef: float = 0.0
) -> torch.Tensor:
    """Token-level rewards: the outcome score at the last valid response token minus the
    token-level KL penalty (Ziegler et al. 2019; Ouyang et al. 2022):
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
