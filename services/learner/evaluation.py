"""The learner service's held-out eval (`ServerEval`): through a generation server that serves
the current version, scored by the reward server; a server that fails it is skipped for a while
and another (or the same, restarted) one is used."""

from __future__ import annotations

import contextlib
import logging
from typing import TYPE_CHECKING, Callable

import grpc

from ..agents.evaluate import held_out_evaluator
from ..agents.host import AgentServiceDown, Outage
from ..common.lifecycle import RunFailed
from ..common.rpc.errors import Reason, reason_of
from ..common.rpc.retry import DependencyUnavailable
from ..common.servers import Fault, ServerPool, Tries
from ..common.types import SamplingParams
from ..generation.client import generation_clients
from ..reward.client import HeldOut, RewardClient
from ..training.loop import Phase

if TYPE_CHECKING:
    from ..common.config import Config

log = logging.getLogger(__name__)


class ServerEval:
    """The held-out eval of the `held_out` prompts on the policy a generation server serves, in
    the phase "evaluating" (then back to the phase it interrupted). `logger`: where its warnings
    go (the entry point's, so its lines name it)."""

    def __init__(
        self,
        cfg: Config,
        tokenizer,
        held_out: list,
        reward: RewardClient,
        phase: Phase,
        logger: logging.Logger | None = None,
    ):
        self.cfg, self.tokenizer, self.held_out, self.reward, self.phase = cfg, tokenizer, held_out, reward, phase
        self.params = SamplingParams.for_eval(cfg)
        self.log = logger or log

    def evaluate(self, tries: Tries, on_server: Callable[[str], dict]) -> dict:
        """`on_server(address)` on each server `tries` gives until one answers; one that fails is
        skipped as `tries`' policy says. An agent's eval that failed for its agent service's sake
        skips none."""
        phase = self.phase.name
        self.phase.enter("evaluating")
        for address in tries:
            if address is None:
                break
            try:
                out = on_server(address)
            except Outage as e:
                self.log.warning("agent eval on %s failed (%s); trying again", address, e)
                tries.failed(address, Fault.ELSEWHERE if isinstance(e, AgentServiceDown) else Fault.FAILED)
                continue
            except grpc.RpcError as e:
                if e.code() == grpc.StatusCode.INVALID_ARGUMENT:
                    raise
                if reason_of(e) is Reason.REWARD_FUNCTION_FAILED:  # the user's reward function raised
                    raise RunFailed(e.details()) from None
                self.log.warning("eval on %s failed (%s: %s); skipping it", address, e.code().name, e.details())
                tries.failed(address, Fault.FAILED)
                continue
            self.phase.enter(phase)
            return out
        raise DependencyUnavailable(f"no generation server serves policy version {tries.policy_version} for the eval")

    def on_server(self, servers: ServerPool, address: str) -> dict:
        """The held-out eval of the policy the server at `address` (of `servers`) serves: one reply
        per prompt scored by the reward server's held-out reward (and the training reward besides a
        gold one), or an agent's sessions, every turn on that server, through an endpoint of the
        learner's own."""
        rpc = self.cfg.rpc
        with held_out_evaluator(
            self.cfg,
            self.tokenizer,
            self.params,
            backend=servers.client(address),
            scorer=HeldOut(self.reward),
            proxy=self.reward if self.cfg.reward.eval_rules is not None else None,
            servers=lambda: contextlib.closing(ServerPool.fixed(address, generation_clients(rpc))),
        ) as evaluator:
            return evaluator.metrics(self.held_out)
