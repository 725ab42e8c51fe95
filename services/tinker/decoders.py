"""Where the Tinker API's samples are decoded (`decoder_for`, chosen by `tinker.generation`):

    InProcess   the project's `hf` generation backend in this process (the default)
    OverGrpc    a generation server of the API's own (`rlhf serve generation`), over gRPC: the
                sampler weights are pushed to it as the learner pushes a policy (a partial push
                of the tensors that differ from the base where its backend takes one, hf; the
                whole policy where it does not, vllm)

Both answer the same calls, the ones `Engine` (sampling.py) makes: `generate`, `score`,
`update_weights`, and `base(names)`, the base model's tensors of those names (what a push puts
back when the weights it served are replaced)."""

from __future__ import annotations

import logging
import threading
import time
import uuid
from typing import TYPE_CHECKING, Any, Iterable, Protocol, Sequence

import grpc
import torch

from ..common.model_files import load_causal_lm, load_tokenizer, read_state, state_names
from ..common.rpc.errors import Reason, reason_of
from ..common.rpc.retry import DependencyUnavailable, RideThrough, backoff_delays
from ..common.types import GenerationResult, SamplingParams, TokenScores
from ..weights.protocol import PushKind
from .protocol import ApiError

if TYPE_CHECKING:
    from ..common.config import Config
    from ..common.types import GenerationBackend

log = logging.getLogger(__name__)

Weights = dict[str, torch.Tensor]


class Decoder(Protocol):
    tokenizer: Any
    vocab_size: int
    partial: bool  # a push may hold some tensors only
    remote: bool  # decodes in another process: sampling needs no turn of the compute thread
    where: str  # in what it says

    @property
    def policy_version(self) -> int: ...

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> GenerationResult: ...

    def score(self, sequences: Sequence[Sequence[int]], starts: Sequence[int]) -> TokenScores: ...

    def update_weights(self, state: Weights, version: int) -> None: ...

    def base(self, names: Iterable[str] | None = None) -> Weights: ...

    def close(self) -> None: ...


class InProcess:
    """The `hf` generation backend of this process: weights loaded in place, the base read off it."""

    partial = True
    remote = False
    where = "the generation backend in this process"

    def __init__(self, backend: GenerationBackend):
        if not backend.partial_updates or not hasattr(backend, "model"):
            raise ValueError(
                "the Tinker API samples in its process with the hf generation backend (generation.backend: hf); "
                "for vLLM give it a generation server of its own (tinker.generation)"
            )
        self.backend = backend
        self.tokenizer: Any = backend.tokenizer
        self.vocab_size = int(backend.vocab_size)
        self._model = getattr(backend, "model")

    @property
    def policy_version(self) -> int:
        return int(self.backend.policy_version)

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> GenerationResult:
        return self.backend.generate(prompts, params)

    def score(self, sequences: Sequence[Sequence[int]], starts: Sequence[int]) -> TokenScores:
        return getattr(self.backend, "score")(sequences, starts)

    def update_weights(self, state: Weights, version: int) -> None:
        self.backend.update_weights(state, version)

    def base(self, names: Iterable[str] | None = None) -> Weights:
        own = self._model.state_dict()
        return {n: own[n].detach().float().cpu().clone() for n in (own if names is None else names)}

    def close(self) -> None:
        pass  # the backend goes with the process


class OverGrpc:
    """A generation server at `address` that serves `model.path`'s model to this API alone (its
    weights are whichever sampler the API last needed). Calls ride through its restarts for
    rpc.dependency_wait_s; the base tensors a push puts back are read from `model.path`'s files
    each time they are needed (a partial push: the few a sampler's weights replaced)."""

    remote = True

    def __init__(self, cfg: Config, address: str):
        from ..generation.client import GenerationClient

        self.model_path, self.where = cfg.model.path, f"the generation server at {address}"
        ride = RideThrough("generation server", address, cfg.rpc)
        self.initial_s, self.max_s, self.wait_s = ride.initial_s, ride.max_s, ride.wait_s
        self.client = GenerationClient(address, cfg.rpc, interceptors=[ride])
        try:
            info = self._call(lambda: self.client.info())
        except ApiError as e:
            raise ValueError(f"tinker.generation: {e.message}") from None
        self.tokenizer: Any = load_tokenizer(cfg.model.path)
        self.vocab_size, self.partial = int(info.vocab_size), bool(info.partial_updates)
        self.prompt_length = int(info.prompt_length)
        self._check(cfg, info)
        self._base: Weights | None = None
        self._lock = threading.Lock()
        log.info(
            "tinker: samples are decoded by %s (%s %s on %s; %s pushes)",
            self.where,
            info.backend,
            info.engine_version,
            info.device,
            "partial" if self.partial else "whole-policy",
        )

    def _check(self, cfg: Config, info) -> None:
        from transformers import AutoConfig

        vocab = int(getattr(AutoConfig.from_pretrained(cfg.model.path), "vocab_size", 0) or 0)
        sample_tokens = cfg.tinker.sample_tokens(cfg.response_length)
        problems = []
        if vocab and info.vocab_size != vocab:
            problems.append(f"it serves a model of {info.vocab_size} tokens where model.path's has {vocab}")
        if info.response_length < sample_tokens:
            problems.append(
                f"its response_length {info.response_length} is under the {sample_tokens} new tokens this API samples"
            )
        if info.prompt_length + info.response_length < cfg.tinker.datum_tokens(cfg.prompt_length, cfg.response_length):
            problems.append(
                f"its prompt_length + response_length ({info.prompt_length + info.response_length}) is under this "
                f"API's {cfg.tinker.datum_tokens(cfg.prompt_length, cfg.response_length)} tokens of a sampled sequence"
            )
        if problems:
            raise ValueError(f"tinker.generation: {self.where} cannot serve this API: " + "; ".join(problems))

    @property
    def policy_version(self) -> int:
        return int(self._call(lambda: self.client.info()).policy_version)

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> GenerationResult:
        # a prompt past the server's prompt_length goes as a later turn: its first prompt_length tokens first
        firsts = [min(len(p), self.prompt_length) for p in prompts]
        key = uuid.uuid4().hex  # a repeat after a lost answer joins the first call's work on the server
        return self._call(lambda: self.client.generate(prompts, params, key=key, first_prompt_tokens=firsts))

    def score(self, sequences: Sequence[Sequence[int]], starts: Sequence[int]) -> TokenScores:
        return self._call(lambda: self.client.score_tokens(sequences, starts))

    def update_weights(self, state: Weights, version: int) -> None:
        """A push (a stream, which `RideThrough` does not repeat): repeated here while the server is
        unavailable, for as long as the other calls wait."""
        kind = PushKind.PARTIAL if self.partial else PushKind.FULL
        delays = backoff_delays(self.initial_s, self.max_s)
        t0 = time.monotonic()
        while True:
            try:
                self.client.update_weights(state, version, kind=kind)
                return
            except grpc.RpcError as e:
                waited = time.monotonic() - t0
                if e.code() != grpc.StatusCode.UNAVAILABLE or (self.wait_s is not None and waited >= self.wait_s):
                    raise self._api_error(e) from None
                log.warning("waiting for %s to take a weight push (%.0fs so far)", self.where, waited)
                time.sleep(next(delays))

    def base(self, names: Iterable[str] | None = None) -> Weights:
        """The base tensors `names` (None: all), float32, read from model.path's safetensors files
        when asked, not held; a model in another format is loaded once and held."""
        with self._lock:
            if self._base is None:
                wanted = state_names(self.model_path) if names is None else set(names)
                found = read_state(self.model_path, wanted)
                if found is not None:
                    return found
                log.info("tinker: %s holds no safetensors of every tensor: its base is held in memory", self.model_path)
                self._base = {k: v.detach().float() for k, v in load_causal_lm(self.model_path).state_dict().items()}
        return dict(self._base) if names is None else {n: self._base[n] for n in names}

    def _call(self, call):
        """`call()`, its failures as the API's errors: a server that stayed away or refused."""
        try:
            return call()
        except DependencyUnavailable as e:
            raise ApiError(503, f"{e}; try again once it is back", code="generation_unavailable") from None
        except grpc.RpcError as e:
            raise self._api_error(e) from None

    def _api_error(self, e: grpc.RpcError) -> ApiError:
        if reason_of(e) is Reason.VERSION_NOT_NEWER:  # a push: the server took a newer one from elsewhere
            return ApiError(
                409,
                f"{self.where} serves a newer version than this API pushed: another writer pushes weights to it; "
                "give the Tinker API a generation server of its own",
                code="generation_shared",
            )
        code = e.code()
        what = (e.details() or "").splitlines()[0][:300] if e.details() else ""
        return ApiError(STATUS.get(code, 502), f"{self.where}: {code.name}: {what}", code="generation_failed")

    def close(self) -> None:
        self.client.close()


# a generation server's answer as this API's HTTP status: the request's fault (400), the server away
# (503, worth a retry), anything else a server that cannot serve this API as configured (502)
STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 400,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 503,
}


def decoder_for(cfg: Config) -> Decoder:
    """The decoder `tinker.generation` names: a generation server's address, or none (this process's
    generation backend, `make_backend`)."""
    if cfg.tinker.generation:
        return OverGrpc(cfg, cfg.tinker.generation)
    from ..generation.policy import make_backend

    return InProcess(make_backend(cfg))
