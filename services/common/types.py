"""The data contracts every service shares: prompts, sampling parameters, completions, reward
samples and results, sample groups and the learner's rollout batch; and the interfaces
(`GenerationBackend`, `Scorer`, `ValueFunction`) that a domain object and its gRPC client both
satisfy. A leaf module: it imports no service and no torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Mapping, Protocol, Sequence

if TYPE_CHECKING:
    from .config import Config

if TYPE_CHECKING:  # annotations only
    import torch

    from .modeling import TokenBatch


Progress = Callable[[], None]
"""The `on_progress` of long work: called at each step of it (a micro-batch, a server's answer,
a wait's tick); the learner service hands its heartbeat (a sign of life, see learner/liveness.py)."""


def no_progress() -> None:
    """The `on_progress` when nobody listens."""


STRUCTURED_LABEL = "ground_truth"  # the metadata field of a label stored as a structure (a dict or list)


@dataclass
class PromptRecord:
    """One prompt of a dataset: its id, the rendered text, an optional label (the reference answer
    a rule reward checks against) and whatever else the row carried."""

    id: str
    prompt: str
    label: str | None = None
    metadata: dict = field(default_factory=dict)


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    max_new_tokens: int = 16
    stop_token_ids: list[int] = field(default_factory=list)  # EOS is always a stop token
    seed: int | None = None

    @classmethod
    def for_training(cls, cfg: Config, n: int | None = None) -> "SamplingParams":
        """Training rollouts: the group size and the configured temperature/top-p/top-k."""
        g = cfg.generation
        return cls(
            n=n or cfg.num_return_sequences_in_group,
            temperature=g.temperature,
            top_p=g.top_p,
            top_k=g.top_k,
            max_new_tokens=cfg.response_length,
        )

    @classmethod
    def for_eval(cls, cfg: Config) -> "SamplingParams":
        """The held-out eval: one sample per prompt at eval_temperature (0 = greedy), seeded."""
        g = cfg.generation
        return cls(
            n=1,
            temperature=g.eval_temperature,
            top_p=g.top_p,
            top_k=g.top_k,
            max_new_tokens=cfg.response_length,
            seed=cfg.run.seed,
        )


@dataclass
class Completion:
    token_ids: list[int]
    log_probs: list[float]  # log-prob of each sampled token under the sampling distribution
    finish_reason: str  # "stop" (a stop token was sampled, and is included) or "length"
    # a multi-turn trajectory: 1 where the policy sampled the token, 0 where the environment put it
    # in context (a tool's result, a user's turn: no gradient, no KL); None: every token sampled
    loss_mask: list[int] | None = None
    # per token, the policy version that sampled it, where that is not one version for all (a
    # weight update in flight, a partial rollout resumed after an update); None: every token from
    # the version its result or group names
    token_versions: list[int] | None = None

    def versions(self, default: int) -> list[int]:
        """Per token, the policy version that sampled it (`default` where it is one version)."""
        return list(self.token_versions) if self.token_versions is not None else [default] * len(self.token_ids)


def switched_versions(first: int, switches: Sequence[tuple[int, int]], n_tokens: int) -> list[int] | None:
    """Per token of a completion of `n_tokens` tokens, the policy version that sampled it: `first`,
    then from each switch's token position on its version (`switches`: (position, version) in
    order). None when that is `first` for every token (the form `Completion.token_versions` takes)."""
    per_token = [first] * n_tokens
    for at, version in switches:
        per_token[at:] = [version] * max(n_tokens - at, 0)
    return None if all(v == first for v in per_token) else per_token


@dataclass
class GenerationResult:
    completions: list[list[Completion]]  # [prompt][sample]
    policy_version: int  # the version decoding began on (every token's, unless a completion's token_versions say)
    tokens: int
    seconds: float


@dataclass
class RewardSample:
    prompt: str
    response: str
    label: str | None = None
    metadata: dict = field(default_factory=dict)


@dataclass
class ScoreResult:
    reward: float
    components: dict[str, float] = field(default_factory=dict)


@dataclass
class SampleGroup:
    """The samples of one prompt: `policy_version` the oldest that sampled a token of them (each
    token's own in a completion's `token_versions`, when they differ)."""

    uid: str  # "<epoch>:<prompt id>": samples of a group share it (GRPO/RLOO groups)
    record: PromptRecord
    prompt_ids: list[int]
    completions: list[Completion]
    scores: list[ScoreResult]
    values: list[list[float]] | None  # per sample, one value per response token
    policy_version: int
    # per sample, the teacher's log-prob of each response token (on-policy distillation); None: no teacher
    teacher_log_probs: list[list[float]] | None = None
    # per sample, per response token, the teacher's top-k tokens and their log-probs (distill.forward_kl_coef)
    teacher_top_ids: list[list[list[int]]] | None = None
    teacher_top_log_probs: list[list[list[float]]] | None = None


@dataclass
class Rollout:
    """Scored samples of one batch, flattened: B = prompts x samples per prompt. Per-token rows
    are ragged (one entry per response token); the learner pads them once."""

    prompt_ids: list[list[int]]
    response_ids: list[list[int]]
    scores: list[float]
    index: list  # group id per sample: samples of one prompt share it
    gen_log_probs: list[list[float]] | None = None  # the sampler's log-probs
    values: list[list[float]] | None = None  # critic values per response token, needed for GAE
    policy_versions: list[int] = field(default_factory=list)  # per sample, the policy version that sampled it
    # per response token, 1 where trained (the policy sampled it), 0 where the environment put it;
    # None: every response token is trained (single-turn rollouts)
    loss_masks: list[list[int]] | None = None
    # per response token, the policy version that sampled it, when some sample's tokens come from
    # more than one version (weight updates in flight, resumed partial rollouts); None: each
    # sample's tokens all from its `policy_versions` entry
    token_versions: list[list[int]] | None = None
    # per response token, the teacher's log-prob (on-policy distillation), when every group has them
    teacher_log_probs: list[list[float]] | None = None
    # per response token, the teacher's top-k tokens and their log-probs, when every group has them
    teacher_top_ids: list[list[list[int]]] | None = None
    teacher_top_log_probs: list[list[list[float]]] | None = None

    @classmethod
    def from_groups(cls, groups: Sequence[SampleGroup]) -> "Rollout":
        gen_log_probs: list[list[float]] = []
        # critic values when every group has them (the learner's intake drops a group without them
        # from a run that trains a critic; a run without one ignores those a worker sent)
        values: list[list[float]] | None = [] if groups and all(g.values is not None for g in groups) else None
        out = cls([], [], [], [], gen_log_probs, values, [])
        holes = any(c.loss_mask is not None for g in groups for c in g.completions)
        mixed = any(c.token_versions is not None for g in groups for c in g.completions)
        masks: list[list[int]] = []
        versions: list[list[int]] = []
        for g in groups:
            for j, c in enumerate(g.completions):
                if holes:
                    masks.append(list(c.loss_mask) if c.loss_mask is not None else [1] * len(c.token_ids))
                if mixed:
                    versions.append(c.versions(g.policy_version))
                out.prompt_ids.append(g.prompt_ids)
                out.response_ids.append(c.token_ids)
                gen_log_probs.append(c.log_probs)
                out.scores.append(g.scores[j].reward)
                out.index.append(g.uid)
                out.policy_versions.append(g.policy_version)
                if values is not None and g.values is not None:
                    values.append(g.values[j])
        out.loss_masks = masks if holes else None
        out.token_versions = versions if mixed else None
        if groups and all(g.teacher_log_probs is not None for g in groups):
            out.teacher_log_probs = [lp for g in groups for lp in g.teacher_log_probs]  # type: ignore[union-attr]
        if groups and all(g.teacher_top_ids is not None for g in groups):
            out.teacher_top_ids = [t for g in groups for t in g.teacher_top_ids]  # type: ignore[union-attr]
            out.teacher_top_log_probs = [t for g in groups for t in g.teacher_top_log_probs]  # type: ignore[union-attr]
        return out


@dataclass
class TokenScores:
    """Teacher-forced log-probs of given tokens (a generation server's ScoreTokens): per sequence,
    the log-prob of each scored token at temperature 1; the policy version that scored them all,
    and the dtype its engine ran in."""

    log_probs: list[list[float]]
    policy_version: int
    dtype: str


@dataclass
class TeacherScores:
    """A teacher's reading of sampled tokens (on-policy distillation): per sequence, the log-prob
    of each response token given the teacher's context and the tokens before it, at temperature 1;
    with top-k asked, per token the teacher's k most likely next tokens and their log-probs."""

    log_probs: list[list[float]]
    top_ids: list[list[list[int]]] | None = None
    top_log_probs: list[list[list[float]]] | None = None


class Teacher(Protocol):
    """The teacher of on-policy distillation: the in-process `teacher.Teacher` and `TeacherClient`.
    `prompts[i]` is the teacher's context (the student's prompt, or it with a hint), `responses[i]`
    the sampled tokens it scores."""

    def score(
        self, prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]], top_k: int = 0
    ) -> TeacherScores: ...


class GenerationBackend(Protocol):
    """What the generation server serves and the in-process trainer samples with (the `hf` and
    `vllm` backends); `GenerationClient` offers `generate`/`update_weights` over gRPC."""

    policy_version: int  # the policy version it serves
    tokenizer: object
    vocab_size: int
    eos_token_id: int
    pad_token_id: int
    # what the server adapts to
    continuous_batching: bool  # takes calls as they come (vLLM's scheduler), or batched by the server's window
    partial_updates: bool  # loads a partial version (LoRA's merged modules), or whole policies only
    broken: str | None  # why it must not serve now (a reload failed midway); None while it can

    def dead(self) -> str | None: ...  # why it can never serve again (liveness fails); None while alive

    # `stop()` true: every caller left, the batch may end early; `between()`, when given, runs between
    # two decoding steps (weight updates in flight: the `hf` backend's, generation.weight_update)
    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams,
        stop: Callable[[], bool] | None = None,
        between: Callable[[], None] | None = None,
    ) -> GenerationResult: ...

    def update_weights(self, state_dict: Mapping[str, "torch.Tensor"], policy_version: int) -> None: ...

    def parameter_specs(self) -> dict[str, tuple[tuple[int, ...], "torch.dtype"]]: ...

    def info(self) -> dict: ...


class Scorer(Protocol):
    """Rewards for a batch of samples: rule, model and HTTP scorers, and `RewardClient`."""

    def score(self, samples: Sequence[RewardSample]) -> list[ScoreResult]: ...


class ValueFunction(Protocol):
    """The critic: the in-process `Critic` and `CriticClient`."""

    def values(self, batch: "TokenBatch") -> "torch.Tensor": ...

    def train_step(self, batch: "TokenBatch", returns: "torch.Tensor", old_values: "torch.Tensor") -> dict: ...
