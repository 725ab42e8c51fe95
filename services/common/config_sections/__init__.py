"""The sections of the configuration, typed and validated, each key with its default and
description, one module per owner. `Config` (services/common/config.py) holds them beside the
top-level PPO keys; they are importable from here (and from config.py) by name.

    policy.py      model (lora), generation (vllm)          the policy, and how it is sampled
    reward.py      reward (rules), reward_model, critic     the reward server, train-rm, the critic
    training.py    data, run                                the training loop's prompts and run
    rollout.py     replay, rollout                          Redis, the workers, agents, environments
    rpc.py         rpc (its endpoints)                      the network and the RPC plumbing
    tinker.py      tinker                                   the Tinker-compatible training API
"""

from __future__ import annotations

from .base import Strict
from .distill import DistillConfig
from .iterate import IterateConfig
from .policy import GenerationConfig, LoraConfig, ModelConfig, VLLMConfig
from .reward import CriticConfig, RewardConfig, RewardModelConfig, RuleSpec
from .rollout import AGENT_KINDS, ReplayConfig, RolloutConfig
from .rpc import Endpoint, GatewayEndpoint, LearnerEndpoint, RewardEndpoint, RPCConfig
from .tinker import TinkerConfig
from .training import DataConfig, RunConfig

__all__ = [
    "AGENT_KINDS",
    "CriticConfig",
    "DataConfig",
    "Endpoint",
    "GatewayEndpoint",
    "GenerationConfig",
    "LearnerEndpoint",
    "LoraConfig",
    "ModelConfig",
    "RPCConfig",
    "ReplayConfig",
    "RewardConfig",
    "RewardEndpoint",
    "RewardModelConfig",
    "RolloutConfig",
    "DistillConfig",
    "IterateConfig",
    "RuleSpec",
    "RunConfig",
    "Strict",
    "TinkerConfig",
    "VLLMConfig",
]
