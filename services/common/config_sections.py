"""The sections of the configuration (model, generation, reward, critic, data, run, replay,
rollout, rpc): typed, validated, each key with its default and description, grouped below by the
service that owns them. `Config` (services/common/config.py) holds them beside the top-level PPO
keys."""

from __future__ import annotations

from typing import Any, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from . import environments
from .reasoning_gym_tasks import is_task_source
from .reasoning_gym_tasks import source_problem as task_source_problem


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


# ------------------------------------------ the policy (learner and generation)
class LoraConfig(Strict):
    rank: int = Field(
        default=0,
        ge=0,
        description="LoRA rank; 0 trains the full model (with LoRA the KL reference is the base model, adapters off)",
    )
    alpha: float = Field(
        default=16.0, gt=0, description="LoRA scale numerator: the adapters' output is scaled by alpha / rank"
    )
    dropout: float = Field(default=0.0, ge=0, lt=1, description="dropout probability on the adapters' input")
    target_modules: list[str] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"],
        description="names of the linear layers that get adapters",
    )


class ModelConfig(Strict):
    path: str = Field(
        default="runs/tiny-model",
        description="the policy: a local directory with config, weights and "
        "tokenizer, or a Hugging Face hub id (org/name)",
    )
    device: str = Field(
        default="auto", description="torch device: 'auto' (cuda when available), 'cpu', 'cuda', 'cuda:1', ..."
    )
    bf16: bool = Field(
        default=False,
        description="train in bfloat16 autocast (master weights, optimiser state and the "
        "log-prob head stay float32); generation.dtype auto samples in bfloat16 too",
    )
    reference_path: Optional[str] = Field(
        default=None,
        description="the KL reference (ref_model 'sft'): this model "
        "instead of model.path as loaded; set it to the original SFT model when "
        "model.path is an earlier run's final/ (a branch), or the reference moves "
        "with the policy",
    )
    gradient_checkpointing: bool = Field(
        default=False, description="recompute activations in the backward pass: less memory, more compute"
    )
    lora: LoraConfig = Field(default_factory=LoraConfig, description="LoRA adapters")
    nproc: int = Field(
        default=1,
        ge=1,
        description="learner processes (one per GPU) the actor and its optimiser state "
        "are sharded across with FSDP2; `rlhf serve learner` starts them (gloo on the CPU)",
    )


# ------------------------------------------ the generation server
class VLLMConfig(Strict):
    """Options of vLLM's engine (generation.backend: vllm). The defaults suit one GPU; on the CPU
    build, generation.dtype float32 and a few GiB of KV cache (`cpu_kvcache_space_gb`) are what to set."""

    gpu_memory_utilization: float = Field(
        default=0.85, gt=0, le=1, description="share of the GPU's memory vLLM takes (weights + KV cache)"
    )
    max_model_len: Optional[int] = Field(
        default=None, gt=0, description="longest sequence the engine serves; null = prompt_length + response_length"
    )
    tensor_parallel_size: int = Field(default=1, ge=1, description="GPUs one engine shards the model across")
    enforce_eager: bool = Field(
        default=False, description="no CUDA graphs (slower decoding, faster start, less memory)"
    )
    enable_prefix_caching: bool = Field(
        default=True, description="reuse the KV cache of shared prompt prefixes (reset at every weight swap)"
    )
    cpu_kvcache_space_gb: float = Field(
        default=1.0, gt=0, description="KV cache GiB of the CPU build (VLLM_CPU_KVCACHE_SPACE); unused on a GPU"
    )
    seed: int = Field(default=0, description="engine seed (requests with their own seed use theirs)")

    @model_validator(mode="before")
    @classmethod
    def _moved_keys(cls, data):
        if isinstance(data, dict) and "dtype" in data:
            raise ValueError("generation.vllm.dtype is now generation.dtype (one sampler dtype for either backend)")
        return data


class GenerationConfig(Strict):
    backend: Literal["hf", "vllm"] = Field(
        default="hf",
        description="sampling engine: transformers (CPU or GPU) or vLLM "
        "(its continuous batching; GPU, or its CPU build)",
    )
    temperature: float = Field(default=1.0, gt=0, le=10, description="sampling temperature of training rollouts")
    top_p: float = Field(
        default=1.0,
        gt=0,
        le=1,
        description="nucleus sampling: sample from the most likely tokens holding this much probability; 1 = off",
    )
    top_k: int = Field(default=0, ge=0, description="sample from the k most likely tokens; 0 = off")
    eval_temperature: float = Field(
        default=0.0, ge=0, le=10, description="sampling temperature of the held-out eval; 0 = greedy"
    )
    max_batch_size: int = Field(default=256, ge=1, description="most prompts a generation server decodes in one batch")
    batch_window_ms: float = Field(
        default=5.0,
        ge=0,
        description="milliseconds a generation server waits to batch "
        "concurrent calls together (hf; vLLM batches continuously)",
    )
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = Field(
        default="auto",
        description="the sampler's weights and arithmetic, either backend: auto = bfloat16 with model.bf16, "
        "else float32; float32 with model.bf16 trains in bfloat16 and samples in float32 (docs/speed.md)",
    )
    weight_update: Literal["between_batches", "in_flight"] = Field(
        default="between_batches",
        description="when a generation server takes a pushed version: between_batches = the requests in "
        "flight finish on the old one first (each sample one version); in_flight = between two decoding "
        "steps, the requests in flight go on under the new one (each token records its version; the push "
        "waits one step, not a batch; docs/async.md)",
    )
    in_flight_cache: Literal["recompute", "keep"] = Field(
        default="recompute",
        description="weight_update: in_flight: the keys and values of the requests in flight recomputed "
        "under the new weights (one prefill of prompt + tokens so far; vLLM preempts them) or kept as the "
        "old ones computed them",
    )
    vllm: VLLMConfig = Field(default_factory=VLLMConfig, description="vLLM engine options")

    def engine_dtype(self, bf16: bool) -> str:
        """The sampler's dtype by name: `dtype`, with auto resolved by the learner's model.bf16."""
        return self.dtype if self.dtype != "auto" else ("bfloat16" if bf16 else "float32")


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
    micro_batch_size: int = Field(default=8, ge=1, description="pairs per forward and backward (gradients accumulate)")
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


# ------------------------------------------ the training loop (learner, rlhf train --local)
class DataConfig(Strict):
    train: str = Field(
        default="synthetic:reverse",
        description="training prompts: synthetic:TASK (reverse, arithmetic, multiply), a "
        ".jsonl, .parquet, .csv or .json file, hf:DATASET[:CONFIG][@SPLIT] (a hub name or a local "
        "directory), or reasoning-gym:TASK[?size=N&seed=S&OPTION=VALUE...] (a reasoning-gym task "
        "generated offline: N items, default 1000, from seed S, default 0, with the task's config options), "
        "or verifiers (the dataset of rollout.environment's verifiers environment)",
    )
    eval: Optional[str] = Field(
        default=None,
        description="held-out prompts, in the forms of data.train; an hf: source "
        "without @split reads its eval, test or validation split; null = a split of "
        "data.train held out of training (a synthetic task: its own held-out prompts; a "
        "reasoning-gym task: its first data.eval_size items from the training seed + 1000003 whose "
        "question no training item asks; verifiers: the environment's eval_dataset, less its training "
        "prompts, else a split of its dataset)",
    )
    eval_size: int = Field(default=128, ge=1, description="held-out prompts evaluated (the first N)")
    prompt_key: str = Field(
        default="prompt",
        description="record field with the prompt: a string, or a list of chat "
        "messages (verl) rendered through the chat template, as are records with 'messages'; "
        "GSM8K rows without it (question, answer) use 'question'",
    )
    label_key: str = Field(
        default="label",
        description="record field with the reference answer (else verl's "
        "reward_model.ground_truth, else 'solution'; GSM8K rows: the number after '####')",
    )
    chat_template: bool = Field(
        default=False,
        description="wrap each string prompt as one user message and render it "
        "through the tokenizer's chat template; records whose prompt is a list of "
        "messages always use it",
    )
    system_prompt: Optional[str] = Field(
        default=None,
        description="with chat_template: a system message put before each string prompt's user message; null = none",
    )
    instruction: Optional[str] = Field(
        default=None,
        description="text appended (after a space) to each string prompt, "
        "before the chat template: e.g. GSM8K's 'Let's think step by step and "
        'output the final answer after "####".\'; null = none',
    )
    overlong: Literal["filter", "error"] = Field(
        default="filter",
        description="prompts longer than prompt_length tokens: "
        "'filter' drops them with a warning, 'error' stops the run",
    )

    @field_validator("train", "eval")
    @classmethod
    def _task_source(cls, source: Optional[str]) -> Optional[str]:
        # a reasoning-gym source: its syntax, task and config options, when the package is here
        # (without it, the commands that read the data say to install it)
        if is_task_source(source):
            problem = task_source_problem(source, need_package=False)
            if problem:
                raise ValueError(problem)
        return source

    @model_validator(mode="after")
    def _system_prompt_needs_template(self) -> "DataConfig":
        if self.system_prompt is not None and not self.chat_template:
            raise ValueError("data.system_prompt is only used with data.chat_template: true")
        return self


class RunConfig(Strict):
    run_dir: str = Field(
        default="runs/default", description="directory for metrics, checkpoints, logs and the final model"
    )
    iterations: int = Field(default=100, ge=1, description="PPO iterations: one rollout batch and its updates each")
    eval_interval: int = Field(default=10, ge=0, description="evaluate every N iterations; 0 = only first/last")
    checkpoint_interval: int = Field(
        default=10,
        ge=0,
        description="checkpoint every N iterations (and at the end and "
        "on SIGTERM); the learner service acknowledges trained trajectories "
        "at each checkpoint; 0 = only at the end",
    )
    resume_from: Optional[str] = Field(
        default=None,
        description="`rlhf train --local`: go on from this checkpoint "
        "(RUN_DIR/checkpoints/iter_N) instead of the run directory's newest; null = "
        "the newest, or a fresh start when there is none",
    )
    keep_checkpoints: int = Field(
        default=2,
        ge=1,
        description="checkpoints kept under checkpoints/ (the newest); older ones are deleted as new ones are written",
    )
    save_best: bool = Field(
        default=True,
        description="keep the policy of the best held-out evaluation so far as a Hugging "
        "Face directory in best/ (best/best.json: its iteration and held-out reward)",
    )
    gold_drop: Optional[float] = Field(
        default=None,
        gt=0,
        description="how far (in reward units) a held-out evaluation may fall below the best one "
        "so far before run.on_gold_drop acts: the held-out reward is the gold one when "
        "reward.eval_rules is set; null = off",
    )
    max_rollbacks: int = Field(
        default=3,
        ge=0,
        description="rollbacks of run.on_gold_drop a run may make; a fall past run.gold_drop after them stops the run",
    )
    on_gold_drop: Literal["rollback", "stop"] = Field(
        default="rollback",
        description="past run.gold_drop: 'rollback' loads the best policy so far back (best/, or "
        "model.path when the start was the best), drops the optimiser's moments, pushes it to the "
        "generation servers and goes on; 'stop' ends the run there (final/ is that policy)",
    )
    save_generations: bool = Field(
        default=True,
        description="write each held-out evaluation's prompts, responses, labels "
        "and rewards to generations/iter_N.jsonl",
    )
    seed: int = Field(default=0, description="random seed of sampling, data order and initialisation")
    log_every: int = Field(default=1, ge=1, description="print a progress line every N iterations (and at each eval)")
    max_wall_s: Optional[float] = Field(default=None, gt=0, description="stop after this many seconds; null = no limit")
    liveness_s: Optional[float] = Field(
        default=None,
        gt=0,
        description="learner service: its liveness (/healthz, gRPC "
        "health '') fails once the training loop has not advanced (a phase, a "
        "wait's tick, a call answered, an update step) for this many seconds; "
        "null = max(600, 3 x rpc.timeout_s, the longest Redis command with its "
        "retries)",
    )
    hacking_window: int = Field(
        default=3,
        ge=0,
        description="reward-hacking watch: held-out evaluations compared (>= 2); "
        "it warns while across them the held-out reward falls and the train reward rises; "
        "0 = off",
    )
    hacking_min_change: float = Field(
        default=0.05,
        ge=0,
        description="reward-hacking watch: least fall of the held-out "
        "reward and least rise of the train reward across the window (their "
        "least-squares trends, in reward units) that count",
    )
    tensorboard: bool = Field(
        default=True,
        description="write every metric of metrics.jsonl as TensorBoard scalars "
        "into DIR/tensorboard (when the tensorboard package is installed)",
    )
    wandb_project: Optional[str] = Field(
        default=None,
        description="log every metric of metrics.jsonl to this Weights & "
        "Biases project (needs `pip install wandb`); null = off",
    )
    wandb_entity: Optional[str] = Field(default=None, description="W&B entity (user or team); null = your default")
    wandb_mode: Optional[Literal["online", "offline", "disabled"]] = Field(
        default=None, description="W&B mode; null = wandb's default ($WANDB_MODE, else online)"
    )

    @field_validator("hacking_window")
    @classmethod
    def _window(cls, v: int) -> int:
        if v == 1:
            raise ValueError("1 evaluation shows no trend; use 0 (off) or >= 2")
        return v


# ------------------------------------------ the replay buffer and rollout workers
class ReplayConfig(Strict):
    url: Optional[str] = Field(
        default=None,
        description="redis://[:password@]host:port/db (a password percent-encoded, an IPv6 host in "
        "brackets; RESP2: no protocol=3); null = an embedded redis-server that `rlhf up` starts in the run directory",
    )
    password: Optional[str] = Field(default=None, description="Redis password; null = read password_env")
    password_env: str = Field(default="RLHF_REDIS_PASSWORD", description="env var read when password is null")
    namespace: str = Field(default="rlhf", min_length=1, description="key prefix; one namespace per run")
    max_backlog: Optional[int] = Field(
        default=None,
        gt=0,
        description="trajectory groups not yet read by the learner "
        "at which rollout workers pause; default (max_staleness + 1) x "
        "rollout_batch_size",
    )
    claim_idle_s: float = Field(
        default=30.0,
        gt=0,
        description="a prompt pending this long at a silent worker is reclaimed (XAUTOCLAIM) by another",
    )
    heartbeat_s: float = Field(default=2.0, gt=0, description="generation servers and workers report this often")
    heartbeat_ttl_s: float = Field(
        default=10.0, gt=0, description="a server silent this long is taken off the registry"
    )
    block_ms: int = Field(default=500, ge=1, description="longest blocking read on a stream, in milliseconds")
    appendfsync: Literal["everysec", "always", "no"] = Field(
        default="everysec",
        description="embedded Redis AOF fsync policy: everysec survives a crash of Redis itself "
        "with nothing acknowledged lost (at most ~1 s of writes on a crash of the machine); always fsyncs "
        "every write (nothing acknowledged lost even then; slower)",
    )

    @field_validator("url")
    @classmethod
    def _resp2(cls, v: Optional[str]) -> Optional[str]:
        """The replay store reads Redis' RESP2 replies as redis-py shapes them (a stream read is a
        list of [stream, entries]; RESP3, or redis-py's `legacy_responses=false`, makes it a
        map): a URL that asks for either is refused here, not at the first read."""
        from urllib.parse import parse_qs, urlsplit

        if not v:
            return v
        query = parse_qs(urlsplit(v).query)
        if any(not p.strip().isdigit() or int(p) != 2 for p in query.get("protocol", [])):
            raise ValueError("the replay store speaks RESP2: drop `protocol=` from the URL (or set protocol=2)")
        if any(p.strip().lower() in ("false", "0", "no", "off") for p in query.get("legacy_responses", [])):
            raise ValueError("the replay store reads redis-py's legacy reply shapes: drop `legacy_responses=`")
        return v

    def resolved_password(self) -> Optional[str]:
        import os

        return self.password or os.environ.get(self.password_env) or None


# what a session of a sample runs: your function, your gym-like environment, your agent service
AGENT_KINDS = ("agent", "environment", "agent_url")


class RolloutConfig(Strict):
    prompts_per_request: int = Field(default=32, ge=1, description="prompts a worker claims and sends in one Generate")
    partial_tokens: int = Field(
        default=0,
        ge=0,
        description="partial rollouts: at most this many new tokens per Generate call; a longer response "
        "is paused there and resumed by the next call from its tokens so far (after a weight update, if "
        "one came: each token keeps its version), so a push waits for one chunk, not the longest "
        "response; each resume prefills prompt + tokens again (docs/async.md). 0 = off",
    )
    agent: Optional[str] = Field(
        default=None,
        description="an agent function ('path/to/agent.py:run' or 'module:run'): each sample is a "
        "session it runs against the worker's OpenAI-compatible endpoint, fn(client, sample) -> "
        "reward (sync or async); null = one completion per sample, scored by the reward server",
    )
    environment: Optional[str] = Field(
        default=None,
        description="an environment class or factory ('path/to/env.py:SumEnv'), gym-like: reset(sample) -> the "
        "first user message, step(reply) -> (next message, reward, done); each sample a session of it, "
        "the rewards summed. Or an OpenEnv environment: a server, 'openenv+http://HOST:PORT', or its "
        "Environment class in this process, 'openenv:path/to/env.py:MyEnvironment' (options after ?: "
        "observation=FIELD, action=FIELD, adapter=file.py:fn, max_tokens=N). Or a verifiers environment: "
        "'verifiers:path/to/env.py:load_environment' or 'verifiers:ENV_ID' (an installed package; options "
        "after ?: KEY=VALUE, its keyword arguments), each sample one rollout of it scored by its rubric",
    )
    agent_url: Optional[str] = Field(
        default=None,
        description="an agent service over HTTP: for each sample it is POSTed the endpoint, the session "
        "and the sample, talks to the endpoint, and answers (or posts to the session) its reward",
    )
    agent_timeout_s: float = Field(
        default=300.0, gt=0, description="seconds one agent session may take; past it the prompt is dead-lettered"
    )
    max_turns: int = Field(
        default=16,
        ge=1,
        description="the policy's turns in one session: the endpoint refuses the next (an environment's "
        "episode ends there, truncated)",
    )
    endpoint_host: str = Field(
        default="127.0.0.1",
        description="address the worker's OpenAI-compatible endpoint binds (0.0.0.0 for an agent_url "
        "elsewhere; it is handed rpc.advertise_host or this)",
    )
    endpoint_port: int = Field(default=0, ge=0, le=65535, description="its port; 0 picks a free one")
    concurrency: int = Field(default=2, ge=1, description="batches each worker keeps in flight")
    retries: int = Field(
        default=6,
        ge=0,
        description="retries of a failing batch (a service unavailable or "
        "restarting) before it is left pending for later",
    )
    retry_backoff_s: float = Field(
        default=0.5,
        gt=0,
        description="seconds before the first retry; doubles with each retry up to rpc.retry_max_backoff_s",
    )
    generate_timeout_s: Optional[float] = Field(
        default=None,
        gt=0,
        description="deadline of a worker's Generate call before the per-token part, in seconds; null = rpc.timeout_s",
    )
    generate_timeout_per_token_s: float = Field(
        default=0.05,
        ge=0,
        description="seconds a Generate call's deadline "
        "grows per token it asks for (prompts x n x max_new_tokens): a "
        "slow server (a CPU, a busy machine) gets time in proportion to "
        "the work; a retry after a passed deadline gets twice the last",
    )
    metrics_port: Optional[int] = Field(
        default=None, ge=0, le=65535, description="port of each worker's Prometheus /metrics; null = off"
    )

    @field_validator("environment")
    @classmethod
    def _environment_reference(cls, ref: Optional[str]) -> Optional[str]:
        # its kind's syntax, by the registry (environments.py); whether it loads is the pre-flight's
        if ref is not None:
            environments.check(ref)
        return ref

    @model_validator(mode="after")
    def _one_kind_of_agent(self) -> "RolloutConfig":
        given = [k for k in AGENT_KINDS if getattr(self, k)]
        if len(given) > 1:
            raise ValueError(f"rollout: give one of agent, environment, agent_url (got {', '.join(given)})")
        return self

    @model_validator(mode="after")
    def _partial_without_sessions(self) -> "RolloutConfig":
        if self.partial_tokens and self.agent_kind:
            raise ValueError(
                f"partial_tokens={self.partial_tokens} with {self.agent_kind}: partial "
                "rollouts pause single-turn responses; an agent's sessions sample turn by turn through "
                "the endpoint and are never paused. Set rollout.partial_tokens: 0"
            )
        return self

    @property
    def agent_kind(self) -> Optional[str]:
        """Which of `AGENT_KINDS` is set (its value is the reference), or None."""
        return next((k for k in AGENT_KINDS if getattr(self, k)), None)

    @property
    def sessions(self) -> bool:
        """Whether each sample is a session (an agent, an environment or an agent service)
        rather than one completion scored by the reward server."""
        return self.agent_kind is not None


# ------------------------------------------ the network: every server's address and the RPC plumbing
class Endpoint(Strict):
    host: str = Field(
        default="127.0.0.1",
        description="address this server binds and clients dial (0.0.0.0 binds all, dialled on loopback)",
    )
    port: int = Field(..., ge=0, le=65535, description="gRPC port; 0 picks a free port")
    metrics_port: Optional[int] = Field(
        default=None, ge=0, le=65535, description="port of Prometheus /metrics; null = off"
    )


class RewardEndpoint(Endpoint):
    http_port: Optional[int] = Field(
        default=8052, ge=0, le=65535, description="port of the OpenRLHF-style HTTP reward API; null = off"
    )
    max_request_bytes: int = Field(
        default=67_108_864,
        ge=1024,
        description="largest body the HTTP reward API reads, in bytes (a batch of queries); beyond it 413",
    )


class LearnerEndpoint(Endpoint):
    http_port: Optional[int] = Field(
        default=8054, ge=0, le=65535, description="port of the JSON status page (/status); null = off"
    )


class GatewayEndpoint(Strict):
    host: str = Field(default="127.0.0.1", description="address the OpenAI-compatible endpoint binds")
    port: int = Field(default=8090, ge=0, le=65535, description="its HTTP port; 0 picks a free port")
    session_ttl_s: float = Field(default=3600.0, gt=0, description="a session idle this long is forgotten")
    max_sessions: int = Field(default=10_000, ge=1, description="sessions kept at once (the longest idle goes first)")
    max_request_bytes: int = Field(
        default=8_388_608,
        ge=1024,
        description="largest request body read, in bytes (its Content-Length, or what arrives of a "
        "chunked one); beyond it 413. The rollout workers' agent endpoints take it too",
    )
    max_session_id_bytes: int = Field(
        default=256,
        ge=128,
        le=8192,
        description="longest session id (x-session-id, the body's session_id, a /v1/sessions path), "
        "printable ASCII; beyond it 400. The agent endpoints take it too",
    )
    max_session_bytes: int = Field(
        default=16_777_216,
        ge=65_536,
        description="what one session may hold (its token-exact record and the messages it "
        "compares, about 80 bytes a token); a turn of a session holding more is refused "
        "(400, code session_too_large). The agent endpoints take it too",
    )
    max_sessions_bytes: int = Field(
        default=1_073_741_824,
        ge=65_536,
        description="what all sessions may hold together; beyond it the longest idle are forgotten",
    )

    @model_validator(mode="after")
    def _session_fits(self) -> "GatewayEndpoint":
        if self.max_sessions_bytes < self.max_session_bytes:
            raise ValueError(
                f"rpc.gateway.max_sessions_bytes ({self.max_sessions_bytes}) is less than one session's "
                f"max_session_bytes ({self.max_session_bytes})"
            )
        return self


class RPCConfig(Strict):
    host: str = Field(default="127.0.0.1", description="address servers bind; 0.0.0.0 in containers")
    advertise_host: Optional[str] = Field(
        default=None,
        description="address other services reach this one at (the pod IP in Kubernetes); default the bind host",
    )
    auth_token: Optional[str] = Field(default=None, description="bearer token every call must carry")
    auth_token_env: str = Field(default="RLHF_AUTH_TOKEN", description="env var read when auth_token is null")
    tls_cert_file: Optional[str] = Field(
        default=None,
        description="PEM certificate servers present; with tls_key_file, servers speak TLS; null = plaintext",
    )
    tls_key_file: Optional[str] = Field(default=None, description="PEM private key of tls_cert_file")
    tls_ca_file: Optional[str] = Field(default=None, description="clients: CA to trust (default the cert itself)")
    max_message_mb: int = Field(default=256, ge=1, le=2047, description="largest gRPC message, in MiB")
    shm_dir: Optional[str] = Field(
        default=None,
        description="learner and generation servers: a directory on a tmpfs "
        "they share when they run on one host (a compose tmpfs volume, a pod's "
        "emptyDir with medium Memory); a co-located server then loads each version "
        "from a file the learner writes there once, instead of the gRPC stream; "
        "null = off (every push is streamed)",
    )
    delta_push: bool = Field(
        default=False,
        description="learner and generation servers: stream each version as what changed since "
        "the one a server holds, exactly (a server that is behind, new or restarted gets it whole); "
        "40-60% of a float32 version's bytes after 1-10 optimiser steps, for CPU on both ends and "
        "one more copy of the model in host memory on each: worth it across a network slower than "
        "~1.5 Gb/s per server, slower on one host; false = every version goes whole (docs/speed.md)",
    )
    grace_s: float = Field(default=10.0, ge=0, description="shutdown: seconds in-flight calls may take")
    timeout_s: float = Field(default=120.0, gt=0, description="client deadline per call, in seconds")
    retry_backoff_s: float = Field(
        default=0.2,
        gt=0,
        description="clients: seconds before the first retry of a call "
        "that found its service unavailable; doubles with each retry",
    )
    retry_max_backoff_s: float = Field(default=5.0, gt=0, description="clients: longest wait between retries")
    dependency_wait_s: Optional[float] = Field(
        default=600.0,
        gt=0,
        description="learner: how long it waits for an "
        "unavailable critic, reward or generation server (saying so in "
        "its status) before it fails; null = forever",
    )
    max_request_tokens: int = Field(
        default=4_194_304,
        ge=1,
        description="most token positions one Generate may cost "
        "(prompts x n x (prompt tokens + max_new_tokens)); beyond it "
        "RESOURCE_EXHAUSTED",
    )
    open_metrics: bool = Field(
        default=False,
        description="serve /metrics without the bearer token (what a default "
        "Prometheus scrape sends); false = scrapers send 'Authorization: Bearer <token>' "
        "when rpc auth is on",
    )
    max_samples_per_prompt: int = Field(default=64, ge=1, description="limit on Generate's n")
    max_prompts_per_request: int = Field(default=4096, ge=1, description="limit on the prompts of one Generate")
    generation: Endpoint = Field(
        default_factory=lambda: Endpoint(port=50051, metrics_port=9101), description="the generation server"
    )
    reward: RewardEndpoint = Field(
        default_factory=lambda: RewardEndpoint(port=50052, metrics_port=9102), description="the reward server"
    )
    critic: Endpoint = Field(
        default_factory=lambda: Endpoint(port=50053, metrics_port=9103), description="the critic server"
    )
    learner: LearnerEndpoint = Field(
        default_factory=lambda: LearnerEndpoint(port=50054, metrics_port=9104), description="the learner service"
    )
    gateway: GatewayEndpoint = Field(
        default_factory=GatewayEndpoint, description="the OpenAI-compatible endpoint for agents (rlhf serve gateway)"
    )

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
