"""Sampling when `rollout.agent` (or `environment`, `agent_url`) is set, through the one sampling
seam (training/sampling.py's `Sampler`), for a rollout worker, `train --local` and the held-out
eval alike: each sample of a group is a session of the user's agent function against an
OpenAI-compatible endpoint of the sampler's own (host.py: `AgentHost`, over a pool of generation
servers, or the backend in the process), and its token-exact trajectory (the environment's tokens
masked out of the loss) is the sample, with the agent's reward. Every session of a batch runs at
once.

    AgentSampler.sample     the sessions (AgentHost.run) -> their episodes
      groups_of             per prompt its group (host.py), valued by the critic (`values_of`), or
                            the prompt `Rejected` (its sessions failed, or ran longer than the
                            learner takes)
      Distillation.read     with on-policy distillation, the teacher's log-prob of each token
      session_row           every session as an eval row with its conversation (`transcript`)

A session that found no generation server or agent service (`Outage`) gives the batch up for now
(`Failed`, left pending; an eval raises it: an outage measures no policy).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING, Callable

from ..common.rpc.retry import DependencyUnavailable
from ..training.distill import Distillation
from ..training.sampling import Failed, Prompt, Rejected, Sampled, Then, component_means, values_of
from .host import AgentFailed, AgentHost, AgentServiceDown, Episode, Outage, Unscored, groups_of, session_work
from .sessions import as_sample

if TYPE_CHECKING:
    from ..common.config import Config
    from ..common.types import PromptRecord, SampleGroup

log = logging.getLogger(__name__)


class AgentSampler:
    """Prompts -> groups of the agent's sessions on `host` (`group_size` sessions a prompt that
    names none; None: the config's group size), with the critic's values when there is one, the
    teacher's log-probs with `distill` (training/distill.py), and every session as an eval row.
    `on_down(kind)`: counts a batch given up for now, by what was down ("no_generation_server",
    "agent_service"); the sampler then waits `backoff_s` (None: `rollout.retry_backoff_s`), so
    that a worker does not go straight on to its next claim."""

    def __init__(
        self,
        cfg: Config,
        host: AgentHost,
        tokenizer,
        critic,
        stop_event: threading.Event,
        on_down: Callable[[str], None] = lambda kind: None,
        group_size: int | None = None,
        backoff_s: float | None = None,
        distill: Distillation | None = None,
    ):
        self.cfg, self.host, self.tokenizer, self.critic = cfg, host, tokenizer, critic
        self.distill = distill
        self.stop_event, self.on_down = stop_event, on_down
        self.group_size = group_size or cfg.num_return_sequences_in_group
        self.backoff_s = cfg.rollout.retry_backoff_s if backoff_s is None else backoff_s

    def sample(self, prompts: list[Prompt], score_retries: int | None = None) -> Sampled | Failed:
        """The batch, or `Failed`: a prompt at fault (as in a single-turn batch), or no generation
        server or agent service answered, or the critic stayed away (the prompts stay pending).
        `score_retries` means nothing here: the agent scores its own sessions."""
        t0 = time.perf_counter()
        # a prompt refed after a push asks for that version (min_version), as in a single-turn batch
        items = [(p.record, p.uid, p.group_size or self.group_size) for p in prompts]
        try:
            episodes = self.host.run(session_work(items), min_version=max(p.min_version for p in prompts))
            groups = groups_of(items, episodes)
        except Outage as e:
            self.on_down("agent_service" if isinstance(e, AgentServiceDown) else "no_generation_server")
            log.warning("%d prompts left pending: %s", len(prompts), e)
            self.stop_event.wait(self.backoff_s)
            return Failed(Then.LEAVE_PENDING, str(e), e)
        except ValueError as e:  # a prompt at fault, as in a single-turn batch (outcomes.py's ValueError row)
            return Failed(Then.DEAD_LETTER, str(e), e)
        t1 = time.perf_counter()
        out: list[SampleGroup | Rejected] = []
        for group in groups:
            if isinstance(group, AgentFailed):
                out.append(Rejected(str(group)))
                continue
            too_long = too_long_for_training(self.cfg, group)
            if too_long:
                out.append(Rejected(too_long))
                continue
            if self.critic is not None:
                try:
                    value_group(group, self.critic, self.tokenizer)
                except DependencyUnavailable as e:
                    log.error("prompt %s left pending: %s", group.uid, e)
                    return Failed(Then.LEAVE_PENDING, str(e), e)
            out.append(group)
        metrics = self._metrics(out, t0, t1)
        kept = [g for g in out if not isinstance(g, Rejected)]
        if self.distill is not None and kept:
            try:
                metrics.update(self.distill.read(kept))
            except DependencyUnavailable as e:
                log.error("%d prompts left pending: %s", len(prompts), e)
                return Failed(Then.LEAVE_PENDING, str(e), e)
        return Sampled(out, metrics, self._rows(items, episodes))

    def _metrics(self, out: list, t0: float, t1: float) -> dict:
        kept = [g for g in out if not isinstance(g, Rejected)]
        return {
            "time/generate_s": t1 - t0,
            "time/score_s": 0.0,
            "time/values_s": time.perf_counter() - t1,
            "rollout/tokens": sum(trained_tokens(g) for g in kept),
            "rollout/prompts_left_out": len(out) - len(kept),
            # the agent's reward (`agent`) and its parts (a verifiers rubric's functions), as a rule's
            **component_means([s for g in kept for s in g.scores]),
        }

    def _rows(self, items: list, episodes: list[Episode]) -> list[dict]:
        records = [(record, j) for record, _, n in items for j in range(n)]
        return [session_row(record, j, e, self.tokenizer) for (record, j), e in zip(records, episodes)]

    def close(self) -> None:
        """The endpoint, once no batch is sampled any more (the sessions in flight finish first)."""
        self.host.close()


def too_long_for_training(cfg: Config, group: SampleGroup) -> str | None:
    """Why the learner and the critic cannot take `group` (a prompt or a conversation longer than
    they take), or None."""
    longest = max(len(c.token_ids) for c in group.completions)
    if len(group.prompt_ids) <= cfg.prompt_length and longest <= cfg.response_length:
        return None
    return (
        f"agent sessions of prompt {group.uid}: a prompt of {len(group.prompt_ids)} tokens and a "
        f"conversation of {longest} after it, more than prompt_length={cfg.prompt_length} / "
        f"response_length={cfg.response_length} (the learner and the critic take no more)"
    )


def value_group(group: SampleGroup, critic, tokenizer) -> None:
    """The critic's values of each session's tokens, into `group.values` (training/sampling.py's
    `values_of`, as a single-turn batch is valued)."""
    responses = [c.token_ids for c in group.completions]
    group.values = values_of(critic, tokenizer, [group.prompt_ids] * len(responses), responses)


def trained_tokens(group: SampleGroup) -> int:
    """The tokens of a group's sessions that the loss counts (the policy's, not the environment's)."""
    return sum(int(sum(c.loss_mask or [1] * len(c.token_ids))) for c in group.completions)


def session_row(record: PromptRecord, sample: int, e: Episode, tokenizer) -> dict:
    """A session as an eval row (training/sampling.py's shape) with its conversation (`transcript`)
    and the number of the policy's `turns`. A session whose agent failed is a row with reward 0 and
    its `error` (counted by `summarize` as `components["failed"]`): an eval scores what the policy
    does, failures included; one whose reward could not be had (`Unscored`) is such a row marked
    `"unscored": true`, so that its 0 is not read as a reward."""
    runs = transcript(e.trajectory, tokenizer) if e.trajectory is not None else []
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
