"""gRPC client of the reward server with the `Scorer` interface."""
from __future__ import annotations

import json
from typing import Sequence

from ..common.rpc.gen import reward_pb2 as rpb, reward_pb2_grpc
from ..common.rpc.server import RPCClient
from ..common.types import RewardSample, ScoreResult


class RewardClient(RPCClient):
    stub_class = reward_pb2_grpc.RewardStub

    def score(self, samples: Sequence[RewardSample]) -> list[ScoreResult]:
        req = rpb.ScoreRequest()
        for s in samples:
            m = rpb.RewardSample(prompt=s.prompt, response=s.response,
                                 metadata_json=json.dumps(s.metadata) if s.metadata else "")
            if s.label is not None:
                m.label = s.label
            req.samples.append(m)
        resp = self.stub.Score(req, timeout=self.timeout, metadata=self.metadata)
        return [ScoreResult(sc.reward, dict(sc.components)) for sc in resp.scores]
