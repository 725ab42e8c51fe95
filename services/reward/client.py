"""gRPC client of the reward server with the `Scorer` interface; `HeldOut(client)` is the same
server as the held-out evaluation's scorer (`reward.eval_rules` on the server, when set). A batch
the user's reward API failed (`Reason.REWARD_API_FAILED`) raises `RewardAPIFailure`, told apart
from a reward server that is unavailable itself."""

from __future__ import annotations

import json
from typing import Sequence

import grpc

from ..common.rpc.client import RPCClient
from ..common.rpc.errors import Reason, reason_of
from ..common.rpc.gen import reward_pb2 as rpb
from ..common.rpc.gen import reward_pb2_grpc
from ..common.types import RewardSample, ScoreResult


class RewardAPIFailure(RuntimeError):
    """The reward server's scorer could not get this batch's rewards from the user's reward API
    (after its retries), while the API was not known to be down: scoring the batch again later
    may work. Not a gRPC error: its caller decides."""


class RewardClient(RPCClient):
    stub_class = reward_pb2_grpc.RewardStub

    def score(self, samples: Sequence[RewardSample], held_out: bool = False) -> list[ScoreResult]:
        """Rewards of `samples`; `held_out` asks for the held-out evaluation's reward. A batch the
        reward API failed raises `RewardAPIFailure` (with `RideThrough`, once it stops repeating
        it: the rollout worker's says `final=[Reason.REWARD_API_FAILED]`)."""
        req = rpb.ScoreRequest(held_out=held_out)
        for s in samples:
            m = rpb.RewardSample(
                prompt=s.prompt, response=s.response, metadata_json=json.dumps(s.metadata) if s.metadata else ""
            )
            if s.label is not None:
                m.label = s.label
            req.samples.append(m)
        try:
            resp = self.stub.Score(req, timeout=self.timeout, metadata=self.metadata)
        except grpc.RpcError as e:
            if reason_of(e) is Reason.REWARD_API_FAILED:
                raise RewardAPIFailure(e.details()) from None
            raise
        return [ScoreResult(sc.reward, dict(sc.components)) for sc in resp.scores]


class HeldOut:
    """A `Scorer` that scores through `client` (a `RewardClient`) with the held-out evaluation's reward."""

    def __init__(self, client):
        self.client = client

    def score(self, samples: Sequence[RewardSample]) -> list[ScoreResult]:
        return self.client.score(samples, held_out=True)
