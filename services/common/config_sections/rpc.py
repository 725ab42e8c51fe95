"""The network's section: every server's address and port, and the RPC plumbing (auth, TLS, sizes,
deadlines, weight pushes)."""

from __future__ import annotations

from typing import Literal, Optional

from pydantic import Field, model_validator

from .base import Strict


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


class PushParityConfig(Strict):
    """The learner's check that each generation server serves what was pushed: after a push, every
    server scores a fixed probe batch (ScoreTokens) and the learner compares with its own log-probs
    of the same tokens (docs/failure-model.md, "Push parity")."""

    every: int = Field(
        default=10,
        ge=0,
        description="check every this many pushes, the first push of the learner process always "
        "(a broken push path breaks the first push already); 0 = off. 10: on a CPU a check costs "
        "about what the push does (0.8 s beside a 1.0 s push on SmolLM2-135M, measured), a tenth "
        "of that every tenth push; 1 where checks are cheap (a GPU)",
    )
    probe_sequences: int = Field(
        default=4, ge=1, le=64, description="sequences in the probe batch: the first held-out (else training) prompts"
    )
    probe_tokens: int = Field(
        default=16,
        ge=1,
        description="tokens scored per probe sequence: the learner's own greedy continuation of the "
        "prompt, made once at the first check (at most response_length)",
    )
    max_mean_abs: float = Field(
        default=1e-3,
        gt=0,
        description="the largest mean |log-prob difference| per token a float32 server may show; "
        "a clean push measures 0 on a CPU",
    )
    max_mean_abs_bf16: float = Field(
        default=0.1,
        gt=0,
        description="the same for a server whose engine runs in bfloat16 or float16 (its rounding: "
        "0.005 on the tiny model, 0.015 on SmolLM2-135M, measured)",
    )
    on_mismatch: Literal["warn", "stop"] = Field(
        default="warn",
        description="a server beyond its bound, or scoring with another version than the one pushed: "
        "warn = log a warning and count it (rlhf_push_parity_failures_total); stop = also stop the "
        "run, naming the server and the version (a restart resumes from the newest checkpoint)",
    )


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
    push_parity: PushParityConfig = Field(
        default_factory=PushParityConfig,
        description="learner: after a push, check that each generation server serves the pushed policy",
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
    teacher: Endpoint = Field(
        default_factory=lambda: Endpoint(port=50056, metrics_port=9106),
        description="the teacher server of on-policy distillation (rlhf serve teacher)",
    )
    tinker_trainer: Endpoint = Field(
        default_factory=lambda: Endpoint(port=50057, metrics_port=9107),
        description="the training models of a Tinker API (rlhf serve tinker-trainer; the API's tinker.trainer)",
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
