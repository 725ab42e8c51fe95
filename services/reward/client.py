"""gRPC client of the reward server with the `Scorer` interface; `HeldOut(client)` is the same
server as the held-out evaluation's scorer (`reward.eval_rules` on the server, when set)."""
from __future__ import annotations

import json
from typing import Sequence

from ..common.rpc.gen import reward_pb2 as rpb, reward_pb2_grpc
from ..common.rpc.server import RPCClient
from ..common.types import RewardSample, ScoreResult


class RewardClient(RPCClient):
    stub_class = reward_pb2_grpc.RewardStub

    def score(self, samples: Sequence[RewardSample], held_out: bool = False) -> list[ScoreResult]:
        """Rewards of `samples`; `held_out` asks for the held-out evaluation's reward."""
        req = rpb.ScoreRequest(held_out=held_out)
        for s in samples:
            m = rpb.RewardSample(prompt=s.prompt, response=s.response,
                                 metadata_json=json.dumps(s.metadata) if s.metadata else "")
            if s.label is not None:
                m.label = s.label
            req.samples.append(m)
        resp = self.stub.Score(req, timeout=self.timeout, metadata=self.metadata)
        return [ScoreResult(sc.reward, dict(sc.components)) for sc in resp.scores]


class HeldOut:
    """A `Scorer` that scores through `client` (a `RewardClient`, or a `Retrying` one) with the
    held-out evaluation's reward."""

    def __init__(self, client):
        self.client = client

    def score(self, samples: Sequence[RewardSample]) -> list[ScoreResult]:
        return self.client.score(samples, held_out=True)
