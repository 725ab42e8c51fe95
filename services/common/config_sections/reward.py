"""The reward's sections: the reward server (rules, a reward model, an HTTP API), training a reward
model (`rlhf train-rm`), the critic server."""

from __future__ import annotations

from typing import Any, Literal, Optional

from pydantic import Field, model_validator

from .base import Strict
from .policy import LoraConfig


# ------------------------------------------ the reward server
class RuleSpec(Strict):
    name: str = Field(
        ...,
        description="a registered rule (exact_match, verifiable_answer, math_answer, "
        "edit_distance, repetition, length, regex_format) or 'module.path:function'",
    )
    weight: float = Field(default=1.0, description="weight of this rule's score in the reward")
    kwargs: dict[str, Any] = Field(default_factory=dict, description="keyword arguments passed to the rule")


class RewardConfig(Strict):
    type: Literal["rules", "model", "http", "combined"] = Field(
        default="rules",
        description="reward source: rule verifiers, a reward model, an HTTP reward API, or the weighted "
        "sum of those configured",
    )
    rules: list[RuleSpec] = Field(
        default_factory=lambda: [RuleSpec(name="exact_match")],
        description="rule scorers, each {name, weight, kwargs}; their weighted sum",
    )
    model_path: Optional[str] = Field(
        default=None, description="reward model directory (AutoModelForSequenceClassification); null = none"
    )
    model_weight: float = Field(default=1.0, description="weight of the reward model's score in 'combined'")
    ensemble_penalty: float = Field(
        default=0.0,
        ge=0,
        description="for an ensemble of reward models (model_path holding ensemble.json): the reward "
        "is the mean of the members' normalised scores minus this times their standard deviation "
        "(uncertainty-penalised: where the members disagree the policy is paid less); 0 = the mean",
    )
    model_normalize: bool = Field(
        default=False,
        description="score (r - mean) / std with the mean and std of the reward "
        "model on its training pairs (reward_stats.json, written by `rlhf train-rm`)",
    )
    http_url: Optional[str] = Field(
        default=None,
        description="reward API URL (OpenRLHF protocol: POST {query, prompts, labels} -> {rewards}); null = none",
    )
    http_weight: float = Field(default=1.0, description="weight of the HTTP reward in 'combined'")
    http_timeout_s: float = Field(
        default=30.0,
        gt=0,
        description="seconds one HTTP reward request may take (connect, "
        "send, and each wait for the answer); keep (http_retries + 1) x this below "
        "rpc.timeout_s",
    )
    http_retries: int = Field(
        default=3,
        ge=0,
        description="retries of an HTTP reward request that timed out, lost its "
        "connection or got 5xx or 429 (never another 4xx), after a backoff with jitter or "
        "the answer's Retry-After",
    )
    http_backoff_s: float = Field(
        default=0.5,
        gt=0,
        description="least wait before a retry; each wait is drawn between this and 3x the last (decorrelated jitter)",
    )
    http_max_backoff_s: float = Field(
        default=10.0, gt=0, description="longest wait before a retry, without Retry-After"
    )
    http_retry_after_max_s: float = Field(
        default=60.0,
        ge=0,
        description="longest Retry-After (of a 429 or 503, in "
        "seconds or an HTTP date) honoured; a longer one waits this long",
    )
    http_concurrency: int = Field(
        default=8,
        ge=1,
        description="most HTTP reward requests in flight at once, across all the Score calls a reward server runs",
    )
    http_auth_env: Optional[str] = Field(
        default="RLHF_REWARD_API_KEY",
        description="environment variable holding the "
        "reward API's token; when it is set and not empty, every request "
        "carries it in http_auth_header (it is never logged); null = none",
    )
    http_auth_header: str = Field(default="Authorization", min_length=1, description="header the token goes in")
    http_auth_scheme: str = Field(
        default="Bearer",
        description="word before the token in the header ('Bearer "
        "<token>'); empty = the bare token (e.g. for X-API-Key)",
    )
    http_breaker_failures: int = Field(
        default=5,
        ge=0,
        description="failed reward API requests in a row (timeouts, "
        "lost connections, 5xx, 429, 401/403/404/405/407, answers that are not rewards; "
        "the retries of one request count once when the failure may be its "
        "input's) that open its circuit breaker: calls then fail at once without "
        "reaching it, and callers wait; 0 = no breaker",
    )
    http_breaker_cooldown_s: float = Field(
        default=30.0,
        gt=0,
        description="seconds the breaker stays open before one "
        "probe request goes through; its success closes the breaker",
    )
    group_retries: int = Field(
        default=2,
        ge=0,
        description="rollout workers: times a batch is scored again (not "
        "generated again) when the reward API failed it after its own HTTP retries; "
        "then each prompt is tried alone once, and a group the API still fails while "
        "it scores others is dropped (dead-lettered, counted in "
        "rlhf_rollout_groups_dropped_total; the learner feeds a replacement); never a "
        "default reward",
    )
    group_retry_wait_s: float = Field(
        default=10.0,
        ge=0,
        description="rollout workers: seconds before a batch is scored again after the reward API failed it",
    )
    overlong_buffer: int = Field(
        default=0,
        ge=0,
        description="DAPO's soft overlong punishment: a training response in the last this many tokens of "
        "response_length loses up to overlong_penalty, linearly (one cut at the budget all of it), added to its "
        "reward by the sampler (rollout workers, train --local; not the held-out eval). 0 = off",
    )
    overlong_penalty: float = Field(
        default=1.0, ge=0, allow_inf_nan=False, description="the most reward the overlong punishment takes"
    )
    max_text_chars: int = Field(
        default=100_000,
        ge=1,
        description="longest prompt, response or label one sample may "
        "carry (characters); a longer one is refused with INVALID_ARGUMENT",
    )
    eval_rules: Optional[list[RuleSpec]] = Field(
        default=None,
        description="rule scorers of the held-out evaluation "
        "only, each {name, weight, kwargs} as in reward.rules: a gold "
        "reward the policy is not trained on (the reward-hacking watch "
        "compares it with the train reward); null = the training reward",
    )


# ------------------------------------------ reward-model training (`rlhf train-rm`)
class RewardModelConfig(Strict):
    """A scalar reward head on a causal LM backbone, trained on preference pairs with the pairwise
    loss -log sigmoid(r_chosen - r_rejected - margin); its directory is what reward.model_path loads."""

    base: Optional[str] = Field(
        default=None, description="the backbone: a causal LM directory or hub id; null = model.path"
    )
    train: Optional[str] = Field(
        default=None,
        description="preference pairs: a .jsonl, .parquet, .csv or .json file, or "
        "hf:DATASET[:CONFIG][@SPLIT]; rows {prompt, chosen, rejected} (strings or chat "
        "messages), or {chosen, rejected} whose shared leading messages are the prompt",
    )
    eval: Optional[str] = Field(
        default=None,
        description="held-out pairs, in the forms of train; null = hold out eval_fraction of train's prompts",
    )
    eval_fraction: float = Field(
        default=0.1, ge=0, lt=1, description="share of train's prompts held out when eval is null"
    )
    prompt_key: str = Field(default="prompt", description="field with the prompt (absent in a row: the implicit form)")
    chosen_key: str = Field(default="chosen", description="field with the preferred answer")
    rejected_key: str = Field(default="rejected", description="field with the other answer")
    margin_key: Optional[str] = Field(
        default=None,
        description="field with a per-pair margin added to the loss's "
        "(r_chosen - r_rejected must exceed it); null = none",
    )
    margin: float = Field(default=0.0, ge=0, description="a margin every pair's loss asks for, beside margin_key's")
    chat_template: bool = Field(
        default=False,
        description="render string prompts as one user message through the chat "
        "template, as data.chat_template does for the policy (chat-message prompts "
        "always are)",
    )
    max_length: int = Field(
        default=512, ge=8, description="longest prompt + answer in tokens; longer pairs are dropped with a warning"
    )
    epochs: int = Field(default=1, ge=1, description="passes over the training pairs")
    batch_size: int = Field(default=32, ge=1, description="pairs per optimiser step")
    micro_batch_size: int = Field(
        default=8,
        ge=1,
        description="pairs per forward and backward (gradients accumulate): at most 2 x this many distinct "
        "answers are scored in one forward",
    )
    batch_by_prompt: bool = Field(
        default=True,
        description="a step's pairs are those of whole prompts, drawn prompt by prompt, so that an answer "
        "on several pairs (k right of n answers make k(n-k) pairs) is scored once per step and every pair's "
        "loss is built from those scores; false: pairs drawn one by one across prompts (an answer is still "
        "scored once per forward)",
    )
    lr: float = Field(default=1e-5, gt=0, description="AdamW learning rate of the backbone; the new head gets head_lr")
    head_lr: Optional[float] = Field(default=None, gt=0, description="learning rate of the new reward head; null = lr")
    weight_decay: float = Field(default=0.0, ge=0, description="AdamW weight decay")
    warmup_steps: int = Field(default=0, ge=0, description="linear warmup steps, then a cosine decay to 0")
    bf16: bool = Field(
        default=False, description="forward and backward in bfloat16 autocast (weights and Adam in float32)"
    )
    gradient_checkpointing: bool = Field(default=False, description="recompute activations in the backward pass")
    lora: LoraConfig = Field(
        default_factory=LoraConfig,
        description="LoRA adapters on the backbone (the head is trained whole); merged into the written model",
    )
    out: str = Field(default="runs/reward-model", description="where the reward model directory is written")
    seed: int = Field(default=0, description="seed of the head's initialisation, the shuffling and the held-out split")
    ensemble: int = Field(
        default=1,
        ge=1,
        description="reward models trained, each with its own seed (head, data order; the "
        "held-out split is the same): more than 1 writes them as out/member-I and "
        "out/ensemble.json, which reward.type: model serves as one (reward.ensemble_penalty)",
    )

    @model_validator(mode="after")
    def _micro_divides(self) -> "RewardModelConfig":
        if self.batch_size % self.micro_batch_size:
            raise ValueError(
                f"reward_model.batch_size ({self.batch_size}) must be a multiple of "
                f"reward_model.micro_batch_size ({self.micro_batch_size})"
            )
        return self


# ------------------------------------------ the critic server
class CriticConfig(Strict):
    model_path: Optional[str] = Field(
        default=None, description="value model backbone to start from (a local directory or hub id); null = model.path"
    )
    init_from_reward_model: bool = Field(
        default=False,
        description="start the critic from the reward model (reward.model_path; an ensemble's "
        "first member) as InstructGPT does: its backbone, and its head rescaled to the "
        "normalised reward (weight / std, bias - mean / std with its reward_stats.json) so "
        "its first values read the normalised reward of the text so far; critic.model_path "
        "must then be unset",
    )
    lr: float = Field(default=1e-4, gt=0, description="critic learning rate")
    value_loss_coef: float = Field(default=1.0, gt=0, description="scales the value loss (c1 in PPO)")
    nproc: int = Field(
        default=1,
        ge=1,
        description="critic server processes (one per GPU) the value model and its "
        "optimiser state are sharded across with FSDP2; `rlhf serve critic` starts them",
    )
    overlap_training: bool = Field(
        default=True,
        description="learner service: the critic server trains on each "
        "mini-batch while the actor does (a win when they have their own devices)",
    )
    max_abs_target: float = Field(
        default=1e6,
        gt=0,
        description="largest |return| or |old value| Train accepts; "
        "beyond it (or non-finite) the step is refused with INVALID_ARGUMENT",
    )
    micro_batch_size: Optional[int] = Field(
        default=None,
        gt=0,
        description="sequences per forward and backward of a "
        "critic step (gradient accumulation, exact) and per values "
        "forward; null = the top-level micro_batch_size",
    )
