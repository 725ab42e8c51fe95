"""The training loop, one for `rlhf train --local` (services/local.py) and the learner service
(services/learner/run.py). What differs between them is handed in as parts:

    source.collect(iteration, policy_version)
                                        a batch to train on: sampled and scored in-process, or the
                                        trajectories rollout workers left in Redis (None: a stop was
                                        asked while it waited)
    source.trained(batch, iteration)    the update on it is done and published: its metrics
    source.wait_metric, source.data_epoch what the time to get a batch is called; the data epoch
    sink.publish(learner)               number the new policy (the one place versions are numbered)
                                        and hand it to whoever samples: the in-process backend, or
                                        every live generation server; (policy_version, metrics)
    evaluate()                          the held-out eval (in-process, or through a generation server)

and, where the learner service needs them: `checkpoint(iteration, tick)` (its own checkpoint in
place of the policy directory, policy_checkpoints.py), `observe(iteration, metrics)` (each iteration's metrics),
`judged(verdict)` (each verdict of the reward-hacking watch), `phase` (the phase it is in).

One iteration: collect, the PPO step (`learner.step`; the critic trains in it), publish, feed the
reward-hacking watch (watch.py), then on the schedule (schedule.py) the held-out eval and a
checkpoint, and one row of metrics.jsonl (runlog.py). `begin` evaluates the baseline (row 0),
`finish` saves `final/` (and the critic's `final_critic`) and writes summary.json.

Each held-out eval writes what the policy said (`generations/iter_N.jsonl`: prompt, response,
label, reward per prompt; run.save_generations) and, when it is the best so far, the policy as a
Hugging Face directory (`best/`, with `best/best.json`: iteration and held-out reward; run.save_best).
One that falls more than run.gold_drop below the best rolls the policy back to `best/` or stops
the run (run.on_gold_drop).
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Protocol

from ..common.types import Rollout
from .evaluate import write_rows
from .policy_checkpoints import PolicyCheckpoints
from .runlog import RunLog
from .schedule import Schedule, Tick
from .watch import HackingWatch, Verdict, judge, restore_watch, reward_identity

if TYPE_CHECKING:
    from ..common.config import Config

log = logging.getLogger(__name__)


@dataclass
class Batch:
    rollout: Rollout
    policy_version: int  # the policy version when it was collected
    metrics: dict = field(default_factory=dict)  # what producing it measured
    items: Any = None  # the source's own record of it (the learner's trajectory entries)


class RolloutSource(Protocol):
    wait_metric: str  # the metric of the time `collect` took ("time/rollout_s", "time/wait_s")

    @property
    def data_epoch(self) -> int: ...  # passes over the training prompts so far (`data/epoch`)

    def collect(self, iteration: int, policy_version: int) -> Batch | None: ...

    def trained(self, batch: Batch, iteration: int) -> dict: ...


class Trainer(Protocol):
    """The policy's trainer as the loop drives it (`learner/trainer.py:PolicyTrainer` and its
    sharded form): one PPO step on a rollout (the critic, if any, trains in it), the policy's
    weights for the sink, its directory for a checkpoint."""

    policy_version: int  # the policy version it holds (the sink numbers each new one)

    def step(self, rollout: Rollout, critic=None) -> dict: ...  # the step's metrics

    def policy_state_dict(self) -> dict: ...

    def save_policy(self, path: Path, tokenizer=None) -> None: ...

    def restore_policy(self, path: Path) -> None: ...  # run.on_gold_drop: rollback


class WeightSink(Protocol):
    def publish(self, learner: Trainer) -> tuple[int, dict]: ...  # the new policy's version (numbered here), metrics


class Phase:
    """The phase a loop is in ("starting", "waiting", "training", "pushing", "evaluating",
    "checkpointing", "done", ...); `on_change(name)` hears each one entered (the learner's
    heartbeat: each phase is a sign of life)."""

    def __init__(self, on_change: Callable[[str], None] | None = None):
        self.name, self._on_change = "starting", on_change

    def enter(self, name: str) -> None:
        self.name = name
        if self._on_change is not None:
            self._on_change(name)


def best_so_far(run_dir: Path) -> float:
    """The held-out reward of the policy kept in `best/` (best.json), or -inf when none is."""
    best = run_dir / "best" / "best.json"
    return json.loads(best.read_text())["eval/reward_mean"] if best.exists() else float("-inf")


def check_rollback(cfg: Config, learner: Trainer) -> None:
    """run.on_gold_drop: rollback needs what it loads back: best/ (run.save_best), into a
    one-process learner without LoRA."""
    if cfg.run.gold_drop is not None and cfg.run.on_gold_drop == "rollback":
        if getattr(learner, "lora", False) or getattr(learner, "sharded", False) or not cfg.run.save_best:
            raise ValueError(
                "run.on_gold_drop: rollback loads best/ back into a one-process learner without LoRA "
                "(run.save_best on); use run.on_gold_drop: stop here"
            )


class TrainingLoop:
    """The loop's state (iteration, baseline, the last train and eval rewards, the watch) and the
    loop. `time_eval`: the eval's time is reported (`time/eval_s`) and counted in
    `time/iteration_s` (the learner service); otherwise `time/iteration_s` ends before the eval.
    `stop_event` (a threading.Event) ends the loop after the iteration it is in."""

    def __init__(
        self,
        cfg: Config,
        run_dir: Path,
        learner: Trainer,
        critic,
        tokenizer,
        source: RolloutSource,
        sink: WeightSink,
        evaluate: Callable[[], dict],
        *,
        logger: logging.Logger | None = None,
        keep_state: Callable[[Path, dict], None] | None = None,
        checkpoint: Callable[[int, Tick], None] | None = None,
        observe: Callable[[int, dict], None] | None = None,
        judged: Callable[[Verdict], None] | None = None,
        phase: Phase | None = None,
        stop_event=None,
        time_eval: bool = False,
    ):
        """`logger`: where the loop's warnings go (the entry point's, so its lines name it);
        `keep_state(dir, loop_state)`: writes what else a checkpoint needs to resume from, beside the
        policy the loop writes in `dir`; `checkpoint`: a checkpoint of the caller's own instead."""
        self.cfg, self.run_dir = cfg, Path(run_dir)
        self.log = logger or log
        self.learner, self.critic, self.tokenizer = learner, critic, tokenizer
        self.source, self.sink, self.evaluate = source, sink, evaluate
        self.checkpoint = checkpoint or PolicyCheckpoints(
            cfg, self.run_dir, learner, tokenizer, keep_state, self.loop_state
        )
        self._observe, self._judged = observe, judged
        self.phase = phase or Phase()
        self.stop_event, self.time_eval = stop_event, time_eval
        self.watch = HackingWatch(cfg.run.hacking_window, cfg.run.hacking_min_change, reward_identity(cfg.reward))
        self.iteration = 0
        self.baseline: float | None = None
        self.last = {"reward": float("nan"), "eval": float("nan")}
        self.runlog: RunLog | None = None
        self.best = best_so_far(self.run_dir)  # a resumed run keeps its best
        self.halted: str | None = None  # why the run stops before its last iteration (run.on_gold_drop)
        self.rollbacks = 0  # of run.on_gold_drop: rollback so far
        check_rollback(cfg, learner)

    # ------------------------------------------------------------------ checkpoints
    def loop_state(self) -> dict:
        """The loop's own state, what a resumed run restores with `load_loop_state`."""
        return {
            "iteration": self.iteration,
            "baseline": self.baseline,
            "last": dict(self.last),
            "watch": self.watch.state_dict(),
            "rollbacks": self.rollbacks,
        }

    def load_loop_state(self, state: dict) -> None:
        self.iteration, self.baseline = int(state["iteration"]), state["baseline"]
        self.last = dict(state["last"])
        restore_watch(self.watch, state["watch"], log.warning)
        self.rollbacks = int(state.get("rollbacks", 0))  # checkpoints from before rollbacks have none

    # ------------------------------------------------------------------ the loop
    def _evaluated(self, iteration: int) -> dict:
        """The held-out eval's metrics; its generations written, the policy kept if it is the best."""
        out = dict(self.evaluate())
        rows = out.pop("generations", None)
        if rows is not None and self.cfg.run.save_generations:
            write_rows(self.run_dir / "generations" / f"iter_{iteration:06d}.jsonl", rows)
        score = out["eval/reward_mean"]
        if self.cfg.run.save_best and iteration > 0 and score > self.best:
            best = self.run_dir / "best"
            self.learner.save_policy(best, self.tokenizer)
            (best / "best.json").write_text(json.dumps({"iteration": iteration, "eval/reward_mean": score}) + "\n")
            self.log.info(
                "iteration %d: held-out reward %.4f, the best so far: policy kept in %s", iteration, score, best
            )
        self.best = max(self.best, score)
        return out

    def _guarded(self, iteration: int, score: float) -> dict:
        """run.gold_drop: when an evaluation falls more than it below the best so far, roll the
        policy back to the best (and push it) or stop the run; what it adds to the metrics row."""
        drop = self.cfg.run.gold_drop
        if drop is None or iteration == 0 or not score < self.best - drop:
            return {}
        best = self.run_dir / "best"
        if self.cfg.run.on_gold_drop == "stop" or self.rollbacks >= self.cfg.run.max_rollbacks:
            self.halted = (
                f"held-out reward {score:.4f}, more than run.gold_drop={drop:g} below the best {self.best:.4f}"
            )
            why = "run.on_gold_drop: stop" if self.cfg.run.on_gold_drop == "stop" else "run.max_rollbacks reached"
            self.log.warning("iteration %d: %s; stopping (%s)", iteration, self.halted, why)
            return {"eval/gold_stop": 1}
        source = best if (best / "best.json").exists() else Path(self.cfg.model.path)
        self.learner.restore_policy(source)
        self.rollbacks += 1
        self.learner.policy_version, _ = self.sink.publish(self.learner)
        self.last["eval"] = self.best  # the policy now is the one that scored it (final/ if the run ends here)
        self.log.warning(
            "iteration %d: held-out reward %.4f, more than run.gold_drop=%g below the best %.4f: the policy "
            "is rolled back to %s (now version %d)",
            iteration, score, drop, self.best, source, self.learner.policy_version,
        )  # fmt: skip
        return {"eval/rolled_back": 1, "policy/version": self.learner.policy_version}

    def _watched(self, iteration: int, evaluated: dict) -> dict:
        """The reward-hacking watch's verdict on an evaluation (a warning at its onset); what it
        adds to the metrics row."""
        verdict, row = judge(self.watch, iteration, evaluated, self.log.warning)
        if self._judged is not None:
            self._judged(verdict)
        return row

    def begin(self, runlog: RunLog) -> None:
        """The baseline eval (row 0 of metrics.jsonl), unless a resumed run has it already."""
        self.runlog = runlog
        if self.baseline is None:
            base = self._evaluated(0)
            self.baseline = base["eval/reward_mean"]
            runlog.log_eval(0, {**base, **self._watched(0, base)})
        self.last["eval"] = self.baseline
        self.best = max(self.best, self.baseline)  # a resumed run whose start was its best has no best/

    def iterate(self, schedule: Schedule, start_it: int = 0) -> tuple[int, bool]:
        """Iterations start_it + 1 .. run.iterations (fewer when out of time or stopped).
        Returns (the last iteration done, whether a stop ended it)."""
        cfg, runlog, nan = self.cfg, self.runlog, float("nan")
        assert runlog is not None, "begin() comes first"
        it, stopped = start_it, False
        for it in range(start_it + 1, cfg.run.iterations + 1):
            t0 = time.perf_counter()
            batch = self.source.collect(it, self.learner.policy_version)
            if batch is None:
                stopped, it = True, it - 1
                break
            metrics = self._trained(it, batch, t0)
            tick = schedule.at(it)
            if tick.evaluate:
                t3 = time.perf_counter()
                metrics.update(self._evaluated(it))
                if self.time_eval:
                    metrics["time/eval_s"] = time.perf_counter() - t3
                metrics.update(self._watched(it, metrics))
                self.last["eval"] = metrics["eval/reward_mean"]
                metrics.update(self._guarded(it, metrics["eval/reward_mean"]))
            self.last["reward"] = metrics.get("reward/score_mean", nan)
            if self.time_eval:
                metrics["time/iteration_s"] = time.perf_counter() - t0
            if self._observe is not None:
                self._observe(it, metrics)
            runlog.log_iteration(it, metrics)  # before the checkpoint: a crash between the two
            if tick.checkpoint:  # redoes this iteration, whose row a resumed run drops and writes again
                self.checkpoint(it, tick)
            if tick.out_of_time:
                self.log.warning("run.max_wall_s=%s reached after %d iterations", cfg.run.max_wall_s, it)
                break
            if self.halted:
                break
            if self.stop_event is not None and self.stop_event.is_set():
                stopped = True
                break
        return it, stopped

    def _trained(self, it: int, batch: Batch, t0: float) -> dict:
        """Iteration `it` on `batch` (collected since `t0`): the PPO step, the new policy published,
        the batch trained; the iteration's metrics so far, the train reward to the watch."""
        t1 = time.perf_counter()
        self.phase.enter("training")
        metrics = dict(batch.metrics)
        metrics.update(self.learner.step(batch.rollout, self.critic))
        t2 = time.perf_counter()
        self.phase.enter("pushing")
        self.learner.policy_version, pushed = self.sink.publish(self.learner)
        metrics.update(pushed)
        self.iteration = it
        metrics.update({self.source.wait_metric: t1 - t0, "time/train_s": t2 - t1})
        metrics.update(self.source.trained(batch, it))
        metrics.update({"data/epoch": self.source.data_epoch, "policy/version": self.learner.policy_version})
        if not self.time_eval:
            metrics["time/iteration_s"] = time.perf_counter() - t0
        self.watch.train(metrics.get("reward/score_mean", float("nan")))
        return metrics

    def finish(self, iterations: int, wall_s: float, critic_dir: str | Path, **extra) -> dict:
        """The final policy (`final/`), the critic's (`critic_dir`), summary.json; the summary."""
        self.learner.save_policy(self.run_dir / "final", self.tokenizer)
        if self.critic is not None:
            self.critic.save(critic_dir)
        self.phase.enter("done")
        assert self.runlog is not None and self.baseline is not None, "begin() comes first"
        if self.halted:
            extra["halted"] = self.halted  # a run stopped on purpose is finished: a restart does not go on
        return self.runlog.finish(
            baseline=self.baseline, final=self.last["eval"], iterations=iterations, wall_s=wall_s, **extra
        )
