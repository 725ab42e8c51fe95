"""The rollout's sections: the replay buffer (Redis) and the rollout workers, with their agents and environments."""

from __future__ import annotations

from typing import Literal, Optional

from pydantic import Field, field_validator, model_validator

from .. import environments
from .base import Strict


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
    dynamic_sampling: bool = Field(
        default=False,
        description="DAPO's dynamic sampling: a group whose rewards are all equal (all right or all wrong: no "
        "group-relative advantage) is dropped from the batch and more prompts are sampled until it is full "
        "(the learner, or train --local); needs num_return_sequences_in_group >= 2",
    )
    dynamic_sampling_max_rounds: int = Field(
        default=3,
        ge=1,
        description="rounds of sampling one batch may take with dynamic_sampling; past them the batch is "
        "filled with groups whose rewards are all equal, with a warning",
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
