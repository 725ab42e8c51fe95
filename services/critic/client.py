"""gRPC client of the critic server with the in-process `Critic`'s interface."""

from __future__ import annotations

import torch

from ..common.rpc.client import RPCClient
from ..common.rpc.codec import batch_to_proto, tensor_from_proto, tensor_to_proto
from ..common.rpc.gen import critic_pb2 as cpb
from ..common.rpc.gen import critic_pb2_grpc
from ..common.token_batch import TokenBatch


class CriticClient(RPCClient):
    stub_class = critic_pb2_grpc.CriticStub

    def values(self, batch: TokenBatch) -> torch.Tensor:
        resp = self.stub.Values(
            cpb.ValuesRequest(batch=batch_to_proto(batch)), timeout=self.timeout, metadata=self.metadata
        )
        return tensor_from_proto(resp.values, "values")

    def train_step(self, batch: TokenBatch, returns: torch.Tensor, old_values: torch.Tensor) -> dict:
        req = cpb.TrainRequest(
            batch=batch_to_proto(batch),
            returns=tensor_to_proto(returns.float()),
            old_values=tensor_to_proto(old_values.float()),
        )
        return dict(self.stub.Train(req, timeout=self.timeout, metadata=self.metadata).metrics)

    def save(self, path: str) -> int:
        return self.stub.Save(cpb.CheckpointRequest(path=str(path)), timeout=self.timeout, metadata=self.metadata).step

    def load(self, path: str) -> int:
        return self.stub.Load(cpb.CheckpointRequest(path=str(path)), timeout=self.timeout, metadata=self.metadata).step

    def info(self) -> cpb.CriticInfo:
        """Step, checkpoint loaded from, incarnation and start time of the critic server."""
        return self.stub.Info(cpb.CriticInfoRequest(), timeout=self.timeout, metadata=self.metadata)


class OverlappedCritic:
    """A remote critic whose `train_step` returns a Future: the learner sends each mini-batch's
    value targets and goes on with the actor's update while the critic server trains. One
    sender thread keeps the steps in order."""

    def __init__(self, client: CriticClient):
        from concurrent.futures import ThreadPoolExecutor

        self.client = client
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="critic-train")

    def train_step(self, batch: TokenBatch, returns: torch.Tensor, old_values: torch.Tensor):
        return self._pool.submit(self.client.train_step, batch, returns, old_values)

    # the rest is the client's own
    def values(self, batch: TokenBatch) -> torch.Tensor:
        return self.client.values(batch)

    def save(self, path: str) -> int:
        return self.client.save(path)

    def load(self, path: str) -> int:
        return self.client.load(path)

    def info(self) -> cpb.CriticInfo:
        return self.client.info()

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        self.client.close()
