"""gRPC client of the reward server with the `Scorer` interface."""
from __future__ import annotations

import json
from typing import Sequence

from ..common.rpc.gen import reward_pb2 as rpb, reward_pb2_grpc
from ..common.rpc.server import call_metadata, client_channel
from .scorer import RewardSample, ScoreResult


class RewardClient:
    def __init__(self, address: str, rpc_cfg, timeout_s: float | None = None):
        self.channel = client_channel(address, rpc_cfg)
        self.stub = reward_pb2_grpc.RewardStub(self.channel)
        self.metadata = call_metadata(rpc_cfg)
        self.timeout = timeout_s or rpc_cfg.timeout_s

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

    def close(self) -> None:
        self.channel.close()
