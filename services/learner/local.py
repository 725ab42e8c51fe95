"""The in-process trainer: the whole PPO loop in one process, with the same domain objects the
services host (generation backend, reward scorer, critic, learner step), wired directly.

    rlhf train --local -c configs/tiny-cpu.yaml --run-dir runs/local
"""
from __future__ import annotations

import logging
import time
from pathlib import Path

import torch

from ..common.data import EpochSampler, PromptRecord, load_prompts
from ..common.runlog import RunLog
from ..critic.critic import Critic
from ..generation.backend import HFBackend, SamplingParams
from ..reward.scorer import RewardSample, build_scorer
from ..rollout.collect import eval_params, groups_to_rollout, sample_groups, train_params
from .ppo_step import PPOLearner, Rollout, planned_updates, ptx_examples_for

log = logging.getLogger(__name__)


def collect_rollout(records: list[PromptRecord], backend, scorer, tokenizer, params: SamplingParams,
                    critic=None, prompt_length: int | None = None, epoch: int = 0) -> tuple[Rollout, dict]:
    """Generate `params.n` samples per prompt, score them and (for GAE) value them."""
    groups, metrics = sample_groups(records, [f"{epoch}:{r.id}" for r in records], backend, scorer, tokenizer,
                                    params, critic, prompt_length)
    return groups_to_rollout(groups), metrics


def evaluate(records: list[PromptRecord], backend, scorer, tokenizer, params: SamplingParams) -> dict:
    """Held-out reward: one sample per prompt at the eval temperature (0 = greedy)."""
    prompt_ids = [tokenizer(r.prompt)["input_ids"] for r in records]
    gen = backend.generate(prompt_ids, params)
    samples = [RewardSample(r.prompt, tokenizer.decode(c[0].token_ids, skip_special_tokens=True), r.label,
                            r.metadata) for r, c in zip(records, gen.completions)]
    scored = scorer.score(samples)
    out = {"eval/reward_mean": sum(s.reward for s in scored) / len(scored)}
    for k in scored[0].components if scored else []:
        out[f"eval/{k}"] = sum(s.components[k] for s in scored) / len(scored)
    return out


def run_local(cfg, run_dir: str | Path | None = None) -> dict:
    run_dir = Path(run_dir or cfg.run.run_dir)
    torch.manual_seed(cfg.run.seed)
    t_start = time.time()
    backend = HFBackend(cfg.model.path, cfg.model.device)
    tokenizer = backend.tokenizer
    scorer = build_scorer(cfg.reward, device="cpu")
    train = load_prompts(cfg.data.train, "train", tokenizer, cfg.data.prompt_key, cfg.data.label_key,
                         seed=cfg.run.seed)
    held_out = load_prompts(cfg.data.eval, "eval", tokenizer, cfg.data.prompt_key, cfg.data.label_key,
                            limit=cfg.data.eval_size, seed=cfg.run.seed)
    sampler = EpochSampler(train, cfg.run.seed)
    learner = PPOLearner(cfg, total_updates=planned_updates(cfg), ptx_examples=ptx_examples_for(cfg, tokenizer, train))
    critic = Critic.from_config(cfg) if cfg.needs_critic else None
    params, ev_params = train_params(cfg), eval_params(cfg)
    runlog = RunLog(run_dir, cfg, mode="local")
    baseline = evaluate(held_out, backend, scorer, tokenizer, ev_params)
    runlog.log_eval(0, baseline)
    last_eval = baseline
    it = 0
    for it in range(1, cfg.run.iterations + 1):
        t0 = time.perf_counter()
        epoch = sampler.epoch
        rollout, metrics = collect_rollout(sampler.take(cfg.rollout_batch_size), backend, scorer, tokenizer, params,
                                           critic, cfg.prompt_length, epoch)
        t1 = time.perf_counter()
        metrics.update(learner.step(rollout, critic))
        t2 = time.perf_counter()
        backend.update_weights(learner.policy_state_dict(), learner.version)
        t3 = time.perf_counter()
        metrics.update({"time/rollout_s": t1 - t0, "time/train_s": t2 - t1, "time/push_s": t3 - t2,
                        "time/iteration_s": t3 - t0, "data/epoch": sampler.epoch,
                        "policy/version": learner.version})
        out_of_time = cfg.run.max_wall_s is not None and time.time() - t_start > cfg.run.max_wall_s
        last = it == cfg.run.iterations or out_of_time
        if last or (cfg.run.eval_interval and it % cfg.run.eval_interval == 0):
            last_eval = evaluate(held_out, backend, scorer, tokenizer, ev_params)
            metrics.update(last_eval)
        if cfg.run.checkpoint_interval and it % cfg.run.checkpoint_interval == 0 and not last:
            learner.save_policy(run_dir / "checkpoints" / f"iter_{it:06d}", tokenizer)
        runlog.log_iteration(it, metrics)
        if out_of_time:
            log.warning("run.max_wall_s=%s reached after %d iterations", cfg.run.max_wall_s, it)
            break
    learner.save_policy(run_dir / "final", tokenizer)
    if critic is not None:
        critic.save(run_dir / "final_critic")
    return runlog.finish(baseline=baseline["eval/reward_mean"], final=last_eval["eval/reward_mean"],
                         iterations=it, wall_s=time.time() - t_start)
