"""A rollout worker as a service: its parts composed, and its lifecycle. Stateless: run as many
as you like; start and stop them at any time. Each of its loops claims prompts, samples them
(Generate -> Score -> Values) and appends the trajectories while acknowledging the prompts (one
atomic step); beside them it keeps its registry entry alive (a heartbeat).

    serve(cfg) -> RolloutService.start     the worker built, its /metrics served, its first heartbeat
      RolloutWorker.run                    `rollout.concurrency` claim loops and the heartbeat, until stopped
        claims.py:ClaimLoop.run            claim a batch (its claim renewed while it is worked on)
        batches.py:Batches.settle          append its groups, or dead-letter, drop or leave them pending
        Sampler.sample                     the worker's sampler (training/sampling.py's seam), chosen once:
                                           the tries over the generation servers (sampling.py:ServerSampler),
                                           or an agent's sessions (agents/sampler.py:AgentSampler)
        outcomes.py:TABLE                  what a failed try means, and what the worker does about it
        metrics.py:WorkerMetrics           rlhf_rollout_*

    rlhf serve rollout -c configs/tiny-cpu.yaml --set replay.url=redis://127.0.0.1:6379/0
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from typing import TYPE_CHECKING

from ..agents.host import agent_host
from ..agents.sampler import AgentSampler
from ..common.lifecycle import RunFailed, Service
from ..common.model_files import load_tokenizer
from ..common.replay import ReplayStore
from ..common.rpc.client import endpoint_address
from ..common.rpc.errors import Reason
from ..common.rpc.retry import RideThrough, Tagged
from ..common.servers import RetryPolicy, ServerPool
from ..common.types import SamplingParams
from ..critic.client import CriticClient
from ..generation.client import generation_clients
from ..reward.client import RewardClient
from ..teacher.client import teacher_client
from ..training.distill import Distillation
from ..training.sampling import Sampler
from .batches import Batches
from .claims import ClaimLoop
from .metrics import WorkerMetrics
from .sampling import ServerSampler, generate_timeout

if TYPE_CHECKING:
    from ..common.config import Config

log = logging.getLogger(__name__)


class RolloutWorker:
    """A worker's parts, composed: its clients of the reward and critic servers, its pool of
    generation servers and the policy it tries them under, its sampling (a `Sampler`), what it does
    with a sampled batch (`Batches`), its claim loop (`ClaimLoop`) and its metrics."""

    def __init__(self, cfg: Config, store: ReplayStore, name: str | None = None):
        self.cfg, self.store = cfg, store
        self.name = name or f"{socket.gethostname()}-{os.getpid()}"
        self.tokenizer = load_tokenizer(cfg.model.path)
        self.stop_event = threading.Event()
        self.metrics = WorkerMetrics()
        # the reward and critic servers are waited for while they restart (the claim is renewed)
        # (and while the reward API is down; a batch the API failed is scored again, then dropped)
        # (errors say which service answered them: `e.service`)
        self.reward = reward_client(cfg, self.stop_event, self.metrics.waiting)
        self.critic = critic_client(cfg, self.stop_event, self.metrics.waiting) if cfg.needs_critic else None
        # on-policy distillation: the teacher server, waited for like them (or the sampling server itself)
        teacher = teacher_client(cfg, self.stop_event, self.metrics.waiting) if cfg.distill.needs_server else None
        self.distill = Distillation.for_training(cfg, self.tokenizer, teacher)
        # which generation server to call: round robin, at the version if one is, avoiding failures
        self.servers = ServerPool(
            lambda: store.live("generation"), generation_clients(cfg.rpc), cfg.replay.heartbeat_s / 2
        )
        self.retry = retry_policy(cfg)
        self.sampler = self._sampler(cfg)
        self.batches = Batches(store, self.name, self.sampler, self.stop_event, self.metrics)
        self.loop = ClaimLoop(cfg, store, self.name, self.batches.process, self.stop_event, self.metrics)
        self.last_heartbeat = time.monotonic()

    def _sampler(self, cfg: Config) -> Sampler:
        """The worker's one choice of how a prompt is sampled: each sample a session of the user's
        agent, on an endpoint of the worker's own, or one reply of a generation server."""
        if cfg.rollout.sessions:
            return AgentSampler(
                cfg,
                agent_host(cfg, self.tokenizer, self.servers, SamplingParams.for_training(cfg, 1)),
                self.tokenizer,
                self.critic,
                self.stop_event,
                on_down=lambda kind: self.metrics.error(kind).inc(),
                distill=self.distill,
            )
        return ServerSampler(
            cfg,
            self.tokenizer,
            servers=self.servers,
            retry=self.retry,
            reward=self.reward,
            critic=self.critic,
            stop_event=self.stop_event,
            metrics=self.metrics,
            distill=self.distill,
        )

    @property
    def produced(self) -> int:
        """Groups this worker appended."""
        return self.batches.produced

    @property
    def failure(self) -> str | None:
        """Why the run cannot go on (the reward function failed); None while it can."""
        return self.batches.failure

    def generate_timeout(self, n_prompts: int, params: SamplingParams) -> float:
        """The deadline of a Generate call: a base and a budget per token asked for."""
        return generate_timeout(self.cfg, n_prompts, params)

    def process(self, entries: list) -> int:
        """Sample, append and acknowledge one claimed batch. Returns groups appended."""
        return self.batches.process(entries)

    def run(self) -> None:
        """Run `rollout.concurrency` batch loops and a heartbeat until `stop()`."""
        threads = [
            threading.Thread(target=self.loop.run, name=f"rollout-{i}", daemon=True)
            for i in range(self.cfg.rollout.concurrency)
        ]
        for t in threads:
            t.start()
        while not self.stop_event.is_set():
            try:
                self.heartbeat()
            except Exception as e:
                log.warning("heartbeat failed: %s", e)
            self.stop_event.wait(self.cfg.replay.heartbeat_s)
        for t in threads:
            t.join()
        self.close()
        try:
            self.store.deregister("worker", self.name)
        except Exception as e:  # Redis gone at shutdown: the entry expires with its heartbeat's TTL
            log.info("could not deregister worker %s (%s); its registry entry expires on its own", self.name, e)
        log.info("rollout worker %s stopped after %d groups", self.name, self.produced)

    def heartbeat(self) -> None:
        """Register (or refresh) this worker in the registry."""
        self.store.heartbeat("worker", self.name, produced=self.produced)
        self.last_heartbeat = time.monotonic()

    def health(self) -> str | None:
        """None while the worker is alive: its heartbeat reached Redis within replay.heartbeat_ttl_s
        (the age after which the registry forgets it); else why not (for /healthz)."""
        age = time.monotonic() - self.last_heartbeat
        if age > self.cfg.replay.heartbeat_ttl_s:
            return f"no heartbeat reached Redis for {age:.0f} s"
        return None

    def stop(self) -> None:
        self.stop_event.set()

    def close(self) -> None:
        """The agents' endpoint, once the loops have ended (the sessions in flight finish first)."""
        self.sampler.close()

    def serve_metrics(self, port: int, host: str = "127.0.0.1") -> int:
        """/metrics on `port`, behind the bearer token unless rpc.open_metrics, and /healthz (open)."""
        from ..common.rpc.metrics_http import metrics_token, serve_metrics

        self.metrics_httpd, bound = serve_metrics(
            self.metrics.registry, host, port, metrics_token(self.cfg.rpc), self.health
        )
        return bound


def reward_client(cfg: Config, stop_event: threading.Event, on_wait) -> RewardClient:
    """The reward server's client: its errors tagged "reward", the server waited for while it is
    unavailable (and while the reward API is down), a batch the reward API failed raised at once
    (`RewardAPIFailure`: the worker scores it again, then drops it)."""
    reward_at = endpoint_address(cfg.rpc.reward)
    ride = RideThrough(
        "reward server", reward_at, cfg.rpc, stop_event, on_wait=on_wait, final=[Reason.REWARD_API_FAILED]
    )
    return RewardClient(reward_at, cfg.rpc, interceptors=[Tagged("reward"), ride])


def critic_client(cfg: Config, stop_event: threading.Event, on_wait) -> CriticClient:
    """The critic server's client: its errors tagged "critic", the server waited for while it is
    unavailable."""
    critic_at = endpoint_address(cfg.rpc.critic)
    ride = RideThrough("critic server", critic_at, cfg.rpc, stop_event, on_wait=on_wait)
    return CriticClient(critic_at, cfg.rpc, interceptors=[Tagged("critic"), ride])


def retry_policy(cfg: Config) -> RetryPolicy:
    """A batch's tries: `rollout.retries` more after the first, the backoff doubling; a server that
    failed avoided until the next try, one that refused the request a heartbeat's time to live,
    one behind the version a heartbeat."""
    return RetryPolicy(
        tries=cfg.rollout.retries + 1,
        backoff_s=cfg.rollout.retry_backoff_s,
        max_backoff_s=cfg.rpc.retry_max_backoff_s,
        refused_s=cfg.replay.heartbeat_ttl_s,
        behind_s=cfg.replay.heartbeat_s,
    )


class RolloutService(Service):
    """`serve(cfg)`'s handle: start() connects to Redis and registers the worker (its first
    heartbeat), which is when it is ready; run() is the worker's loop until drained."""

    name = "rollout"

    def __init__(self, cfg: Config, name: str | None = None):
        self.cfg, self._name = cfg, name
        self.worker: RolloutWorker | None = None
        self.metrics_port: int | None = None

    def start(self) -> "RolloutService":
        self.worker = RolloutWorker(self.cfg, ReplayStore.from_config(self.cfg), name=self._name)
        if self.cfg.rollout.metrics_port is not None:
            self.metrics_port = self.worker.serve_metrics(self.cfg.rollout.metrics_port, self.cfg.rpc.host)
        self.worker.heartbeat()
        return self

    @property
    def ready(self) -> bool:
        return self.worker is not None

    def _started(self) -> RolloutWorker:
        if self.worker is None:
            raise RuntimeError("RolloutService.start() first")
        return self.worker

    def endpoints(self) -> dict:
        return {"worker": self._started().name, "metrics_port": self.metrics_port}

    def run(self) -> int:
        worker = self._started()
        worker.run()
        if worker.failure:
            raise RunFailed(worker.failure)  # run_service: exit EXIT_RUN_FAILED
        return 0

    def drain(self) -> None:
        if self.worker is not None:
            self.worker.stop()

    def stop(self) -> None:
        self.drain()


def serve(cfg: Config, name: str | None = None) -> RolloutService:
    """A rollout worker (`replay.url` must be set). `name` is its consumer name (default
    host-pid); its /metrics is on `rollout.metrics_port` (null = off) at `rpc.host`."""
    return RolloutService(cfg, name)
