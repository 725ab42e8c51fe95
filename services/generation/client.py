"""A gRPC client of the generation server with the backend's own interface: `generate` returns a
`GenerationResult`, `update_weights` pushes a state dict as a versioned, checksummed stream."""
from __future__ import annotations

from typing import Mapping, Sequence

import torch

from ..common.rpc.codec import weight_chunks
from ..common.rpc.gen import generation_pb2 as gpb, generation_pb2_grpc
from ..common.rpc.server import RPCClient
from ..common.types import Completion, GenerationResult, SamplingParams


class GenerationClient(RPCClient):
    stub_class = generation_pb2_grpc.GenerationStub

    @staticmethod
    def params_to_proto(p: SamplingParams) -> gpb.SamplingParams:
        m = gpb.SamplingParams(n=p.n, temperature=p.temperature, top_p=p.top_p, top_k=p.top_k,
                               max_new_tokens=p.max_new_tokens, stop_token_ids=list(p.stop_token_ids))
        if p.seed is not None:
            m.seed = p.seed
        return m

    def generate(self, prompts: Sequence[Sequence[int] | str], params: SamplingParams) -> GenerationResult:
        req = gpb.GenerateRequest(params=self.params_to_proto(params))
        for p in prompts:
            req.prompts.append(gpb.Prompt(text=p) if isinstance(p, str) else gpb.Prompt(tokens=gpb.TokenIds(ids=list(p))))
        resp = self.stub.Generate(req, timeout=self.timeout, metadata=self.metadata)
        comps = [[Completion(list(c.token_ids), list(c.log_probs), c.finish_reason) for c in r.completions]
                 for r in resp.results]
        return GenerationResult(comps, resp.policy_version, sum(len(c.token_ids) for cs in comps for c in cs), 0.0)

    def update_weights(self, state_dict: Mapping[str, torch.Tensor], version: int, chunk_bytes: int = 4 << 20,
                       run_id: str = "", epoch: int = 0):
        """Push `state_dict` as policy `version`; a server in a distributed run accepts it only
        from the run's learner: (run_id, epoch) as published in the replay registry."""
        return self.stub.PushWeights(weight_chunks(state_dict, version, chunk_bytes, run_id=run_id, epoch=epoch),
                                     timeout=self.timeout, metadata=self.metadata)

    def info(self) -> gpb.GenerationInfo:
        return self.stub.GetInfo(gpb.InfoRequest(), timeout=self.timeout, metadata=self.metadata)

    @property
    def version(self) -> int:
        return int(self.info().policy_version)
