"""The in-process trainer: the whole PPO loop in one process, with the same domain objects the
services host (generation backend, reward scorer, critic, learner step), wired directly; the
reference the distributed run is measured against. The loop is the learner service's
(`services.training.loop`), with an in-process rollout source (`LocalSource`: a batch of prompts
through the sampler chosen once, as a worker chooses: one reply per sample from the backend here,
`ReplySampler`, or an agent's sessions on an endpoint in the process, `AgentSampler`) and the
backend as weight sink.

    rlhf train --local -c configs/tiny-cpu.yaml --run-dir runs/local
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from .agents.evaluate import held_out_evaluator
from .agents.host import agent_host
from .agents.sampler import AgentSampler
from .common.checkpoints import (
    CRITIC_DIR,
    LEARNER_STATE,
    Mode,
    checkpoint_dir,
    complete_checkpoints,
    is_complete,
    mode,
    newest_checkpoint,
    read_state,
    write_state,
)
from .common.model_files import resolve_device
from .common.types import Rollout, SamplingParams
from .critic.critic import Critic
from .generation.inprocess import in_process_pool
from .generation.policy import make_backend
from .learner.checkpoint import finished_run
from .learner.trainer import PolicyTrainer, ptx_examples_for
from .reward.labels import label_reader
from .reward.scorer import build_eval_scorer, build_scorer
from .teacher.teacher import Teacher
from .training.dapo import GroupFilter, merged
from .training.data import EpochSampler, config_prompts
from .training.distill import Distillation
from .training.loop import Batch, TrainingLoop
from .training.runlog import RunLog
from .training.sampling import Failed, Prompt, Rejected, ReplySampler, Sampler
from .training.schedule import Schedule, planned_updates

if TYPE_CHECKING:
    from .common.config import Config

log = logging.getLogger(__name__)


class LocalSource:
    """Batches sampled here by `sampler` (the prompts `epochs` gives, `rollout_batch_size` at a
    time); a prompt the sampler rejects (an agent's sessions failed on it, or ran longer than the
    learner takes) is left out of its batch with a warning, where a rollout worker would
    dead-letter it."""

    wait_metric = "time/rollout_s"

    def __init__(self, cfg: Config, epochs: EpochSampler, sampler: Sampler, stop_event=None):
        self.cfg, self.epochs, self.sampler, self.stop_event = cfg, epochs, sampler, stop_event
        self.lost: str | None = None  # why the run stopped: its environment, reward or agent lost mid-run

    @property
    def data_epoch(self) -> int:
        return self.epochs.epoch

    def collect(self, iteration: int, policy_version: int) -> Batch | None:
        if self.stop_event is not None and self.stop_event.is_set():  # asked before this iteration began
            return None
        if not self.cfg.rollout.dynamic_sampling:
            sampled = self._sample(iteration, self.cfg.rollout_batch_size)
            return None if sampled is None else Batch(Rollout.from_groups(sampled[0]), policy_version, sampled[1])
        return self._dynamic(iteration, policy_version)

    def _dynamic(self, iteration: int, policy_version: int) -> Batch | None:
        """DAPO's dynamic sampling (training/dapo.py): rounds of more prompts until the batch is
        full of groups whose rewards differ, at most `rollout.dynamic_sampling_max_rounds`."""
        groups = GroupFilter.of(self.cfg.rollout_batch_size, self.cfg.rollout.dynamic_sampling_max_rounds)
        rounds: list[tuple[dict, int]] = []
        n = self.cfg.rollout_batch_size
        while n:
            sampled = self._sample(iteration, n)
            if sampled is None:
                return None
            groups.add(sampled[0])
            rounds.append((sampled[1], n))
            n = groups.more()
        metrics = {**merged(rounds), **groups.metrics()}
        return Batch(Rollout.from_groups(groups.batch(f"iteration {iteration}")), policy_version, metrics)

    def _sample(self, iteration: int, n: int) -> tuple[list, dict] | None:
        """`n` prompts sampled (a batch may cross an epoch boundary): their groups, the metrics; None
        when the run cannot go on (`lost` says why)."""
        picked = self.epochs.take_with_epochs(n)
        sampled = self.sampler.sample([Prompt(r, f"{e}:{r.id}") for e, r in picked])
        if isinstance(sampled, Failed):  # the environment, the reward or the agent lost: stop, checkpointed
            self.lost = f"iteration {iteration} could not be sampled: {sampled.why or sampled.then.name.lower()}"
            return None
        kept = []
        for group in sampled.groups:
            if isinstance(group, Rejected):
                log.warning("a prompt left out of iteration %d: %s", iteration, group.reason)
            else:
                kept.append(group)
        if not kept:  # a partial failure goes on; a whole batch of them is the environment's
            first = next(g.reason for g in sampled.groups if isinstance(g, Rejected))
            self.lost = f"every prompt of iteration {iteration} failed (the first: {first})"
            return None
        return kept, sampled.metrics

    def trained(self, batch: Batch, iteration: int) -> dict:
        return {}


class BackendSink:
    """The new policy goes straight into the in-process generation backend, as the next version."""

    def __init__(self, backend):
        self.backend = backend

    def publish(self, learner) -> tuple[int, dict]:
        t0 = time.perf_counter()
        policy_version = learner.policy_version + 1
        self.backend.update_weights(learner.policy_state_dict(), policy_version)
        return policy_version, {"time/push_s": time.perf_counter() - t0}


class LocalState:
    """What `rlhf train --local` keeps in each checkpoint beside the policy (checkpoints/iter_N/, a
    Hugging Face directory) to go on from it: `learner.pt` (the learner's state with its optimiser,
    the prompt sampler's place, the loop's counters, the RNG) and `critic/` (weights, optimiser)."""

    def __init__(self, learner, critic, sampler: EpochSampler):
        self.learner, self.critic, self.sampler = learner, critic, sampler

    def write(self, path: Path, loop_state: dict) -> None:
        if self.critic is not None:
            self.critic.save(path / CRITIC_DIR)
        state = {
            "learner": self.learner.state_dict(),
            "sampler": self.sampler.state_dict(),
            "loop": loop_state,
            "torch_rng": torch.get_rng_state(),
        }
        write_state(path, state)  # written last: a checkpoint with learner.pt is complete

    def read(self, path: Path) -> dict:
        """Restore the learner, the critic and the sampler from the checkpoint `path`; the loop's state."""
        state = read_state(path, weights_only=False)
        self.learner.load_state_dict(state["learner"])
        if self.critic is not None and (path / CRITIC_DIR).exists():
            self.critic.load(path / CRITIC_DIR)
        elif self.critic is not None:  # set aside (`rlhf iterate`, iterate.critic: reset)
            log.info("%s holds no critic: the critic starts from its initial weights", path)
        self.sampler.load_state_dict(state["sampler"])
        torch.set_rng_state(state["torch_rng"])
        return state["loop"]


def checkpoint_problem(path: Path) -> str:
    """Why `path` is no checkpoint to go on from, and the complete ones there are to choose from
    (its run directory's, when it names a checkpoint of one)."""
    if path.is_dir():
        why = f"{path} is no complete checkpoint ({LEARNER_STATE} missing)"
    else:
        why = f"no such checkpoint {path}"
    run_dir = path.parent.parent if path.parent.name == "checkpoints" else path
    found = complete_checkpoints(run_dir)
    if found:
        return f"{why}; the complete checkpoints of {run_dir} are: {', '.join(str(c) for c in found)}"
    return f"{why}; a run keeps its checkpoints as RUN/checkpoints/iter_N (run.keep_checkpoints of them)"


def resume_point(cfg: Config, run_dir: Path) -> Path | None:
    """The checkpoint a local run goes on from: run.resume_from when set, else the newest complete
    one in the run directory (None: a fresh start)."""
    if cfg.run.resume_from:
        path = Path(cfg.run.resume_from).expanduser()
        if not is_complete(path):
            raise FileNotFoundError(f"run.resume_from: {checkpoint_problem(path)}")
        if mode(path) is not Mode.LOCAL:
            raise ValueError(
                f"run.resume_from: {path} is a checkpoint of `rlhf up`, which `rlhf train --local` cannot go on "
                "from; give a checkpoint of `rlhf train --local`, or go on with `rlhf up`"
            )
        return path
    return newest_checkpoint(run_dir)


def run_local(cfg: Config, run_dir: str | Path | None = None, stop_event=None) -> dict:
    """The run's summary; when `stop_event` (a threading.Event) is set, the run stops at the end of
    its iteration with a checkpoint of it, and the summary is {"stopped_at": N, "checkpoint": DIR
    (None when no iteration was done)}."""
    run_dir = Path(run_dir or cfg.run.run_dir)
    done = finished_run(run_dir, cfg.run.iterations)
    if done is not None and not cfg.run.resume_from:
        log.info(
            "run %s already finished at iteration %s (summary.json); raise run.iterations to continue",
            run_dir,
            done.get("iterations"),
        )
        return done
    torch.manual_seed(cfg.run.seed)
    schedule = Schedule(cfg.run)
    backend = make_backend(cfg)
    tokenizer = backend.tokenizer
    scorer = build_scorer(cfg.reward, device=str(resolve_device(cfg.model.device)))  # beside the policy
    gold = build_eval_scorer(cfg.reward)  # reward.eval_rules: a gold reward apart from the proxy trained on
    eval_scorer, proxy = (gold, scorer) if gold is not None else (scorer, None)
    train = config_prompts(cfg, "train", tokenizer, label_reader(cfg))
    held_out = config_prompts(cfg, "eval", tokenizer, label_reader(cfg))
    epochs = EpochSampler(train, cfg.run.seed)
    learner = PolicyTrainer(
        cfg, total_updates=planned_updates(cfg), ptx_examples=ptx_examples_for(cfg, tokenizer, train)
    )
    critic = Critic.from_config(cfg) if cfg.needs_critic else None
    state = LocalState(learner, critic, epochs)
    with contextlib.ExitStack() as stack:
        # the agent's sessions (and its held-out eval) sample through the backend here, batched
        pool = stack.enter_context(contextlib.closing(in_process_pool(backend, cfg))) if cfg.rollout.sessions else None
        evaluator = stack.enter_context(local_evaluator(cfg, tokenizer, backend, eval_scorer, proxy, pool))
        distill = Distillation.for_training(
            cfg, tokenizer, Teacher.from_config(cfg) if cfg.distill.needs_server else None
        )
        sampler = local_sampler(cfg, tokenizer, backend, scorer, critic, pool, stop_event, distill)
        stack.callback(sampler.close)
        source = LocalSource(cfg, epochs, sampler, stop_event)
        parts = (learner, critic, tokenizer, source, backend, evaluator, held_out, state)
        return _train(cfg, run_dir, schedule, parts, stop_event)


def local_evaluator(cfg: Config, tokenizer, backend, scorer, proxy, pool):
    """The held-out eval (a context manager) through the backend here: one reply per prompt scored
    by `scorer` (and by the `proxy` trained on, besides a gold reward), or the agent's sessions on
    `pool` (the backend, batched)."""

    def servers():
        assert pool is not None  # asked for only when the config has an agent
        return contextlib.nullcontext(pool)

    return held_out_evaluator(
        cfg,
        tokenizer,
        SamplingParams.for_eval(cfg),
        backend=backend,
        scorer=scorer,
        servers=servers,
        proxy=proxy,
    )


def local_sampler(cfg: Config, tokenizer, backend, scorer, critic, pool, stop_event, distill=None) -> Sampler:
    """How the rollout step samples, chosen once as a worker chooses: the agent's sessions on an
    endpoint in this process over `pool`, or one reply per sample from the backend; read by the
    teacher with `distill` (training/distill.py)."""
    if cfg.rollout.sessions:  # the agent's sessions, sampled here (a worker's endpoint, in this process)
        assert pool is not None
        host = agent_host(cfg, tokenizer, pool, SamplingParams.for_training(cfg), port=0)
        return AgentSampler(cfg, host, tokenizer, critic, stop_event or threading.Event(), distill=distill)
    return ReplySampler.for_training(cfg, backend, scorer, tokenizer, critic, distill=distill)


def _train(cfg: Config, run_dir: Path, schedule: Schedule, parts: tuple, stop_event) -> dict:
    """The loop, from the run's newest checkpoint if it has one, to its summary."""
    learner, critic, tokenizer, source, backend, evaluator, held_out, state = parts
    loop = TrainingLoop(
        cfg,
        run_dir,
        learner,
        critic,
        tokenizer,
        source,
        BackendSink(backend),
        lambda: evaluator.metrics(held_out),
        logger=log,
        keep_state=state.write,
        stop_event=stop_event,
    )
    start = resume_point(cfg, run_dir)
    if start is not None:
        loop.load_loop_state(state.read(start))
        backend.update_weights(learner.policy_state_dict(), learner.policy_version)
        log.info("resumed from %s (iteration %d)", start, loop.iteration)
    loop.begin(RunLog(run_dir, cfg, mode="local", resume_from=loop.iteration if start is not None else None))
    it, stopped = loop.iterate(schedule, loop.iteration)
    if stopped and it < cfg.run.iterations:  # a stop after the last iteration finishes the run
        summary = _stopped(loop, it, schedule)
        if source.lost is not None:
            summary["lost"] = source.lost
        return summary
    return loop.finish(it, time.time() - schedule.t_start, run_dir / "final_critic")


def _stopped(loop: TrainingLoop, it: int, schedule: Schedule) -> dict:
    """A run stopped after iteration `it`: its checkpoint (written now unless the schedule wrote it),
    the trackers closed."""
    path = checkpoint_dir(loop.run_dir, it)
    if it > 0 and not is_complete(path):
        loop.checkpoint(it, schedule.at(it))
    assert loop.runlog is not None  # begin() set it
    loop.runlog.close()
    return {"stopped_at": it, "checkpoint": str(path) if is_complete(path) else None}
