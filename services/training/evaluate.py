"""Held-out evaluation: one `Evaluator` for every held-out eval: the training loop's, in-process
(`rlhf train --local`: the generation backend and the scorer) and in the learner service (a
generation server serving the current version, the reward server's held-out scorer), and
`rlhf eval` on any model directory. An Evaluator samples the prompts in batches through the one
sampling seam (sampling.py: a `ReplySampler`, one completion per sample scored by a `Scorer`; or an
agent's sessions, agents/sampler.py:`AgentSampler`) and reads the batch's rows, or the training
loop's `eval/...` metrics of them. Which sampler an eval uses is decided once, by `how_sampled`
(agents/evaluate.py:`held_out_evaluator` builds it).

    Evaluator.rows        the prompts in batches of `batch`, each batch -> `sampler.sample` -> its rows
    Evaluator.metrics     the rows' `eval/...` metrics (`eval_metrics`), the rows under "generations"

A generation row: {"id", "prompt", "response", "label", "reward", "components", "sample"}
(`sample`: 0..n-1, the samples of one prompt), and `proxy_reward` when a proxy scores them too.
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterable

from ..common.types import PromptRecord
from .sampling import Failed, Prompt, Sampler

if TYPE_CHECKING:
    from ..common.config import Config


class HowSampled(enum.Enum):
    """How each held-out prompt is sampled and scored."""

    REPLY = "reply"  # `params.n` completions in one generate call, each scored by the held-out reward
    SESSIONS = "sessions"  # `params.n` sessions of the config's agent, each with the agent's reward


def how_sampled(cfg: Config, rule: str | None = None) -> HowSampled:
    """The one choice of how a held-out prompt is sampled: the sessions of the config's agent
    (`rollout.agent`, `environment` or `agent_url`), unless a reward `rule` is to score one reply
    (`rlhf eval --rule`); else one completion per sample."""
    return HowSampled.SESSIONS if cfg.rollout.sessions and rule is None else HowSampled.REPLY


@dataclass
class Evaluator:
    """A held-out eval: the prompts `batch` at a time (None: all at once) through `sampler` (a
    `ReplySampler`, or an agent's sessions: agents/sampler.py), its rows read."""

    sampler: Sampler
    batch: int | None = None

    def rows(self, records: list[PromptRecord], progress: Callable[[int, int], None] | None = None) -> list[dict]:
        """Every sample's row, in record order; `progress(done, total)` after each batch."""
        rows: list[dict] = []
        step = self.batch or max(1, len(records))
        for start in range(0, len(records), step):
            sampled = self.sampler.sample([Prompt(r, f"eval/{r.id}") for r in records[start : start + step]])
            if isinstance(sampled, Failed):  # an eval measures no policy through an outage: the caller's to say
                raise sampled.cause or RuntimeError(sampled.why)
            rows += sampled.rows
            if progress is not None:
                progress(min(start + step, len(records)), len(records))
        return rows

    def metrics(self, records: list[PromptRecord]) -> dict:
        """The training loop's held-out eval: its `eval/...` metrics, the rows under "generations"."""
        return eval_metrics(self.rows(records))


def summarize(rows: list[dict], pass_reward: float | None = None) -> dict:
    """reward_mean (mean@n: over every sample), and with `pass_reward`, pass@n: the share of prompts
    with at least one sample whose reward is at least that; the mean of each reward component."""
    out: dict = {
        "reward_mean": sum(r["reward"] for r in rows) / len(rows) if rows else float("nan"),
        "prompts": len({r["id"] for r in rows}),
        "samples": len(rows),
    }
    for k in dict.fromkeys(k for r in rows for k in r["components"]):  # a failed agent session's row has fewer
        out[k] = sum(r["components"].get(k, 0.0) for r in rows) / len(rows)
    if pass_reward is not None:
        best: dict[str, float] = {}
        for r in rows:
            best[r["id"]] = max(best.get(r["id"], float("-inf")), r["reward"])
        out["pass_at_n"] = sum(v >= pass_reward for v in best.values()) / len(best) if best else float("nan")
    return out


def eval_metrics(rows: list[dict]) -> dict:
    """The training loop's `eval/...` metrics of scored rows (`summarize`; `eval/proxy_reward_mean`
    when a proxy scored them too; `eval/unscored`, the share of rows whose reward could not be had,
    when the rows say), the rows under "generations"."""
    summary = summarize(rows)
    out: dict = {"eval/reward_mean": summary["reward_mean"]}
    out.update({f"eval/{k}": v for k, v in summary.items() if k not in ("reward_mean", "prompts", "samples")})
    out["generations"] = rows
    if rows and "proxy_reward" in rows[0]:
        out["eval/proxy_reward_mean"] = sum(r["proxy_reward"] for r in rows) / len(rows)
    if any("unscored" in r for r in rows):  # an agent's sessions: the share whose reward could not be had
        out["eval/unscored"] = sum(bool(r.get("unscored")) for r in rows) / len(rows)
    return out


def write_rows(path: Path, rows: Iterable[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for r in rows:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
