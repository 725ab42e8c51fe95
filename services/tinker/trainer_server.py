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
import logging
import os
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

from ..common.compute import ComputeThread
from ..common.lifecycle import GrpcService
from ..common.rpc.errors import BadRequest, FailedPrecondition, Reason, ResourceExhausted
from ..common.rpc.gen import trainer_pb2 as tpb
from ..common.rpc.gen import trainer_pb2_grpc
from ..common.rpc.server import RPCServer
from ..weights.protocol import PushKind
from ..weights.stream import StreamSpec, weight_chunks
from .losses import check_inputs, loss_for
from .protocol import ApiError
from .training import LAYERS, Adam, Call, ModelSpec, TrainingModel
from .wire import Limits, read_forward_backward

if TYPE_CHECKING:
    from ..common.config import Config

log = logging.getLogger(__name__)

STATE_CHUNK = 1 << 20  # bytes of a saved state per message
STATE_SLACK = 64 << 20  # what a saved state may hold beyond 3 copies of the trainable tensors (its framing)
KNOWN_LAYERS = frozenset(name for names in LAYERS.values() for name in names)


@dataclass
class Held:
    """A model held here, the last op it ran and that op's answer, and the lock that makes a
    repeated op wait for the first and take its answer."""

    model: TrainingModel
    last_op: str = ""
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
    def __init__(self, cfg: Config, vocab_size: int):
        self.cfg, self.t = cfg, cfg.tinker
        self.limits = Limits(self.t.max_datums, self.t.datum_tokens(cfg.prompt_length, cfg.response_length), vocab_size)
        self.compute = ComputeThread("tinker-trainer")  # one model's work at a time, in order
        self.models: dict[str, Held] = {}
        self.lock = threading.Lock()  # over `models`
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
        model_id = _model_id(request.model)
        spec = self._spec(request.spec)
        with self.lock:
            held = self.models.get(model_id)
            if held is None and len(self.models) >= self.t.max_models:
                raise ResourceExhausted(
                    f"{self.t.max_models} training models are held, this trainer's limit (tinker.max_models)",
                    field="model",
                )
        if held is not None:  # a repeated Create
            return self._state(model_id, held)
        with refused_as_bad_request():
            model = self.compute.run(TrainingModel, self.cfg, spec)
        with self.lock:
            held = self.models.setdefault(model_id, Held(model))
        log.info("model %s created (LoRA rank %d; %d held)", model_id, spec.rank, len(self.models))
        return self._state(model_id, held)

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
        return ModelSpec(s.rank, tuple(s.targets), s.seed if s.HasField("seed") else None)

    def Drop(self, request, context):
        with self.lock:
            held = self.models.pop(request.model, None)
        if held is None:
            return tpb.TrainerModelState(model=request.model)
        log.info("model %s dropped (%d held)", request.model, len(self.models))
        return self._state(request.model, held)

    # ------------------------------------------------------------ training
    def _once(self, held: Held, op: str, work):
        """`work()`'s answer, or, for the op `held` ran last, that op's answer again."""
        with held.lock:
            if op == held.last_op:
                return held.last_answer
            answer = work()
            held.last_op, held.last_answer = op, answer
            return answer

    def ForwardBackward(self, request, context):
        _check_op(request.op)
        held = self._held(request.model)
        with refused_as_bad_request():
            req = read_forward_backward(request.request, self.limits)
            loss, settings = loss_for(req.loss_fn, req.config)
            for i, d in enumerate(req.data):
                check_inputs(loss, i, set(d.inputs))
        call = Call(request.request, req.data, loss, settings, request.backward, request.op)
        output = self._once(held, request.op, lambda: self.compute.run(held.model.forward_backward, call))
        return tpb.TrainerForwardBackwardResult(output=output)

    def OptimStep(self, request, context):
        _check_op(request.op)
        held = self._held(request.model)
        adam = _adam(request)
        metrics = self._once(held, request.op, lambda: self.compute.run(held.model.optim_step, adam, request.op))
        return tpb.TrainerOptimStepResult(metrics=metrics)

    # ------------------------------------------------------------ weights and state
    def SamplerWeights(self, request, context) -> Iterator:
        held = self._held(request.model)
        weights = self.compute.run(held.model.sampler_weights)
        yield from weight_chunks(weights, StreamSpec(policy_version=held.model.steps + 1, kind=PushKind.PARTIAL))

    def SaveState(self, request, context) -> Iterator:
        held = self._held(request.model)
        with _scratch() as file:
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
        with _scratch() as file:
            _receive(request_iterator, file, header.total_bytes)
            with refused_as_bad_request():
                self.compute.run(held.model.load, file, header.optimizer)
        with held.lock:
            held.last_op = ""  # a loaded model answers no earlier op again
        return self._state(header.model, held)

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


def _check_op(op: str) -> None:
    if not 1 <= len(op) <= 512:
        raise BadRequest(
            f"op: {len(op)} characters; each forward_backward and optim_step names itself (1 to 512)", field="op"
        )


def _adam(r: tpb.TrainerOptimStep) -> Adam:
    """The step's AdamW settings, each in its range (what the API checked already)."""
    checks = [
        ("learning_rate", r.learning_rate, 0.0, 1.0),
        ("beta1", r.beta1, 0.0, 1.0),
        ("beta2", r.beta2, 0.0, 1.0),
        ("eps", r.eps, 0.0, 1.0),
        ("weight_decay", r.weight_decay, 0.0, 1e3),
        ("grad_clip_norm", r.grad_clip_norm, 0.0, 1e12),
    ]
    for name, value, low, high in checks:
        if not low <= value <= high:  # NaN fails too
            raise BadRequest(f"{name}: {value}, expected {low:g} to {high:g}", field=name)
    return Adam(r.learning_rate, (r.beta1, r.beta2), r.eps, r.weight_decay, r.grad_clip_norm)


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

        vocab = int(AutoConfig.from_pretrained(cfg.model.path).vocab_size)
        ep = cfg.rpc.tinker_trainer
        server = RPCServer("tinker-trainer", cfg.rpc, ep.port, ep.metrics_port, host=ep.host)
        servicer = TrainerServicer(cfg, vocab)
        trainer_pb2_grpc.add_TrainerServicer_to_server(servicer, server.grpc)
        server.start()
        server.set_ready(True)
        log.info("tinker-trainer: training models of %s for a Tinker API", cfg.model.path)
        return server, servicer, [servicer.compute.close]

    return GrpcService("tinker-trainer", build)
