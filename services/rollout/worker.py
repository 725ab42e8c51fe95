"""A stateless rollout worker: claim prompts -> Generate -> Score -> Values -> append the
trajectories and acknowledge the prompts (one atomic step). Run as many as you like; start and
stop them at any time. A worker killed mid-batch leaves its prompts pending; another worker
reclaims them after `replay.claim_idle_s`. A live worker renews its claim while it works, so a
slow batch (or one waiting for a restarting service) is never taken over.

A Generate call's deadline grows with the work it asks for: `rollout.generate_timeout_s` (default
`rpc.timeout_s`) plus `rollout.generate_timeout_per_token_s` x prompts x n x max_new_tokens. Every
attempt of one batch carries the same idempotency key, so a retry that reaches a server still
working on the batch waits for that work instead of starting it again (the server stops work whose
callers have all left).

Failures, by where they come from:
    a generation server unavailable, or refusing the request as a whole (its limits differ)
        -> another server is tried (that one avoided for a while); after `rollout.retries`
           the batch is left pending and picked up again later
    a Generate past its deadline -> retried like the above, with twice the deadline
    the reward or critic server unavailable -> wait for it (it restarts), as the learner does;
        so too while the user's reward API is down (its circuit breaker open) or refuses the
        token or URL: nothing is scored, nothing dropped
    the reward API failed this batch (its requests' retries spent, the breaker closed)
        -> the batch's scoring alone is repeated `reward.group_retries` times, then the batch is
           split and each prompt sampled and scored once more; a group that still gets no reward
           while the API scores others is dropped: dead-lettered (the learner feeds a
           replacement) and counted (`rlhf_rollout_groups_dropped_total`); when it scores none,
           the prompts stay pending (an outage, not an input). A batch of one prompt is dropped
           after its retries. No group is ever appended with a partial or a default reward.
    one prompt refused (INVALID_ARGUMENT about prompts[i], a reward rule's complaint, a 4xx the
        reward API answered about the input)
        -> the batch is split to find it; that prompt alone goes to the dead-letter stream

    rlhf serve rollout -c configs/tiny-cpu.yaml --set replay.url=redis://127.0.0.1:6379/0
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid
from typing import TYPE_CHECKING

import grpc
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from ..common.lifecycle import RunFailed, Service
from ..common.metrics import labelled, register_process_metrics
from ..common.modeling import load_tokenizer
from ..common.replay import ReplayStore, redis_error_code
from ..common.replay.records import group_to_proto, task_record
from ..common.rpc.client import endpoint_address
from ..common.rpc.errors import Reason, reason_of
from ..common.rpc.retry import DependencyUnavailable, RideThrough, Tagged
from ..common.servers import Fault, RetryPolicy, ServerPool, Tries
from ..common.types import SamplingParams
from ..critic.client import CriticClient
from ..gateway.agents import agent_host
from ..generation.client import GenerationClient, generation_clients
from ..reward.client import RewardAPIFailure, RewardClient
from .agents import AgentSampling, Rejected
from .step import sample_groups

if TYPE_CHECKING:
    from ..common.config import Config

log = logging.getLogger(__name__)

# kinds of rlhf_rollout_errors_total: waiting for the reward or critic server, no generation server
# registered, a dependency gone longer than the worker waits, an error in the claim loop, a batch
# the reward API failed on every try and prompt by prompt (left pending), an agent service
# (rollout.agent_url) that did not answer, and the
# gRPC status codes (lower case) of failed calls, the common ones listed (any other may appear)
ERROR_KINDS = (
    "waiting",
    "no_generation_server",
    "dependency",
    "loop",
    "reward_api",
    "agent_service",
    "unavailable",
    "deadline_exceeded",
)


class WorkerMetrics:
    """A worker's Prometheus metrics, each labelled `service="rollout"`, and its process's."""

    SERVICE = "rollout"

    def __init__(self):
        self.registry = CollectorRegistry()
        r, service = self.registry, self.SERVICE

        counter = labelled(Counter, r, service)

        self.claimed = counter("rlhf_rollout_prompts_claimed_total", "prompts claimed")
        self.reclaimed = counter("rlhf_rollout_prompts_reclaimed_total", "prompts taken over from a silent worker")
        self.produced = counter("rlhf_rollout_groups_produced_total", "trajectory groups appended")
        self.duplicates = counter("rlhf_rollout_duplicates_total", "prompt attempts that already had trajectories")
        self.dead = counter("rlhf_rollout_dead_letters_total", "prompts no worker can process")
        self.score_retries = counter(
            "rlhf_rollout_score_retries_total", "batches scored again after the reward API failed them"
        )
        self.dropped = counter(
            "rlhf_rollout_groups_dropped_total",
            "groups dropped (dead-lettered) because the reward API could not score them",
        )
        self.errors = Counter("rlhf_rollout_errors_total", "failed service calls", ["service", "kind"], registry=r)
        for kind in ERROR_KINDS:  # from 0, so an alert's rate exists before the first error
            self.error(kind)
        self.backpressure = counter("rlhf_rollout_backpressure_seconds_total", "seconds paused on a full buffer")
        self.batch_seconds = Histogram(
            "rlhf_rollout_batch_seconds",
            "claim to append, per batch",
            ["service"],
            registry=r,
            buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120),
        ).labels(service)
        self.in_flight = Gauge(
            "rlhf_rollout_batches_in_flight", "batches being processed", ["service"], registry=r
        ).labels(service)
        register_process_metrics(r, service)

    def error(self, kind: str):
        """The `rlhf_rollout_errors_total` child of `kind`."""
        return self.errors.labels(self.SERVICE, kind)


class RewardFunctionFailed(RuntimeError):
    """The reward server answered FAILED_PRECONDITION: the user's reward function raised (the
    details hold its traceback). Not the prompt's fault, and no retry mends it."""


class _OneBatch:
    """A generation client as `sample_groups` calls it, for the attempts at one batch: each call
    with the batch's deadline and idempotency key."""

    def __init__(self, client: GenerationClient, key: str, timeout_s: float):
        self.client, self.key, self.timeout_s = client, key, timeout_s

    def generate(self, prompts, params: SamplingParams):
        return self.client.generate(prompts, params, timeout=self.timeout_s, key=self.key)


class ScoringFailed(RuntimeError):
    """The reward API failed a batch on every try: its groups have no reward."""


class _Scoring:
    """The reward server as `sample_groups` calls it in a worker: a batch the reward API failed
    (`RewardAPIFailure`) is scored again `retries` times, `wait_s` apart (the samples are kept:
    nothing is generated again), then `ScoringFailed`. A stopping worker raises
    `DependencyUnavailable` instead (the batch stays pending)."""

    def __init__(self, reward, retries: int, wait_s: float, stop_event: threading.Event, metrics: WorkerMetrics):
        self.reward, self.retries, self.wait_s = reward, retries, wait_s
        self.stop_event, self.metrics = stop_event, metrics

    def score(self, samples):
        for attempt in range(self.retries + 1):
            try:
                return self.reward.score(samples)
            except RewardAPIFailure as e:
                error = e
            if self.stop_event.is_set():
                raise DependencyUnavailable(f"stopping; the reward API failed the batch: {error}")
            if attempt < self.retries:
                self.metrics.score_retries.inc()
                log.warning(
                    "the reward API failed a batch of %d samples (%s); scoring it again in %.1fs (%d/%d)",
                    len(samples),
                    error,
                    self.wait_s,
                    attempt + 1,
                    self.retries,
                )
                self.stop_event.wait(self.wait_s)
        raise ScoringFailed(str(error))


class _ClaimRenewal:
    """While a batch is worked on, re-claim its prompts every claim_idle_s / 3 (their idle time
    restarts), so other workers see a live owner and leave them alone."""

    def __init__(self, store: ReplayStore, consumer: str, entry_ids: list, every_s: float):
        self.store, self.consumer, self.ids, self.every_s = store, consumer, entry_ids, every_s
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="claim-renewal", daemon=True)

    def _loop(self) -> None:
        while not self._done.wait(self.every_s):
            try:
                self.store.renew_claims(self.consumer, self.ids)
            except Exception as e:  # Redis restarting: the next renewal tries again
                log.warning("could not renew the claim on %d prompts: %s", len(self.ids), e)

    def __enter__(self) -> "_ClaimRenewal":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._done.set()
        self._thread.join(timeout=5)


class RolloutWorker:
    def __init__(self, cfg: Config, store: ReplayStore, name: str | None = None):
        self.cfg, self.store = cfg, store
        self.name = name or f"{socket.gethostname()}-{os.getpid()}"
        self.tokenizer = load_tokenizer(cfg.model.path)
        self.stop_event = threading.Event()
        self.metrics = WorkerMetrics()
        # the reward and critic servers are waited for while they restart (the claim is renewed)
        # (and while the reward API is down; a batch the API failed is scored again, then dropped)
        # (errors say which service answered them: `e.service`)
        reward_at = endpoint_address(cfg.rpc.reward)
        self.reward = RewardClient(
            reward_at,
            cfg.rpc,
            interceptors=[
                Tagged("reward"),
                RideThrough(
                    "reward server",
                    reward_at,
                    cfg.rpc,
                    self.stop_event,
                    on_wait=self._waiting,
                    final=[Reason.REWARD_API_FAILED],
                ),
            ],
        )
        self.critic = None
        if cfg.needs_critic:
            critic_at = endpoint_address(cfg.rpc.critic)
            self.critic = CriticClient(
                critic_at,
                cfg.rpc,
                interceptors=[
                    Tagged("critic"),
                    RideThrough("critic server", critic_at, cfg.rpc, self.stop_event, on_wait=self._waiting),
                ],
            )
        # which generation server to call: round robin, at the version if one is, avoiding failures
        self.servers = ServerPool(
            lambda: store.live("generation"), generation_clients(cfg.rpc), cfg.replay.heartbeat_s / 2
        )
        # a batch's tries: `rollout.retries` more after the first, the backoff doubling; a server that
        # failed avoided until the next try, one that refused the request a heartbeat's time to
        # live, one behind the version a heartbeat
        rc = cfg.rollout
        self.retry = RetryPolicy(
            tries=rc.retries + 1,
            backoff_s=rc.retry_backoff_s,
            max_backoff_s=cfg.rpc.retry_max_backoff_s,
            refused_s=cfg.replay.heartbeat_ttl_s,
            behind_s=cfg.replay.heartbeat_s,
        )
        self.agents: AgentSampling | None = None
        if cfg.rollout.sessions:  # each sample a session of the user's agent, on an endpoint of its own
            self.agents = AgentSampling(
                cfg,
                agent_host(cfg, self.tokenizer, self.servers, SamplingParams.for_training(cfg, 1)),
                self.tokenizer,
                self.critic,
                self.stop_event,
                on_down=lambda kind: self.metrics.error(kind).inc(),
            )
        self._lock = threading.Lock()
        self.produced = 0
        self.failure: str | None = None  # why the run cannot go on (the reward function failed)
        self.last_heartbeat = time.monotonic()

    def _waiting(self, msg: str | None) -> None:
        if msg:
            self.metrics.error("waiting").inc()

    # ------------------------------------------------------------------ one batch
    def generate_timeout(self, n_prompts: int, params: SamplingParams) -> float:
        """The deadline of a Generate call: a base and a budget per token asked for."""
        rc = self.cfg.rollout
        base = rc.generate_timeout_s if rc.generate_timeout_s is not None else self.cfg.rpc.timeout_s
        return base + rc.generate_timeout_per_token_s * n_prompts * params.n * params.max_new_tokens

    def _sample(self, entries: list, score_retries: int | None = None) -> list | None:
        """Groups for `entries` (one Generate call), retrying transient failures on the servers
        `self.retry` picks; None = give up (the prompts stay pending and are reclaimed later).
        `ScoringFailed` when the reward API failed the batch `score_retries` + 1 times (default
        `reward.group_retries` + 1)."""
        tasks = [t for _, t in entries]
        if self.agents is not None:
            return self.agents.sample(tasks)
        min_version = max(t.min_version for t in tasks)
        params = SamplingParams.for_training(self.cfg, tasks[0].group_size or None)
        key, timeout = uuid.uuid4().hex, self.generate_timeout(len(tasks), params)
        retries = self.cfg.reward.group_retries if score_retries is None else score_retries
        scoring = _Scoring(self.reward, retries, self.cfg.reward.group_retry_wait_s, self.stop_event, self.metrics)
        tries = Tries(self.servers, self.retry, min_version, self.stop_event)
        for address in tries:
            if self.stop_event.is_set() and tries.attempt:
                return None
            if address is None:
                self.metrics.error("no_generation_server").inc()
                log.info("no live generation server registered; waiting %.1fs", tries.backoff_s)
                tries.failed(None)
                continue
            try:
                generation = _OneBatch(self.servers.client(address), key, timeout)
                groups, m = sample_groups(
                    [task_record(t) for t in tasks],
                    [t.uid for t in tasks],
                    generation,
                    scoring,
                    self.tokenizer,
                    params,
                    self.critic,
                    self.cfg.prompt_length,
                )
            except DependencyUnavailable as e:  # reward or critic gone for longer than we wait
                self.metrics.error("dependency").inc()
                log.error("batch of %d prompts left pending: %s", len(tasks), e)
                return None
            except grpc.RpcError as e:
                fault = self._fault(e, address, len(tasks), tries.attempt)
                if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED and fault is Fault.FAILED:
                    timeout *= 2  # the server was slower than the budget: the same deadline would fail again
                tries.failed(address, fault)
                continue
            if groups and groups[0].version < min_version:  # the server missed a push; it will catch up
                log.info("%s served version %d < %d; trying another", address, groups[0].version, min_version)
                tries.failed(address, Fault.BEHIND)
                continue
            log.debug(
                "batch of %d: generate %.3fs score %.3fs values %.3fs",
                len(tasks),
                m["time/generate_s"],
                m["time/score_s"],
                m["time/values_s"],
            )
            return [(g, address, m) for g in groups]
        return None

    def _fault(self, e: grpc.RpcError, address: str, n_prompts: int, attempt: int) -> Fault:
        """What a failed try of a batch on `address` says (counted and logged): the generation
        server failed (`FAILED`) or refused the request as a whole (`REFUSED`), or the reward or
        critic server failed it (`ELSEWHERE`). Raises for what no retry mends: a prompt refused
        (ValueError: the batch is split to find it) or the user's reward function failing."""
        source, reason = getattr(e, "service", "generation"), reason_of(e)
        if reason is Reason.REWARD_FUNCTION_FAILED:
            raise RewardFunctionFailed(e.details()) from None  # the user's function raised
        if e.code() == grpc.StatusCode.INVALID_ARGUMENT and (source != "generation" or reason is Reason.PROMPT_INVALID):
            raise ValueError(e.details()) from None  # about a prompt: isolate it
        self.metrics.error(e.code().name.lower()).inc()
        retries = self.cfg.rollout.retries
        if source != "generation":
            log.warning(
                "batch of %d prompts: the %s server answered %s (%s); retry %d/%d",
                n_prompts,
                source,
                e.code().name,
                e.details(),
                attempt + 1,
                retries,
            )
            return Fault.ELSEWHERE
        if e.code() == grpc.StatusCode.INVALID_ARGUMENT:
            log.error(
                "generation server %s refuses the request itself (%s): its limits differ from this "
                "worker's config; trying another",
                address,
                e.details(),
            )
            return Fault.REFUSED
        log.warning(
            "batch of %d prompts failed on %s (%s: %s); retry %d/%d",
            n_prompts,
            address,
            e.code().name,
            e.details(),
            attempt + 1,
            retries,
        )
        return Fault.FAILED

    def process(self, entries: list) -> int:
        """Sample, append and acknowledge one claimed batch. Returns groups appended."""
        return self._process(entries)[0]

    def _process(self, entries: list, score_retries: int | None = None, drop: bool = True) -> tuple[int, str]:
        """`process` with `score_retries` (None: reward.group_retries). Returns the groups appended
        and what happened: "scored" (appended, or already there), "rejected" (dead-lettered: a
        server refused a prompt), "unscored" (the reward API failed it; left pending: not `drop`),
        "dropped" (that, dead-lettered) or "pending" (given up on for now)."""
        t0 = time.perf_counter()
        try:
            result = self._sample(entries, score_retries)
        except RewardFunctionFailed as e:  # a bug in the user's code: no prompt is to blame, the run stops
            log.error(
                "the reward function failed; this worker stops, and `rlhf up` stops the run (the prompts "
                "stay pending):\n%s",
                e,
            )
            self.failure = str(e)
            self.stop_event.set()
            return 0, "pending"
        except ValueError as e:  # the request itself is bad: isolate the prompts that cause it
            if len(entries) > 1:
                return sum(self._process([e1], score_retries)[0] for e1 in entries), "scored"
            entry_id, task = entries[0]
            log.error("prompt %s cannot be processed, moved to the dead-letter stream: %s", task.uid, e)
            self.store.dead_letter(entry_id, task, str(e), self.name)
            self.metrics.dead.inc()
            return 0, "rejected"
        except ScoringFailed as e:  # the reward API failed it on every try
            if len(entries) > 1:
                return self._isolate(entries, e), "scored"
            entry_id, task = entries[0]
            if not drop:
                return 0, "unscored"
            log.error(
                "prompt %s: the reward API gave its group no reward on every try; the group is dropped "
                "(moved to the dead-letter stream, the learner feeds a replacement): %s",
                task.uid,
                e,
            )
            self.store.dead_letter(entry_id, task, f"reward API: {e}", self.name)
            self.metrics.dead.inc()
            self.metrics.dropped.inc()
            return 0, "dropped"
        if result is None:
            log.error(
                "giving up on a batch of %d prompts for now; they stay pending and will be reclaimed", len(entries)
            )
            return 0, "pending"
        for (entry_id, task), r in zip(entries, result):
            if isinstance(r, Rejected):  # an agent's sessions failed on their input: that prompt alone
                log.error("prompt %s cannot be processed, moved to the dead-letter stream: %s", task.uid, r.reason)
                self.store.dead_letter(entry_id, task, r.reason, self.name)
                self.metrics.dead.inc()
        kept = [(e, r) for e, r in zip(entries, result) if not isinstance(r, Rejected)]
        entries, result = [e for e, _ in kept], [r for _, r in kept]
        secs = time.perf_counter() - t0
        added = self.store.produce(
            [
                (
                    entry_id,
                    group_to_proto(group, task, self.name, address, m["time/generate_s"], int(m["rollout/tokens"])),
                )
                for (entry_id, task), (group, address, m) in zip(entries, result)
            ]
        )
        appended = sum(added)
        self.metrics.duplicates.inc(len(added) - appended)
        self.metrics.produced.inc(appended)
        self.metrics.batch_seconds.observe(time.perf_counter() - t0)
        log.debug("batch of %d appended in %.3fs (sampling %.3fs)", len(entries), time.perf_counter() - t0, secs)
        with self._lock:
            self.produced += appended
        return appended, "scored"

    def _isolate(self, entries: list, error: ScoringFailed) -> int:
        """After the reward API failed a batch on every try: each prompt alone, sampled and scored
        once more. A prompt whose group it still fails is dropped only once the API has scored
        another of these prompts (then the failure is that input's; one that failed before gets one
        more try first); if it scores none, it fails everything (an outage, not an input), and the
        prompts stay pending for a later try. Returns groups appended."""
        log.error(
            "the reward API failed a batch of %d prompts on every try (%s); trying each prompt alone",
            len(entries),
            error,
        )
        appended, waiting, works = 0, [], False
        for i, entry in enumerate(entries):
            n, what = self._process([entry], 0, drop=works)
            appended += n
            if what == "unscored":
                waiting.append(entry)
            elif what in ("scored", "rejected") and not works:
                works = True  # the API answers: the prompts that failed before get one more try
                appended += sum(self._process([w], 0, drop=True)[0] for w in waiting)
                waiting = []
            elif what == "pending":  # the reward server or its API down (breaker open) past the wait
                log.error(
                    "the reward API is down: the %d prompts not tried alone yet stay pending", len(entries) - i - 1
                )
                break
        if waiting:
            self.metrics.error("reward_api").inc()
            log.error(
                "the reward API scored none of %d prompts alone either: it fails every request, not one "
                "input; they stay pending and are tried again later",
                len(waiting),
            )
        return appended

    # ------------------------------------------------------------------ loops
    def _loop(self) -> None:
        rc = self.cfg.replay
        while not self.stop_event.is_set():
            try:
                if self.store.backlog() >= self.cfg.max_backlog:
                    t0 = time.time()
                    self.stop_event.wait(rc.block_ms / 1000)
                    self.metrics.backpressure.inc(time.time() - t0)
                    continue
                entries, reclaimed = self.store.claim_prompts(
                    self.name, self.cfg.rollout.prompts_per_request, rc.block_ms
                )
                if not entries:
                    continue
                self.metrics.claimed.inc(len(entries))
                if reclaimed:
                    self.metrics.reclaimed.inc(reclaimed)
                    log.info("reclaimed %d prompts from a silent worker", reclaimed)
                self.metrics.in_flight.inc()
                try:
                    with _ClaimRenewal(self.store, self.name, [e for e, _ in entries], rc.claim_idle_s / 3):
                        self.process(entries)
                finally:
                    self.metrics.in_flight.dec()
            except Exception as e:  # Redis restarting, a stream reset by a new run, ...
                if redis_error_code(e) == "NOGROUP":
                    self.store.ensure_groups()
                    continue
                self.metrics.error("loop").inc()
                log.exception("rollout loop error; retrying in 1s")
                self.stop_event.wait(1.0)

    def run(self) -> None:
        """Run `rollout.concurrency` batch loops and a heartbeat until `stop()`."""
        threads = [
            threading.Thread(target=self._loop, name=f"rollout-{i}", daemon=True)
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
        except Exception:
            pass
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
        if self.agents is not None:
            self.agents.close()
            self.agents = None

    def serve_metrics(self, port: int, host: str = "127.0.0.1") -> int:
        """/metrics on `port`, behind the bearer token unless rpc.open_metrics, and /healthz (open)."""
        from ..common.rpc.metrics_http import metrics_token, serve_metrics

        self.metrics_httpd, bound = serve_metrics(
            self.metrics.registry, host, port, metrics_token(self.cfg.rpc), self.health
        )
        return bound


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
