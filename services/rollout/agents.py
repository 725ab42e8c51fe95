"""Sampling when `rollout.agent` (or `environment`, `agent_url`) is set, for a rollout worker and
for `train --local` alike (sampling.py's `GroupSampler`): each sample of a group is a session of
the user's agent function against an OpenAI-compatible endpoint of the sampler's own
(agents/host.py: `AgentHost`, over a pool of generation servers, or the backend in the process,
sampling with the training distribution), and its token-exact trajectory (the environment's
tokens masked out of the loss) is the sample, with the agent's reward. Every session of a batch
runs at once.

A prompt whose sessions failed (`AgentFailed`), or ran longer than the learner takes, comes back
`Rejected` (a worker dead-letters it alone and appends the others); a session that found no
generation server or agent service (`Outage`) gives the batch up for now (left pending).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING, Callable

from ..agents.host import AgentFailed, AgentHost, AgentServiceDown, Outage
from ..common.rpc.retry import DependencyUnavailable
from ..training.sampling import values_of
from .outcomes import Failed, Then, classify, message
from .sampling import Prompt, Rejected, Sampled

if TYPE_CHECKING:
    from ..common.config import Config
    from ..common.types import SampleGroup

log = logging.getLogger(__name__)


class AgentSampler:
    """Prompts -> groups of the agent's sessions on `host`, with the critic's values when there is
    one. `on_down(kind)`: counts a batch given up for now, by what was down
    ("no_generation_server", "agent_service")."""

    def __init__(
        self,
        cfg: Config,
        host: AgentHost,
        tokenizer,
        critic,
        stop_event: threading.Event,
        on_down: Callable[[str], None] = lambda kind: None,
    ):
        self.cfg, self.host, self.tokenizer, self.critic = cfg, host, tokenizer, critic
        self.stop_event, self.on_down = stop_event, on_down

    def sample(self, prompts: list[Prompt], score_retries: int | None = None) -> Sampled | Failed:
        """The batch, or `Failed`: a prompt at fault (as in a single-turn batch), or no generation
        server or agent service answered, or the critic stayed away (the prompts stay pending).
        `score_retries` means nothing here: the agent scores its own sessions."""
        t0 = time.perf_counter()
        size = self.cfg.num_return_sequences_in_group
        try:
            # a prompt refed after a push asks for that version (min_version), as in a single-turn batch
            items = [(p.record, p.uid, p.group_size or size) for p in prompts]
            groups = self.host.groups(items, min_version=max(p.min_version for p in prompts))
        except Outage as e:
            self.on_down("agent_service" if isinstance(e, AgentServiceDown) else "no_generation_server")
            log.warning("%d prompts left pending: %s", len(prompts), e)
            self.stop_event.wait(self.cfg.rollout.retry_backoff_s)  # not straight on to the next claim
            return Failed(Then.LEAVE_PENDING, message(e))
        except ValueError as e:  # a prompt at fault, as in a single-turn batch
            row = classify(e)
            if row is None:
                raise
            return Failed(row.then, message(e))
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
                    return Failed(Then.LEAVE_PENDING)
            out.append(group)
        kept = [g for g in out if not isinstance(g, Rejected)]
        scores = [s for g in kept for s in g.scores]
        metrics = {
            "time/generate_s": t1 - t0,
            "time/score_s": 0.0,
            "time/values_s": time.perf_counter() - t1,
            "rollout/tokens": sum(trained_tokens(g) for g in kept),
            "rollout/prompts_left_out": len(out) - len(kept),
            **{  # the agent's reward (`agent`) and its parts (a verifiers rubric's functions), as a rule's
                f"reward/{name}": sum(s.components.get(name, 0.0) for s in scores) / len(scores)
                for name in dict.fromkeys(k for s in scores for k in s.components)
            },
        }
        return Sampled(out, metrics)

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
