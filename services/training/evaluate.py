"""Held-out evaluation: generate for each prompt, score every sample, summarise. The training loop's
eval runs it in-process (the generation backend and the scorer) or in the learner service (a
generation server serving the current version and the reward server's held-out scorer): both
satisfy `GenerationBackend.generate` and `Scorer.score`. `rlhf eval` runs it on any model
directory.

A generation row: {"id", "prompt", "response", "label", "reward", "components", "sample"}
(`sample`: 0..n-1, the samples of one prompt).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable, Iterable

from ..common.types import PromptRecord, RewardSample, SamplingParams


def generate_and_score(
    records: list[PromptRecord],
    backend,
    scorer,
    tokenizer,
    params: SamplingParams,
    batch: int | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> list[dict]:
    """`params.n` samples of each record's prompt, each scored: one row per sample, in record order.
    `batch`: prompts per generate call (None: all at once); `progress(done, total)` after each."""
    rows: list[dict] = []
    step = batch or max(1, len(records))
    for start in range(0, len(records), step):
        chunk = records[start : start + step]
        gen = backend.generate([tokenizer(r.prompt)["input_ids"] for r in chunk], params)
        texts = [[tokenizer.decode(c.token_ids, skip_special_tokens=True) for c in comps] for comps in gen.completions]
        samples = [RewardSample(r.prompt, t, r.label, r.metadata) for r, ts in zip(chunk, texts) for t in ts]
        scored = iter(scorer.score(samples))
        for r, ts in zip(chunk, texts):
            for j, t in enumerate(ts):
                s = next(scored)
                rows.append(
                    {
                        "id": r.id,
                        "prompt": r.prompt,
                        "response": t,
                        "label": r.label,
                        "reward": s.reward,
                        "components": dict(s.components),
                        "sample": j,
                    }
                )
        if progress is not None:
            progress(min(start + step, len(records)), len(records))
    return rows


def summarize(rows: list[dict], pass_reward: float | None = None) -> dict:
    """reward_mean (mean@n: over every sample), and with `pass_reward`, pass@n: the share of prompts
    with at least one sample whose reward is at least that; the mean of each reward component."""
    out: dict = {
        "reward_mean": sum(r["reward"] for r in rows) / len(rows) if rows else float("nan"),
        "prompts": len({r["id"] for r in rows}),
        "samples": len(rows),
    }
    for k in rows[0]["components"] if rows else []:
        out[k] = sum(r["components"].get(k, 0.0) for r in rows) / len(rows)
    if pass_reward is not None:
        best: dict[str, float] = {}
        for r in rows:
            best[r["id"]] = max(best.get(r["id"], float("-inf")), r["reward"])
        out["pass_at_n"] = sum(v >= pass_reward for v in best.values()) / len(best) if best else float("nan")
    return out


def evaluate(records: list[PromptRecord], backend, scorer, tokenizer, params: SamplingParams, proxy=None) -> dict:
    """The training loop's held-out eval: `params.n` = 1 sample per prompt (greedy at
    eval_temperature 0), scored; `eval/...` metrics, and the rows under "generations".
    `proxy`: the training reward, when the held-out one (`scorer`) is a gold reward apart
    (`reward.eval_rules`): the same responses scored by it too, as `eval/proxy_reward_mean` and
    each row's `proxy_reward`, so a policy that pleases the proxy but not the gold shows."""
    rows = generate_and_score(records, backend, scorer, tokenizer, params)
    out = eval_metrics(rows)
    if proxy is not None and rows:
        meta = {r.id: r.metadata for r in records}
        scored = proxy.score([RewardSample(r["prompt"], r["response"], r["label"], meta[r["id"]]) for r in rows])
        for r, s in zip(rows, scored):
            r["proxy_reward"] = s.reward
        out["eval/proxy_reward_mean"] = sum(s.reward for s in scored) / len(scored)
    return out


def eval_metrics(rows: list[dict]) -> dict:
    """The training loop's `eval/...` metrics of scored rows (`summarize`), the rows under "generations"."""
    summary = summarize(rows)
    out: dict = {"eval/reward_mean": summary["reward_mean"]}
    out.update({f"eval/{k}": v for k, v in summary.items() if k not in ("reward_mean", "prompts", "samples")})
    out["generations"] = rows
    return out


def write_rows(path: Path, rows: Iterable[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for r in rows:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
