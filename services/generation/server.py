"""The generation server: Generate (batched across concurrent callers), PushWeights (streamed,
checksummed, applied atomically between batches), LoadSharedWeights (the same, the bytes read from
a file the co-located learner wrote into shared memory), GetInfo.

A Generate whose caller has gone (its deadline passed, or it cancelled the call) stops costing
anything: queued, it never runs; running, its batch ends at the next decoding step once nobody
waits for any of the batch (hf; a batch shared with live calls runs on, the gone caller's rows
are discarded), or its requests are aborted in the engine (vllm). A retry carries the first
call's idempotency key (metadata `x-idempotency-key`, `GenerationClient.generate(key=...)`): while
that work is still running the retry waits for it instead of starting a second copy (`InFlight`).

    rlhf serve generation -c configs/tiny-cpu.yaml      (`serve(cfg)` below)
"""

from __future__ import annotations

import hashlib
import logging
import math
from typing import TYPE_CHECKING, Callable, cast

import grpc

from ..common.lifecycle import GrpcService
from ..common.rpc.errors import BadRequest, Reason, ResourceExhausted
from ..common.rpc.gen import common_pb2, generation_pb2_grpc
from ..common.rpc.gen import generation_pb2 as gpb
from ..common.rpc.server import RPCServer
from ..common.types import GenerationBackend, SamplingParams
from ..weights.assemble import WeightChunkDecoder
from ..weights.receiver import Applied, WeightReceiver, shm_probe
from ..weights.shm import Probe
from .batching import InFlight, make_batcher
from .client import IDEMPOTENCY_KEY
from .decode import GREEDY_BELOW
from .metrics import GenerationMetrics
from .policy import make_backend

if TYPE_CHECKING:
    from typing import Mapping, Protocol, Sequence

    from ..common.config import Config

    class _Tokenizer(Protocol):
        """What the server uses of a backend's tokenizer (a Hugging Face one: `load_tokenizer`)."""

        def __call__(self, text: str, add_special_tokens: bool = True) -> Mapping[str, list[int]]: ...

        def apply_chat_template(
            self, conversation: list[dict[str, str]], *, tokenize: bool, add_generation_prompt: bool
        ) -> str: ...

        def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = False) -> str: ...


log = logging.getLogger(__name__)


def _bad_prompt(field: str, why: str) -> BadRequest:
    """An error about one prompt of a request (`field` is `prompts[i]...`): it carries
    `Reason.PROMPT_INVALID` and the field, and the rest of the request is fine."""
    return BadRequest(f"{field}: {why}", Reason.PROMPT_INVALID, field=field)


class GenerationServicer(generation_pb2_grpc.GenerationServicer):
    """Weight updates (PushWeights, LoadSharedWeights, a late server's pull) go to `receiver`
    (`services/weights/receiver.py`: the fence, shared memory, the checks and the atomic swap on
    the batcher's thread between batches): `fence(header)`, when given, decides whether a version
    comes from the run's writer; `probe`, when given, is this server's proof of its shared-memory
    directory (`rpc.shm_dir`)."""

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
        self.tok = cast("_Tokenizer", backend.tokenizer)
        self.vocab_size = backend.vocab_size
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

    # ------------------------------------------------------------ decode + check
    def _prompt_ids(self, i: int, p: gpb.Prompt) -> list[int]:
        kind = p.WhichOneof("input")
        if kind == "tokens":
            ids = list(p.tokens.ids)
        elif kind == "text":
            ids = self.tok(p.text)["input_ids"]
        elif kind == "chat":
            if not p.chat.messages:
                raise _bad_prompt(f"prompts[{i}].chat.messages", "empty")
            try:
                text = self.tok.apply_chat_template(
                    [{"role": m.role, "content": m.content} for m in p.chat.messages],
                    tokenize=False,
                    add_generation_prompt=True,
                )
            except Exception as e:  # the template refuses the conversation (roles out of order, ...)
                raise _bad_prompt(f"prompts[{i}].chat", f"the chat template refused it: {e}") from None
            ids = self.tok(text, add_special_tokens=False)["input_ids"]
        else:
            raise _bad_prompt(f"prompts[{i}]", "none of tokens, text, chat is set")
        if not ids:
            raise _bad_prompt(f"prompts[{i}]", "empty prompt")
        first = p.first_prompt_tokens or len(ids)
        if first > len(ids):
            raise _bad_prompt(f"prompts[{i}].first_prompt_tokens", f"{first}, more than the prompt's {len(ids)} tokens")
        if first > self.cfg.prompt_length:
            what = f"{len(ids)} tokens" if first == len(ids) else f"a conversation whose first prompt is {first} tokens"
            raise _bad_prompt(f"prompts[{i}]", f"{what}, more than prompt_length={self.cfg.prompt_length}")
        if len(ids) - first >= self.cfg.response_length:
            raise _bad_prompt(
                f"prompts[{i}]",
                f"{len(ids) - first} tokens of conversation after its first prompt leave no room for a reply "
                f"in response_length={self.cfg.response_length}",
            )
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise _bad_prompt(
                f"prompts[{i}].tokens", f"token id {bad[0]} outside the vocabulary [0, {self.vocab_size})"
            )
        return ids

    def _params(self, m: gpb.SamplingParams) -> SamplingParams:
        rpc, g = self.cfg.rpc, self.cfg.generation
        n = m.n or 1
        if not 1 <= n <= rpc.max_samples_per_prompt:
            raise BadRequest(f"params.n: {n} outside [1, {rpc.max_samples_per_prompt}]")
        temperature = m.temperature if m.HasField("temperature") else g.temperature
        if not math.isfinite(temperature) or not 0 <= temperature <= 10:
            raise BadRequest(f"params.temperature: {temperature} outside [0, 10]")
        if temperature < GREEDY_BELOW:
            temperature = 0.0  # greedy, as the backend treats it (dividing by a denormal overflows)
        top_p = m.top_p if m.HasField("top_p") else g.top_p
        if not math.isfinite(top_p) or not 0 < top_p <= 1:
            raise BadRequest(f"params.top_p: {top_p} outside (0, 1]")
        if m.top_k < 0:
            raise BadRequest(f"params.top_k: {m.top_k} is negative (0 turns top-k off)")
        max_new = m.max_new_tokens or self.cfg.response_length
        if not 1 <= max_new <= self.cfg.response_length:
            raise BadRequest(
                f"params.max_new_tokens: {max_new} outside [1, response_length={self.cfg.response_length}]"
            )
        bad = [t for t in m.stop_token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise BadRequest(f"params.stop_token_ids: {bad[0]} outside the vocabulary [0, {self.vocab_size})")
        return SamplingParams(
            n=n,
            temperature=temperature,
            top_p=top_p,
            top_k=m.top_k,
            max_new_tokens=max_new,
            stop_token_ids=list(m.stop_token_ids),
            seed=m.seed if m.HasField("seed") else None,
        )

    # ------------------------------------------------------------ RPCs
    def Generate(self, request, context):
        self.batcher.enter()
        try:
            return self._generate(request, context)
        finally:
            self.batcher.exit()

    def _check_cost(self, n_prompts: int, width: int, params: SamplingParams, exact: bool) -> None:
        """What one request may cost: prompts x n x (prompt width + max_new_tokens) token positions
        (the backend pads every prompt to the longest), at most rpc.max_request_tokens."""
        cost = n_prompts * params.n * (width + params.max_new_tokens)
        limit = self.cfg.rpc.max_request_tokens
        if cost > limit:
            raise ResourceExhausted(
                f"request: {n_prompts} prompts x n={params.n} x ({'' if exact else 'at least '}{width} prompt tokens "
                f"+ max_new_tokens={params.max_new_tokens}) = {cost} token positions, more than "
                f"rpc.max_request_tokens={limit}; send fewer prompts or samples per request",
                Reason.REQUEST_TOO_LARGE,
            )

    @staticmethod
    def _work_key(request, context) -> str | None:
        """The caller's idempotency key with a digest of the request: the same key on another
        request (a caller's bug) never gets the first one's answer."""
        key = dict(context.invocation_metadata()).get(IDEMPOTENCY_KEY) if context is not None else None
        if not key:
            return None
        return f"{key}:{hashlib.blake2b(request.SerializeToString(deterministic=True), digest_size=16).hexdigest()}"

    def _generate(self, request, context=None):
        """Request-level errors come first; an error about one prompt carries `Reason.PROMPT_INVALID`
        and the field `prompts[i]` (rollout workers isolate that prompt; see `_bad_prompt`).
        Without a `context` (an in-process call) the work is never abandoned."""
        if not request.prompts:
            raise BadRequest("prompts: empty batch (0 prompts)")
        if len(request.prompts) > self.cfg.rpc.max_prompts_per_request:
            raise BadRequest(
                f"prompts: {len(request.prompts)} prompts, more than {self.cfg.rpc.max_prompts_per_request}"
            )
        params = self._params(request.params)
        # a cheap lower bound before tokenizing anything: token prompts' lengths, 1 for text and chat
        known = [len(p.tokens.ids) for p in request.prompts if p.WhichOneof("input") == "tokens"]
        longest = self.cfg.prompt_length + self.cfg.response_length - 1  # a later turn's longest prompt
        width = min(max(known + [1]), longest)  # a longer prompt is refused on its own
        self._check_cost(
            len(request.prompts), width, params, exact=len(known) == len(request.prompts) and width == max(known)
        )
        prompts = [self._prompt_ids(i, p) for i, p in enumerate(request.prompts)]
        self._check_cost(len(prompts), max(len(p) for p in prompts), params, exact=True)
        res = self.in_flight.run(
            self._work_key(request, context), context, lambda stopped: self.batcher.start(prompts, params, stopped)
        )
        out = gpb.GenerateResponse(policy_version=res.policy_version)
        for ids, comps in zip(prompts, res.completions):
            out.results.append(
                gpb.PromptResult(
                    prompt_token_ids=ids,
                    completions=[
                        gpb.Completion(
                            token_ids=c.token_ids,
                            log_probs=c.log_probs,
                            finish_reason=c.finish_reason,
                            text=self.tok.decode(c.token_ids, skip_special_tokens=True),
                            token_versions=c.token_versions or [],
                        )
                        for c in comps
                    ],
                )
            )
        return out

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
