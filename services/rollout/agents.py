"""A rollout worker's samples when `rollout.agent` is set: each sample of a group is a session of
the user's agent function against the worker's own OpenAI-compatible endpoint (agents/host.py:
`AgentHost`, over the worker's pool of generation servers, sampling with the training
distribution), and its token-exact trajectory (the environment's tokens masked out of the loss)
is the sample, with the agent's reward. Every session of a claimed batch runs at once.

A prompt whose sessions failed (`AgentFailed`) comes back `Rejected`: the worker dead-letters it
alone and appends the others; a session that found no generation server or agent service
(`Outage`) leaves the batch pending.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..agents.host import AgentFailed, AgentHost, AgentServiceDown, Outage
from ..common.modeling import build_token_batch
from ..common.replay.records import task_record
from ..common.rpc.retry import DependencyUnavailable

if TYPE_CHECKING:
    from ..common.config import Config
    from ..common.types import SampleGroup

log = logging.getLogger(__name__)


@dataclass
class Rejected:
    """A claimed prompt whose sessions failed (`AgentFailed`): the worker dead-letters it with
    `reason` and appends the others' groups."""

    reason: str


class AgentSampling:
    """Claimed prompts -> groups of agent sessions, with the critic's values when there is one."""

    def __init__(self, cfg: Config, host: AgentHost, tokenizer, critic, stop_event: threading.Event, on_down):
        """`on_down(kind)`: counts a batch left pending, by what was down ("no_generation_server",
        "agent_service")."""
        self.cfg, self.host, self.tokenizer, self.critic = cfg, host, tokenizer, critic
        self.stop_event, self.on_down = stop_event, on_down

    def sample(self, tasks: list) -> list | None:
        """Per task (group, "agent", metrics), or `Rejected` for one whose sessions failed; None =
        give up for now (no generation server or agent service answered, or the critic stayed
        away: the prompts stay pending)."""
        t0 = time.perf_counter()
        size = self.cfg.num_return_sequences_in_group
        try:
            # a prompt refed after a push asks for that version (min_version), as in a single-turn batch
            items = [(task_record(t), t.uid, t.group_size or size) for t in tasks]
            groups = self.host.groups(items, min_version=max(t.min_version for t in tasks))
        except Outage as e:
            self.on_down("agent_service" if isinstance(e, AgentServiceDown) else "no_generation_server")
            log.warning("%d prompts left pending: %s", len(tasks), e)
            self.stop_event.wait(self.cfg.rollout.retry_backoff_s)  # not straight on to the next claim
            return None
        secs = (time.perf_counter() - t0) / len(tasks)
        out: list = []
        for t, group in zip(tasks, groups):
            if isinstance(group, AgentFailed):
                out.append(Rejected(str(group)))
                continue
            too_long = too_long_for_training(self.cfg, group)
            if too_long:
                out.append(Rejected(too_long))
                continue
            t1 = time.perf_counter()
            if self.critic is not None:
                try:
                    value_group(group, self.critic, self.tokenizer)
                except DependencyUnavailable as e:
                    log.error("prompt %s left pending: %s", t.uid, e)
                    return None
            metrics = {
                "time/generate_s": secs,
                "time/score_s": 0.0,
                "time/values_s": time.perf_counter() - t1,
                "rollout/tokens": trained_tokens(group),
            }
            out.append((group, "agent", metrics))
        return out

    def close(self) -> None:
        """The endpoint, once the worker's loops have ended (the sessions in flight finish first)."""
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
    """The critic's values of each session's tokens, into `group.values`."""
    responses = [c.token_ids for c in group.completions]
    v = critic.values(build_token_batch([group.prompt_ids] * len(responses), responses, tokenizer.pad_token_id))
    group.values = [v[i, : len(r)].tolist() for i, r in enumerate(responses)]


def trained_tokens(group: SampleGroup) -> int:
    """The tokens of a group's sessions that the loss counts (the policy's, not the environment's)."""
    return sum(int(sum(c.loss_mask or [1] * len(c.token_ids))) for c in group.completions)
