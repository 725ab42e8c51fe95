"""`rlhf make-prefs`: preference pairs labelled by a judge (RLAIF), the hops in order.

1. `n` samples of the policy (model.path) for each training prompt (data.train, the first
   `limit`), each scored by the judge: the held-out reward (reward.eval_rules), else the
   training reward.
2. `more` further samples for each prompt whose first samples the judge told apart (some better
   than others): the prompts the model sometimes gets right are where pairs come from.
3. `hard_negatives` counterfactuals of each best-scored answer of a prompt (one of its numbers
   changed; with a numeric label, the first has the label as its last number: `pairs.counterfactuals`),
   scored by the same judge. A prompt the model never got right gets its pairs from them.
4. Every pair of a prompt's answers the judge tells apart (`pairs.judged_pairs`), at most
   `max_pairs_per_prompt` (hard ones kept first), written as jsonl rows `rlhf train-rm` reads.
"""

from __future__ import annotations

import dataclasses
import math
import random
import time
from pathlib import Path
from typing import Callable

from ..common.config import Config
from ..common.types import RewardSample, SamplingParams
from ..reward.labels import label_reader
from ..reward.scorer import build_eval_scorer, build_scorer
from ..training.data import config_prompts
from ..training.evaluate import Evaluator, write_rows
from ..training.sampling import ReplySampler
from .pairs import Judged, cap_pairs, counterfactuals, judged_pairs, pair_row


@dataclasses.dataclass
class PairPlan:
    """What `make_preferences` samples and pairs (the `rlhf make-prefs` flags)."""

    n: int = 4
    temperature: float | None = None
    limit: int | None = None
    offset: int = 0  # the prompts from this one on (the first `limit` of them)
    min_gap: float = 1e-9
    more: int = 0
    hard_negatives: int = 0
    max_pairs_per_prompt: int | None = None


def make_preferences(cfg: Config, out: Path, plan: PairPlan, say: Callable[[str], None] = print) -> dict:
    """Writes `out` as jsonl rows ({id, prompt, chosen, rejected, chosen_reward, rejected_reward,
    label, hard, synthetic}; the prompt as the policy sees it, so train the reward model with
    reward_model.chat_template false) and returns what it printed last, as numbers."""
    from ..generation.policy import load_policy

    t = cfg.generation.temperature if plan.temperature is None else plan.temperature
    if plan.n < 2 or t <= 0:
        raise ValueError(f"pairs need at least 2 different samples per prompt: n={plan.n}, temperature={t:g}")
    judge = build_eval_scorer(cfg.reward) or build_scorer(cfg.reward, device="cpu")
    backend = load_policy(cfg.model.path, cfg.model.path, cfg.model.device)
    prompts = config_prompts(cfg, "train", backend.tokenizer, label_reader(cfg))[plan.offset :]
    prompts = prompts[: plan.limit]
    if not prompts:
        raise ValueError(f"data.train ({cfg.data.train}): no prompts to make pairs from")
    say(
        f"{len(prompts)} prompts from {cfg.data.train}, {plan.n} samples each at temperature {t:g}, judged by "
        + ("reward.eval_rules" if cfg.reward.eval_rules else f"reward.{cfg.reward.type}")
    )
    t0 = time.monotonic()

    def sample(records, n: int, seed: int) -> list[dict]:
        params = SamplingParams(n=n, temperature=t, top_p=cfg.generation.top_p, top_k=cfg.generation.top_k,
                                max_new_tokens=cfg.response_length, seed=seed)  # fmt: skip
        evaluator = Evaluator(ReplySampler(backend, judge, backend.tokenizer, params), batch=max(1, 64 // n))
        return evaluator.rows(records, lambda done, total: say(f"  {done}/{total} prompts"))

    answers = _sampled_answers(prompts, plan, sample, cfg.run.seed, say)
    synthetic = _add_counterfactuals(prompts, answers, judge, plan.hard_negatives, random.Random(cfg.run.seed))
    rng = random.Random(cfg.run.seed)
    pairs = [
        pair_row(p.id, p.prompt, p.label, c, r)
        for p in prompts
        for c, r in cap_pairs(judged_pairs(answers[p.id], plan.min_gap), plan.max_pairs_per_prompt, rng)
    ]
    write_rows(out, pairs)
    stats = _stats(prompts, answers, synthetic, pairs, t0)
    say(
        f"{stats['pairs']} pairs written to {out} from {stats['prompts_with_pairs']} of {len(prompts)} prompts "
        f"({stats['hard_pairs']} hard: two answers of one form, different numbers); {stats['samples']} samples, "
        f"mean reward {stats['reward_mean']:.3f}, {synthetic} counterfactuals judged; {stats['seconds']:.0f} s"
    )
    return stats


def _sampled_answers(prompts, plan: PairPlan, sample, seed: int, say: Callable[[str], None]) -> dict[str, list[Judged]]:
    """Hops 1 and 2: each prompt's judged samples, by prompt id (`sample(records, n, seed)` gives
    the judged rows)."""
    rows = sample(prompts, plan.n, seed)
    answers: dict[str, list[Judged]] = {}
    for r in rows:
        answers.setdefault(r["id"], []).append(Judged(r["response"], r["reward"]))
    if plan.more:
        apart = [p for p in prompts if _spread(answers[p.id]) >= plan.min_gap]
        say(f"{len(apart)} prompts whose samples the judge told apart: {plan.more} samples more each")
        for r in sample(apart, plan.more, seed + 1):
            answers[r["id"]].append(Judged(r["response"], r["reward"]))
    return answers


def _stats(prompts, answers: dict[str, list[Judged]], synthetic: int, pairs: list[dict], t0: float) -> dict:
    """What `make_preferences` returns: prompts, samples (the policy's, scored), counterfactuals
    judged, pairs (hard ones), prompts with pairs, the samples' mean reward, seconds since `t0`."""
    sampled = [a for a_s in answers.values() for a in a_s if not a.synthetic and math.isfinite(a.score)]
    return {
        "prompts": len(prompts),
        "samples": len(sampled),
        "counterfactuals": synthetic,
        "pairs": len(pairs),
        "hard_pairs": sum(p["hard"] for p in pairs),
        "prompts_with_pairs": len({p["id"] for p in pairs}),
        "reward_mean": sum(a.score for a in sampled) / max(1, len(sampled)),
        "seconds": round(time.monotonic() - t0, 1),
    }


def _spread(answers: list[Judged]) -> float:
    scores = [a.score for a in answers if math.isfinite(a.score)]
    return max(scores) - min(scores) if scores else 0.0


def _add_counterfactuals(prompts, answers: dict[str, list[Judged]], judge, k: int, rng: random.Random) -> int:
    """`k` counterfactuals of each best-scored text of each prompt, judged, added to its answers;
    how many were judged."""
    if k <= 0:
        return 0
    made: list[tuple[str, str]] = []  # (prompt id, text)
    for p in prompts:
        scores = [a.score for a in answers[p.id] if math.isfinite(a.score)]
        top = max(scores, default=math.nan)
        for text in sorted({a.text for a in answers[p.id] if a.score == top}):
            made += [(p.id, c) for c in counterfactuals(text, k, rng, p.label)]
    by_id = {p.id: p for p in prompts}
    samples = [RewardSample(by_id[i].prompt, text, by_id[i].label, by_id[i].metadata) for i, text in made]
    for (i, text), s in zip(made, judge.score(samples) if samples else []):
        answers[i].append(Judged(text, s.reward, synthetic=True))
    return len(made)
