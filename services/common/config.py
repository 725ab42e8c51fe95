"""One typed, validated configuration for every service.

The PPO keys live at the top level with the names and defaults of ROLL's RLVRConfig (the seed
table `shared/seeds/000_*.txt`), so the seed's own YAML block validates unchanged. Everything
else (model, sampling, reward, critic, run) sits in sections. Unknown keys are errors that name
the closest valid key; out-of-range values are errors that name the allowed range or choices.

    cfg = load_config("configs/tiny-cpu.yaml", overrides=["pg_clip=0.1", "run.seed=3"])
"""
from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any, Literal, Optional

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

ADV_ESTIMATORS = ("gae", "reinforce", "grpo", "rloo", "reinforce_plus_plus")
LOSS_AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
KL_PENALTIES = ("kl", "abs", "mse", "low_var_kl", "full", "k1", "k2", "k3")
REWARD_NORMS = ("batch", "group", "running")
REF_MODELS = ("sft", "policy", "mixture")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class LoraConfig(_Strict):
    rank: int = Field(0, ge=0, description="LoRA rank; 0 trains the full model")
    alpha: float = Field(16.0, gt=0)
    dropout: float = Field(0.0, ge=0, lt=1)
    target_modules: list[str] = Field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])


class ModelConfig(_Strict):
    path: str = Field("runs/tiny-model", description="directory with config, weights and tokenizer")
    device: str = Field("auto", description="'auto', 'cpu', 'cuda', 'cuda:1', ...")
    bf16: bool = False
    gradient_checkpointing: bool = False
    lora: LoraConfig = Field(default_factory=LoraConfig)


class GenerationConfig(_Strict):
    backend: Literal["hf", "vllm"] = "hf"
    temperature: float = Field(1.0, gt=0, le=10)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0, description="0 disables top-k")
    eval_temperature: float = Field(0.0, ge=0, le=10, description="0 = greedy held-out eval")
    max_batch_size: int = Field(256, ge=1)
    batch_window_ms: float = Field(5.0, ge=0)


class RuleSpec(_Strict):
    name: str = Field(..., description="a registered rule or 'module.path:function'")
    weight: float = 1.0
    kwargs: dict[str, Any] = Field(default_factory=dict)


class RewardConfig(_Strict):
    type: Literal["rules", "model", "http", "combined"] = "rules"
    rules: list[RuleSpec] = Field(default_factory=lambda: [RuleSpec(name="exact_match")])
    model_path: Optional[str] = None
    model_weight: float = 1.0
    http_url: Optional[str] = None
    http_weight: float = 1.0
    http_timeout_s: float = Field(30.0, gt=0)
    http_retries: int = Field(3, ge=0)
    http_concurrency: int = Field(8, ge=1)


class CriticConfig(_Strict):
    model_path: Optional[str] = Field(None, description="backbone to start from; default model.path")
    lr: float = Field(1e-4, gt=0)
    value_loss_coef: float = Field(1.0, gt=0, description="scales the value loss (c1 in PPO)")
    overlap_training: bool = Field(True, description="learner service: the critic server trains on each "
                                   "mini-batch while the actor does (a win when they have their own devices)")


class DataConfig(_Strict):
    train: str = Field("synthetic:reverse", description="JSONL path, or synthetic:<task>")
    eval: str = Field("synthetic:reverse", description="held-out prompts: JSONL path, or synthetic:<task>")
    eval_size: int = Field(128, ge=1)
    prompt_key: str = "prompt"
    label_key: str = "label"


class RunConfig(_Strict):
    run_dir: str = "runs/default"
    iterations: int = Field(100, ge=1)
    eval_interval: int = Field(10, ge=0, description="evaluate every N iterations; 0 = only first/last")
    checkpoint_interval: int = Field(10, ge=0, description="checkpoint every N iterations (and at the end and "
                                     "on SIGTERM); the learner service acknowledges trained trajectories "
                                     "at each checkpoint; 0 = only at the end")
    seed: int = 0
    log_every: int = Field(1, ge=1)
    max_wall_s: Optional[float] = Field(None, gt=0, description="stop after this many seconds")


class ReplayConfig(_Strict):
    url: Optional[str] = Field(None, description="redis://[:password@]host:port/db; null = an embedded "
                               "redis-server that `rlhf up` starts in the run directory")
    password: Optional[str] = None
    password_env: str = Field("RLHF_REDIS_PASSWORD", description="env var read when password is null")
    namespace: str = Field("rlhf", min_length=1, description="key prefix; one namespace per run")
    max_backlog: Optional[int] = Field(None, gt=0, description="trajectory groups not yet read by the learner "
                                       "above which rollout workers pause; default (max_staleness + 1) x "
                                       "rollout_batch_size")
    claim_idle_s: float = Field(30.0, gt=0, description="a prompt pending this long at a silent worker is "
                                "reclaimed (XAUTOCLAIM) by another")
    heartbeat_s: float = Field(2.0, gt=0, description="generation servers and workers report this often")
    heartbeat_ttl_s: float = Field(10.0, gt=0, description="a server silent this long is taken off the registry")
    block_ms: int = Field(500, ge=1, description="longest blocking read on a stream")

    def resolved_password(self) -> Optional[str]:
        import os
        return self.password or os.environ.get(self.password_env) or None


class RolloutConfig(_Strict):
    prompts_per_request: int = Field(32, ge=1, description="prompts a worker claims and sends in one Generate")
    concurrency: int = Field(2, ge=1, description="batches each worker keeps in flight")
    retries: int = Field(5, ge=0, description="tries of a failing call before the batch is left to others")
    retry_backoff_s: float = Field(0.5, gt=0)
    metrics_port: Optional[int] = Field(None, ge=0, le=65535, description="Prometheus /metrics; null = off")


class Endpoint(_Strict):
    host: str = "127.0.0.1"
    port: int = Field(..., ge=0, le=65535, description="0 picks a free port")
    metrics_port: Optional[int] = Field(None, ge=0, le=65535, description="Prometheus /metrics; null = off")


class RewardEndpoint(Endpoint):
    http_port: Optional[int] = Field(8052, ge=0, le=65535, description="OpenRLHF-style HTTP reward API; null = off")


class LearnerEndpoint(Endpoint):
    http_port: Optional[int] = Field(8054, ge=0, le=65535, description="JSON status at /status; null = off")


class RPCConfig(_Strict):
    host: str = Field("127.0.0.1", description="address servers bind; 0.0.0.0 in containers")
    advertise_host: Optional[str] = Field(None, description="address other services reach this one at (the "
                                          "pod IP in Kubernetes); default the bind host")
    auth_token: Optional[str] = Field(None, description="bearer token every call must carry")
    auth_token_env: str = Field("RLHF_AUTH_TOKEN", description="env var read when auth_token is null")
    tls_cert_file: Optional[str] = None
    tls_key_file: Optional[str] = None
    tls_ca_file: Optional[str] = Field(None, description="clients: CA to trust (default the cert itself)")
    max_message_mb: int = Field(256, ge=1, le=2047)
    grace_s: float = Field(10.0, ge=0, description="shutdown: seconds in-flight calls may take")
    timeout_s: float = Field(120.0, gt=0, description="client deadline per call")
    max_samples_per_prompt: int = Field(64, ge=1, description="limit on Generate's n")
    max_prompts_per_request: int = Field(4096, ge=1)
    generation: Endpoint = Field(default_factory=lambda: Endpoint(port=50051, metrics_port=9101))
    reward: RewardEndpoint = Field(default_factory=lambda: RewardEndpoint(port=50052, metrics_port=9102))
    critic: Endpoint = Field(default_factory=lambda: Endpoint(port=50053, metrics_port=9103))
    learner: LearnerEndpoint = Field(default_factory=lambda: LearnerEndpoint(port=50054, metrics_port=9104))

    @model_validator(mode="after")
    def _tls_pair(self) -> "RPCConfig":
        if bool(self.tls_cert_file) != bool(self.tls_key_file):
            raise ValueError("rpc.tls_cert_file and rpc.tls_key_file must be set together")
        return self

    def resolved_auth_token(self) -> Optional[str]:
        import os
        return self.auth_token or os.environ.get(self.auth_token_env) or None


class Config(_Strict):
    # --- ppo related (names and defaults of the seed table) -----------------------------------
    rollout_batch_size: int = Field(512, gt=0, description="prompts per batch")
    prompt_length: int = Field(2048, gt=0)
    response_length: int = Field(4096, gt=0)
    adv_estimator: Literal[ADV_ESTIMATORS] = "gae"  # type: ignore[valid-type]
    num_return_sequences_in_group: int = Field(1, gt=0)
    ppo_epochs: int = Field(1, gt=0)
    use_kl_loss: bool = True
    kl_loss_coef: float = Field(0.001, ge=0)
    loss_agg_mode: Literal[LOSS_AGG_MODES] = "seq-mean-token-sum"  # type: ignore[valid-type]
    whiten_advantages: bool = True
    advantage_clip: Optional[float] = Field(2.0, gt=0)
    reward_clip: Optional[float] = Field(None, gt=0)
    dual_clip_loss: bool = True
    lambd: float = Field(0.95, ge=0, le=1)
    gamma: float = Field(1.0, ge=0, le=1)
    pg_clip: float = Field(0.2, gt=0, lt=1)
    value_clip: Optional[float] = Field(None, gt=0)
    kl_penalty: Literal[KL_PENALTIES] = "kl"  # type: ignore[valid-type]
    target_kl: Optional[float] = Field(None, gt=0)
    init_kl_coef: float = Field(0.2, ge=0)
    kl_horizon: int = Field(10000, gt=0)
    add_token_level_kl: bool = False
    # normalize
    reward_norm: Optional[Literal[REWARD_NORMS]] = None  # type: ignore[valid-type]
    reward_shift: bool = False
    reward_scale: bool = False
    # --- the rest of the seeds: loss terms, dual clip, asymmetric clip, reference choice ------
    dual_clip_c: float = Field(3.0, gt=1, description="c of dual-clip PPO (clip_ratio_c)")
    pg_clip_low: Optional[float] = Field(None, gt=0, lt=1, description="default pg_clip")
    pg_clip_high: Optional[float] = Field(None, gt=0, description="default pg_clip (DAPO clip-higher)")
    entropy_coef: float = Field(0.0, ge=0)
    ptx_coef: float = Field(0.0, ge=0, description="PTX/SFT next-token loss weight (InstructGPT)")
    ref_model: Literal[REF_MODELS] = "sft"  # type: ignore[valid-type]
    ref_mix_coef: float = Field(0.5, ge=0, le=1, description="weight of the SFT model in 'mixture'")
    recompute_old_log_probs: bool = True
    max_staleness: int = Field(0, ge=0, description="policy versions a trajectory may lag the learner; "
                               "0 = synchronous on-policy PPO, >= 1 overlaps generation and training")
    # --- optimisation --------------------------------------------------------------------------
    actor_lr: float = Field(1e-6, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    adam_betas: tuple[float, float] = (0.9, 0.999)
    lr_warmup_steps: int = Field(0, ge=0)
    lr_scheduler: Literal["constant", "linear", "cosine"] = "constant"
    max_grad_norm: Optional[float] = Field(1.0, gt=0)
    ppo_mini_batch_size: int = Field(64, gt=0, description="sequences per optimiser step")
    micro_batch_size: Optional[int] = Field(None, gt=0, description="sequences per forward; default mini batch")
    # --- sections ------------------------------------------------------------------------------
    model: ModelConfig = Field(default_factory=ModelConfig)
    generation: GenerationConfig = Field(default_factory=GenerationConfig)
    reward: RewardConfig = Field(default_factory=RewardConfig)
    critic: CriticConfig = Field(default_factory=CriticConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    run: RunConfig = Field(default_factory=RunConfig)
    rpc: RPCConfig = Field(default_factory=RPCConfig)
    replay: ReplayConfig = Field(default_factory=ReplayConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)

    @model_validator(mode="after")
    def _consistent(self) -> "Config":
        if self.adv_estimator in ("grpo", "rloo") and self.num_return_sequences_in_group < 2:
            raise ValueError(
                f"adv_estimator={self.adv_estimator!r} needs num_return_sequences_in_group >= 2 "
                f"(got {self.num_return_sequences_in_group})")
        return self

    @property
    def max_backlog(self) -> int:
        return self.replay.max_backlog or (self.max_staleness + 1) * self.rollout_batch_size

    @property
    def needs_critic(self) -> bool:
        return self.adv_estimator == "gae"

    @property
    def clip_low(self) -> float:
        return self.pg_clip_low if self.pg_clip_low is not None else self.pg_clip

    @property
    def clip_high(self) -> float:
        return self.pg_clip_high if self.pg_clip_high is not None else self.pg_clip


class ConfigError(Exception):
    """Every problem found in a configuration, each with its key path."""

    def __init__(self, errors: list[str]):
        super().__init__("\n".join(errors))
        self.errors = errors


def _fields_at(path: tuple) -> list[str]:
    model: Any = Config
    for part in path:
        field = model.model_fields.get(part) if hasattr(model, "model_fields") else None
        if field is None or not (isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel)):
            return []
        model = field.annotation
    return list(model.model_fields)


def _describe(err: dict) -> str:
    loc = tuple(err["loc"])
    key = ".".join(str(p) for p in loc) or "<root>"
    if err["type"] == "extra_forbidden":
        valid = _fields_at(loc[:-1])
        close = difflib.get_close_matches(str(loc[-1]), valid, n=1, cutoff=0.5)
        hint = f"; did you mean {'.'.join([*map(str, loc[:-1]), close[0]])!r}?" if close else ""
        return f"{key}: unknown key{hint}"
    msg = err["msg"]
    if err["type"] == "literal_error":
        msg = f"got {err['input']!r}; allowed: {err['ctx']['expected']}"
    elif "input" in err and err["type"] not in ("missing",):
        msg = f"{msg} (got {err['input']!r})"
    return f"{key}: {msg}"


def _set_path(data: dict, dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    node = data
    for p in parts[:-1]:
        child = node.get(p)
        if child is None:
            child = node[p] = {}
        if not isinstance(child, dict):
            raise ConfigError([f"{dotted}: cannot set a key inside {p!r}, which is not a section"])
        node = child
    node[parts[-1]] = value


def parse_overrides(overrides: list[str] | None) -> list[tuple[str, Any]]:
    out = []
    for item in overrides or []:
        if "=" not in item:
            raise ConfigError([f"--set {item!r}: expected key=value"])
        key, raw = item.split("=", 1)
        out.append((key.strip(), yaml.safe_load(raw) if raw.strip() else None))
    return out


def config_from_dict(data: dict | None, overrides: list[str] | None = None) -> Config:
    data = dict(data or {})
    for key, value in parse_overrides(overrides):
        _set_path(data, key, value)
    try:
        return Config.model_validate(data)
    except ValidationError as e:
        raise ConfigError([_describe(err) for err in e.errors()]) from None


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    data: dict = {}
    if path is not None:
        p = Path(path)
        if not p.exists():
            raise ConfigError([f"{p}: no such config file"])
        try:
            loaded = yaml.safe_load(p.read_text())
        except yaml.YAMLError as e:
            raise ConfigError([f"{p}: not valid YAML: {e}"]) from None
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError([f"{p}: the top level must be a mapping"])
        data = loaded or {}
    return config_from_dict(data, overrides)


def dump_config(cfg: Config) -> str:
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)
