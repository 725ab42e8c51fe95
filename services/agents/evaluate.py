"""The held-out eval as each caller opens it: `held_out_evaluator` makes the one choice of how a
prompt is sampled (training/evaluate.py:`how_sampled`) and gives the `Evaluator` for it: one
completion per sample (`SingleTurn`), or the sessions of an agent (`rollout.agent`, `environment`
or `agent_url`) through an `AgentHost` (agents.py) over the generation servers the caller opens
(`AgentSessions`: each session an eval row with its conversation). The learner's eval (`rlhf up`)
and `rlhf eval` open it here.

    held_out_evaluator    how_sampled(cfg, rule) -> SingleTurn, or the servers opened, an
                          AgentHost on them -> AgentSessions; the Evaluator over it
      AgentSessions.rows  the batch's sessions at once (AgentHost.run) -> one row each
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, ContextManager, Iterator

from ..common.servers import ServerPool
from ..common.types import PromptRecord, SamplingParams
from ..training.evaluate import Evaluator, HowSampled, SingleTurn, how_sampled
from .host import AgentHost, Outage, Unscored, agent_host, session_name
from .sessions import as_sample

if TYPE_CHECKING:
    from ..common.config import Config


def transcript(trajectory: dict, tokenizer) -> list[dict]:
    """A trajectory's conversation after its prompt, as runs of the policy's tokens and the
    environment's: [{"by": "policy" | "environment", "text"}], special tokens kept (the turns'
    boundaries show)."""
    _, completion = as_sample(trajectory)
    mask = completion.loss_mask or [1] * len(completion.token_ids)
    runs: list[dict] = []
    start = 0
    for i in range(1, len(mask) + 1):
        if i == len(mask) or mask[i] != mask[start]:
            by = "policy" if mask[start] else "environment"
            runs.append({"by": by, "text": tokenizer.decode(completion.token_ids[start:i], skip_special_tokens=False)})
            start = i
    return runs


@dataclass
class AgentSessions:
    """`n` sessions of the agent on `host` per held-out record, all of a batch at once, as eval
    rows (training/evaluate.py's shape: {"id", "prompt", "response", "label", "reward",
    "components", "sample"}) with the conversation (`transcript`) and the number of the policy's
    `turns`. A session whose agent failed is a row with reward 0 and its `error` (counted by
    `summarize` as `components["failed"]`): an eval scores what the policy does, failures
    included; one whose reward could not be had (`Unscored`) is such a row marked `"unscored":
    true`, so that its 0 is not read as a reward. A session that found no generation server
    raises Outage: an outage measures no policy."""

    host: AgentHost
    tokenizer: Any
    n: int = 1

    def rows(self, records: list[PromptRecord]) -> list[dict]:
        work = [(r, session_name(r.id, j, "eval/")) for r in records for j in range(self.n)]
        episodes = self.host.run(work)
        down = [e.error for e in episodes if isinstance(e.error, Outage)]
        if down:
            raise down[0]
        return [self._row(r, i % self.n, e) for i, ((r, _), e) in enumerate(zip(work, episodes))]

    def _row(self, record: PromptRecord, sample: int, e) -> dict:
        runs = transcript(e.trajectory, self.tokenizer) if e.trajectory is not None else []
        reward = e.reward if e.error is None else 0.0
        row = {
            "id": record.id,
            "prompt": record.prompt,
            "response": "".join(x["text"] for x in runs),
            "label": record.label,
            "reward": reward,
            "components": {**e.components, "agent": reward, "failed": float(e.error is not None)},
            "sample": sample,
            "turns": e.trajectory["turns"] if e.trajectory is not None else 0,
            "transcript": runs,
        }
        if e.error is not None:
            row["error"] = str(e.error)
        row["unscored"] = isinstance(e.error, Unscored)
        return row


@contextlib.contextmanager
def held_out_evaluator(
    cfg: Config,
    tokenizer,
    params: SamplingParams,
    *,
    backend,
    scorer,
    servers: Callable[[], ContextManager[ServerPool]],
    proxy=None,
    batch: int | None = None,
    turn_params: SamplingParams | None = None,
    rule: str | None = None,
) -> Iterator[Evaluator]:
    """The held-out eval of the policy, sampled as `how_sampled(cfg, rule)` says:
    - one reply: `params.n` completions of each prompt by `backend` (a `GenerationBackend`), scored
      by `scorer` (and `proxy`), `batch` prompts per generate call (None: all at once);
    - an agent's sessions: `servers()` opens the pool of generation servers the agent's endpoint
      samples from (closed after), every turn with `turn_params` (default `params`), `params.n`
      sessions per prompt, generation.max_batch_size prompts' sessions at once."""
    if how_sampled(cfg, rule) is HowSampled.REPLY:
        yield Evaluator(SingleTurn(backend, scorer, tokenizer, params, proxy), batch)
        return
    with servers() as pool:
        host = agent_host(cfg, tokenizer, pool, turn_params or params, port=0)
        try:
            yield Evaluator(AgentSessions(host, tokenizer, params.n), cfg.generation.max_batch_size)
        finally:
            host.close()
