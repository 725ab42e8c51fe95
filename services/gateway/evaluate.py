"""The held-out eval of an agent (`rollout.agent`, `environment` or `agent_url`): one session per
prompt through an `AgentHost` (agents.py), each as an eval row with its conversation. The
learner's eval (`rlhf up`) and `rlhf eval` run it."""

from __future__ import annotations

from typing import Callable

from ..common.types import PromptRecord
from .agents import AgentHost, Outage, session_name
from .sessions import as_sample


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


def evaluate_agent(
    host: AgentHost,
    records: list[PromptRecord],
    tokenizer,
    n: int = 1,
    batch: int = 32,
    progress: Callable[[int, int], None] | None = None,
) -> list[dict]:
    """`n` sessions of the agent per held-out record (`batch` records at once), as eval rows
    (training/evaluate.py's shape: {"id", "prompt", "response", "label", "reward", "components",
    "sample"}) with the conversation (`transcript`) and the number of the policy's `turns`. A
    session whose agent failed is a row with reward 0 and its `error` (counted by `summarize` as
    `components["failed"]`): an eval scores what the policy does, failures included. A session
    that found no generation server raises Outage: an outage measures no policy."""
    rows: list[dict] = []
    for start in range(0, len(records), batch):
        chunk = records[start : start + batch]
        work = [(r, session_name(r.id, j, "eval/")) for r in chunk for j in range(n)]
        episodes = host.run(work)
        down = [e.error for e in episodes if isinstance(e.error, Outage)]
        if down:
            raise down[0]
        for i, ((r, _), e) in enumerate(zip(work, episodes)):
            runs = transcript(e.trajectory, tokenizer) if e.trajectory is not None else []
            row = {
                "id": r.id,
                "prompt": r.prompt,
                "response": "".join(x["text"] for x in runs),
                "label": r.label,
                "reward": e.reward if e.error is None else 0.0,
                "components": {"agent": e.reward if e.error is None else 0.0, "failed": float(e.error is not None)},
                "sample": i % n,
                "turns": e.trajectory["turns"] if e.trajectory is not None else 0,
                "transcript": runs,
            }
            if e.error is not None:
                row["error"] = str(e.error)
            rows.append(row)
        if progress is not None:
            progress(min(start + batch, len(records)), len(records))
    return rows
