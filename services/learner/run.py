"""The learner's training run (`LearnerLoop`, run by the learner service): trains on
trajectories from the replay buffer with the same PPO step as the in-process trainer, pushes every
new policy to the generation servers, checkpoints, evaluates and reports status.

    rlhf serve learner -c configs/tiny-cpu.yaml --set replay.url=redis://127.0.0.1:6379/0

Composed, nothing calling back into its owner: the training loop of the in-process trainer
(`TrainingLoop`, services/training/loop.py) with a `ReplaySource` (feeder + intake, source.py) and a
`PushSink` (numbers versions, the weights' publisher, sink.py), and the learner's checkpoints
(`LearnerState`, state.py), status (`LearnerStatus`, status.py) and metrics around it. One
iteration, hop by hop:
    ReplaySource.collect          critic restarted? (CriticWatch.check)           (source.py)
      feeder.feed                 prompts max_staleness batches ahead             (feeder.py)
      intake.collect              rollout_batch_size fresh, unique groups         (intake.py)
    learner.step                  experience, then the PPO update; the critic
                                  trains over gRPC                   (trainer.py, experience.py, update.py)
    PushSink.publish              the next version from Redis's counter, then     (sink.py)
      publisher.push              snapshot, plan, deliver to every live server    (weights/publisher.py)
      PushParity.check            when due: every server scores the probe batch   (parity.py)
    ReplaySource.trained          acknowledge the groups as trained               (intake.py)
    LearnerLoop.evaluate          on the schedule: through a server of the `ServerPool`,
                                  tried as `eval_retry` says                      (common/servers.py)
      held_out_evaluator          one reply per prompt, or the agent's sessions   (agents/evaluate.py)
    LearnerLoop.checkpoint        on the schedule (LearnerState.save); then the
                                  trajectories in it are acknowledged in Redis    (state.py, checkpoint.py)
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from prometheus_client import CollectorRegistry

from ..common.model_files import load_tokenizer
from ..common.replay import ReplayStore
from ..common.rpc.client import endpoint_address
from ..common.rpc.retry import DependencyUnavailable, EachAnswer, RideThrough
from ..common.servers import RetryPolicy, ServerPool, Tries
from ..common.sharding.followers import follow, release_followers
from ..common.sharding.group import from_env
from ..common.types import Progress, no_progress
from ..critic.client import CriticClient, OverlappedCritic
from ..generation.client import generation_clients
from ..reward.client import RewardClient
from ..training.data import config_prompts
from ..training.loop import Phase, TrainingLoop
from ..training.runlog import RunLog
from ..training.schedule import Schedule, Tick, planned_updates
from ..weights.publisher import Publisher
from .checkpoint import Checkpointer, finished_run
from .evaluation import ServerEval
from .feeder import PromptFeeder
from .intake import TrajectoryIntake
from .liveness import Heartbeat, liveness_bound_s
from .metrics import LearnerMetrics, ReplayPoller
from .parity import PushParity, PushParityFailed
from .sharded import ShardedPolicyTrainer
from .sink import PushSink
from .source import CriticWatch, ReplaySource
from .state import LearnerState
from .status import LearnerStatus
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


def service_clients(cfg: Config, heartbeat: Heartbeat, stop_event: threading.Event):
    """(critic, its watch, reward): the clients of the critic server (None, None without one) and
    the reward server. Calls ride through a restart of the critic or reward server (until
    `stop_event`; the `heartbeat` told what they wait for); each answer beats."""

    def riding(what: str, address: str) -> RideThrough:
        return RideThrough(what, address, cfg.rpc, stop_event, on_wait=heartbeat.waiting)

    critic = critic_watch = None
    if cfg.needs_critic:
        critic_at = endpoint_address(cfg.rpc.critic)
        client = CriticClient(
            critic_at, cfg.rpc, interceptors=[EachAnswer(heartbeat), riding("critic server", critic_at)]
        )
        critic = OverlappedCritic(client) if cfg.critic.overlap_training else client
        critic_watch = CriticWatch(critic, logger=log)
    reward_at = endpoint_address(cfg.rpc.reward)
    reward = RewardClient(reward_at, cfg.rpc, interceptors=[EachAnswer(heartbeat), riding("reward server", reward_at)])
    return critic, critic_watch, reward


def service_training_loop(
    cfg: Config,
    run_dir: Path,
    learner: PolicyTrainer,
    critic,
    tokenizer,
    source: ReplaySource,
    sink: PushSink,
    metrics: LearnerMetrics,
    *,
    evaluate: Callable[[], dict],
    checkpoint: Callable[[int, Tick], None],
    phase: Phase,
    stop_event: threading.Event,
) -> TrainingLoop:
    """The training loop of the learner service: the replay as its `source`, the pushes as its
    `sink`; each iteration's metrics and each verdict of the reward-hacking watch into Prometheus
    (`metrics`); the eval's time counted in the iteration's; the service's own eval, checkpoint,
    phase and stop."""
    return TrainingLoop(
        cfg,
        run_dir,
        learner,
        critic,
        tokenizer,
        source,
        sink,
        evaluate,
        logger=log,
        checkpoint=checkpoint,
        observe=lambda it, m: metrics.observe(it, m, source.counters),
        judged=lambda verdict: metrics.suspected(verdict.suspected),
        phase=phase,
        stop_event=stop_event,
        time_eval=True,
    )


def push_parity(cfg: Config, servers: ServerPool, records, tokenizer, metrics: LearnerMetrics) -> PushParity | None:
    """The push parity check (`rpc.push_parity`), its probe made from `records`' prompts; None when off."""
    if cfg.rpc.push_parity.every <= 0:
        return None
    return PushParity(cfg, servers.client, [r.prompt for r in records], tokenizer, gauges=metrics)


def eval_retry_policy(cfg: Config) -> RetryPolicy:
    """The eval's way through the servers: only one at the current version, waited for up to
    rpc.dependency_wait_s; one that failed it avoided for a heartbeat's time to live."""
    return RetryPolicy(
        backoff_s=cfg.rpc.retry_backoff_s,
        avoid_s=cfg.replay.heartbeat_ttl_s,
        only_at_version=True,
        wait_s=cfg.rpc.dependency_wait_s,
    )


class LearnerLoop:
    """The learner service's training run, composed: the training loop (`training`, shared with
    the in-process trainer) with the replay buffer as its source and the generation servers as
    its sink; the learner's checkpoints (`checkpoints`), status (`report`), liveness and Prometheus
    metrics around it. Rank 0 of a sharded learner (model.nproc > 1) or the only process."""

    def __init__(self, cfg: Config, run_dir: str | Path | None = None, registry: CollectorRegistry | None = None):
        self.cfg = cfg
        # touched by every phase, wait tick, answered call and update step (see liveness.py)
        self.heartbeat = Heartbeat(liveness_bound_s(cfg))
        self.phase = Phase(on_change=self.heartbeat.beat)  # each phase the loop enters is a sign of life
        self.run_dir = Path(run_dir or cfg.run.run_dir).resolve()
        self.run_dir.mkdir(parents=True, exist_ok=True)
        run_id = run_identity(self.run_dir)
        self.stop_event = threading.Event()
        self.store = ReplayStore.from_config(cfg)
        self.tokenizer = load_tokenizer(cfg.model.path)
        train = train_prompts(cfg, self.tokenizer)
        self.held_out = config_prompts(cfg, "eval", self.tokenizer)
        # with model.nproc > 1, rank 0 of the group (`follower_main` builds the others')
        # the heartbeat at each micro-batch forward and optimiser step
        self.learner = make_trainer(cfg, ptx_examples_for(cfg, self.tokenizer, train), on_progress=self.heartbeat)
        self.critic, self.critic_watch, self.reward = service_clients(cfg, self.heartbeat, self.stop_event)
        self.feeder = PromptFeeder(cfg, self.store, train)
        # the heartbeat at each tick of the wait for trajectories
        self.intake = TrajectoryIntake(cfg, self.store, self.feeder, on_progress=self.heartbeat)
        # the live generation servers: pushed to, and one at the current version for the eval
        self.servers = ServerPool(
            lambda: self.store.live("generation"), generation_clients(cfg.rpc), cfg.replay.heartbeat_s / 2
        )
        # the heartbeat as each server's push is answered
        self.publisher = Publisher(cfg, self.store, self.learner, self.servers, on_progress=self.heartbeat)
        self.metrics = LearnerMetrics(registry or CollectorRegistry())
        # after a push, when due: does every server serve what was pushed? (parity.py)
        self.parity = push_parity(cfg, self.servers, self.held_out or train, self.tokenizer, self.metrics)
        self.sink = PushSink(self.store, self.publisher, run_id, self.parity)
        self.checkpointer = Checkpointer(self.run_dir, self.store, self.critic, keep=cfg.run.keep_checkpoints)
        self.source = ReplaySource(self.store, self.feeder, self.intake, self.stop_event, self.phase, self.critic_watch)
        self.training = service_training_loop(
            cfg, self.run_dir, self.learner, self.critic, self.tokenizer, self.source, self.sink,
            metrics=self.metrics, evaluate=self.evaluate, checkpoint=self.checkpoint, phase=self.phase,
            stop_event=self.stop_event,
        )  # fmt: skip
        self.checkpoints = LearnerState(
            self.checkpointer, self.learner, self.training, self.source, self.sink, self.metrics, logger=log
        )
        self.poller: ReplayPoller | None = None  # the prompt queue's gauges, from start to close
        self.ready = threading.Event()  # resumed and the current policy published
        self.evaluation = ServerEval(cfg, self.tokenizer, self.held_out, self.reward, self.phase, logger=log)
        self.eval_retry = eval_retry_policy(cfg)
        self.t_start = time.time()
        self.report = LearnerStatus(
            self.training, self.source, self.sink, self.checkpoints, self.heartbeat, self.t_start
        )

    @property
    def state(self) -> str:
        """The phase the run is in (the status's "state")."""
        return self.phase.name

    def liveness(self) -> str | None:
        """None while the training loop advances (or has ended); else why its liveness fails."""
        return self.heartbeat.stuck()

    @property
    def counters(self) -> dict:
        return self.source.counters

    def status(self) -> dict:
        return self.report.status()

    def state_dict(self) -> dict:
        return self.checkpoints.state_dict()

    def checkpoint(self, iteration: int, tick: Tick) -> None:
        self.phase.enter("checkpointing")
        self.save_checkpoint()

    def save_checkpoint(self) -> Path:
        return self.checkpoints.save()

    def resume(self) -> int:
        """Load the newest checkpoint if there is one; otherwise start the namespace afresh.
        Returns the iteration to continue after."""
        return self.checkpoints.resume()

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
        except PushParityFailed as e:
            self.phase.enter("failed")
            last = self.checkpointer.latest()
            log.error("%s. The newest checkpoint is %s", e, last.name if last else "none (a restart starts over)")
            raise
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
        start_it = self._start()
        it, stopped = self.training.iterate(Schedule(self.cfg.run, self.t_start), start_it)
        return self._end(it, stopped)

    def _start(self) -> int:
        """Resumed, fenced, the current policy published (then ready), the baseline evaluated:
        the iteration to go on after."""
        cfg = self.cfg
        start_it = self.resume()
        self.heartbeat.beat("resumed")
        self.sink.fence()
        if self.critic_watch is not None:
            self.critic_watch.check(start_it)
        self.phase.enter("pushing")
        self.sink.publish_current(self.learner.policy_version)
        self.ready.set()
        self.poller = ReplayPoller(self.store.prompt_queue, self.metrics.queue, cfg.replay.heartbeat_s).start()
        resumed_from = self.checkpoints.resumed_from
        self.training.begin(
            RunLog(
                self.run_dir,
                cfg,
                mode=f"distributed (max_staleness={cfg.max_staleness})",
                resume_from=start_it if resumed_from is not None else None,
            )
        )
        self.metrics.eval_reward.set(self.training.last["eval"])  # not 0 (a false fall) until the next eval
        if resumed_from is not None:
            self.intake.reread_pending()
        return start_it

    def _end(self, it: int, stopped: bool) -> dict:
        """After the last iteration (`it`), or a stop: the last checkpoint, and the summary."""
        training = self.training
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
            resumed_from=self.checkpoints.resumed_from,
            policy_version=self.learner.policy_version,
            **self.counters,
        )

    def evaluate(self) -> dict:
        """Held-out eval through a generation server that serves the current version; one that
        fails is skipped for a while and another (or the same, restarted) one is used
        (`self.eval_retry`; evaluation.py)."""
        policy_version = self.learner.policy_version
        # waiting for a server, not stuck: each look beats
        tries = Tries(self.servers, self.eval_retry, policy_version, self.stop_event, on_tick=self.heartbeat)
        return self.evaluation.evaluate(tries, self._evaluate_on)

    def _evaluate_on(self, address: str) -> dict:
        """The held-out eval of the policy the server at `address` serves."""
        return self.evaluation.on_server(self.servers, address)

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
