"""One typed, validated configuration for every service.

The PPO keys live at the top level with the names and defaults of ROLL's RLVRConfig PPO table,
so ROLL's own YAML block (`configs/seed-ppo.yaml`) validates unchanged. Everything
else (model, sampling, reward, critic, run) sits in sections. Unknown keys are errors that name
the closest valid key; out-of-range values are errors that name the allowed range or choices.

    cfg = load_config("configs/tiny-cpu.yaml", overrides=["pg_clip=0.1", "run.seed=3"])
"""

from __future__ import annotations

import copy
import difflib
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Optional

import yaml
from pydantic import BaseModel, Field, ValidationError, model_validator

from ..ppo import (
    ADV_ESTIMATORS,
    KL_ESTIMATORS,
    LOSS_AGG_MODES,
    POLICY_LOSSES,
    REFERENCE_CHOICES,
    REWARD_NORMS,
    ROLLOUT_CORRECTIONS,
)
from . import environments
from .config_sections import (  # noqa: F401 (the sections are importable from here too)
    CriticConfig,
    DataConfig,
    DistillConfig,
    Endpoint,
    GenerationConfig,
    IterateConfig,
    LearnerEndpoint,
    LoraConfig,
    ModelConfig,
    ReplayConfig,
    RewardConfig,
    RewardEndpoint,
    RewardModelConfig,
    RolloutConfig,
    RPCConfig,
    RuleSpec,
    RunConfig,
    Strict,
    TinkerConfig,
    VLLMConfig,
)

if TYPE_CHECKING:
    from pydantic_core import ErrorDetails

# the algorithm's choices come from its registries: one list of names, not two
ADV_ESTIMATOR_NAMES = ADV_ESTIMATORS.names()
KL_PENALTY_NAMES = KL_ESTIMATORS.choices()
POLICY_LOSS_NAMES = POLICY_LOSSES.names()
ROLLOUT_CORRECTION_NAMES = ROLLOUT_CORRECTIONS.names()


class Config(Strict):
    # --- ppo related (names and defaults of ROLL's PPO table) ---------------------------------
    rollout_batch_size: int = Field(default=512, gt=0, description="prompts sampled per iteration")
    prompt_length: int = Field(default=2048, gt=0, description="most tokens of a prompt")
    response_length: int = Field(default=4096, gt=0, description="most generated tokens of a response")
    adv_estimator: Literal[ADV_ESTIMATOR_NAMES] = Field(  # type: ignore[valid-type]
        default="gae", description="advantage estimator: gae uses the critic, the others are critic-free"
    )
    num_return_sequences_in_group: int = Field(
        default=1, gt=0, description="responses sampled per prompt (>= 2 for grpo and rloo)"
    )
    ppo_epochs: int = Field(default=1, gt=0, description="optimisation passes over each rollout batch")
    use_kl_loss: bool = Field(default=True, description="add kl_loss_coef x KL to the reference as a loss term")
    kl_loss_coef: float = Field(default=0.001, ge=0, description="weight of the KL loss term")
    loss_agg_mode: Literal[LOSS_AGG_MODES] = Field(  # type: ignore[valid-type]
        default="seq-mean-token-sum",
        description="reduction of per-token losses: mean over all tokens (token-mean), "
        "per-sequence sum or mean then mean over sequences (seq-mean-token-sum/-mean), or total / padded length "
        "(seq-mean-token-sum-norm, Dr. GRPO)",
    )
    whiten_advantages: bool = Field(default=True, description="normalise advantages to mean 0, std 1 over the batch")
    advantage_clip: Optional[float] = Field(default=2.0, gt=0, description="clamp advantages to [-x, x]; null = off")
    reward_clip: Optional[float] = Field(default=None, gt=0, description="clamp rewards to [-x, x]; null = off")
    dual_clip_loss: bool = Field(
        default=True,
        description="dual-clip PPO: bound the loss of negative-advantage tokens at dual_clip_c x advantage",
    )
    lambd: float = Field(default=0.95, ge=0, le=1, description="GAE lambda")
    gamma: float = Field(default=1.0, ge=0, le=1, description="discount factor")
    pg_clip: float = Field(
        default=0.2, gt=0, lt=1, description="PPO clip range: the ratio is clipped to [1 - pg_clip, 1 + pg_clip]"
    )
    value_clip: Optional[float] = Field(
        default=None, gt=0, description="clip new values to old values +- this (PPO2); null = off"
    )
    kl_penalty: Literal[KL_PENALTY_NAMES] = Field(  # type: ignore[valid-type]
        default="kl",
        description="per-token KL estimator: kl (k1), abs, mse (k2), low_var_kl (k3), or full (exact, over "
        "the whole vocabulary)",
    )
    target_kl: Optional[float] = Field(
        default=None,
        gt=0,
        description="target KL of the adaptive KL controller; null = the coefficient stays init_kl_coef",
    )
    init_kl_coef: float = Field(
        default=0.2, ge=0, description="(initial) coefficient of the per-token KL in the reward"
    )
    kl_horizon: int = Field(
        default=10000,
        gt=0,
        description="adaptive KL horizon, in sequences: each update moves the "
        "coefficient by at most 20% x sequences / horizon",
    )
    add_token_level_kl: bool = Field(
        default=False, description="subtract the KL coefficient x per-token KL from the reward"
    )
    # normalize
    reward_norm: Optional[Literal[REWARD_NORMS]] = Field(  # type: ignore[valid-type]
        default=None,
        description="normalise rewards with statistics of the batch, of each prompt's group, or running "
        "ones; null = off",
    )
    reward_shift: bool = Field(default=False, description="with reward_norm: only subtract the mean")
    reward_scale: bool = Field(default=False, description="with reward_norm: only divide by the std")
    # --- beyond ROLL's table: loss terms, dual clip, asymmetric clip, reference choice ------
    dual_clip_c: float = Field(default=3.0, gt=1, description="c of dual-clip PPO (clip_ratio_c)")
    pg_clip_low: Optional[float] = Field(
        default=None, gt=0, lt=1, description="lower clip range (ratio >= 1 - this); null = pg_clip"
    )
    pg_clip_high: Optional[float] = Field(
        default=None, gt=0, description="upper clip range (ratio <= 1 + this; DAPO clip-higher); null = pg_clip"
    )
    policy_loss: Literal[POLICY_LOSS_NAMES] = Field(  # type: ignore[valid-type]
        default="vanilla",
        description="policy objective: 'vanilla' = PPO clip on the token ratio (dual clip when "
        "dual_clip_loss), 'gspo' = clip on the sequence ratio (GSPO), 'cispo' = REINFORCE weighted by the "
        "clipped, detached token ratio (CISPO; bounds: cispo_clip_low, pg_clip_high)",
    )
    cispo_clip_low: float = Field(
        default=1.0,
        ge=0,
        le=1,
        description="policy_loss cispo: lower bound of the weight (ratio >= 1 - this); 1 = no lower "
        "bound, as the CISPO paper; the upper bound is pg_clip_high (null = pg_clip)",
    )
    entropy_coef: float = Field(default=0.0, ge=0, description="weight of the entropy bonus")
    ptx_coef: float = Field(default=0.0, ge=0, description="PTX/SFT next-token loss weight (InstructGPT)")
    ref_model: Literal[REFERENCE_CHOICES] = Field(  # type: ignore[valid-type]
        default="sft",
        description="KL reference: the frozen initial model, the policy before this update, or a mixture of both",
    )
    ref_mix_coef: float = Field(default=0.5, ge=0, le=1, description="weight of the SFT model in 'mixture'")
    recompute_old_log_probs: bool = Field(
        default=True,
        description="recompute the sampled tokens' old log-probs with the training model; false = use the sampler's",
    )
    fuse_old_log_probs: bool = Field(
        default=True,
        description="skip the forward that recomputes old log-probs when it "
        "provably equals the training forward (one epoch, one mini-batch, no KL in "
        "the reward, reference 'sft', kl_penalty not 'full', no rollout correction nor its metrics, no "
        "dropout) and take them from the training forward; false = always recompute",
    )
    rollout_correction: Optional[Literal[ROLLOUT_CORRECTION_NAMES]] = Field(  # type: ignore[valid-type]
        default=None,
        description="correction for a sampler that differs from the learner (bf16 vLLM, staleness), "
        "from the ratio pi_old / sampler of each sampled token: none; token_tis (each token's loss x "
        "min(ratio, rollout_is_threshold)); seq_tis (every token of a sequence x min(product of its "
        "ratios, rollout_is_threshold)); seq_mask (drop a sequence whose geometric-mean ratio is outside "
        "[rollout_mask_low, rollout_mask_high], default [0.99, 1.01]); icepop (drop a token whose ratio is "
        "outside the band, default [0.5, 2.0]). Needs the sampler's log-probs. null = token_tis when "
        "rollout_is is true, else none (set, it wins over rollout_is)",
    )
    rollout_is: bool = Field(
        default=False,
        description="the older spelling of rollout_correction: token_tis, read only when rollout_correction is null",
    )
    rollout_is_threshold: float = Field(
        default=2.0, gt=0, description="cap C of the truncated importance weight (token_tis, seq_tis)"
    )
    rollout_mask_low: Optional[float] = Field(
        default=None,
        ge=0,
        lt=1,
        description="lower end of the ratio band seq_mask and icepop keep; null = the mode's (0.99, 0.5)",
    )
    rollout_mask_high: Optional[float] = Field(
        default=None,
        gt=1,
        description="upper end of the ratio band seq_mask and icepop keep; null = the mode's (1.01, 2.0)",
    )
    rollout_correction_metrics: bool = Field(
        default=False,
        description="log the sampler/learner drift metrics (rollout_correction/*) with rollout_correction "
        "none too (needs the sampler's log-probs; keeps the old-log-prob forward); any other mode logs them",
    )
    max_staleness: int = Field(
        default=0,
        ge=0,
        description="policy versions a trajectory may lag the learner; "
        "0 = synchronous on-policy PPO, >= 1 overlaps generation and training",
    )
    # --- optimisation --------------------------------------------------------------------------
    actor_lr: float = Field(default=1e-6, gt=0, description="policy learning rate")
    weight_decay: float = Field(default=0.0, ge=0, description="AdamW weight decay of the policy and the critic")
    adam_betas: tuple[float, float] = Field(default=(0.9, 0.999), description="AdamW betas of the policy")
    lr_warmup_steps: int = Field(default=0, ge=0, description="optimiser steps of linear learning-rate warmup")
    lr_scheduler: Literal["constant", "linear", "cosine"] = Field(
        default="constant", description="policy learning-rate schedule after the warmup"
    )
    max_grad_norm: Optional[float] = Field(
        default=1.0, gt=0, description="clip the policy's gradient norm to this; null = off"
    )
    ppo_mini_batch_size: int = Field(default=64, gt=0, description="sequences per optimiser step")
    micro_batch_size: Optional[int] = Field(
        default=None,
        gt=0,
        description="sequences per forward and backward "
        "(gradient accumulation, exact in every loss_agg_mode); "
        "null = ppo_mini_batch_size",
    )
    log_prob_micro_batch_size: Optional[int] = Field(
        default=None,
        gt=0,
        description="sequences per forward of the "
        "passes without gradients (old log-probs, reference, "
        "values); null = micro_batch_size",
    )
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
    distill: DistillConfig = Field(
        default_factory=DistillConfig, description="on-policy distillation: a teacher scores each sampled token"
    )
    reward_model: RewardModelConfig = Field(
        default_factory=RewardModelConfig, description="reward-model training (`rlhf train-rm`)"
    )
    iterate: IterateConfig = Field(
        default_factory=IterateConfig, description="iterated RLHF (`rlhf iterate`): rounds of pairs, reward model, PPO"
    )
    tinker: TinkerConfig = Field(
        default_factory=TinkerConfig, description="the Tinker-compatible training API (`rlhf serve tinker`)"
    )

    @model_validator(mode="after")
    def _consistent(self) -> "Config":
        if self.adv_estimator in ("grpo", "rloo") and self.num_return_sequences_in_group < 2:
            raise ValueError(
                f"adv_estimator={self.adv_estimator!r} needs num_return_sequences_in_group >= 2 "
                f"(got {self.num_return_sequences_in_group})"
            )
        if self.rollout.dynamic_sampling and self.num_return_sequences_in_group < 2:
            raise ValueError(
                "rollout.dynamic_sampling drops groups whose rewards are all equal: with "
                "num_return_sequences_in_group=1 every group is; set it to 2 or more"
            )
        self._environment_prompts()
        self._distillation()
        if self.critic.init_from_reward_model:
            if self.critic.model_path is not None:
                raise ValueError(
                    "critic.init_from_reward_model: the critic starts from reward.model_path; unset critic.model_path"
                )
            if self.reward.model_path is None:
                raise ValueError(
                    "critic.init_from_reward_model: needs reward.model_path (the reward model to start from)"
                )
        return self

    def _distillation(self) -> None:
        """A teacher that can say something the student does not already know."""
        d = self.distill
        if d.enabled and self.rollout.dynamic_sampling:
            raise ValueError(
                "rollout.dynamic_sampling drops groups whose rewards are all equal, but with distill.enabled "
                "every sampled token carries the teacher's signal: turn one of them off"
            )
        if d.enabled and d.forward_kl_coef > 0 and (d.top_k < 1 or d.teacher == "policy"):
            raise ValueError(
                "distill.forward_kl_coef: the top-k forward KL needs the teacher's top-k log-probs: set distill.top_k "
                "(e.g. 8) with distill.teacher: model (the policy as the teacher returns no top-k)"
            )
        if not d.enabled or d.teacher != "policy":
            return
        if not d.hint:
            raise ValueError(
                "distill.teacher: policy scores with the policy that sampled; without distill.hint its "
                "context is the student's and every distillation advantage is 0: set distill.hint, or "
                "distill.teacher: model with distill.teacher_path"
            )
        if self.rollout.sessions:
            raise ValueError(
                "distill.teacher: policy is for one reply per sample; an agent's sessions (rollout.agent, "
                "environment, agent_url) are read by a teacher model: distill.teacher: model"
            )

    def _environment_prompts(self) -> None:
        """A data source that takes an environment's prompts (`verifiers`) has an environment of
        that kind to take them from (the reference's syntax: RolloutConfig's; whether it loads:
        the pre-flight's)."""
        env = self.rollout.environment
        for key in ("train", "eval"):
            source = getattr(self.data, key)
            if source in environments.sources() and not environments.brings_prompts(env, source):
                kind = environments.sources()[source]
                raise ValueError(
                    f"data.{key}: `{source}` takes the prompts of a {kind.name} environment; "
                    f"set rollout.environment to one ({kind.syntax})"
                )

    @property
    def max_backlog(self) -> int:
        return self.replay.max_backlog or (self.max_staleness + 1) * self.rollout_batch_size

    @property
    def needs_critic(self) -> bool:
        return self.adv_estimator == "gae"

    @property
    def rollout_correction_mode(self) -> str:
        """The rollout correction in force: `rollout_correction`, else token_tis with the older
        `rollout_is: true`, else none."""
        if self.rollout_correction is not None:
            return self.rollout_correction
        return "token_tis" if self.rollout_is else "none"

    @property
    def uses_sampler_log_probs(self) -> bool:
        """Whether each step compares the sampler's log-probs with the learner's old ones (a
        correction, or its metrics alone)."""
        return self.rollout_correction_mode != "none" or self.rollout_correction_metrics

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


def _describe(err: ErrorDetails, data: dict | None = None) -> str:
    loc = tuple(err["loc"])
    key = ".".join(str(p) for p in loc) or "<root>"
    if err["type"] == "extra_forbidden":
        valid = _fields_at(loc[:-1])
        close = difflib.get_close_matches(str(loc[-1]), valid, n=1, cutoff=0.5)
        hint = f"; did you mean {'.'.join([*map(str, loc[:-1]), close[0]])!r}?" if close else ""
        if close and data is not None:
            hint += _as_suggested(data, loc, close[0])
        return f"{key}: {UNKNOWN_KEY}{hint}"
    msg = err["msg"]
    if err["type"] == "literal_error":
        msg = f"got {err['input']!r}; allowed: {err['ctx']['expected']}"
    elif err["type"] == "value_error":
        msg = str(err["ctx"]["error"])
    elif "input" in err and err["type"] not in ("missing",):
        msg = f"{msg} (got {err['input']!r})"
    return f"{key}: {msg}"


def _as_suggested(data: dict, loc: tuple, name: str) -> str:
    """What validation says of a misspelt key's value under the key it was probably meant to be
    (so `gama: 1.5` reports gamma's range in the same run), or ""."""
    trial = copy.deepcopy(data)
    node = trial
    for p in loc[:-1]:
        node = node[p]
    if name in node:
        return ""
    node[name] = node.pop(loc[-1])
    try:
        Config.model_validate(trial)
    except ValidationError as e:
        said = [_describe(err) for err in e.errors() if tuple(err["loc"]) == (*loc[:-1], name)]
        return f" ({said[0]})" if said else ""
    return ""


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


def parse_overrides(overrides: list | None) -> list[tuple[str, Any]]:
    """`KEY=VALUE` strings (the value is YAML), or (key, value) pairs already typed (the CLI's flags)."""
    out = []
    for item in overrides or []:
        if isinstance(item, tuple):
            out.append(item)
            continue
        if "=" not in item:
            raise ConfigError([f"--set {item!r}: expected key=value"])
        key, raw = item.split("=", 1)
        try:
            out.append((key.strip(), yaml.safe_load(raw) if raw.strip() else None))
        except yaml.YAMLError as e:
            raise ConfigError([f"--set {item!r}: the value is not valid YAML: {_yaml_error(e)}"]) from None
    return out


UNKNOWN_KEY = "unknown key"  # how a key the schema does not have is reported (blame_overrides reads it)


def blame_overrides(errors: list[str], origins: dict[str, str]) -> list[str]:
    """`errors` ("KEY: problem") with each KEY that an override set (or a key inside it) named by
    that override, as `origins` ({key: "--set KEY=VALUE"}) has it: "--set gamma=3: Input ...". A
    problem with a value someone set on the command line is theirs, not the config file's."""
    out = []
    for err in errors:
        key, sep, problem = err.partition(": ")
        owner = next((k for k in sorted(origins, key=len, reverse=True) if key == k or key.startswith(f"{k}.")), None)
        if owner is None:  # a section's problem: the override inside it that the problem names
            inside = [k for k in sorted(origins) if k.startswith(f"{key}.")]
            named = [k for k in inside if k.rsplit(".", 1)[-1] in problem]
            owner = (
                max(named, key=len) if named else (inside[0] if inside and problem.startswith(UNKNOWN_KEY) else None)
            )
        if not sep or owner is None:
            out.append(err)
        else:
            out.append(f"{origins[owner]}: {problem if key == owner else err}")
    return out


def config_from_dict(data: dict | None, overrides: list | None = None) -> Config:
    data = dict(data or {})
    for key, value in parse_overrides(overrides):
        _set_path(data, key, value)
    try:
        return Config.model_validate(data)
    except ValidationError as e:
        raise ConfigError([_describe(err, data) for err in e.errors()]) from None


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


# where `base: NAME` finds a preset by name, after the file's own directory and $RLHF_CONFIG_PATH
PRESETS = Path(__file__).resolve().parents[2] / "configs"


def config_data(path: str | Path | None = None, overrides: list | None = None) -> dict:
    """The config file's mapping (layered on its `base:`, if it names one) with `overrides`
    applied, not validated."""
    data = _file_data(Path(path), ()) if path is not None else {}
    for key, value in parse_overrides(overrides):
        _set_path(data, key, value)
    return data


def _file_data(p: Path, seen: tuple[Path, ...]) -> dict:
    """One file's mapping; with `base: NAME` (a preset such as smollm2-cpu, or a path relative to
    the file), the base's mapping with this file's keys layered over it: sections merge key by key,
    everything else (lists included) is replaced. The base's run.run_dir is not inherited: unless
    the file sets its own, its run goes in runs/FILE (runs/mine for mine.yaml)."""
    loaded = _read_yaml(p)
    if loaded is not None and not isinstance(loaded, dict):
        raise ConfigError([f"{p}: the top level must be a mapping"])
    data = dict(loaded or {})
    base = data.pop("base", None)
    if base is None:
        return data
    if not isinstance(base, str) or not base:
        raise ConfigError([f"{p}: base: give a preset name (e.g. smollm2-cpu) or a config file path"])
    found = find_base(base, p.parent)
    if found is None:
        names = ", ".join(sorted(q.stem for q in PRESETS.glob("*.yaml")))
        raise ConfigError([f"{p}: base: {base!r} is no file here and no preset; presets: {names}"])
    if found.resolve() in seen or found.resolve() == p.resolve():
        raise ConfigError([f"{p}: base: {base!r} leads back to itself"])
    under = _file_data(found, (*seen, p.resolve()))
    mine = data.get("data")
    if not isinstance(mine, dict):
        mine = {}
    if "train" in mine and "eval" not in mine:
        # the base's held-out prompts belong to the base's training prompts: with prompts of your
        # own and none held out, a split of yours is (never the preset's task)
        under = _without(under, "data", "eval")
    # the base's run directory holds the base's run: this file's run has its own, named after it
    own_run = _layered(_without(under, "run", "run_dir"), {"run": {"run_dir": f"runs/{p.stem}"}})
    return _layered(own_run, data)


def _without(data: dict, section: str, key: str) -> dict:
    """`data` with `section.key` left out."""
    if not isinstance(data.get(section), dict):
        return data
    return {**data, section: {k: v for k, v in data[section].items() if k != key}}


def find_base(name: str, beside: Path) -> Path | None:
    """A `base:` config: `name` as a path (from the file's directory), or NAME.yaml in the file's
    directory, in $RLHF_CONFIG_PATH's directories, or among the presets (configs/)."""
    import os

    direct = Path(name).expanduser()
    direct = direct if direct.is_absolute() else beside / direct
    if direct.is_file():
        return direct
    file = name if name.endswith((".yaml", ".yml")) else f"{name}.yaml"
    dirs = [beside, *map(Path, filter(None, os.environ.get("RLHF_CONFIG_PATH", "").split(os.pathsep))), PRESETS]
    return next((d / file for d in dirs if (d / file).is_file()), None)


def _layered(base: dict, top: dict) -> dict:
    out = dict(base)
    for key, value in top.items():
        out[key] = _layered(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def load_config(path: str | Path | None = None, overrides: list | None = None) -> Config:
    return config_from_dict(config_data(path, overrides))


def dump_config(cfg: Config) -> str:
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)
