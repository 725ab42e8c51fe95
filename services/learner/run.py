"""The learner's training run (`LearnerLoop`, run by the learner service): trains on
trajectories from the replay buffer with the same PPO step as the in-process trainer, pushes every
new policy to the generation servers, checkpoints, evaluates and reports status.

    rlhf serve learner -c configs/tiny-cpu.yaml --set replay.url=redis://127.0.0.1:6379/0

Composed, nothing calling back into its owner: the training loop of the in-process trainer
(`TrainingLoop`, services/training/loop.py) with a `ReplaySource` (feeder + intake) and a
`PushSink` (numbers versions, the weights' publisher), and the learner's checkpoints, status and metrics
around it. One iteration, hop by hop:
    ReplaySource.collect          critic restarted? (CriticWatch.check, this file)
      feeder.feed                 prompts max_staleness batches ahead             (feeder.py)
      intake.collect              rollout_batch_size fresh, unique groups         (intake.py)
    learner.step                  experience, then the PPO update; the critic
                                  trains over gRPC                   (trainer.py, experience.py, update.py)
    PushSink.publish              the next version from Redis's counter, then
      publisher.push              snapshot, plan, deliver to every live server    (weights/publisher.py)
    ReplaySource.trained          acknowledge the groups as trained               (intake.py)
    LearnerLoop.evaluate          on the schedule: through a server of the `ServerPool`,
                                  tried as `eval_retry` says                      (common/servers.py)
      held_out_evaluator          one reply per prompt, or the agent's sessions   (agents/evaluate.py)
    LearnerLoop.checkpoint        on the schedule; then the trajectories in it
                                  are acknowledged in Redis                       (checkpoint.py)
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import grpc
import torch
from prometheus_client import CollectorRegistry

from ..agents.evaluate import held_out_evaluator
from ..agents.host import AgentServiceDown, Outage
from ..common.lifecycle import RunFailed
from ..common.model_files import load_tokenizer
from ..common.replay import ReplayStore
from ..common.rpc.client import endpoint_address
from ..common.rpc.errors import Reason, reason_of
from ..common.rpc.retry import DependencyUnavailable, EachAnswer, RideThrough
from ..common.servers import Fault, RetryPolicy, ServerPool, Tries
from ..common.sharding.followers import follow, release_followers
from ..common.sharding.group import from_env
from ..common.types import Progress, Rollout, SamplingParams, no_progress
from ..critic.client import CriticClient, OverlappedCritic
from ..generation.client import generation_clients
from ..reward.client import HeldOut, RewardClient
from ..training.data import config_prompts
from ..training.loop import Batch, Phase, TrainingLoop
from ..training.runlog import RunLog
from ..training.schedule import Schedule, Tick, planned_updates
from ..weights.publisher import Publisher
from .checkpoint import Checkpointer, finished_run
from .feeder import PromptFeeder
from .intake import TrajectoryIntake
from .liveness import Heartbeat, liveness_bound_s
from .metrics import LearnerMetrics, ReplayPoller
from .sharded import ShardedPolicyTrainer
from .trainer import PolicyTrainer, ptx_examples_for

if TYPE_CHECKING:
    from ..common.config import Config

log = logging.getLogger(__name__)


def run_identity(run_dir: Path) -> str:
    """The run's id (DIR/run_id, made once): the fencing identity of its weight pushes."""
    path = run_dir / "run_id"
    if not path.exists():
        path.write_text(uuid.uuid4().hex + "\n")
    return path.read_text().strip()


def train_prompts(cfg: Config, tokenizer) -> list:
    return config_prompts(cfg, "train", tokenizer)


def follower_main(cfg: Config) -> int:
    """Ranks 1..N-1 of a sharded learner (model.nproc > 1): their shards of the actor, running
    what rank 0 (the `LearnerLoop`) announces until it is done."""
    ptx = None
    if cfg.ptx_coef:  # the PTX examples are the labelled training prompts, as on rank 0
        tokenizer = load_tokenizer(cfg.model.path)
        ptx = ptx_examples_for(cfg, tokenizer, train_prompts(cfg, tokenizer))
    return follow(make_trainer(cfg, ptx))


def make_trainer(cfg: Config, ptx_examples, on_progress: Progress = no_progress) -> PolicyTrainer:
    """This process's policy trainer: its part of the group the actor is sharded across
    (model.nproc > 1), or the whole actor in one process."""
    updates = planned_updates(cfg)
    if cfg.model.nproc > 1:
        dist = from_env(cfg.model.device, cfg.model.nproc)
        assert dist is not None  # nproc > 1: from_env returns the group or raises saying how to start the ranks
        return ShardedPolicyTrainer(
            cfg,
            total_updates=updates,
            ptx_examples=ptx_examples,
            on_progress=on_progress,
            dist=dist,
        )
    return PolicyTrainer(cfg, total_updates=updates, ptx_examples=ptx_examples, on_progress=on_progress)


def quietly(fn: Callable[[], Any], default: Any) -> Any:
    """`fn()`, or `default` when it raises (a status field must not fail the status)."""
    try:
        return fn()
    except Exception:
        return default


class CriticWatch:
    """Notices a restarted critic server: which state it came back with (the newest checkpoint's
    critic or its initial weights) goes into the log and `state` (the status's "critic")."""

    def __init__(self, critic):
        self.critic = critic
        self.state: dict = {}

    def check(self, iteration: int) -> None:
        info = self.critic.info()
        before = self.state.get("incarnation")
        restarts = self.state.get("restarts", 0)
        if before is not None and before != info.incarnation:
            restarts += 1
            log.warning(
                "the critic server restarted; it serves %s (step %d): the value function is as of that "
                "checkpoint, the policy is at iteration %d",
                info.loaded_from or "its initial weights",
                info.step,
                iteration,
            )
        self.state = {
            "incarnation": info.incarnation,
            "loaded_from": info.loaded_from,
            "step": info.step,
            "restarts": restarts,
        }


class ReplaySource:
    """The rollout source of the learner service: fresh, unique trajectory groups the rollout
    workers left in the replay buffer (`intake`), for prompts the `feeder` keeps queued ahead."""

    wait_metric = "time/wait_s"

    def __init__(
        self,
        store: ReplayStore,
        feeder: PromptFeeder,
        intake: TrajectoryIntake,
        stop_event: threading.Event,
        phase: Phase,
        critic_watch: CriticWatch | None = None,
    ):
        self.store, self.feeder, self.intake, self.stop_event = store, feeder, intake, stop_event
        self.phase, self.critic_watch = phase, critic_watch

    @property
    def data_epoch(self) -> int:
        return self.feeder.data_epoch

    def collect(self, iteration: int, policy_version: int) -> Batch | None:
        if self.critic_watch is not None:
            self.critic_watch.check(iteration - 1)
        self.feeder.feed(iteration, policy_version)
        self.phase.enter("waiting")
        batch = self.intake.collect(policy_version, self.stop_event)
        if batch is None:
            return None
        return Batch(Rollout.from_groups([g for _, g in batch]), policy_version, items=batch)

    def trained(self, batch: Batch, iteration: int) -> dict:
        self.intake.trained(batch.items)
        rollout = batch.rollout
        staleness = [batch.policy_version - v for v in rollout.policy_versions]
        return {
            "rollout/tokens": sum(len(r) for r in rollout.response_ids),
            "rollout/tokens_per_s": self.intake.tokens_per_s(),
            "replay/staleness_mean": sum(staleness) / len(staleness),
            "replay/backlog": quietly(self.store.backlog, -1),
            "replay/dropped_stale": self.intake.counters["dropped_stale"],
            "replay/duplicates": self.intake.counters["duplicates"],
        }


class PushSink:
    """The weight sink of the learner service, and the one place its policy versions are
    numbered: from the replay store's counter, so that they only go forward across learner
    restarts and above anything a server serves. Each new policy is pushed to every live
    generation server and published in the registry, with `address` (where servers pull from:
    set by the server before the run starts)."""

    def __init__(self, store: ReplayStore, publisher: Publisher):
        self.store, self.publisher = store, publisher
        self.address = ""

    def next_version(self) -> int:
        return self.store.next_version()

    def publish(self, learner) -> tuple[int, dict]:
        policy_version = self.next_version()
        return policy_version, self.publisher.push(policy_version, self.address)

    def publish_current(self, policy_version: int) -> None:
        """At the start: the policy the learner holds (version 0, the initial weights every server
        loads, is only published; a restored one is pushed)."""
        if policy_version > 0:
            self.store.publish_learner(self.address, policy_version, *self.publisher.identity)
            self.publisher.push(policy_version, self.address)
        else:
            self.publisher.publish_initial(self.address)


class LearnerLoop:
    """The learner service's training run, composed: the training loop (`training`, shared with
    the in-process trainer) with the replay buffer as its source and the generation servers as
    its sink; the learner's checkpoints, status, liveness and Prometheus metrics around it.
    Rank 0 of a sharded learner (model.nproc > 1) or the only process."""

    def __init__(self, cfg: Config, run_dir: str | Path | None = None, registry: CollectorRegistry | None = None):
        self.cfg = cfg
        # touched by every phase, wait tick, answered call and update step (see liveness.py)
        self.heartbeat = Heartbeat(liveness_bound_s(cfg))
        self.phase = Phase(on_change=self.heartbeat.beat)  # each phase the loop enters is a sign of life
        self.run_dir = Path(run_dir or cfg.run.run_dir).resolve()
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.run_id, self.fence_epoch = run_identity(self.run_dir), 0
        self.stop_event = threading.Event()
        self.waiting_for: str | None = None  # the dependency the loop waits for, if any
        self.store = ReplayStore.from_config(cfg)
        self.tokenizer = load_tokenizer(cfg.model.path)
        train = train_prompts(cfg, self.tokenizer)
        self.held_out = config_prompts(cfg, "eval", self.tokenizer)
        # with model.nproc > 1, rank 0 of the group (`follower_main` builds the others')
        # the heartbeat at each micro-batch forward and optimiser step
        self.learner = make_trainer(cfg, ptx_examples_for(cfg, self.tokenizer, train), on_progress=self.heartbeat)
        self.critic = self.critic_watch = None
        if cfg.needs_critic:  # calls ride through a restart of the critic or reward server; each answer beats
            critic_at = endpoint_address(cfg.rpc.critic)
            critic = CriticClient(
                critic_at, cfg.rpc, interceptors=[EachAnswer(self.heartbeat), self._riding("critic server", critic_at)]
            )
            self.critic = OverlappedCritic(critic) if cfg.critic.overlap_training else critic
            self.critic_watch = CriticWatch(self.critic)
        reward_at = endpoint_address(cfg.rpc.reward)
        self.reward = RewardClient(
            reward_at, cfg.rpc, interceptors=[EachAnswer(self.heartbeat), self._riding("reward server", reward_at)]
        )
        self.feeder = PromptFeeder(cfg, self.store, train)
        # the heartbeat at each tick of the wait for trajectories
        self.intake = TrajectoryIntake(cfg, self.store, self.feeder, on_progress=self.heartbeat)
        # the live generation servers: pushed to, and one at the current version for the eval
        self.servers = ServerPool(
            lambda: self.store.live("generation"), generation_clients(cfg.rpc), cfg.replay.heartbeat_s / 2
        )
        # the heartbeat as each server's push is answered
        self.publisher = Publisher(cfg, self.store, self.learner, self.servers, on_progress=self.heartbeat)
        self.sink = PushSink(self.store, self.publisher)
        self.checkpointer = Checkpointer(self.run_dir, self.store, self.critic, keep=cfg.run.keep_checkpoints)
        self.metrics = LearnerMetrics(registry or CollectorRegistry())
        self.training = TrainingLoop(
            cfg,
            self.run_dir,
            self.learner,
            self.critic,
            self.tokenizer,
            ReplaySource(self.store, self.feeder, self.intake, self.stop_event, self.phase, self.critic_watch),
            self.sink,
            self.evaluate,
            logger=log,
            checkpoint=self.checkpoint,
            observe=lambda it, m: self.metrics.observe(it, m, self.counters),
            judged=lambda verdict: self.metrics.suspected(verdict.suspected),
            phase=self.phase,
            stop_event=self.stop_event,
            time_eval=True,
        )
        self.poller: ReplayPoller | None = None  # the prompt queue's gauges, from start to close
        self.ready = threading.Event()  # resumed and the current policy published
        self.eval_params = SamplingParams.for_eval(cfg)
        # the eval's way through the servers: only one at the current version, waited for up to
        # rpc.dependency_wait_s; one that failed it avoided for a heartbeat's time to live
        self.eval_retry = RetryPolicy(
            backoff_s=cfg.rpc.retry_backoff_s,
            avoid_s=cfg.replay.heartbeat_ttl_s,
            only_at_version=True,
            wait_s=cfg.rpc.dependency_wait_s,
        )
        self.resumed_from: int | None = None
        self.t_start = time.time()

    @property
    def address(self) -> str:
        """Where generation servers pull from: set by the server before run()."""
        return self.sink.address

    @address.setter
    def address(self, value: str) -> None:
        self.sink.address = value

    @property
    def state(self) -> str:
        """The phase the run is in (the status's "state")."""
        return self.phase.name

    def _riding(self, what: str, address: str) -> RideThrough:
        return RideThrough(what, address, self.cfg.rpc, self.stop_event, on_wait=self._waiting)

    def _waiting(self, msg: str | None) -> None:
        self.waiting_for = msg
        self.heartbeat.beat()  # a retry's tick: waiting for a dependency, not stuck

    def liveness(self) -> str | None:
        """None while the training loop advances (or has ended); else why its liveness fails."""
        return self.heartbeat.stuck()

    # ------------------------------------------------------------------ status
    @property
    def counters(self) -> dict:
        return {**self.intake.counters, "dead_letters": self.feeder.dead_letters}

    def status(self) -> dict:
        t = self.training
        return {
            "iteration": t.iteration,
            "total_iterations": self.cfg.run.iterations,
            "policy_version": self.learner.policy_version,
            "state": self.phase.name,
            "last_reward": t.last["reward"],
            "last_eval_reward": t.last["eval"],
            **self.counters,
            "generation_servers": quietly(lambda: len(self.store.live("generation")), 0),
            "replay_backlog": quietly(self.store.backlog, -1),
            "uptime_s": round(time.time() - self.t_start, 1),
            "resumed_from": self.resumed_from,
            "waiting_for": self.waiting_for,
            "stale_streak": self.intake.stale_streak,
            "critic": self.critic_watch.state if self.critic_watch is not None else {},
            "run_id": self.run_id,
            "fence_epoch": self.fence_epoch,
            "liveness": {**self.heartbeat.status(), "stuck": self.liveness()},
            "reward_hacking_suspected": t.watch.last.suspected,
            "reward_hacking": t.watch.status(),
        }

    # ------------------------------------------------------------------ checkpoint / resume
    def state_dict(self) -> dict:
        t = self.training
        return {
            "learner": self.learner.state_dict(),
            "feeder": self.feeder.state_dict(),
            "iteration": t.iteration,
            "counters": dict(self.intake.counters),
            "baseline": t.baseline,
            "torch_rng": torch.get_rng_state(),
            "watch": t.watch.state_dict(),
        }

    def checkpoint(self, iteration: int, tick: Tick) -> None:
        self.phase.enter("checkpointing")
        self.save_checkpoint()

    def save_checkpoint(self) -> Path:
        iteration = self.training.iteration
        try:
            path = self.checkpointer.save(
                iteration,
                self.state_dict(),
                self.intake.uncommitted,
                write_actor=self.learner.save_actor if self.learner.sharded else None,
            )
        except DependencyUnavailable as e:
            raise DependencyUnavailable(f"the checkpoint of iteration {iteration} was not written: {e}") from None
        self.intake.committed()
        return path

    def resume(self) -> int:
        """Load the newest checkpoint if there is one; otherwise start the namespace afresh.
        Returns the iteration to continue after."""
        ckpt = self.checkpointer.latest()
        if ckpt is None:
            prior = quietly(lambda: self.store.live("generation"), {})
            n = self.store.reset()
            if n:
                log.info("fresh run: cleared %d keys of replay namespace %r", n, self.store.ns)
            top = max((int(i.get("policy_version", 0)) for i in prior.values()), default=0)
            if top > 0:  # servers left over from an earlier run serve newer-numbered weights
                self.store.raise_version_to(top)
                self.learner.policy_version = self.sink.next_version()
            return 0
        state = self.checkpointer.load(ckpt)
        self.learner.load_state_dict(state["learner"], ckpt / "actor")
        self.feeder.load_state_dict(state["feeder"])
        torch.set_rng_state(state["torch_rng"])
        t = self.training
        t.iteration, t.baseline = int(state["iteration"]), state["baseline"]
        self.intake.counters.update(state["counters"])
        self.metrics.counted(self.counters, restored=True)  # Prometheus counts this process's events
        t.watch.load_state_dict(state.get("watch", {}))  # absent in checkpoints of older versions
        self.metrics.suspected(t.watch.last.suspected)
        # versions only go forward: the restored weights get a number above anything served
        self.learner.policy_version = self.sink.next_version()
        self.resumed_from = t.iteration
        log.info(
            "resumed from checkpoint %s (iteration %d); policy is now version %d",
            ckpt.name,
            t.iteration,
            self.learner.policy_version,
        )
        return t.iteration

    # ------------------------------------------------------------------ the run
    def run(self) -> dict:
        """The training run. A dependency that stays unavailable (`rpc.dependency_wait_s`), or is
        gone when a stop asks for the last checkpoint, raises `DependencyUnavailable`."""
        done = finished_run(self.run_dir, self.cfg.run.iterations)
        if done is not None:
            self.phase.enter("done")
            self.heartbeat.ended()
            self.ready.set()
            log.info(
                "run %s already finished at iteration %s (summary.json); raise run.iterations to continue",
                self.run_dir,
                done.get("iterations"),
            )
            return done
        try:
            return self._run()
        except DependencyUnavailable as e:
            self.phase.enter("failed")
            last = self.checkpointer.latest()
            log.error(
                "%s: %s. The newest checkpoint is %s: a restart resumes from it; trajectories trained "
                "since are trained again, none is lost",
                "stopped without a final checkpoint" if self.stop_event.is_set() else "the run cannot go on",
                e,
                last.name if last else "none (a restart starts over)",
            )
            raise
        finally:
            self.heartbeat.ended()  # nothing left to watch: the process ends

    def _run(self) -> dict:
        cfg, training = self.cfg, self.training
        start_it = self.resume()
        self.heartbeat.beat("resumed")
        self.fence_epoch = self.store.new_learner_epoch()
        self.publisher.identity = (self.run_id, self.fence_epoch)
        if self.critic_watch is not None:
            self.critic_watch.check(start_it)
        self.phase.enter("pushing")
        self.sink.publish_current(self.learner.policy_version)
        self.ready.set()
        self.poller = ReplayPoller(self.store.prompt_queue, self.metrics.queue, cfg.replay.heartbeat_s).start()
        training.begin(
            RunLog(
                self.run_dir,
                cfg,
                mode=f"distributed (max_staleness={cfg.max_staleness})",
                resume_from=start_it if self.resumed_from is not None else None,
            )
        )
        self.metrics.eval_reward.set(training.last["eval"])  # not 0 (a false fall) until the next eval
        if self.resumed_from is not None:
            self.intake.reread_pending()
        it, stopped = training.iterate(Schedule(cfg.run, self.t_start), start_it)
        if self.intake.uncommitted or stopped:
            self.phase.enter("checkpointing")
            self.save_checkpoint()
        if stopped:
            self.phase.enter("stopped")
            log.info(
                "stopped at iteration %d; `rlhf serve learner` (or `rlhf up`) with this run "
                "directory resumes from the checkpoint",
                training.iteration,
            )
            return {"stopped_at": training.iteration}
        # the critic's is relative to the run directory, the critic server's root
        assert training.runlog is not None  # begin() set it
        return training.finish(
            it,
            time.time() - training.runlog.t0,
            "final_critic",
            resumed_from=self.resumed_from,
            policy_version=self.learner.policy_version,
            **self.counters,
        )

    def evaluate(self) -> dict:
        """Held-out eval through a generation server that serves the current version; one that
        fails is skipped for a while and another (or the same, restarted) one is used
        (`self.eval_retry`). An agent's eval that failed for its agent service's sake skips none."""
        phase = self.phase.name
        self.phase.enter("evaluating")
        policy_version = self.learner.policy_version
        # waiting for a server, not stuck: each look beats
        tries = Tries(self.servers, self.eval_retry, policy_version, self.stop_event, on_tick=self.heartbeat)
        for address in tries:
            if address is None:
                break
            try:
                out = self._evaluate_on(address)
            except Outage as e:
                log.warning("agent eval on %s failed (%s); trying again", address, e)
                tries.failed(address, Fault.ELSEWHERE if isinstance(e, AgentServiceDown) else Fault.FAILED)
                continue
            except grpc.RpcError as e:
                if e.code() == grpc.StatusCode.INVALID_ARGUMENT:
                    raise
                if reason_of(e) is Reason.REWARD_FUNCTION_FAILED:  # the user's reward function raised
                    raise RunFailed(e.details()) from None
                log.warning("eval on %s failed (%s: %s); skipping it", address, e.code().name, e.details())
                tries.failed(address, Fault.FAILED)
                continue
            self.phase.enter(phase)
            return out
        raise DependencyUnavailable(f"no generation server serves policy version {policy_version} for the eval")

    def _evaluate_on(self, address: str) -> dict:
        """The held-out eval of the policy the server at `address` serves: one reply per prompt
        scored by the reward server's held-out reward (and the training reward besides a gold one),
        or an agent's sessions, every turn on that server, through an endpoint of the learner's own."""
        rpc = self.cfg.rpc
        with held_out_evaluator(
            self.cfg,
            self.tokenizer,
            self.eval_params,
            backend=self.servers.client(address),
            scorer=HeldOut(self.reward),
            proxy=self.reward if self.cfg.reward.eval_rules is not None else None,
            servers=lambda: contextlib.closing(ServerPool.fixed(address, generation_clients(rpc))),
        ) as evaluator:
            return evaluator.metrics(self.held_out)

    def stop(self) -> None:
        self.stop_event.set()

    def close(self) -> None:
        release_followers(self.learner)
        if self.poller is not None:
            self.poller.stop()
        if self.training.runlog is not None:
            self.training.runlog.close()
        self.publisher.close()
        self.servers.close()
