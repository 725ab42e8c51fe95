"""Pulling a policy version from the learner (a generation server that starts late, or finds it
missed a push): the learner's gRPC client, its PullWeights (a chunk stream, applied by
receiver.py) and, for operators and tests, its Status. It lives here, beside the push, so that the
generation service reaches the learner's weights without importing the learner."""

from __future__ import annotations

from typing import Iterator

from ..common.rpc.client import RPCClient
from ..common.rpc.gen import common_pb2, learner_pb2_grpc
from ..common.rpc.gen import learner_pb2 as lpb


class LearnerClient(RPCClient):
    stub_class = learner_pb2_grpc.LearnerStub

    def pull_weights(self, have_policy_version: int) -> Iterator[common_pb2.WeightChunk]:
        """The current policy as a chunk stream; empty when `have_policy_version` is already current."""
        return self.stub.PullWeights(
            lpb.PullWeightsRequest(have_policy_version=have_policy_version),
            timeout=self.timeout,
            metadata=self.metadata,
        )

    def status(self) -> lpb.LearnerStatus:
        return self.stub.Status(lpb.StatusRequest(), timeout=self.timeout, metadata=self.metadata)
