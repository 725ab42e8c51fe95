"""The in-process trainer: the whole PPO loop in one process, with the same domain objects the
services host (generation backend, reward scorer, critic, learner step), wired directly; the
reference the distributed run is measured against.

    rlhf train --local -c configs/tiny-cpu.yaml --run-dir runs/local
"""
from __future__ import annotations

import logging
import time
from pathlib import Path

import torch

from .common.data import EpochSampler, config_prompts
from .common.runlog import RunLog
from .common.sampling import evaluate, sample_groups
from .common.types import Rollout, SamplingParams
from .critic.critic import Critic
from .generation.server import make_backend
from .learner.ppo_step import PPOLearner, ptx_examples_for
from .learner.schedule import Schedule, planned_updates
from .learner.watch import HackingWatch, judge
from .reward.scorer import build_eval_scorer, build_scorer

log = logging.getLogger(__name__)


def run_local(cfg, run_dir: str | Path | None = None) -> dict:
    run_dir = Path(run_dir or cfg.run.run_dir)
    torch.manual_seed(cfg.run.seed)
    schedule = Schedule(cfg.run)
    backend = make_backend(cfg)
    tokenizer = backend.tokenizer
    scorer = build_scorer(cfg.reward, device="cpu")
    eval_scorer = build_eval_scorer(cfg.reward) or scorer  # reward.eval_rules: a gold reward apart
    train = config_prompts(cfg, "train", tokenizer)
    held_out = config_prompts(cfg, "eval", tokenizer)
    sampler = EpochSampler(train, cfg.run.seed)
    learner = PPOLearner(cfg, total_updates=planned_updates(cfg), ptx_examples=ptx_examples_for(cfg, tokenizer, train))
    critic = Critic.from_config(cfg) if cfg.needs_critic else None
    params, eval_params = SamplingParams.for_training(cfg), SamplingParams.for_eval(cfg)
    watch = HackingWatch(cfg.run.hacking_window, cfg.run.hacking_min_change)
    runlog = RunLog(run_dir, cfg, mode="local")
    baseline = evaluate(held_out, backend, eval_scorer, tokenizer, eval_params)
    runlog.log_eval(0, {**baseline, **judge(watch, 0, baseline, log.warning)[1]})
    last_eval = baseline
    it = 0
    for it in range(1, cfg.run.iterations + 1):
        t0 = time.perf_counter()
        picked = sampler.take_with_epochs(cfg.rollout_batch_size)  # a batch may cross an epoch boundary
        groups, metrics = sample_groups([r for _, r in picked], [f"{e}:{r.id}" for e, r in picked], backend,
                                        scorer, tokenizer, params, critic, cfg.prompt_length)
        t1 = time.perf_counter()
        metrics.update(learner.step(Rollout.from_groups(groups), critic))
        t2 = time.perf_counter()
        backend.update_weights(learner.policy_state_dict(), learner.version)
        t3 = time.perf_counter()
        metrics.update({"time/rollout_s": t1 - t0, "time/train_s": t2 - t1, "time/push_s": t3 - t2,
                        "time/iteration_s": t3 - t0, "data/epoch": sampler.epoch,
                        "policy/version": learner.version})
        watch.train(metrics.get("reward/score_mean", float("nan")))
        tick = schedule.at(it)
        if tick.evaluate:
            last_eval = evaluate(held_out, backend, eval_scorer, tokenizer, eval_params)
            metrics.update(last_eval)
            metrics.update(judge(watch, it, last_eval, log.warning)[1])
        if tick.checkpoint and not tick.last:  # the last one is `final/`
            learner.save_policy(run_dir / "checkpoints" / f"iter_{it:06d}", tokenizer)
        runlog.log_iteration(it, metrics)
        if tick.out_of_time:
            log.warning("run.max_wall_s=%s reached after %d iterations", cfg.run.max_wall_s, it)
            break
    learner.save_policy(run_dir / "final", tokenizer)
    if critic is not None:
        critic.save(run_dir / "final_critic")
    return runlog.finish(baseline=baseline["eval/reward_mean"], final=last_eval["eval/reward_mean"],
                         iterations=it, wall_s=time.time() - schedule.t_start)
