"""Reward scorers: a batch of samples in, one reward each (plus named components) out.

`RuleScorer` runs verifier functions; `ModelScorer` runs a sequence-classification reward model,
`EnsembleScorer` several as one; `CombinedScorer` takes a weighted sum of any of them. Each
satisfies the `Scorer` protocol (`services/common/types.py`), which the reward server and the
in-process trainer both call; `HTTPScorer` (`http_scorer.py`) calls your reward API.
`build_eval_scorer` is the held-out evaluation's scorer when `reward.eval_rules` sets one apart
from the training reward.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Sequence

import torch

from ..common.compute import ComputeThread
from ..common.reward_model_dir import is_ensemble, members, reward_logits, reward_stats
from ..common.types import RewardSample, Scorer, ScoreResult
from .functions import RewardFunction
from .rules import RULES

if TYPE_CHECKING:
    from ..common.config_sections import RewardConfig


class RuleScorer:
    """Weighted sum of rule functions, built in or yours (services/reward/functions.py); each rule's
    value is reported as a component. A rule that raises or returns what is not a finite number
    is a `RewardFunctionError` with its traceback."""

    def __init__(self, rules: Sequence[tuple[str, float, dict]]):
        if not rules:
            raise ValueError("RuleScorer needs at least one rule")
        self.rules = [(weight, RewardFunction.build(name, kwargs, RULES)) for name, weight, kwargs in rules]

    @classmethod
    def from_specs(cls, specs) -> "RuleScorer":
        """From the config's rule entries (`reward.rules`, `reward.eval_rules`)."""
        return cls([(r.name, r.weight, r.kwargs) for r in specs])

    def score(self, samples: Sequence[RewardSample]) -> list[ScoreResult]:
        out = [ScoreResult(0.0, {}) for _ in samples]
        for weight, rule in self.rules:
            for res, v in zip(out, rule(samples)):
                res.components[rule.name] = v
                res.reward += weight * v
        return out


class ModelScorer:
    """A sequence-classification reward model (any AutoModelForSequenceClassification directory
    with one label, such as `rlhf train-rm` writes), batched, with its own tokenizer. Reward =
    logit of the single class, read at the last non-padding token of prompt + response; with
    `normalize`, (logit - mean) / std from the directory's reward_stats.json. Every forward runs
    on the scorer's one compute thread (`common/compute.py`), whichever gRPC thread asked."""

    def __init__(
        self, path: str, device: str = "cpu", batch_size: int = 32, max_length: int = 4096, normalize: bool = False
    ):
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        self.shift, self.scale = reward_stats(path) if normalize else (0.0, 1.0)
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.model = AutoModelForSequenceClassification.from_pretrained(path).to(device).eval()
        if self.model.config.pad_token_id is None:
            self.model.config.pad_token_id = self.tokenizer.pad_token_id
        self.device, self.batch_size, self.max_length = device, batch_size, max_length
        self.compute = ComputeThread("reward-model")

    def score(self, samples: Sequence[RewardSample]) -> list[ScoreResult]:
        return self.compute.run(self._score, samples)

    @torch.no_grad()
    def _score(self, samples: Sequence[RewardSample]) -> list[ScoreResult]:
        out = []
        for i in range(0, len(samples), self.batch_size):
            chunk = samples[i : i + self.batch_size]
            texts = [s.prompt + s.response for s in chunk]
            for v in reward_logits(self.model, self.tokenizer, texts, self.device, self.max_length).tolist():
                v = (v - self.shift) / self.scale
                out.append(ScoreResult(v, {"model": v}))
        return out


class EnsembleScorer:
    """An ensemble of reward models (a directory with ensemble.json): each member's normalised
    score, and as the reward their mean minus `penalty` times their standard deviation (over the
    members, population): where the members disagree the reward is lower (uncertainty-penalised
    RLHF). Components: `model` (the reward), `model_mean`, `model_std`."""

    def __init__(self, paths: Sequence[Path], device: str = "cpu", penalty: float = 0.0):
        self.members = [ModelScorer(str(p), device, normalize=True) for p in paths]
        self.penalty = penalty
        self.compute = ComputeThread("reward-model")  # every member's forward on this one thread

    def score(self, samples: Sequence[RewardSample]) -> list[ScoreResult]:
        if not samples:
            return []
        return self.compute.run(self._score, samples)

    def _score(self, samples: Sequence[RewardSample]) -> list[ScoreResult]:
        each = torch.tensor([[r.reward for r in m._score(samples)] for m in self.members], dtype=torch.float64)
        mean, std = each.mean(0), each.std(0, unbiased=False)
        reward = mean - self.penalty * std
        return [
            ScoreResult(r, {"model": r, "model_mean": m, "model_std": d})
            for r, m, d in zip(reward.tolist(), mean.tolist(), std.tolist())
        ]


def model_scorer(reward_cfg: RewardConfig, device: str = "cpu") -> Scorer:
    """The scorer of reward.model_path: one reward model, or an ensemble of them."""
    path = reward_cfg.model_path
    assert path is not None, "build_scorer asks for a model scorer only with reward.model_path set"
    if not is_ensemble(path):
        return ModelScorer(path, device, normalize=reward_cfg.model_normalize)
    return EnsembleScorer(members(path), device, reward_cfg.ensemble_penalty)


class CombinedScorer:
    """Weighted sum of named scorers; each scorer's reward becomes a component."""

    def __init__(self, parts: Sequence[tuple[str, float, Scorer]]):
        self.parts = list(parts)

    def score(self, samples: Sequence[RewardSample]) -> list[ScoreResult]:
        results = [ScoreResult(0.0, {}) for _ in samples]
        for name, weight, scorer in self.parts:
            for res, part in zip(results, scorer.score(samples)):
                res.reward += weight * part.reward
                res.components.update({f"{name}/{k}": v for k, v in part.components.items()})
                res.components[name] = part.reward
        return results


def build_scorer(reward_cfg: RewardConfig, device: str = "cpu", api_metrics=None) -> Scorer:
    """The scorer a `RewardConfig` describes; `api_metrics` (a `RewardAPIMetrics`) counts the
    requests its HTTP reward API gets, if it has one."""
    parts: list[tuple[str, float, Scorer]] = []
    if reward_cfg.type in ("rules", "combined") and reward_cfg.rules:
        parts.append(("rules", 1.0, RuleScorer.from_specs(reward_cfg.rules)))
    if reward_cfg.type in ("model", "combined") and reward_cfg.model_path:
        parts.append(
            (
                "model",
                reward_cfg.model_weight,
                model_scorer(reward_cfg, device),
            )
        )
    if reward_cfg.type in ("http", "combined") and reward_cfg.http_url:
        from .http_scorer import HTTPScorer

        parts.append(("http", reward_cfg.http_weight, HTTPScorer.from_config(reward_cfg, api_metrics)))
    if not parts:
        raise ValueError(
            f"reward.type={reward_cfg.type!r} needs "
            + {
                "rules": "reward.rules",
                "model": "reward.model_path",
                "http": "reward.http_url",
                "combined": "at least one of reward.rules, reward.model_path, reward.http_url",
            }[reward_cfg.type]
        )
    if len(parts) == 1 and parts[0][1] == 1.0:
        return parts[0][2]
    return CombinedScorer(parts)


def build_eval_scorer(reward_cfg: RewardConfig) -> Scorer | None:
    """The held-out evaluation's own scorer: the rules of `reward.eval_rules` (a gold reward the
    policy is not trained on), or None when they are unset (the eval uses the training reward)."""
    if reward_cfg.eval_rules is None:
        return None
    return RuleScorer.from_specs(reward_cfg.eval_rules)
