"""The critic server: Values, Train (one optimiser step), Save, Load.

    rlhf serve critic -c configs/tiny-cpu.yaml
"""
from __future__ import annotations

from pathlib import Path

from ..common.compute import ComputeThread
from ..common.rpc.codec import BadRequest, batch_from_proto, tensor_from_proto, tensor_to_proto
from ..common.rpc.gen import critic_pb2 as cpb, critic_pb2_grpc
from ..common.lifecycle import GrpcService
from ..common.rpc.server import RPCServer


class CriticServicer(critic_pb2_grpc.CriticServicer):
    def __init__(self, critic, cfg, metrics=None):
        self.critic, self.cfg, self.metrics = critic, cfg, metrics
        self.vocab_size = critic.model.backbone.config.vocab_size
        self.compute = ComputeThread("critic")  # one step at a time, in order; values wait for it

    def _batch(self, msg):
        b = batch_from_proto(msg, self.vocab_size, self.cfg.prompt_length, self.cfg.response_length)
        if self.metrics:
            self.metrics.batch_size.labels(self.metrics.service, "sequences").observe(b.input_ids.shape[0])
        return b

    def Values(self, request, context):
        batch = self._batch(request.batch)
        values = self.compute.run(self.critic.values, batch)
        return cpb.ValuesResponse(values=tensor_to_proto(values.float()))

    def Train(self, request, context):
        batch = self._batch(request.batch)
        shape = tuple(batch.response_mask.shape)
        returns = tensor_from_proto(request.returns, "returns", ndim=2).float()
        old = tensor_from_proto(request.old_values, "old_values", ndim=2).float()
        for name, t in (("returns", returns), ("old_values", old)):
            if tuple(t.shape) != shape:
                raise BadRequest(f"{name}: shape {list(t.shape)}, expected {list(shape)} (the response_mask's)")
        metrics = self.compute.run(self.critic.train_step, batch, returns, old)
        return cpb.TrainResponse(metrics=metrics, step=self.critic.steps)

    def _path(self, path: str) -> Path:
        if not path:
            raise BadRequest("path: empty")
        return Path(path)

    def Save(self, request, context):
        p = self._path(request.path)
        self.compute.run(self.critic.save, p)
        return cpb.CheckpointResponse(path=str(p), step=self.critic.steps)

    def Load(self, request, context):
        p = self._path(request.path)
        if not (p / "value_head.safetensors").exists():
            raise BadRequest(f"path: no critic checkpoint in {p} (value_head.safetensors missing)")
        self.compute.run(self.critic.load, p)
        return cpb.CheckpointResponse(path=str(p), step=self.critic.steps)


def serve(cfg, critic=None, port: int | None = None, metrics_port: int | None = -1) -> GrpcService:
    """The critic service: loads the value model `critic` describes (or uses `critic`) and serves
    gRPC. Ports default to `rpc.critic`'s (metrics_port None = off)."""
    def build():
        c = critic
        if c is None:
            from .critic import Critic
            c = Critic.from_config(cfg)
        ep = cfg.rpc.critic
        server = RPCServer("critic", cfg.rpc, ep.port if port is None else port,
                           ep.metrics_port if metrics_port == -1 else metrics_port, host=ep.host)
        servicer = CriticServicer(c, cfg, server.metrics)
        critic_pb2_grpc.add_CriticServicer_to_server(servicer, server.grpc)
        server.start()
        server.set_ready(True)
        return server, servicer, [servicer.compute.close]
    return GrpcService("critic", build)
