"""A gRPC client of the generation server with the backend's own interface: `generate` returns a
`GenerationResult`, `update_weights` pushes a state dict as a versioned, checksummed stream;
`load_shared` points a co-located server at a version in shared memory. `ServerPool`: which live
generation server to call."""

from __future__ import annotations

import itertools
import threading
import time
from typing import TYPE_CHECKING, Callable, Iterable, Mapping, Sequence

import grpc
import torch

from ..common.rpc.client import RPCClient
from ..common.rpc.gen import common_pb2, generation_pb2_grpc
from ..common.rpc.gen import generation_pb2 as gpb
from ..common.types import Completion, GenerationResult, SamplingParams
from ..weights.protocol import CHUNK_BYTES, chunk_bytes
from ..weights.stream import encode_weights

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
        resp = self.stub.Generate(req, timeout=timeout or self.timeout, metadata=metadata)
        comps = [
            [Completion(list(c.token_ids), list(c.log_probs), c.finish_reason) for c in r.completions]
            for r in resp.results
        ]
        return GenerationResult(comps, resp.policy_version, sum(len(c.token_ids) for cs in comps for c in cs), 0.0)

    def update_weights(
        self,
        state_dict: Mapping[str, torch.Tensor],
        version: int,
        chunk_bytes: int = CHUNK_BYTES,
        run_id: str = "",
        epoch: int = 0,
    ):
        """Push `state_dict` as policy `version`; a server in a distributed run accepts it only
        from the run's learner: (run_id, epoch) as published in the replay registry."""
        return self.push_encoded(
            encode_weights(state_dict, version, min(chunk_bytes, self.max_chunk_bytes), run_id=run_id, epoch=epoch)
        )

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

    def info(self, timeout: float | None = None) -> gpb.GenerationInfo:
        return self.stub.GetInfo(gpb.InfoRequest(), timeout=timeout or self.timeout, metadata=self.metadata)

    @property
    def version(self) -> int:
        return int(self.info().policy_version)


class ServerPool:
    """The one answer to "which generation server do I call?", for the rollout workers, the
    learner's eval and its weight pushes: the live servers of the registry (`live()`: address ->
    its entry, re-read when older than `refresh_s`), one picked round robin preferring those at a
    policy version, a server that just failed avoided for a while, and one cached client per
    address.

    `clock` (monotonic seconds) times the avoidance; a test may move it."""

    def __init__(
        self,
        live: Callable[[], dict[str, dict]],
        rpc_cfg: RPCConfig,
        refresh_s: float,
        clock: Callable[[], float] = time.monotonic,
    ):
        self._read, self.rpc_cfg, self.refresh_s, self.clock = live, rpc_cfg, refresh_s, clock
        self._servers: dict[str, dict] = {}
        self._read_at: float | None = None  # when the registry was last read (`clock`)
        self._avoided: dict[str, float] = {}  # address -> until when (`clock`)
        self._clients: dict[str, GenerationClient] = {}
        self._turn = itertools.count()
        self._lock = threading.Lock()

    @classmethod
    def fixed(cls, address: str, rpc_cfg: RPCConfig) -> "ServerPool":
        """A pool of the one server at `address` (no registry: a configured server, an eval's own)."""
        return cls(lambda: {address: {}}, rpc_cfg, refresh_s=3600.0)

    def live(self, fresh: bool = False) -> dict[str, dict]:
        """The registry's live generation servers (address -> entry, with its `version`): read
        again when `fresh` or older than `refresh_s`."""
        with self._lock:
            return dict(self._live(fresh))

    def _live(self, fresh: bool) -> dict[str, dict]:
        now = self.clock()
        if fresh or self._read_at is None or now - self._read_at > self.refresh_s:
            self._servers, self._read_at = self._read(), now
        return self._servers

    def pick(self, version: int = 0, only_at_version: bool = False) -> str | None:
        """A live server not avoided now, round robin: one the registry shows at `version` or
        newer if any (re-reading the registry before settling for an older one), else, unless
        `only_at_version`, any (its answer's version is the final word). None when there is none."""
        with self._lock:
            now = self.clock()
            for fresh in (False, True):
                servers = self._live(fresh)
                usable = sorted(a for a in servers if self._avoided.get(a, 0) <= now)
                current = [a for a in usable if servers[a].get("version", 0) >= version]
                if current:
                    break
            candidates = current if (current or only_at_version) else usable
            return candidates[next(self._turn) % len(candidates)] if candidates else None

    def avoid(self, address: str, seconds: float) -> None:
        """Leave `address` out of `pick` for `seconds`; the registry is read again at the next pick."""
        with self._lock:
            self._avoided[address] = self.clock() + seconds
            self._read_at = None

    def avoided(self) -> dict[str, float]:
        """The servers `pick` leaves out now: address -> seconds left."""
        with self._lock:
            now = self.clock()
            return {a: until - now for a, until in self._avoided.items() if until > now}

    def client(self, address: str) -> GenerationClient:
        with self._lock:
            if address not in self._clients:
                self._clients[address] = GenerationClient(address, self.rpc_cfg)
            return self._clients[address]

    def wait_for(
        self, version: int, timeout_s: float | None, stop: threading.Event, on_tick: Callable[[], None] = lambda: None
    ) -> str | None:
        """A server at `version` or newer (`pick(version, only_at_version=True)`), waiting for
        one up to `timeout_s` (None: until `stop` is set), calling `on_tick` at each look; None
        when the time is up or `stop` is set."""
        deadline = None if timeout_s is None else self.clock() + timeout_s
        while True:
            address = self.pick(version, only_at_version=True)
            if address is not None:
                return address
            if (deadline is not None and self.clock() > deadline) or stop.is_set():
                return None
            on_tick()
            stop.wait(0.2)  # the next pick reads the registry again (none was at the version)

    def close(self) -> None:
        with self._lock:
            clients, self._clients = list(self._clients.values()), {}
        for c in clients:
            c.close()
