"""`rlhf serve tinker-trainer`: the training models of a Tinker API (`rlhf serve tinker` with
`tinker.trainer: HOST:PORT`) in a service of their own, over gRPC (proto/rlhf/v1/trainer.proto):
the same `TrainingModel`s the API holds in its process by default, built from the learner's parts,
here on their own machine or GPU.

    rlhf serve tinker-trainer -c configs/tiny-cpu.yaml

The API keeps the sessions, futures, sequences and checkpoint names; each call here names its
model by the API's id. Every request is checked again here as the API checks it (a forward_backward
is the SDK's own protobuf). A forward_backward or optim_step carries an op id: the same op again (a
retry after a lost answer) is answered with the first one's result, never computed twice. A model
this process does not hold (it restarted since) is refused with reason MODEL_NOT_HELD, which the
API turns into "start again from your checkpoint"."""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import pickle
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

from pydantic import ValidationError

from ..common.compute import ComputeThread
from ..common.lifecycle import GrpcService
from ..common.rpc.errors import BadRequest, FailedPrecondition, Reason, ResourceExhausted
from ..common.rpc.gen import trainer_pb2 as tpb
from ..common.rpc.gen import trainer_pb2_grpc
from ..common.rpc.server import RPCServer
from ..weights.protocol import PushKind
from ..weights.stream import StreamSpec, weight_chunks
from .losses import check_inputs, loss_for
from .protocol import STATE_CHUNK, AdamSpec, ApiError
from .training import LAYERS, Adam, Call, ModelSpec, TrainingModel
from .wire import Limits, read_forward_backward

if TYPE_CHECKING:
    from ..common.config import Config

log = logging.getLogger(__name__)

STATE_SLACK = 64 << 20  # what a saved state may hold beyond 3 copies of the trainable tensors (its framing)
STATE_STREAMS = 2  # saved states on their way at once (each a scratch file of up to a state's size)
STATE_WAIT_S = 60.0  # how long a state stream waits for its turn before it is refused
KNOWN_LAYERS = frozenset(name for names in LAYERS.values() for name in names)
# what torch.load and a state's tensors raise on bytes that are no state of this model
NOT_A_STATE = (pickle.UnpicklingError, EOFError, RuntimeError, AttributeError, KeyError, TypeError, ValueError)


@dataclass
class Held:
    """A model held here: its spec and owner (the API process that made it), the last op it ran
    (kind, op id, the request's digest) and that op's answer, and the lock that makes a repeated op
    wait for the first and take its answer."""

    model: TrainingModel
    spec: ModelSpec
    owner: str
    last_op: tuple[str, str, str] = ("", "", "")
    last_answer: object = None
    lock: threading.Lock = field(default_factory=threading.Lock)


@contextlib.contextmanager
def refused_as_bad_request():
    """The API's 400 (`ApiError`) raised by a check or a model, as the INVALID_ARGUMENT it is here."""
    try:
        yield
    except ApiError as e:
        raise BadRequest(e.message, field=e.param) from None


class TrainerServicer(trainer_pb2_grpc.TrainerServicer):
    def __init__(self, cfg: Config, vocab_size: int, tied: bool):
        """`tied`: the model's unembedding shares the embedding's weight (no adapter may go on it)."""
        self.cfg, self.t, self.tied = cfg, cfg.tinker, tied
        self.limits = Limits(self.t.max_datums, self.t.datum_tokens(cfg.prompt_length, cfg.response_length), vocab_size)
        self.compute = ComputeThread("tinker-trainer")  # one model's work at a time, in order
        self.models: dict[str, Held] = {}
        self.lock = threading.Lock()  # over `models`
        self.creating = threading.Lock()  # one Create at a time: its check, build and insert as one
        self.streams = threading.BoundedSemaphore(STATE_STREAMS)
        self.incarnation, self.started_at = uuid.uuid4().hex, time.time()

    # ------------------------------------------------------------ models
    def _held(self, model_id: str) -> Held:
        with self.lock:
            held = self.models.get(model_id)
        if held is None:
            raise FailedPrecondition(
                f"model {model_id[:120]}: this trainer holds no such model (it restarted since the model was made, "
                "or the model was dropped)",
                Reason.MODEL_NOT_HELD,
                field="model",
            )
        return held

    def _state(self, model_id: str, held: Held) -> tpb.TrainerModelState:
        return tpb.TrainerModelState(model=model_id, steps=held.model.steps, pending=held.model.pending)

    def Create(self, request, context):
        model_id, owner = _model_id(request.model), _owner(request.owner)
        spec = self._spec(request.spec)
        with self.creating:
            self._drop_others(owner)
            with self.lock:
                held = self.models.get(model_id)
            if held is not None:  # a repeated Create
                if held.spec != spec:
                    raise BadRequest(f"model {model_id[:120]}: held already, with another spec", field="spec")
                return self._state(model_id, held)
            if len(self.models) >= self.t.max_models:
                raise ResourceExhausted(
                    f"{self.t.max_models} training models are held, this trainer's limit (tinker.max_models)",
                    field="model",
                )
            with refused_as_bad_request():
                model = self.compute.run(TrainingModel, self.cfg, spec)
            with self.lock:
                held = self.models[model_id] = Held(model, spec, owner)
        log.info("model %s created (LoRA rank %d; %d held)", model_id, spec.rank, len(self.models))
        return self._state(model_id, held)

    def _drop_others(self, owner: str) -> None:
        """The models of any other owner dropped: a trainer serves one API, and an API process that
        restarted holds none of the models its predecessor made."""
        with self.lock:
            gone = [m for m, h in self.models.items() if h.owner != owner]
            for m in gone:
                del self.models[m]
        if gone:
            log.info("%d model(s) of an earlier API process dropped (a new one creates models)", len(gone))

    def _spec(self, s: tpb.TrainerModelSpec) -> ModelSpec:
        if not 0 <= s.rank <= self.t.max_lora_rank:
            raise BadRequest(f"spec.rank: {s.rank}, expected 0 to {self.t.max_lora_rank}", field="spec.rank")
        unknown = [t for t in s.targets if t not in KNOWN_LAYERS]
        if unknown or len(s.targets) > len(KNOWN_LAYERS):
            raise BadRequest(
                f"spec.targets: {unknown[0][:64] if unknown else len(s.targets)!r} is no layer this trainer adapts "
                f"({', '.join(sorted(KNOWN_LAYERS))})",
                field="spec.targets",
            )
        if s.rank and not s.targets:
            raise BadRequest("spec.targets: a LoRA model (rank > 0) adapts at least one layer", field="spec.targets")
        if self.tied and "lm_head" in s.targets:
            raise BadRequest(
                "spec.targets: lm_head shares its weight with the embedding in this model; no adapter goes on it",
                field="spec.targets",
            )
        return ModelSpec(s.rank, tuple(s.targets), s.seed if s.HasField("seed") else None)

    def Drop(self, request, context):
        with self.lock:
            held = self.models.pop(request.model, None)
        if held is None:
            return tpb.TrainerModelState(model=request.model)
        log.info("model %s dropped (%d held)", request.model, len(self.models))
        return self._state(request.model, held)

    # ------------------------------------------------------------ training
    def _once(self, held: Held, op: tuple[str, str, str], work):
        """`work()`'s answer, or, for the op `held` ran last (its kind, id and request), that op's
        answer again; its id again with another kind or request is refused."""
        with held.lock:
            if op == held.last_op:
                return held.last_answer
            if op[1] == held.last_op[1]:
                raise BadRequest(f"op {op[1][:120]}: used already, by another request", field="op")
            answer = work()
            held.last_op, held.last_answer = op, answer
            return answer

    def ForwardBackward(self, request, context):
        _check_op(request.op)
        if len(request.request) > self.t.max_request_bytes:
            raise BadRequest(
                f"request: {len(request.request)} bytes, more than tinker.max_request_bytes={self.t.max_request_bytes}",
                field="request",
            )
        held = self._held(request.model)
        with refused_as_bad_request():
            req = read_forward_backward(request.request, self.limits)
            loss, settings = loss_for(req.loss_fn, req.config)
            for i, d in enumerate(req.data):
                check_inputs(loss, i, set(d.inputs))
        call = Call(request.request, req.data, loss, settings, request.backward, request.op)
        op = ("forward_backward" if request.backward else "forward", request.op, _digest(request.request))
        output = self._once(held, op, lambda: self.compute.run(held.model.forward_backward, call))
        return tpb.TrainerForwardBackwardResult(output=output)

    def OptimStep(self, request, context):
        _check_op(request.op)
        held = self._held(request.model)
        adam = _adam(request)
        op = ("optim_step", request.op, _digest(repr(adam).encode()))
        metrics = self._once(held, op, lambda: self.compute.run(held.model.optim_step, adam, request.op))
        return tpb.TrainerOptimStepResult(metrics=metrics)

    # ------------------------------------------------------------ weights and state
    def SamplerWeights(self, request, context) -> Iterator:
        held = self._held(request.model)
        weights = self.compute.run(held.model.sampler_weights)
        yield from weight_chunks(weights, StreamSpec(policy_version=held.model.steps + 1, kind=PushKind.PARTIAL))

    def SaveState(self, request, context) -> Iterator:
        held = self._held(request.model)
        with self._stream_turn(), _scratch() as file:
            self.compute.run(held.model.save, file)
            size = file.stat().st_size
            yield tpb.TrainerStateChunk(header=tpb.TrainerStateHeader(model=request.model, total_bytes=size))
            with open(file, "rb") as f:
                while data := f.read(STATE_CHUNK):
                    yield tpb.TrainerStateChunk(data=data)

    def LoadState(self, request_iterator, context):
        first = next(request_iterator, None)
        if first is None or first.WhichOneof("payload") != "header":
            raise BadRequest("a LoadState stream starts with its header", field="header")
        header = first.header
        held = self._held(header.model)
        bound = 3 * sum(p.numel() * p.element_size() for p in held.model.policy.parameters() if p.requires_grad)
        if not 0 <= header.total_bytes <= bound + STATE_SLACK:
            raise BadRequest(
                f"header.total_bytes: {header.total_bytes}; a state of this model takes at most {bound + STATE_SLACK}",
                field="header.total_bytes",
            )
        with self._stream_turn(), _scratch() as file:
            _receive(request_iterator, file, header.total_bytes)
            try:
                with refused_as_bad_request():
                    self.compute.run(held.model.load, file, header.optimizer)
            except NOT_A_STATE as e:
                raise BadRequest(f"data: not a saved state of this model ({type(e).__name__})", field="data") from None
        with held.lock:
            held.last_op = ("", "", "")  # a loaded model answers no earlier op again
        return self._state(header.model, held)

    @contextlib.contextmanager
    def _stream_turn(self):
        """A turn for a state stream (STATE_STREAMS at once), or RESOURCE_EXHAUSTED after STATE_WAIT_S."""
        if not self.streams.acquire(timeout=STATE_WAIT_S):
            raise ResourceExhausted(f"{STATE_STREAMS} saved states are on their way already; try again", field="model")
        try:
            yield
        finally:
            self.streams.release()

    def Info(self, request, context):
        return tpb.TrainerInfo(
            model_path=self.cfg.model.path,
            vocab_size=self.limits.vocab_size,
            models=len(self.models),
            max_models=self.t.max_models,
            max_request_bytes=self.t.max_request_bytes,
            incarnation=self.incarnation,
            started_at=self.started_at,
        )


def _model_id(model: str) -> str:
    if not 1 <= len(model) <= 256:
        raise BadRequest(f"model: {len(model)} characters, expected 1 to 256", field="model")
    return model


def _owner(owner: str) -> str:
    if len(owner) > 256:
        raise BadRequest(f"owner: {len(owner)} characters, expected at most 256", field="owner")
    return owner


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _check_op(op: str) -> None:
    if not 1 <= len(op) <= 512:
        raise BadRequest(
            f"op: {len(op)} characters; each forward_backward and optim_step names itself (1 to 512)", field="op"
        )


def _adam(r: tpb.TrainerOptimStep) -> Adam:
    """The step's AdamW settings, in the ranges the API takes them in (its AdamSpec: finite, betas
    under 1, eps above 0)."""
    names = ("learning_rate", "beta1", "beta2", "eps", "weight_decay", "grad_clip_norm")
    try:
        p = AdamSpec.model_validate({n: getattr(r, n) for n in names})
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(x) for x in first["loc"])
        raise BadRequest(f"{where}: {first['msg']}", field=where) from None
    assert p.learning_rate is not None and p.beta1 is not None and p.beta2 is not None and p.eps is not None
    return Adam(p.learning_rate, (p.beta1, p.beta2), p.eps, p.weight_decay, p.grad_clip_norm)


@contextlib.contextmanager
def _scratch():
    """A file of its own for a state on its way, removed after."""
    fd, name = tempfile.mkstemp(prefix="tinker-state-", suffix=".pt")
    os.close(fd)
    try:
        yield Path(name)
    finally:
        Path(name).unlink(missing_ok=True)


def _receive(chunks, file: Path, total: int) -> None:
    """The stream's data chunks into `file`: exactly `total` bytes, or a BadRequest."""
    got = 0
    with open(file, "wb") as f:
        for chunk in chunks:
            if chunk.WhichOneof("payload") != "data":
                raise BadRequest("a LoadState stream has one header, first", field="header")
            got += len(chunk.data)
            if got > total:
                raise BadRequest(f"data: more than the header's total_bytes ({total})", field="data")
            f.write(chunk.data)
    if got != total:
        raise BadRequest(f"data: {got} bytes, the header said {total}", field="data")


def serve(cfg: Config) -> GrpcService:
    """The trainer service: binds `rpc.tinker_trainer`'s ports and serves gRPC; models are built
    when the API asks for them."""

    def build():
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(cfg.model.path)
        ep = cfg.rpc.tinker_trainer
        server = RPCServer("tinker-trainer", cfg.rpc, ep.port, ep.metrics_port, host=ep.host)
        servicer = TrainerServicer(cfg, int(config.vocab_size), bool(getattr(config, "tie_word_embeddings", False)))
        trainer_pb2_grpc.add_TrainerServicer_to_server(servicer, server.grpc)
        server.start()
        server.set_ready(True)
        log.info("tinker-trainer: training models of %s for a Tinker API", cfg.model.path)
        return server, servicer, [servicer.compute.close]

    return GrpcService("tinker-trainer", build)
