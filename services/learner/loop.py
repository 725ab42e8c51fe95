"""The learner's training loop (`LearnerLoop`, run by the learner service): trains on
trajectories from the replay buffer with the same PPO step as the in-process trainer, pushes every
new policy to the generation servers, checkpoints, evaluates and reports status.

    rlhf serve learner -c configs/tiny-cpu.yaml --set replay.url=redis://127.0.0.1:6379/0

The loop is the in-process trainer's (services/training/loop.py), with the replay buffer as its
rollout source and the generation servers as its weight sink. One iteration (each part has a
file of its own):
    feeder.feed                   keep prompts max_staleness batches ahead      (feeder.py)
    intake.collect                rollout_batch_size fresh, unique groups        (intake.py)
    learner.step                  the PPO update; the critic trains over gRPC    (ppo_step.py)
    broadcaster.push              version N+1 to every live generation server    (broadcast.py)
    evaluate / checkpoint         on the schedule shared with the in-process trainer (training/schedule.py)
    checkpointer.save             then acknowledge the trajectories it includes  (checkpoint.py)
"""
from __future__ import annotations

import logging
import threading
import time
import uuid
from pathlib import Path

import grpc
import torch
from prometheus_client import CollectorRegistry

from ..training.data import config_prompts
from ..common.lifecycle import RunFailed
from ..common.modeling import load_tokenizer
from ..common.replay import ReplayStore
from ..training.runlog import RunLog
from ..common.rpc.errors import Reason, reason_of
from ..common.rpc.retry import DependencyUnavailable, Retrying
from ..common.rpc.server import endpoint_address
from ..training.evaluate import evaluate
from ..common.types import Rollout, SamplingParams
from ..critic.client import CriticClient, OverlappedCritic
from ..generation.client import ServerPool
from ..reward.client import HeldOut, RewardClient
from .broadcast import WeightBroadcaster
from .checkpoint import Checkpointer, finished_run
from ..common.sharding.group import from_env
from ..common.sharding.followers import follow, release_followers
from .feeder import PromptFeeder
from .intake import TrajectoryIntake
from .liveness import Beating, Heartbeat, liveness_bound_s
from .metrics import LearnerMetrics, ReplayPoller
from .ppo_step import PolicyTrainer, ptx_examples_for
from .sharded import ShardedPolicyTrainer
from ..training.loop import Batch, TrainingLoop
from ..training.schedule import Schedule, Tick, planned_updates
from ..training.watch import Verdict

log = logging.getLogger(__name__)


def run_identity(run_dir: Path) -> str:
    """The run's id (DIR/run_id, made once): the fencing identity of its weight pushes."""
    path = run_dir / "run_id"
    if not path.exists():
        path.write_text(uuid.uuid4().hex + "\n")
    return path.read_text().strip()


def train_prompts(cfg, tokenizer) -> list:
    return config_prompts(cfg, "train", tokenizer)


def follower_main(cfg) -> int:
    """Ranks 1..N-1 of a sharded learner (model.nproc > 1): their shards of the actor, running
    what rank 0 (the `LearnerLoop`) announces until it is done."""
    ptx = None
    if cfg.ptx_coef:  # the PTX examples are the labelled training prompts, as on rank 0
        tokenizer = load_tokenizer(cfg.model.path)
        ptx = ptx_examples_for(cfg, tokenizer, train_prompts(cfg, tokenizer))
    return follow(make_trainer(cfg, ptx))


def make_trainer(cfg, ptx_examples) -> PolicyTrainer:
    """This process's policy trainer: its part of the group the actor is sharded across
    (model.nproc > 1), or the whole actor in one process."""
    updates = planned_updates(cfg)
    if cfg.model.nproc > 1:
        return ShardedPolicyTrainer(cfg, total_updates=updates, ptx_examples=ptx_examples,
                                    dist=from_env(cfg.model.device, cfg.model.nproc))
    return PolicyTrainer(cfg, total_updates=updates, ptx_examples=ptx_examples)


class ReplaySource:
    """The rollout source of the learner service: fresh, unique trajectory groups the rollout
    workers left in the replay buffer, for prompts the feeder keeps queued ahead."""
    wait_metric = "time/wait_s"

    def __init__(self, loop: "LearnerLoop"):
        self.loop = loop

    @property
    def data_epoch(self) -> int:
        return self.loop.feeder.data_epoch

    def collect(self, iteration: int, version: int) -> Batch | None:
        s = self.loop
        s._check_critic()
        s.feeder.feed(iteration, version)
        s.state = "waiting"
        batch = s.intake.collect(version, s.stop_event)
        if batch is None:
            return None
        return Batch(Rollout.from_groups([g for _, g in batch]), version, items=batch)

    def trained(self, batch: Batch, iteration: int) -> dict:
        s = self.loop
        s.intake.trained(batch.items)
        rollout = batch.rollout
        staleness = [batch.version - v for v in rollout.versions]
        return {"rollout/tokens": sum(len(r) for r in rollout.response_ids),
                "rollout/tokens_per_s": s.intake.tokens_per_s(),
                "replay/staleness_mean": sum(staleness) / len(staleness),
                "replay/backlog": s._quietly(s.store.backlog, -1),
                "replay/dropped_stale": s.intake.counters["dropped_stale"],
                "replay/duplicates": s.intake.counters["duplicates"]}


class PushSink:
    """The weight sink of the learner service: the new policy gets the next version number of the
    replay store's counter and is pushed to every live generation server."""

    def __init__(self, loop: "LearnerLoop"):
        self.loop = loop

    def publish(self, learner) -> dict:
        learner.version = self.loop.store.next_version()
        return self.loop.broadcaster.push(learner.version, self.loop.address)


class LearnerLoop(TrainingLoop):
    time_eval = True

    def __init__(self, cfg, run_dir: str | Path | None = None, registry: CollectorRegistry | None = None):
        """Rank 0 of a sharded learner (model.nproc > 1) or the only process."""
        self.cfg = cfg
        # touched by every phase, wait tick, answered call and update step (see liveness.py)
        self.heartbeat = Heartbeat(liveness_bound_s(cfg))
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
        self.learner = make_trainer(cfg, ptx_examples_for(cfg, self.tokenizer, train))
        self.learner.on_progress = self.heartbeat  # each micro-batch forward and optimiser step
        self.critic = None
        if cfg.needs_critic:  # calls ride through a restart of the critic or reward server
            self.critic = self._retrying(CriticClient(endpoint_address(cfg.rpc.critic), cfg.rpc), "critic server")
            if cfg.critic.overlap_training:
                self.critic = OverlappedCritic(self.critic)
            self.critic = Beating(self.critic, self.heartbeat)
        TrainingLoop.__init__(self, cfg, self.run_dir, self.learner, self.critic, self.tokenizer, ReplaySource(self),
                              PushSink(self), logger=log)
        self.critic_state: dict = {}
        self.reward = Beating(self._retrying(RewardClient(endpoint_address(cfg.rpc.reward), cfg.rpc), "reward server"),
                              self.heartbeat)
        self.feeder = PromptFeeder(cfg, self.store, train)
        self.intake = TrajectoryIntake(cfg, self.store, self.feeder)
        self.intake.on_progress = self.heartbeat  # each tick of the wait for trajectories
        # the live generation servers: pushed to, and one at the current version for the eval
        self.servers = ServerPool(lambda: self.store.live("generation"), cfg.rpc, cfg.replay.heartbeat_s / 2)
        self.broadcaster = WeightBroadcaster(cfg, self.store, self.learner, self.servers)
        self.broadcaster.on_progress = self.heartbeat  # each server's push answered, each tick of a wait
        self.checkpointer = Checkpointer(self.run_dir, self.store, self.critic, keep=cfg.run.keep_checkpoints)
        self.metrics = LearnerMetrics(registry or CollectorRegistry())
        self.poller: ReplayPoller | None = None  # the prompt queue's gauges, from start to close
        self.address = ""  # where generation servers pull from: set by the server before run()
        self.ready = threading.Event()  # resumed and the current policy published
        self.state = "starting"
        self.eval_params = SamplingParams.for_eval(cfg)
        self.resumed_from: int | None = None
        self.t_start = time.time()

    def _retrying(self, client, what: str) -> Retrying:
        return Retrying(client, what, self.cfg.rpc, self.stop_event, on_wait=self._waiting)

    def _waiting(self, msg: str | None) -> None:
        self.waiting_for = msg
        self.heartbeat.beat()  # a retry's tick: waiting for a dependency, not stuck

    @property
    def state(self) -> str:
        return self._state

    @state.setter
    def state(self, value: str) -> None:
        """Each phase the loop enters is a sign of life."""
        self._state = value
        self.heartbeat.beat(value)

    def liveness(self) -> str | None:
        """None while the training loop advances (or has ended); else why its liveness fails."""
        return self.heartbeat.stuck()

    # ------------------------------------------------------------------ status
    @property
    def counters(self) -> dict:
        return {**self.intake.counters, "dead_letters": self.feeder.dead_letters}

    def status(self) -> dict:
        return {"iteration": self.iteration, "total_iterations": self.cfg.run.iterations,
                "policy_version": self.learner.version, "state": self.state,
                "last_reward": self.last["reward"], "last_eval_reward": self.last["eval"], **self.counters,
                "generation_servers": self._quietly(lambda: len(self.store.live("generation")), 0),
                "replay_backlog": self._quietly(self.store.backlog, -1),
                "uptime_s": round(time.time() - self.t_start, 1), "resumed_from": self.resumed_from,
                "waiting_for": self.waiting_for, "stale_streak": self.intake.stale_streak,
                "critic": self.critic_state, "run_id": self.run_id, "fence_epoch": self.fence_epoch,
                "liveness": {**self.heartbeat.status(), "stuck": self.liveness()},
                "reward_hacking_suspected": self.watch.last.suspected, "reward_hacking": self.watch.status()}

    @staticmethod
    def _quietly(fn, default):
        try:
            return fn()
        except Exception:
            return default

    # ------------------------------------------------------------------ checkpoint / resume
    def state_dict(self) -> dict:
        return {"learner": self.learner.state_dict(), "feeder": self.feeder.state_dict(),
                "iteration": self.iteration, "counters": dict(self.intake.counters), "baseline": self.baseline,
                "torch_rng": torch.get_rng_state(), "watch": self.watch.state_dict()}

    def save_checkpoint(self) -> Path:
        try:
            path = self.checkpointer.save(self.iteration, self.state_dict(), self.intake.uncommitted,
                                          write_actor=self.learner.save_actor if self.learner.sharded else None)
        except DependencyUnavailable as e:
            raise DependencyUnavailable(f"the checkpoint of iteration {self.iteration} was not written: {e}") from None
        self.intake.committed()
        return path

    def resume(self) -> int:
        """Load the newest checkpoint if there is one; otherwise start the namespace afresh.
        Returns the iteration to continue after."""
        ckpt = self.checkpointer.latest()
        if ckpt is None:
            prior = self._quietly(lambda: self.store.live("generation"), {})
            n = self.store.reset()
            if n:
                log.info("fresh run: cleared %d keys of replay namespace %r", n, self.store.ns)
            top = max((int(i.get("version", 0)) for i in prior.values()), default=0)
            if top > 0:  # servers left over from an earlier run serve newer-numbered weights
                self.store.raise_version_to(top)
                self.learner.version = self.store.next_version()
            return 0
        state = self.checkpointer.load(ckpt)
        self.learner.load_state_dict(state["learner"], ckpt / "actor")
        self.feeder.load_state_dict(state["feeder"])
        torch.set_rng_state(state["torch_rng"])
        self.iteration, self.baseline = int(state["iteration"]), state["baseline"]
        self.intake.counters.update(state["counters"])
        self.metrics.counted(self.counters, restored=True)  # Prometheus counts this process's events
        self.watch.load_state_dict(state.get("watch", {}))  # absent in checkpoints of older versions
        self.metrics.suspected(self.watch.last.suspected)
        # versions only go forward: the restored weights get a number above anything served
        self.learner.version = self.store.next_version()
        self.resumed_from = self.iteration
        log.info("resumed from checkpoint %s (iteration %d); policy is now version %d", ckpt.name, self.iteration,
                 self.learner.version)
        return self.iteration

    # ------------------------------------------------------------------ the loop
    def _check_critic(self) -> None:
        """Notice a restarted critic server: which state it came back with (the newest
        checkpoint's critic or its initial weights) goes into the log and the status."""
        if self.critic is None:
            return
        info = self.critic.info()
        before = self.critic_state.get("incarnation")
        restarts = self.critic_state.get("restarts", 0)
        if before is not None and before != info.incarnation:
            restarts += 1
            log.warning("the critic server restarted; it serves %s (step %d): the value function is as of that "
                        "checkpoint, the policy is at iteration %d", info.loaded_from or "its initial weights",
                        info.step, self.iteration)
        self.critic_state = {"incarnation": info.incarnation, "loaded_from": info.loaded_from, "step": info.step,
                             "restarts": restarts}

    def run(self) -> dict:
        """The training loop. A dependency that stays unavailable (`rpc.dependency_wait_s`), or is
        gone when a stop asks for the last checkpoint, raises `DependencyUnavailable`."""
        done = finished_run(self.run_dir, self.cfg.run.iterations)
        if done is not None:
            self.state = "done"
            self.heartbeat.ended()
            self.ready.set()
            log.info("run %s already finished at iteration %s (summary.json); raise run.iterations to continue",
                     self.run_dir, done.get("iterations"))
            return done
        try:
            return self._run()
        except DependencyUnavailable as e:
            self.state = "failed"
            last = self.checkpointer.latest()
            log.error("%s: %s. The newest checkpoint is %s: a restart resumes from it; trajectories trained "
                      "since are trained again, none is lost",
                      "stopped without a final checkpoint" if self.stop_event.is_set() else "the run cannot go on",
                      e, last.name if last else "none (a restart starts over)")
            raise
        finally:
            self.heartbeat.ended()  # nothing left to watch: the process ends

    def _run(self) -> dict:
        cfg = self.cfg
        start_it = self.resume()
        self.heartbeat.beat("resumed")
        self.fence_epoch = self.store.new_learner_epoch()
        self.broadcaster.identity = (self.run_id, self.fence_epoch)
        self._check_critic()
        self.state = "pushing"
        if self.learner.version > 0:
            self.store.publish_learner(self.address, self.learner.version, self.run_id, self.fence_epoch)
            self.broadcaster.push(self.learner.version, self.address)
        else:
            self.broadcaster.publish_initial(self.address)
        self.ready.set()
        self.poller = ReplayPoller(self.store.prompt_queue, self.metrics.queue, cfg.replay.heartbeat_s).start()
        self.begin(RunLog(self.run_dir, cfg, mode=f"distributed (max_staleness={cfg.max_staleness})",
                          resume_from=start_it if self.resumed_from is not None else None))
        self.metrics.eval_reward.set(self.last["eval"])  # not 0 (a false fall) until the next eval
        if self.resumed_from is not None:
            self.intake.reread_pending()
        it, stopped = self.iterate(Schedule(cfg.run, self.t_start), start_it)
        if self.intake.uncommitted or stopped:
            self.state = "checkpointing"
            self.save_checkpoint()
        if stopped:
            self.state = "stopped"
            log.info("stopped at iteration %d; `rlhf serve learner` (or `rlhf up`) with this run "
                     "directory resumes from the checkpoint", self.iteration)
            return {"stopped_at": self.iteration}
        # the critic's is relative to the run directory, the critic server's root
        return self.finish(it, time.time() - self.runlog.t0, "final_critic", resumed_from=self.resumed_from,
                           policy_version=self.learner.version, **self.counters)

    # ------------------------------------------------------------------ the loop's hooks
    def judged(self, verdict: Verdict) -> None:
        self.metrics.suspected(verdict.suspected)  # the gauge

    def observe(self, metrics: dict) -> None:
        self.metrics.observe(self, metrics)

    def checkpoint(self, iteration: int, tick: Tick) -> None:
        self.state = "checkpointing"
        self.save_checkpoint()

    def evaluate(self) -> dict:
        """Held-out eval through a generation server that serves the current version; one that
        fails is skipped for a while and another (or the same, restarted) one is used."""
        state, self.state = self.state, "evaluating"
        version = self.learner.version
        while True:
            address = self.servers.wait_for(version, self.cfg.rpc.dependency_wait_s, self.stop_event,
                                            on_tick=self.heartbeat)  # waiting for a server, not stuck
            if address is None:
                raise DependencyUnavailable(f"no generation server serves policy version {version} for the eval")
            target = self.servers.client(address)
            try:
                out = evaluate(self.held_out, target, HeldOut(self.reward), self.tokenizer, self.eval_params,
                               proxy=self.reward if self.cfg.reward.eval_rules is not None else None)
                break
            except grpc.RpcError as e:
                if e.code() == grpc.StatusCode.INVALID_ARGUMENT:
                    raise
                if reason_of(e) is Reason.REWARD_FUNCTION_FAILED:  # the user's reward function raised
                    raise RunFailed(e.details()) from None
                log.warning("eval on %s failed (%s: %s); skipping it", address, e.code().name, e.details())
                self.servers.avoid(address, self.cfg.replay.heartbeat_ttl_s)
                self.stop_event.wait(self.cfg.rpc.retry_backoff_s)
        self.state = state
        return out

    def stop(self) -> None:
        self.stop_event.set()

    def close(self) -> None:
        release_followers(self.learner)
        if self.poller is not None:
            self.poller.stop()
        if self.runlog is not None:
            self.runlog.close()
        self.broadcaster.close()
        self.servers.close()
