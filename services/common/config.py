"""One typed, validated configuration for every service.

The PPO keys live at the top level with the names and defaults of ROLL's RLVRConfig PPO table,
so ROLL's own YAML block (`configs/seed-ppo.yaml`) validates unchanged. Everything
else (model, sampling, reward, critic, run) sits in sections. Unknown keys are errors that name
the closest valid key; out-of-range values are errors that name the allowed range or choices.

    cfg = load_config("configs/tiny-cpu.yaml", overrides=["pg_clip=0.1", "run.seed=3"])
"""
from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any, Literal, Optional

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from ..ppo import ADV_ESTIMATORS, KL_ESTIMATORS, LOSS_AGG_MODES, POLICY_LOSSES, REFERENCE_CHOICES, REWARD_NORMS
from .data import source_problem

# the algorithm's choices come from its registries: one list of names, not two
ADV_ESTIMATOR_NAMES = ADV_ESTIMATORS.names()
KL_PENALTY_NAMES = KL_ESTIMATORS.choices()
POLICY_LOSS_NAMES = POLICY_LOSSES.names()


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class LoraConfig(_Strict):
    rank: int = Field(0, ge=0, description="LoRA rank; 0 trains the full model (with LoRA the KL reference is "
                      "the base model, adapters off)")
    alpha: float = Field(16.0, gt=0, description="LoRA scale numerator: the adapters' output is scaled by alpha / rank")
    dropout: float = Field(0.0, ge=0, lt=1, description="dropout probability on the adapters' input")
    target_modules: list[str] = Field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"],
                                      description="names of the linear layers that get adapters")


class ModelConfig(_Strict):
    path: str = Field("runs/tiny-model", description="the policy: a local directory with config, weights and "
                      "tokenizer, or a Hugging Face hub id (org/name)")
    device: str = Field("auto", description="torch device: 'auto' (cuda when available), 'cpu', 'cuda', 'cuda:1', ...")
    bf16: bool = Field(False, description="train and sample in bfloat16 instead of float32")
    gradient_checkpointing: bool = Field(False, description="recompute activations in the backward pass: less "
                                         "memory, more compute")
    lora: LoraConfig = Field(default_factory=LoraConfig, description="LoRA adapters")
    nproc: int = Field(1, ge=1, description="learner processes (one per GPU) the actor and its optimiser state "
                       "are sharded across with FSDP2; `rlhf serve learner` starts them (gloo on the CPU)")


class VLLMConfig(_Strict):
    """Options of vLLM's engine (generation.backend: vllm). The defaults suit one GPU; on the CPU
    build, dtype float32 and a few GiB of KV cache (`cpu_kvcache_space_gb`) are what to set."""
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = Field(
        "auto", description="engine dtype: auto = bfloat16 with model.bf16, else float32")
    gpu_memory_utilization: float = Field(0.85, gt=0, le=1, description="share of the GPU's memory vLLM takes "
                                          "(weights + KV cache)")
    max_model_len: Optional[int] = Field(None, gt=0, description="longest sequence the engine serves; null = "
                                         "prompt_length + response_length")
    tensor_parallel_size: int = Field(1, ge=1, description="GPUs one engine shards the model across")
    enforce_eager: bool = Field(False, description="no CUDA graphs (slower decoding, faster start, less memory)")
    enable_prefix_caching: bool = Field(True, description="reuse the KV cache of shared prompt prefixes (reset "
                                        "at every weight swap)")
    cpu_kvcache_space_gb: float = Field(1.0, gt=0, description="KV cache GiB of the CPU build "
                                        "(VLLM_CPU_KVCACHE_SPACE); unused on a GPU")
    seed: int = Field(0, description="engine seed (requests with their own seed use theirs)")


class GenerationConfig(_Strict):
    backend: Literal["hf", "vllm"] = Field("hf", description="sampling engine: transformers (CPU or GPU) or vLLM "
                                           "(its continuous batching; GPU, or its CPU build)")
    temperature: float = Field(1.0, gt=0, le=10, description="sampling temperature of training rollouts")
    top_p: float = Field(1.0, gt=0, le=1, description="nucleus sampling: sample from the most likely tokens "
                         "holding this much probability; 1 = off")
    top_k: int = Field(0, ge=0, description="sample from the k most likely tokens; 0 = off")
    eval_temperature: float = Field(0.0, ge=0, le=10, description="sampling temperature of the held-out eval; "
                                    "0 = greedy")
    max_batch_size: int = Field(256, ge=1, description="most prompts a generation server decodes in one batch")
    batch_window_ms: float = Field(5.0, ge=0, description="milliseconds a generation server waits to batch "
                                   "concurrent calls together (hf; vLLM batches continuously)")
    vllm: VLLMConfig = Field(default_factory=VLLMConfig, description="vLLM engine options")


class RuleSpec(_Strict):
    name: str = Field(..., description="a registered rule (exact_match, verifiable_answer, edit_distance, "
                      "repetition, length, regex_format) or 'module.path:function'")
    weight: float = Field(1.0, description="weight of this rule's score in the reward")
    kwargs: dict[str, Any] = Field(default_factory=dict, description="keyword arguments passed to the rule")


class RewardConfig(_Strict):
    type: Literal["rules", "model", "http", "combined"] = Field(
        "rules", description="reward source: rule verifiers, a reward model, an HTTP reward API, or the weighted "
        "sum of those configured")
    rules: list[RuleSpec] = Field(default_factory=lambda: [RuleSpec(name="exact_match")],
                                  description="rule scorers, each {name, weight, kwargs}; their weighted sum")
    model_path: Optional[str] = Field(None, description="reward model directory "
                                      "(AutoModelForSequenceClassification); null = none")
    model_weight: float = Field(1.0, description="weight of the reward model's score in 'combined'")
    http_url: Optional[str] = Field(None, description="reward API URL (OpenRLHF protocol: POST {query, prompts, "
                                    "labels} -> {rewards}); null = none")
    http_weight: float = Field(1.0, description="weight of the HTTP reward in 'combined'")
    http_timeout_s: float = Field(30.0, gt=0, description="seconds one HTTP reward request may take")
    http_retries: int = Field(3, ge=0, description="retries of a failed HTTP reward request, with exponential backoff")
    http_concurrency: int = Field(8, ge=1, description="most HTTP reward requests in flight at once")
    max_text_chars: int = Field(100_000, ge=1, description="longest prompt, response or label one sample may "
                                "carry (characters); a longer one is refused with INVALID_ARGUMENT")
    eval_rules: Optional[list[RuleSpec]] = Field(None, description="rule scorers of the held-out evaluation "
                                                 "only, each {name, weight, kwargs} as in reward.rules: a gold "
                                                 "reward the policy is not trained on (the reward-hacking watch "
                                                 "compares it with the train reward); null = the training reward")


class CriticConfig(_Strict):
    model_path: Optional[str] = Field(None, description="value model backbone to start from (a local directory "
                                      "or hub id); null = model.path")
    lr: float = Field(1e-4, gt=0, description="critic learning rate")
    value_loss_coef: float = Field(1.0, gt=0, description="scales the value loss (c1 in PPO)")
    nproc: int = Field(1, ge=1, description="critic server processes (one per GPU) the value model and its "
                       "optimiser state are sharded across with FSDP2; `rlhf serve critic` starts them")
    overlap_training: bool = Field(True, description="learner service: the critic server trains on each "
                                   "mini-batch while the actor does (a win when they have their own devices)")
    max_abs_target: float = Field(1e6, gt=0, description="largest |return| or |old value| Train accepts; "
                                  "beyond it (or non-finite) the step is refused with INVALID_ARGUMENT")


class DataConfig(_Strict):
    train: str = Field("synthetic:reverse", description="training prompts: synthetic:TASK, a .jsonl, .parquet, "
                       ".csv or .json file, or hf:DATASET[:CONFIG][@SPLIT] (a hub name or a local directory)")
    eval: str = Field("synthetic:reverse", description="held-out prompts, in the forms of data.train; an hf: "
                      "source without @split reads its eval, test or validation split")
    eval_size: int = Field(128, ge=1, description="held-out prompts evaluated (the first N)")
    prompt_key: str = Field("prompt", description="record field with the prompt text (records with 'messages' go "
                            "through the chat template)")
    label_key: str = Field("label", description="record field with the reference answer (else 'solution')")
    overlong: Literal["filter", "error"] = Field("filter", description="prompts longer than prompt_length tokens: "
                                                 "'filter' drops them with a warning, 'error' stops the run")



class RunConfig(_Strict):
    run_dir: str = Field("runs/default", description="directory for metrics, checkpoints, logs and the final model")
    iterations: int = Field(100, ge=1, description="PPO iterations: one rollout batch and its updates each")
    eval_interval: int = Field(10, ge=0, description="evaluate every N iterations; 0 = only first/last")
    checkpoint_interval: int = Field(10, ge=0, description="checkpoint every N iterations (and at the end and "
                                     "on SIGTERM); the learner service acknowledges trained trajectories "
                                     "at each checkpoint; 0 = only at the end")
    seed: int = Field(0, description="random seed of sampling, data order and initialisation")
    log_every: int = Field(1, ge=1, description="print a progress line every N iterations (and at each eval)")
    max_wall_s: Optional[float] = Field(None, gt=0, description="stop after this many seconds; null = no limit")
    hacking_window: int = Field(3, ge=0, description="reward-hacking watch: held-out evaluations compared (>= 2); "
                                "it warns while across them the held-out reward falls and the train reward rises; "
                                "0 = off")
    hacking_min_change: float = Field(0.05, ge=0, description="reward-hacking watch: least fall of the held-out "
                                      "reward and least rise of the train reward across the window (their "
                                      "least-squares trends, in reward units) that count")
    tensorboard: bool = Field(True, description="write every metric of metrics.jsonl as TensorBoard scalars "
                              "into DIR/tensorboard (when the tensorboard package is installed)")
    wandb_project: Optional[str] = Field(None, description="log every metric of metrics.jsonl to this Weights & "
                                         "Biases project (needs `pip install wandb`); null = off")
    wandb_entity: Optional[str] = Field(None, description="W&B entity (user or team); null = your default")
    wandb_mode: Optional[Literal["online", "offline", "disabled"]] = Field(
        None, description="W&B mode; null = wandb's default ($WANDB_MODE, else online)")

    @field_validator("hacking_window")
    @classmethod
    def _window(cls, v: int) -> int:
        if v == 1:
            raise ValueError("1 evaluation shows no trend; use 0 (off) or >= 2")
        return v


class ReplayConfig(_Strict):
    url: Optional[str] = Field(None, description="redis://[:password@]host:port/db; null = an embedded "
                               "redis-server that `rlhf up` starts in the run directory")
    password: Optional[str] = Field(None, description="Redis password; null = read password_env")
    password_env: str = Field("RLHF_REDIS_PASSWORD", description="env var read when password is null")
    namespace: str = Field("rlhf", min_length=1, description="key prefix; one namespace per run")
    max_backlog: Optional[int] = Field(None, gt=0, description="trajectory groups not yet read by the learner "
                                       "at which rollout workers pause; default (max_staleness + 1) x "
                                       "rollout_batch_size")
    claim_idle_s: float = Field(30.0, gt=0, description="a prompt pending this long at a silent worker is "
                                "reclaimed (XAUTOCLAIM) by another")
    heartbeat_s: float = Field(2.0, gt=0, description="generation servers and workers report this often")
    heartbeat_ttl_s: float = Field(10.0, gt=0, description="a server silent this long is taken off the registry")
    block_ms: int = Field(500, ge=1, description="longest blocking read on a stream, in milliseconds")
    appendfsync: Literal["everysec", "always", "no"] = Field(
        "everysec", description="embedded Redis AOF fsync policy: everysec survives a crash of Redis itself "
        "with nothing acknowledged lost (at most ~1 s of writes on a crash of the machine); always fsyncs "
        "every write (nothing acknowledged lost even then; slower)")

    def resolved_password(self) -> Optional[str]:
        import os
        return self.password or os.environ.get(self.password_env) or None


class RolloutConfig(_Strict):
    prompts_per_request: int = Field(32, ge=1, description="prompts a worker claims and sends in one Generate")
    concurrency: int = Field(2, ge=1, description="batches each worker keeps in flight")
    retries: int = Field(6, ge=0, description="retries of a failing batch (a service unavailable or "
                         "restarting) before it is left pending for later")
    retry_backoff_s: float = Field(0.5, gt=0, description="seconds before the first retry; doubles with each "
                                   "retry up to rpc.retry_max_backoff_s")
    metrics_port: Optional[int] = Field(None, ge=0, le=65535, description="port of each worker's Prometheus "
                                        "/metrics; null = off")


class Endpoint(_Strict):
    host: str = Field("127.0.0.1", description="address this server binds and clients dial (0.0.0.0 binds all, "
                      "dialled on loopback)")
    port: int = Field(..., ge=0, le=65535, description="gRPC port; 0 picks a free port")
    metrics_port: Optional[int] = Field(None, ge=0, le=65535, description="port of Prometheus /metrics; null = off")


class RewardEndpoint(Endpoint):
    http_port: Optional[int] = Field(8052, ge=0, le=65535, description="port of the OpenRLHF-style HTTP reward "
                                     "API; null = off")


class LearnerEndpoint(Endpoint):
    http_port: Optional[int] = Field(8054, ge=0, le=65535, description="port of the JSON status page (/status); "
                                     "null = off")


class RPCConfig(_Strict):
    host: str = Field("127.0.0.1", description="address servers bind; 0.0.0.0 in containers")
    advertise_host: Optional[str] = Field(None, description="address other services reach this one at (the "
                                          "pod IP in Kubernetes); default the bind host")
    auth_token: Optional[str] = Field(None, description="bearer token every call must carry")
    auth_token_env: str = Field("RLHF_AUTH_TOKEN", description="env var read when auth_token is null")
    tls_cert_file: Optional[str] = Field(None, description="PEM certificate servers present; with tls_key_file, "
                                         "servers speak TLS; null = plaintext")
    tls_key_file: Optional[str] = Field(None, description="PEM private key of tls_cert_file")
    tls_ca_file: Optional[str] = Field(None, description="clients: CA to trust (default the cert itself)")
    max_message_mb: int = Field(256, ge=1, le=2047, description="largest gRPC message, in MiB")
    shm_dir: Optional[str] = Field(None, description="learner and generation servers: a directory on a tmpfs "
                                   "they share when they run on one host (a compose tmpfs volume, a pod's "
                                   "emptyDir with medium Memory); a co-located server then loads each version "
                                   "from a file the learner writes there once, instead of the gRPC stream; "
                                   "null = off (every push is streamed)")
    grace_s: float = Field(10.0, ge=0, description="shutdown: seconds in-flight calls may take")
    timeout_s: float = Field(120.0, gt=0, description="client deadline per call, in seconds")
    retry_backoff_s: float = Field(0.2, gt=0, description="clients: seconds before the first retry of a call "
                                   "that found its service unavailable; doubles with each retry")
    retry_max_backoff_s: float = Field(5.0, gt=0, description="clients: longest wait between retries")
    dependency_wait_s: Optional[float] = Field(600.0, gt=0, description="learner: how long it waits for an "
                                               "unavailable critic, reward or generation server (saying so in "
                                               "its status) before it fails; null = forever")
    max_request_tokens: int = Field(4_194_304, ge=1, description="most token positions one Generate may cost "
                                    "(prompts x n x (prompt tokens + max_new_tokens)); beyond it "
                                    "RESOURCE_EXHAUSTED")
    open_metrics: bool = Field(False, description="serve /metrics without the bearer token (what a default "
                               "Prometheus scrape sends); false = scrapers send 'Authorization: Bearer <token>' "
                               "when rpc auth is on")
    max_samples_per_prompt: int = Field(64, ge=1, description="limit on Generate's n")
    max_prompts_per_request: int = Field(4096, ge=1, description="limit on the prompts of one Generate")
    generation: Endpoint = Field(default_factory=lambda: Endpoint(port=50051, metrics_port=9101),
                                 description="the generation server")
    reward: RewardEndpoint = Field(default_factory=lambda: RewardEndpoint(port=50052, metrics_port=9102),
                                   description="the reward server")
    critic: Endpoint = Field(default_factory=lambda: Endpoint(port=50053, metrics_port=9103),
                             description="the critic server")
    learner: LearnerEndpoint = Field(default_factory=lambda: LearnerEndpoint(port=50054, metrics_port=9104),
                                     description="the learner service")

    @model_validator(mode="before")
    @classmethod
    def _endpoint_defaults(cls, data):
        """`rpc.critic.host=critic` alone keeps the critic's default ports (an endpoint given in part
        is completed from its defaults instead of losing them)."""
        if isinstance(data, dict):
            for name, field in cls.model_fields.items():
                if isinstance(data.get(name), dict) and field.default_factory is not None:
                    data = {**data, name: {**field.default_factory().model_dump(), **data[name]}}
        return data

    @model_validator(mode="after")
    def _tls_pair(self) -> "RPCConfig":
        if bool(self.tls_cert_file) != bool(self.tls_key_file):
            raise ValueError("rpc.tls_cert_file and rpc.tls_key_file must be set together")
        return self

    def resolved_auth_token(self) -> Optional[str]:
        import os
        return self.auth_token or os.environ.get(self.auth_token_env) or None


class Config(_Strict):
    # --- ppo related (names and defaults of ROLL's PPO table) ---------------------------------
    rollout_batch_size: int = Field(512, gt=0, description="prompts sampled per iteration")
    prompt_length: int = Field(2048, gt=0, description="most tokens of a prompt")
    response_length: int = Field(4096, gt=0, description="most generated tokens of a response")
    adv_estimator: Literal[ADV_ESTIMATOR_NAMES] = Field(  # type: ignore[valid-type]
        "gae", description="advantage estimator: gae uses the critic, the others are critic-free")
    num_return_sequences_in_group: int = Field(1, gt=0, description="responses sampled per prompt (>= 2 for grpo "
                                               "and rloo)")
    ppo_epochs: int = Field(1, gt=0, description="optimisation passes over each rollout batch")
    use_kl_loss: bool = Field(True, description="add kl_loss_coef x KL to the reference as a loss term")
    kl_loss_coef: float = Field(0.001, ge=0, description="weight of the KL loss term")
    loss_agg_mode: Literal[LOSS_AGG_MODES] = Field(  # type: ignore[valid-type]
        "seq-mean-token-sum", description="reduction of per-token losses: mean over all tokens (token-mean), "
        "per-sequence sum or mean then mean over sequences (seq-mean-token-sum/-mean), or total / padded length "
        "(seq-mean-token-sum-norm, Dr. GRPO)")
    whiten_advantages: bool = Field(True, description="normalise advantages to mean 0, std 1 over the batch")
    advantage_clip: Optional[float] = Field(2.0, gt=0, description="clamp advantages to [-x, x]; null = off")
    reward_clip: Optional[float] = Field(None, gt=0, description="clamp rewards to [-x, x]; null = off")
    dual_clip_loss: bool = Field(True, description="dual-clip PPO: bound the loss of negative-advantage tokens "
                                 "at dual_clip_c x advantage")
    lambd: float = Field(0.95, ge=0, le=1, description="GAE lambda")
    gamma: float = Field(1.0, ge=0, le=1, description="discount factor")
    pg_clip: float = Field(0.2, gt=0, lt=1, description="PPO clip range: the ratio is clipped to "
                           "[1 - pg_clip, 1 + pg_clip]")
    value_clip: Optional[float] = Field(None, gt=0, description="clip new values to old values +- this (PPO2); "
                                        "null = off")
    kl_penalty: Literal[KL_PENALTY_NAMES] = Field(  # type: ignore[valid-type]
        "kl", description="per-token KL estimator: kl (k1), abs, mse (k2), low_var_kl (k3), or full (exact, over "
        "the whole vocabulary)")
    target_kl: Optional[float] = Field(None, gt=0, description="target KL of the adaptive KL controller; null = "
                                       "the coefficient stays init_kl_coef")
    init_kl_coef: float = Field(0.2, ge=0, description="(initial) coefficient of the per-token KL in the reward")
    kl_horizon: int = Field(10000, gt=0, description="adaptive KL horizon, in sequences: each update moves the "
                            "coefficient by at most 20% x sequences / horizon")
    add_token_level_kl: bool = Field(False, description="subtract the KL coefficient x per-token KL from the reward")
    # normalize
    reward_norm: Optional[Literal[REWARD_NORMS]] = Field(  # type: ignore[valid-type]
        None, description="normalise rewards with statistics of the batch, of each prompt's group, or running "
        "ones; null = off")
    reward_shift: bool = Field(False, description="with reward_norm: only subtract the mean")
    reward_scale: bool = Field(False, description="with reward_norm: only divide by the std")
    # --- beyond ROLL's table: loss terms, dual clip, asymmetric clip, reference choice ------
    dual_clip_c: float = Field(3.0, gt=1, description="c of dual-clip PPO (clip_ratio_c)")
    pg_clip_low: Optional[float] = Field(None, gt=0, lt=1, description="lower clip range (ratio >= 1 - this); "
                                         "null = pg_clip")
    pg_clip_high: Optional[float] = Field(None, gt=0, description="upper clip range (ratio <= 1 + this; DAPO "
                                          "clip-higher); null = pg_clip")
    policy_loss: Literal[POLICY_LOSS_NAMES] = Field(  # type: ignore[valid-type]
        "vanilla", description="policy objective: 'vanilla' = PPO clip on the token ratio (dual clip when "
        "dual_clip_loss), 'gspo' = clip on the sequence ratio (GSPO)")
    entropy_coef: float = Field(0.0, ge=0, description="weight of the entropy bonus")
    ptx_coef: float = Field(0.0, ge=0, description="PTX/SFT next-token loss weight (InstructGPT)")
    ref_model: Literal[REFERENCE_CHOICES] = Field(  # type: ignore[valid-type]
        "sft", description="KL reference: the frozen initial model, the policy before this update, or a mixture "
        "of both")
    ref_mix_coef: float = Field(0.5, ge=0, le=1, description="weight of the SFT model in 'mixture'")
    recompute_old_log_probs: bool = Field(True, description="recompute the sampled tokens' old log-probs with "
                                          "the training model; false = use the sampler's")
    fuse_old_log_probs: bool = Field(True, description="skip the forward that recomputes old log-probs when it "
                                     "provably equals the training forward (one epoch, one mini-batch, no KL in "
                                     "the reward, reference 'sft', kl_penalty not 'full', no rollout_is, no "
                                     "dropout) and take them from the training forward; false = always recompute")
    rollout_is: bool = Field(False, description="truncated importance sampling: weight each token's policy "
                             "loss by min(exp(old_log_prob - sampler's log_prob), rollout_is_threshold), "
                             "correcting for a sampler that differs from the learner (bf16 vLLM, staleness); "
                             "needs the sampler's log-probs; with recompute_old_log_probs false every weight is 1")
    rollout_is_threshold: float = Field(2.0, gt=0, description="cap of the truncated importance weight")
    max_staleness: int = Field(0, ge=0, description="policy versions a trajectory may lag the learner; "
                               "0 = synchronous on-policy PPO, >= 1 overlaps generation and training")
    # --- optimisation --------------------------------------------------------------------------
    actor_lr: float = Field(1e-6, gt=0, description="policy learning rate")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay of the policy and the critic")
    adam_betas: tuple[float, float] = Field((0.9, 0.999), description="AdamW betas of the policy")
    lr_warmup_steps: int = Field(0, ge=0, description="optimiser steps of linear learning-rate warmup")
    lr_scheduler: Literal["constant", "linear", "cosine"] = Field("constant", description="policy learning-rate "
                                                                  "schedule after the warmup")
    max_grad_norm: Optional[float] = Field(1.0, gt=0, description="clip the policy's gradient norm to this; "
                                           "null = off")
    ppo_mini_batch_size: int = Field(64, gt=0, description="sequences per optimiser step")
    micro_batch_size: Optional[int] = Field(None, gt=0, description="sequences per forward and backward "
                                            "(gradient accumulation); null = ppo_mini_batch_size")
    # --- sections ------------------------------------------------------------------------------
    model: ModelConfig = Field(default_factory=ModelConfig, description="the policy model")
    generation: GenerationConfig = Field(default_factory=GenerationConfig, description="sampling")
    reward: RewardConfig = Field(default_factory=RewardConfig, description="the reward")
    critic: CriticConfig = Field(default_factory=CriticConfig, description="the value model")
    data: DataConfig = Field(default_factory=DataConfig, description="training and held-out prompts")
    run: RunConfig = Field(default_factory=RunConfig, description="length, evaluation, checkpoints, logging")
    rpc: RPCConfig = Field(default_factory=RPCConfig, description="servers: addresses, auth, TLS, limits")
    replay: ReplayConfig = Field(default_factory=ReplayConfig, description="the Redis replay buffer")
    rollout: RolloutConfig = Field(default_factory=RolloutConfig, description="rollout workers")

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


def data_source_errors(cfg: "Config") -> list[str]:
    """Data sources that cannot be read here (a missing file or dataset directory, an unknown
    synthetic task). Checked by the commands that read the data (`config validate`, `train`,
    `up`, `serve learner`), not by every service: a generation server needs no prompt files."""
    errors = []
    for key in ("train", "eval"):
        problem = source_problem(getattr(cfg.data, key))
        if problem:
            errors.append(f"data.{key}: {problem}")
    return errors


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
    elif err["type"] == "value_error":
        msg = str(err["ctx"]["error"])
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
        try:
            out.append((key.strip(), yaml.safe_load(raw) if raw.strip() else None))
        except yaml.YAMLError as e:
            raise ConfigError([f"--set {item!r}: the value is not valid YAML: {_yaml_error(e)}"]) from None
    return out


def config_from_dict(data: dict | None, overrides: list[str] | None = None) -> Config:
    data = dict(data or {})
    for key, value in parse_overrides(overrides):
        _set_path(data, key, value)
    try:
        return Config.model_validate(data)
    except ValidationError as e:
        raise ConfigError([_describe(err) for err in e.errors()]) from None


def _yaml_error(e: yaml.YAMLError) -> str:
    """A YAML error in one line: what is wrong, and where."""
    mark = getattr(e, "problem_mark", None)
    problem = getattr(e, "problem", None)
    if isinstance(e, yaml.reader.ReaderError):
        ch = f"#x{e.character:04x}" if isinstance(e.character, int) else repr(e.character)
        return f"character {ch} at position {e.position} is not allowed in YAML"
    where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
    return f"{problem or ' '.join(str(e).split())}{where}"


def _read_yaml(p: Path) -> Any:
    """The parsed YAML of the config file `p`; a missing, unreadable, binary or malformed file is
    a ConfigError that says which."""
    if not p.exists():
        raise ConfigError([f"{p}: no such config file"])
    try:
        text = p.read_bytes().decode("utf-8")
    except IsADirectoryError:
        raise ConfigError([f"{p}: is a directory, not a config file"]) from None
    except OSError as e:
        raise ConfigError([f"{p}: cannot read: {e.strerror or e}"]) from None
    except UnicodeDecodeError as e:
        raise ConfigError([f"{p}: not a text file (byte {e.start} is not UTF-8); a config is YAML text"]) from None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ConfigError([f"{p}: not valid YAML: {_yaml_error(e)}"]) from None


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    data: dict = {}
    if path is not None:
        p = Path(path)
        loaded = _read_yaml(p)
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError([f"{p}: the top level must be a mapping"])
        data = loaded or {}
    return config_from_dict(data, overrides)


def dump_config(cfg: Config) -> str:
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)
