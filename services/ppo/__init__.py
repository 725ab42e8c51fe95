"""The PPO algorithm as pure tensor functions: no I/O, no config objects. Variants sit in
registries (`ADV_ESTIMATORS`, `KL_ESTIMATORS`, `POLICY_LOSSES`, `ROLLOUT_CORRECTIONS`) whose names
are the config's choices."""

from .advantages import (
    ADV_ESTIMATORS,
    compute_advantages,
    compute_gae_advantage_return,
    compute_grpo_outcome_advantage,
    compute_reinforce_plus_plus_advantage,
    compute_reinforce_return,
    compute_rloo_outcome_advantage,
)
from .core import (
    LOSS_AGG_MODES,
    AggNorm,
    agg_loss,
    clip_by_value,
    explained_variance,
    masked_mean,
    masked_sum,
    masked_var,
    masked_whiten,
)
from .distill import distillation_advantages
from .kl import (
    KL_ESTIMATORS,
    REFERENCE_CHOICES,
    AdaptiveKLController,
    FixedKLController,
    apply_kl_penalty,
    kl_penalty,
    make_kl_controller,
    mix_reference_log_probs,
    reference_log_probs,
)
from .losses import (
    POLICY_LOSSES,
    compute_cispo_policy_loss,
    compute_gspo_policy_loss,
    compute_policy_loss,
    compute_sft_loss,
    compute_value_loss,
    entropy_from_logits,
    logprobs_from_logits,
)
from .normalize import REWARD_NORMS, RunningMeanStd, normalize_rewards, postprocess_rewards
from .registry import Registry
from .rollout_correction import (
    DRIFT_METRICS,
    ICEPOP_BOUNDS,
    ROLLOUT_CORRECTIONS,
    SEQ_MASK_BOUNDS,
    drift_metrics,
    rollout_correction,
)
from .rollout_is import rollout_importance_weights, staleness_weights

__all__ = [name for name in dir() if not name.startswith("_")]
