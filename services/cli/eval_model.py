"""`rlhf eval`: what a model says on a dataset, scored, and against another model on the same prompts.

    rlhf eval -c FILE [--model DIR] [--baseline DIR] [--data SOURCE] [--limit N] [--n N]
              [--temperature T] [--rule NAME] [--pass-reward R] [--run-dir DIR] [--out DIR]

MODEL and the baseline may be any model directory: the base, a run's `final/` or `best/`, a
Hugging Face checkpoint (`checkpoints/iter_N` of `rlhf train --local`), a checkpoint of `rlhf up`
(`learner.pt`, its policy loaded into model.path's architecture), a LoRA adapter directory
(merged into the base it names), or the Tinker API's sampler weights (`tinker://RUN/
sampler_weights/NAME`, found under tinker.root, loaded over model.path). The prompts are
data.eval (or --data) as the config reads them, the first data.eval_size (or --limit); the reward
is the config's held-out reward (reward.eval_rules, else the training reward: rules, a reward
model, an HTTP API), or the rule --rule names. Greedy by default (generation.eval_temperature);
--n N samples per prompt gives mean@N and, with --pass-reward, pass@N.

Writes OUT/NAME.jsonl (one row per sample: id, prompt, response, label, reward, components,
sample) and OUT/summary.json, and prints a summary (side by side with --baseline). OUT is --out,
else RUN_DIR/eval: the run directory --run-dir names (run.run_dir).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import time
from pathlib import Path
from typing import Iterator

from ..agents.evaluate import held_out_evaluator
from ..common.config import Config, RewardConfig, RuleSpec
from ..common.servers import ServerPool
from ..common.types import SamplingParams
from ..generation.backend import HFBackend
from ..generation.inprocess import in_process_pool
from ..generation.policy import load_policy
from ..reward.labels import label_reader
from ..reward.scorer import RuleScorer, build_eval_scorer, build_scorer
from ..training.data import config_prompts, held_out_source
from ..training.evaluate import HowSampled, how_sampled, summarize, write_rows
from .preflight import looks_local


def _params(cfg: Config, n: int, temperature: float | None) -> SamplingParams:
    g = cfg.generation
    t = g.eval_temperature if temperature is None else temperature
    if n > 1 and t == 0:
        raise ValueError(f"--n {n} samples of a greedy eval are {n} copies of one answer; give --temperature > 0")
    return SamplingParams(
        n=n, temperature=t, top_p=g.top_p, top_k=g.top_k, max_new_tokens=cfg.response_length, seed=cfg.run.seed
    )  # seeded: both models get the same sampling noise


def _scorer(cfg: Config, rule: str | None):
    if rule is not None:
        return RuleScorer([(rule, 1.0, {})])
    return build_eval_scorer(cfg.reward) or build_scorer(cfg.reward, device="cpu")


def _scored_by(cfg: Config, rule: str | None) -> Config:
    """The config, its reward the rule --rule names when there is one."""
    if rule is None:
        return cfg
    return cfg.model_copy(update={"reward": RewardConfig(rules=[RuleSpec(name=rule)])})


def _fmt(v) -> str:
    return f"{v:.4f}" if isinstance(v, float) else str(v)


def run_eval(
    cfg: Config,
    model: str | None,
    baseline: str | None,
    out: Path,
    n: int = 1,
    temperature: float | None = None,
    rule: str | None = None,
    pass_reward: float | None = None,
    say=print,
) -> dict:
    """Evaluate `model` (default model.path) and `baseline` on the same prompts; the summary."""
    params = _params(cfg, n, temperature)
    agent = how_sampled(cfg, rule) is HowSampled.SESSIONS  # the agent's reward, or --rule on one reply
    scorer = None if agent else _scorer(cfg, rule)
    models = {"model": model or cfg.model.path}
    if baseline is not None:
        models = {"baseline": baseline, **models}
    results: dict[str, dict] = {}
    rows_of: dict[str, list[dict]] = {}
    prompts = None
    for name, path in models.items():
        t0 = time.monotonic()
        backend = load_policy(path, cfg.model.path, cfg.model.device)
        if prompts is None:  # their labels checked against the reward this eval scores with
            prompts = _prompts(cfg, rule, backend.tokenizer, params, say)
        rows = _model_rows(cfg, name, backend, prompts, params, scorer, rule, say)
        rows_of[name] = rows
        write_rows(out / f"{name}.jsonl", rows)
        results[name] = {"path": path, **summarize(rows, pass_reward), "seconds": round(time.monotonic() - t0, 1)}
        del backend
    summary = _summary(cfg, params, rule, agent, results, rows_of)
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    _report(summary, results, out, say)
    return summary


def _prompts(cfg: Config, rule: str | None, tokenizer, params: SamplingParams, say) -> list:
    """The held-out prompts (their labels checked against the reward this eval scores with), said."""
    scored = _scored_by(cfg, rule)
    prompts = config_prompts(scored, "eval", tokenizer, label_reader(scored))
    say(
        f"{len(prompts)} prompts from {held_out_source(cfg)}, {params.n} sample(s) each"
        + (" (greedy)" if params.temperature == 0 else f" at temperature {params.temperature:g}")
    )
    return prompts


def _model_rows(cfg: Config, name: str, backend, prompts: list, params: SamplingParams, scorer, rule, say) -> list:
    """One model's rows, a progress line after each batch and a heartbeat while one takes long."""
    done = [0]

    def progress(finished: int, total: int) -> None:
        done[0] = finished
        say(f"  {name}: {finished}/{total} prompts")

    step = min(cfg.generation.max_batch_size, len(prompts))

    def waiting() -> str:
        return f"  {name}: {done[0]}/{len(prompts)} prompts, sampling the next {min(step, len(prompts) - done[0])}"

    with heartbeat(say, waiting):
        return _rows(cfg, backend, prompts, params, scorer, rule, progress)


def _summary(cfg: Config, params: SamplingParams, rule, agent: bool, results: dict, rows_of: dict) -> dict:
    """summary.json: the data, the sampling, what scored, each model's results and, with a
    baseline, how the model compares per sample."""
    kind = cfg.rollout.agent_kind
    summary: dict = {
        "data": held_out_source(cfg),
        "n": params.n,
        "temperature": params.temperature,
        "reward": rule
        or (f"the agent's (rollout.{kind}: {getattr(cfg.rollout, kind)})" if agent and kind else None)
        or ("reward.eval_rules" if cfg.reward.eval_rules else f"reward.{cfg.reward.type}"),
        **results,
    }
    if "baseline" in rows_of:
        by_id = {(r["id"], r["sample"]): r["reward"] for r in rows_of["baseline"]}
        diffs = [r["reward"] - by_id[(r["id"], r["sample"])] for r in rows_of["model"]]
        summary["compared"] = {
            "better": sum(d > 0 for d in diffs),
            "worse": sum(d < 0 for d in diffs),
            "same": sum(d == 0 for d in diffs),
            "reward_mean_change": (results["model"]["reward_mean"] - results["baseline"]["reward_mean"]),
        }
    return summary


def _report(summary: dict, results: dict, out: Path, say) -> None:
    """The results side by side, the comparison, and where the rows and summary are."""
    keys = [k for k in results["model"] if k not in ("path", "seconds")]
    say("")
    say(f"{'':<14}" + "".join(f"{name:>14}" for name in results))
    for k in keys:
        say(f"{k:<14}" + "".join(f"{_fmt(results[name].get(k)):>14}" for name in results))
    if "compared" in summary:
        c = summary["compared"]
        say(
            f"per sample against the baseline: {c['better']} better, {c['worse']} worse, {c['same']} the same; "
            f"reward_mean {c['reward_mean_change']:+.4f}"
        )
    say(
        f"every prompt, response and reward: {out}/{'{baseline,model}' if 'compared' in summary else 'model'}.jsonl; "
        f"summary: {out / 'summary.json'}"
    )


HEARTBEAT_S = 30.0


@contextlib.contextmanager
def heartbeat(say, waiting, every_s: float = HEARTBEAT_S) -> Iterator[None]:
    """While the block runs, `say(waiting() + how long so far)` every `every_s` seconds: a batch
    of a real model's eval takes minutes, and its progress line comes only at the batch's end."""
    import threading

    stop = threading.Event()
    t0 = time.monotonic()

    def beat() -> None:
        while not stop.wait(every_s):
            say(f"{waiting()} ({time.monotonic() - t0:.0f} s so far)")

    thread = threading.Thread(target=beat, name="eval-heartbeat", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def _rows(cfg: Config, backend: HFBackend, prompts: list, params: SamplingParams, scorer, rule, progress) -> list:
    """Every sample's row of `backend`'s policy on `prompts`, sampled as the config says (`how_sampled`)."""
    with held_out_evaluator(
        cfg,
        backend.tokenizer,
        params,
        backend=backend,
        scorer=scorer,
        servers=lambda: _served(cfg, backend),
        # as many prompts per generate call as a generation server takes: the in-process eval's shapes
        batch=cfg.generation.max_batch_size,
        # an agent's: every turn its own sampling noise (one seed for all would repeat a sample n times)
        turn_params=dataclasses.replace(params, n=1, seed=None),
        rule=rule,
    ) as evaluator:
        return evaluator.rows(prompts, progress)


@contextlib.contextmanager
def _served(cfg: Config, backend: HFBackend) -> Iterator[ServerPool]:
    """`backend` in this process as a pool of one generation 'server' (batched as a server
    batches): an agent's sessions sample there, with no server started."""
    servers = in_process_pool(backend, cfg)
    try:
        yield servers
    finally:
        servers.close()


def missing_policies(paths: dict[str, str | None]) -> list[str]:
    """The policies that are not here, named by their flag: a path that looks local and does not
    exist (checked before anything is evaluated or written; a hub id is fetched as it loads)."""
    return [
        f"{flag} {path}: no such model directory or checkpoint (relative paths are from {Path.cwd()})"
        for flag, path in paths.items()
        if path is not None and looks_local(path) and not Path(path).expanduser().exists()
    ]


def tinker_checkpoint(cfg: Config, flag: str, path: str | None) -> str | None:
    """A `tinker://RUN/sampler_weights/NAME` path as the directory it names under tinker.root (the
    Tinker API's sampler weights, over model.path); any other path as it is."""
    if path is None or not path.startswith("tinker://"):
        return path
    from ..tinker.checkpoints import Store, TinkerPath
    from ..tinker.protocol import ApiError

    try:
        return str(Store(cfg.tinker.root).found(TinkerPath.parse(path, "sampler_weights", flag)))
    except ApiError as e:
        raise ValueError(f"{e.message} (under tinker.root={cfg.tinker.root})") from None


def main_eval(cfg: Config, args) -> int:
    args.model = tinker_checkpoint(cfg, "--model", args.model)
    args.baseline = tinker_checkpoint(cfg, "--baseline", args.baseline)
    missing = missing_policies({"--model": args.model or cfg.model.path, "--baseline": args.baseline})
    if missing:
        raise ValueError("; ".join(missing))
    out = Path(args.out or Path(cfg.run.run_dir) / "eval")
    out.mkdir(parents=True, exist_ok=True)
    run_eval(
        cfg,
        args.model,
        args.baseline,
        out,
        args.n,
        args.temperature,
        args.rule,
        args.pass_reward,
        say=lambda line: print(line, flush=True),
    )
    return 0
