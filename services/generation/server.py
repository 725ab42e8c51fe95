"""The generation server: Generate (batched across concurrent callers), PushWeights (streamed,
checksummed, applied atomically between batches), LoadSharedWeights (the same, the bytes read from
a file the co-located learner wrote into shared memory), ScoreTokens (the log-probs of given tokens
under the version served, run between batches like a Generate: the learner's push parity check),
GetInfo.

A Generate whose caller has gone (its deadline passed, or it cancelled the call) stops costing
anything: queued, it never runs; running, its batch ends at the next decoding step once nobody
waits for any of the batch (hf; a batch shared with live calls runs on, the gone caller's rows
are discarded), or its requests are aborted in the engine (vllm). A retry carries the first
call's idempotency key (metadata `x-idempotency-key`, `GenerationClient.generate(key=...)`): while
that work is still running the retry waits for it instead of starting a second copy (`InFlight`).

    rlhf serve generation -c configs/tiny-cpu.yaml      (`serve(cfg)` below)
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Callable

import grpc

from ..common.lifecycle import GrpcService
from ..common.rpc.errors import Unimplemented
from ..common.rpc.gen import common_pb2, generation_pb2_grpc
from ..common.rpc.gen import generation_pb2 as gpb
from ..common.rpc.server import RPCServer
from ..common.types import GenerationBackend
from ..weights.decoder import WeightChunkDecoder
from ..weights.receiver import Applied, WeightReceiver, shm_probe
from ..weights.shm import Probe
from .batching import InFlight, make_batcher
from .generate_request import GenerateRequests, read_scored, scored_response, work_key
from .metrics import GenerationMetrics
from .policy import make_backend

if TYPE_CHECKING:
    from ..common.config import Config


log = logging.getLogger(__name__)


class GenerationServicer(generation_pb2_grpc.GenerationServicer):
    """A Generate request is read, checked and answered by `requests` (generate_request.py), its
    work run by the batcher (batching.py). Weight updates (PushWeights, LoadSharedWeights, a late
    server's pull) go to `receiver` (`services/weights/receiver.py`: the fence, shared memory, the
    checks and the atomic swap on the batcher's thread between batches): `fence(header)`, when
    given, decides whether a version comes from the run's writer; `probe`, when given, is this
    server's proof of its shared-memory directory (`rpc.shm_dir`)."""

    def __init__(
        self,
        backend: GenerationBackend,
        cfg: Config,
        server: RPCServer | None = None,
        model_name: str = "",
        fence: Callable[[common_pb2.WeightHeader], None] | None = None,
        probe: Probe | None = None,
    ):
        self.backend, self.cfg, self.server = backend, cfg, server
        self.vocab_size = backend.vocab_size
        self.requests = GenerateRequests(backend.tokenizer, backend.vocab_size, cfg)
        self.model_name = model_name or cfg.model.path
        metrics = GenerationMetrics(server.metrics) if server else None
        self.batcher = make_batcher(backend, cfg, metrics)
        self.in_flight = InFlight()
        self.receiver = WeightReceiver(
            backend,
            self.batcher.call,
            cfg,
            fence=fence,
            probe=probe,
            readiness=server,
            on_applied=metrics.record_swap if metrics else None,
        )

    @property
    def fence(self):
        return self.receiver.fence

    @fence.setter
    def fence(self, fence) -> None:
        self.receiver.fence = fence

    @property
    def probe(self) -> Probe | None:
        return self.receiver.probe

    @property
    def base(self) -> str:
        return self.receiver.base

    @property
    def tok(self):
        """The backend's tokenizer, the one requests are read and responses decoded with."""
        return self.requests.tok

    @tok.setter
    def tok(self, tok) -> None:
        self.requests.tok = tok

    # ------------------------------------------------------------ RPCs
    def Generate(self, request, context):
        self.batcher.enter()
        try:
            return self._generate(request, context)
        finally:
            self.batcher.exit()

    def _generate(self, request, context=None):
        """The request read and checked (`GenerateRequests.read`: request-level errors first, then
        each prompt's), its work run once however often it is retried with its idempotency key
        (`InFlight`), its response. Without a `context` (an in-process call) the work is never
        abandoned."""
        prompts, params = self.requests.read(request)
        res = self.in_flight.run(
            work_key(request, context), context, lambda stopped: self.batcher.start(prompts, params, stopped)
        )
        return self.requests.response(prompts, res)

    def liveness(self) -> str | None:
        """Why this server can no longer make progress, or None (the health service's "", which
        Kubernetes' liveness probe asks: a restart is what helps then): its backend marked broken
        (a vLLM reload failed midway, so the engine holds half a policy; its engine core died), or
        the thread that runs every batch and weight swap has exited. Readiness is another matter:
        it also goes off for a moment during each weight swap."""
        broken = self.backend.broken
        if broken:
            return f"generation backend broken: {broken}"
        return self.batcher.dead()

    def registry_info(self) -> dict:
        """What this server's registry entry says besides its policy_version: the shared-memory probe's
        nonce, where its weights come from (`base`), whether its backend takes partial pushes, and
        with `rpc.delta_push` the version a delta may be against (`delta_base`, "" for none)."""
        info = {"base": self.base, "partial": self.backend.partial_updates}
        if self.probe is not None:
            info["shm"] = self.probe.nonce
        if self.receiver.keeps_delta_base:
            info["delta_base"] = self.receiver.delta_base_key()
        return info

    def apply_chunks(self, chunks, context=None, origin: str = "") -> Applied:
        """A pushed (or pulled) stream applied as one new policy version (`WeightReceiver.apply_chunks`)."""
        return self.receiver.apply_chunks(chunks, context, origin)

    def apply_shared(self, request, context=None) -> Applied:
        """A version the co-located learner wrote into shared memory (`WeightReceiver.apply_shared`)."""
        return self.receiver.apply_shared(request, context)

    def PushWeights(self, request_iterator, context):
        return _response(self.apply_chunks(request_iterator, context))

    def LoadSharedWeights(self, request, context):
        return _response(self.apply_shared(request, context))

    def ScoreTokens(self, request, context):
        """The log-prob of each given token under the version served, on the compute thread between
        batches (or between two decoding steps with weight updates in flight), so one version scores
        the whole request and the response names it. A backend that cannot (`scores_tokens` false) is
        refused at once, UNIMPLEMENTED, before anything waits for its engine."""
        if not getattr(self.backend, "scores_tokens", False):
            raise Unimplemented(
                f"ScoreTokens: the {self.backend.info()['backend']} backend does not score given tokens yet "
                "(a server of another version of this project); nothing was run"
            )
        seqs, starts = read_scored(request, self.vocab_size, self.cfg)
        return scored_response(self.batcher.call(self.backend.score, seqs, starts))  # type: ignore[attr-defined]

    def GetInfo(self, request, context):
        info = self.backend.info()
        return gpb.GenerationInfo(
            model=self.model_name,
            backend=info["backend"],
            engine_version=info["engine_version"],
            dtype=info["dtype"],
            device=info["device"],
            policy_version=self.backend.policy_version,
            vocab_size=self.vocab_size,
            prompt_length=self.cfg.prompt_length,
            response_length=self.cfg.response_length,
            eos_token_id=self.backend.eos_token_id,
            pad_token_id=self.backend.pad_token_id,
            partial_updates=self.backend.partial_updates,
        )


def _response(a: Applied) -> common_pb2.PushWeightsResponse:
    return common_pb2.PushWeightsResponse(
        policy_version=a.policy_version,
        bytes=a.nbytes,
        seconds=a.seconds,
        swap_wait_seconds=a.swap_wait_s,
        swap_seconds=a.swap_s,
    )


def add_generation_servicer(servicer, grpc_server) -> None:
    """`add_GenerationServicer_to_server`, with PushWeights' chunks decoded by `WeightChunkDecoder`
    (a piece's data reaches `assemble_weights` as a view of the received bytes, not a copy)."""
    captured: dict = {}

    class _Capture:
        def add_generic_rpc_handlers(self, handlers):
            pass

        def add_registered_method_handlers(self, service, handlers):
            captured[service] = dict(handlers)

    generation_pb2_grpc.add_GenerationServicer_to_server(servicer, _Capture())
    for service, handlers in captured.items():
        handlers["PushWeights"] = handlers["PushWeights"]._replace(request_deserializer=WeightChunkDecoder().FromString)
        grpc_server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service, handlers),))
        grpc_server.add_registered_method_handlers(service, handlers)


def serve(cfg: Config, backend=None) -> GrpcService:
    """The generation service: loads the backend (or uses `backend`), then binds `rpc.generation`'s
    ports and serves gRPC; in a distributed run (`replay.url` set) it registers in Redis and pulls
    the current policy before it reports ready."""

    def build():
        b = backend if backend is not None else make_backend(cfg)
        ep = cfg.rpc.generation
        # a handler thread per call in flight: as many as a batch takes (agents' sessions send one prompt a call)
        handlers = max(16, cfg.generation.max_batch_size + 8)
        server = RPCServer("generation", cfg.rpc, ep.port, ep.metrics_port, host=ep.host, max_workers=handlers)
        store = None
        if cfg.replay.url:  # weights only from the learner the registry names (LearnerFence)
            from ..common.replay import ReplayStore
            from ..weights.receiver import LearnerFence

            store = ReplayStore.from_config(cfg)
        probe = shm_probe(cfg.rpc.shm_dir)
        servicer = GenerationServicer(
            b, cfg, server, fence=LearnerFence(store) if store is not None else None, probe=probe
        )
        add_generation_servicer(servicer, server.grpc)
        server.set_liveness(servicer.liveness)
        server.start()
        closers = [servicer.batcher.close] + ([probe.close] if probe is not None else [])
        if store is not None:
            from ..common.rpc.server import advertised_address
            from .registration import Registration

            reg = Registration(cfg, servicer, advertised_address(cfg.rpc, ep.host, server.port), store).start()
            closers.insert(0, reg.stop)
        server.set_ready(True)
        return server, servicer, closers

    return GrpcService("generation", build)
