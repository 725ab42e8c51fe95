"""A gRPC client of the generation server with the backend's own interface: `generate` returns a
`GenerationResult`, `update_weights` pushes a state dict as a versioned, checksummed stream;
`score_tokens` has given tokens scored under the version served (ScoreTokens);
`load_shared` points a co-located server at a version in shared memory. `generation_clients`: how
a `ServerPool` (common/servers.py: which live generation server to call) reaches one."""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Iterable, Mapping, Sequence

import grpc
import torch

from ..common.rpc.client import Abandoned, Cancel, RPCClient
from ..common.rpc.gen import common_pb2, generation_pb2_grpc
from ..common.rpc.gen import generation_pb2 as gpb
from ..common.types import Completion, GenerationResult, SamplingParams, TokenScores
from ..weights.protocol import CHUNK_BYTES, PushKind, chunk_bytes
from ..weights.stream import StreamSpec, encode_weights

if TYPE_CHECKING:
    from ..common.config_sections import RPCConfig

# gRPC metadata of a Generate call: the caller's idempotency key (the same on its retries)
IDEMPOTENCY_KEY = "x-idempotency-key"


class GenerationClient(RPCClient):
    stub_class = generation_pb2_grpc.GenerationStub
    _push_raw = None

    def __init__(
        self,
        address: str,
        rpc_cfg: RPCConfig,
        timeout_s: float | None = None,
        interceptors: Sequence[grpc.UnaryUnaryClientInterceptor] = (),
    ):
        super().__init__(address, rpc_cfg, timeout_s, interceptors)
        self.max_chunk_bytes = chunk_bytes(rpc_cfg.max_message_mb)  # room for the piece's metadata

    @staticmethod
    def params_to_proto(p: SamplingParams) -> gpb.SamplingParams:
        m = gpb.SamplingParams(
            n=p.n,
            temperature=p.temperature,
            top_p=p.top_p,
            top_k=p.top_k,
            max_new_tokens=p.max_new_tokens,
            stop_token_ids=list(p.stop_token_ids),
        )
        if p.seed is not None:
            m.seed = p.seed
        return m

    def generate(
        self,
        prompts: Sequence[Sequence[int] | str],
        params: SamplingParams,
        timeout: float | None = None,
        key: str | None = None,
        first_prompt_tokens: Sequence[int] | None = None,
        cancel: Cancel | None = None,
    ) -> GenerationResult:
        """`timeout`: this call's deadline in seconds (default the client's). `key`: an idempotency
        key; a retry that sends the same request with the same key while the server still works on
        the first call waits for that work instead of starting a second copy. `first_prompt_tokens`:
        per prompt, for a later turn of a conversation, how many of its tokens are its first
        prompt (0: all; generation.proto's `Prompt.first_prompt_tokens`)."""
        req = gpb.GenerateRequest(params=self.params_to_proto(params))
        firsts = list(first_prompt_tokens or [0] * len(prompts))
        for p, first in zip(prompts, firsts):
            req.prompts.append(
                gpb.Prompt(text=p, first_prompt_tokens=first)
                if isinstance(p, str)
                else gpb.Prompt(tokens=gpb.TokenIds(ids=list(p)), first_prompt_tokens=first)
            )
        metadata = self.metadata + ((IDEMPOTENCY_KEY, key),) if key else self.metadata
        if cancel is None:
            resp = self.stub.Generate(req, timeout=timeout or self.timeout, metadata=metadata)
        else:
            cancel.check()
            call = self.stub.Generate.future(req, timeout=timeout or self.timeout, metadata=metadata)
            cancel.bind(call.cancel)
            try:
                resp = call.result()
            except (grpc.FutureCancelledError, grpc.RpcError):
                if cancel.is_set:
                    raise Abandoned("the caller went away; its Generate was cancelled") from None
                raise
        comps = [
            [
                Completion(list(c.token_ids), list(c.log_probs), c.finish_reason, None, list(c.token_versions) or None)
                for c in r.completions
            ]
            for r in resp.results
        ]
        return GenerationResult(comps, resp.policy_version, sum(len(c.token_ids) for cs in comps for c in cs), 0.0)

    def update_weights(
        self,
        state_dict: Mapping[str, torch.Tensor],
        policy_version: int,
        chunk_bytes: int = CHUNK_BYTES,
        run_id: str = "",
        epoch: int = 0,
        kind: PushKind = PushKind.FULL,
    ):
        """Push `state_dict` as `policy_version` (`kind` PARTIAL: some tensors, over what the server
        holds); a server in a distributed run accepts it only from the run's learner: (run_id,
        epoch) as published in the replay registry."""
        spec = StreamSpec(policy_version, min(chunk_bytes, self.max_chunk_bytes), kind, run_id=run_id, epoch=epoch)
        return self.push_encoded(encode_weights(state_dict, spec))

    def push_encoded(self, chunks: Iterable[bytes]):
        """PushWeights with a stream of already serialised `WeightChunk` messages (`encode_weights`):
        the bytes go on the wire as they are, so one encoding can serve many servers."""
        if self._push_raw is None:
            self._push_raw = self.channel.stream_unary(
                "/rlhf.v1.Generation/PushWeights",
                request_serializer=None,
                response_deserializer=common_pb2.PushWeightsResponse.FromString,
            )
        return self._push_raw(iter(chunks), timeout=self.timeout, metadata=self.metadata)

    def load_shared(self, request: gpb.SharedWeights, timeout: float | None = None):
        """LoadSharedWeights: load a version the learner wrote into the shared-memory directory it
        shares with this server (`services.weights.shm`)."""
        return self.stub.LoadSharedWeights(request, timeout=timeout or self.timeout, metadata=self.metadata)

    def score_tokens(
        self, sequences: Sequence[Sequence[int]], starts: Sequence[int], timeout: float | None = None
    ) -> TokenScores:
        """ScoreTokens: the log-prob (temperature 1) of each token of `sequences[i][starts[i]:]`
        given the tokens before it, under the version the server serves, which the answer names.
        A server that cannot score (vLLM, or one older than the method): UNIMPLEMENTED."""
        req = gpb.ScoreTokensRequest(
            sequences=[gpb.ScoredSequence(token_ids=list(ids), prompt_tokens=s) for ids, s in zip(sequences, starts)]
        )
        resp = self.stub.ScoreTokens(req, timeout=timeout or self.timeout, metadata=self.metadata)
        return TokenScores([list(r.log_probs) for r in resp.results], int(resp.policy_version), resp.dtype)

    def info(self, timeout: float | None = None) -> gpb.GenerationInfo:
        return self.stub.GetInfo(gpb.InfoRequest(), timeout=timeout or self.timeout, metadata=self.metadata)

    @property
    def policy_version(self) -> int:
        return int(self.info().policy_version)


def generation_clients(rpc_cfg: RPCConfig) -> Callable[[str], GenerationClient]:
    """How a `ServerPool` of generation servers (common/servers.py) reaches one: a client of its
    address with `rpc_cfg`."""
    return lambda address: GenerationClient(address, rpc_cfg)
