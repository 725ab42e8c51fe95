"""Where the Tinker API's training models live (`trainer_for`, chosen by `tinker.trainer`):

    InProcess   `TrainingModel`s in this process, on its compute thread (the default)
    OverGrpc    a trainer of the API's own (`rlhf serve tinker-trainer`, trainer_server.py), over
                gRPC: the same `TrainingModel`s in its process, each call naming its model by the
                API's id

Both make models that answer the same calls, the ones api.py makes on its compute thread:
`forward_backward(call)` (the SDK's output bytes), `optim_step(adam, op)`, `sampler_weights()`,
`save(file)`, `load(file, optimizer)`, and `release()` when the API lets one go."""

from __future__ import annotations

import logging
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Protocol, TypeVar

import grpc
import torch

from ..common.rpc.client import RPCClient
from ..common.rpc.errors import Reason, reason_of
from ..common.rpc.gen import trainer_pb2 as tpb
from ..common.rpc.gen import trainer_pb2_grpc
from ..common.rpc.retry import IDEMPOTENT, DependencyUnavailable, RideThrough
from ..weights.assemble import assemble_weights
from .decoders import STATUS
from .protocol import STATE_CHUNK, ApiError
from .training import Adam, Call, ModelSpec, TrainingModel

if TYPE_CHECKING:
    from ..common.config import Config

log = logging.getLogger(__name__)
T = TypeVar("T")

# a trainer's calls: a repeat after a lost answer is answered once (op ids), a Create of a held
# model is a no-op, a Drop of a dropped one too
REPEATABLE = IDEMPOTENT | {"Create", "ForwardBackward", "OptimStep", "Drop"}
COMPUTE_DEADLINE_FACTOR = 30  # a training call may take this many rpc.timeout_s (a long batch on a CPU)
RELEASE_S = 10.0  # a model let go is dropped on the trainer within this, or left to the next API process


class Model(Protocol):
    spec: ModelSpec

    def forward_backward(self, call: Call) -> bytes: ...

    def optim_step(self, adam: Adam, op: str = "") -> dict[str, float]: ...

    def sampler_weights(self) -> dict[str, torch.Tensor]: ...

    def save(self, file: Path) -> None: ...

    def load(self, file: Path, optimizer: bool) -> None: ...

    def release(self) -> None: ...


class Trainer(Protocol):
    remote: bool
    where: str

    def create(self, model_id: str, spec: ModelSpec) -> Model: ...

    def close(self) -> None: ...


class InProcess:
    remote = False
    where = "this process"

    def __init__(self, cfg: Config):
        self.cfg = cfg

    def create(self, model_id: str, spec: ModelSpec) -> Model:
        return TrainingModel(self.cfg, spec)

    def close(self) -> None:
        pass


class TrainerClient(RPCClient):
    stub_class = trainer_pb2_grpc.TrainerStub


class Link:
    """The gRPC link to a trainer at `address`: calls that ride through its restarts for
    rpc.dependency_wait_s, their failures as the API's errors."""

    def __init__(self, cfg: Config, address: str):
        self.where = f"the trainer at {address}"
        ride = RideThrough("tinker trainer", address, cfg.rpc, idempotent=REPEATABLE, final=(Reason.MODEL_NOT_HELD,))
        self.client = TrainerClient(address, cfg.rpc, cfg.rpc.timeout_s * COMPUTE_DEADLINE_FACTOR, [ride])
        self.kw = {"timeout": self.client.timeout, "metadata": self.client.metadata}
        # calls that must not wait for a trainer that is away (a model let go): one try, briefly
        self.once = trainer_pb2_grpc.TrainerStub(self.client._channel)

    def call(self, rpc: Callable[[trainer_pb2_grpc.TrainerStub], T]) -> T:
        """`rpc(stub)`, its failures as the API's errors: a trainer that stayed away, refused, or no
        longer holds the model (restarted)."""
        try:
            return rpc(self.client.stub)
        except DependencyUnavailable as e:
            raise ApiError(503, f"{e}; try again once it is back", code="trainer_unavailable") from None
        except grpc.RpcError as e:
            raise self._api_error(e) from None

    def _api_error(self, e: grpc.RpcError) -> ApiError:
        what = (e.details() or "").splitlines()[0][:300] if e.details() else ""
        if reason_of(e) is Reason.MODEL_NOT_HELD:
            return ApiError(
                400,
                f"{self.where} restarted since this model was made: its weights, its optimiser state and the "
                "gradients its forward_backward calls accumulated are gone, so this call would be half a step. "
                "Create a training client from your last checkpoint (ServiceClient."
                "create_training_client_from_state_with_optimizer) and redo the forward_backward",
                param="model_id",
                code="server_restarted",
            )
        code = e.code()
        return ApiError(STATUS.get(code, 502), f"{self.where}: {code.name}: {what}", code="trainer_failed")

    def close(self) -> None:
        self.client.close()


class OverGrpc:
    """A trainer at `address` that serves `model.path`'s model to this API alone; a model it no
    longer holds (it restarted) is the client's to make again from a checkpoint."""

    remote = True

    def __init__(self, cfg: Config, address: str):
        self.link = Link(cfg, address)
        self.where = self.link.where
        self.owner = uuid.uuid4().hex  # this API process: its first model drops those of the one before
        try:
            info = self.link.call(lambda s: s.Info(tpb.TrainerInfoRequest(), **self.link.kw))
        except ApiError as e:
            raise ValueError(f"tinker.trainer: {e.message}") from None
        self._check(cfg, info)
        log.info("tinker: training models live in %s (%s; %d held)", self.where, info.model_path, info.models)

    def _check(self, cfg: Config, info) -> None:
        from transformers import AutoConfig

        vocab = int(getattr(AutoConfig.from_pretrained(cfg.model.path), "vocab_size", 0) or 0)
        problems = []
        if vocab and info.vocab_size != vocab:
            problems.append(f"it trains a model of {info.vocab_size} tokens where model.path's has {vocab}")
        if info.max_request_bytes < cfg.tinker.max_request_bytes:
            problems.append(
                f"it reads requests of at most {info.max_request_bytes} bytes, under this API's "
                f"tinker.max_request_bytes {cfg.tinker.max_request_bytes}"
            )
        if cfg.rpc.max_message_mb << 20 < cfg.tinker.max_request_bytes * 2:
            problems.append(
                f"rpc.max_message_mb {cfg.rpc.max_message_mb} is too small for a forward_backward of "
                f"tinker.max_request_bytes {cfg.tinker.max_request_bytes} and its answer"
            )
        if problems:
            raise ValueError(f"tinker.trainer: {self.where} cannot serve this API: " + "; ".join(problems))

    def create(self, model_id: str, spec: ModelSpec) -> Model:
        pb_spec = tpb.TrainerModelSpec(rank=spec.rank, targets=list(spec.targets), seed=spec.seed)
        create = tpb.TrainerCreate(model=model_id, spec=pb_spec, owner=self.owner)
        self.link.call(lambda s: s.Create(create, **self.link.kw))
        return RemoteModel(self.link, model_id, spec)

    def close(self) -> None:
        self.link.close()


class RemoteModel:
    """A training model held by a trainer over `link`, by the API's id. A training call the trainer
    stayed away for may or may not have run there: the model is then not known, and refused."""

    def __init__(self, link: Link, model_id: str, spec: ModelSpec):
        self.link, self.id, self.spec = link, model_id, spec
        self.ref = tpb.TrainerModelRef(model=model_id)
        self.unknown: str | None = None  # why what the trainer holds is not known

    def _train(self, what: str, rpc: Callable[[trainer_pb2_grpc.TrainerStub], T]) -> T:
        """A call that changes the model: refused once the model is not known; a trainer that stays
        away leaves it not known (whether the call ran there cannot be told)."""
        if self.unknown is not None:
            raise ApiError(400, self.unknown, param="model_id", code="server_restarted")
        try:
            return self.link.call(rpc)
        except ApiError as e:
            if e.code == "trainer_unavailable":
                self.unknown = (
                    f"model {self.id}: {self.link.where} did not answer a {what}, which may or may not have run "
                    "there, so the model's state is not known. Create a training client from your last checkpoint "
                    "(ServiceClient.create_training_client_from_state_with_optimizer)"
                )
            raise

    def forward_backward(self, call: Call) -> bytes:
        req = tpb.TrainerForwardBackward(model=self.id, op=call.op, request=call.body, backward=call.backward)
        return self._train("forward_backward", lambda s: s.ForwardBackward(req, **self.link.kw)).output

    def optim_step(self, adam: Adam, op: str = "") -> dict[str, float]:
        req = tpb.TrainerOptimStep(
            model=self.id,
            op=op,
            learning_rate=adam.learning_rate,
            beta1=adam.betas[0],
            beta2=adam.betas[1],
            eps=adam.eps,
            weight_decay=adam.weight_decay,
            grad_clip_norm=adam.grad_clip_norm,
        )
        return dict(self._train("optim_step", lambda s: s.OptimStep(req, **self.link.kw)).metrics)

    def sampler_weights(self) -> dict[str, torch.Tensor]:
        return self.link.call(lambda s: assemble_weights(s.SamplerWeights(self.ref, **self.link.kw))[2])

    def save(self, file: Path) -> None:
        """The trainer's saved state, as it streams it, into `file`."""

        def fetch(s) -> None:
            chunks = s.SaveState(self.ref, **self.link.kw)
            header = next(chunks).header
            got = 0
            with open(file, "wb") as f:
                for chunk in chunks:
                    got += len(chunk.data)
                    f.write(chunk.data)
            if got != header.total_bytes:
                raise ApiError(502, f"{self.link.where} sent {got} bytes of a {header.total_bytes}-byte state")

        self.link.call(fetch)

    def load(self, file: Path, optimizer: bool) -> None:
        """The state in `file` sent to the trainer, which loads it over this model."""

        def chunks():
            header = tpb.TrainerStateHeader(model=self.id, optimizer=optimizer, total_bytes=file.stat().st_size)
            yield tpb.TrainerStateChunk(header=header)
            with open(file, "rb") as f:
                while data := f.read(STATE_CHUNK):
                    yield tpb.TrainerStateChunk(data=data)

        self._train("load_state", lambda s: s.LoadState(chunks(), **self.link.kw))

    def release(self) -> None:
        """The model dropped on the trainer: one try, briefly (a trainer that is away has lost it, or
        drops it when the next API process creates a model)."""
        try:
            self.link.once.Drop(self.ref, timeout=RELEASE_S, metadata=self.link.kw["metadata"])
        except grpc.RpcError as e:
            log.warning("model %s: not dropped by %s: %s", self.id, self.link.where, e.code().name)


def trainer_for(cfg: Config) -> Trainer:
    """The trainer `tinker.trainer` names: a trainer server's address, or none (this process)."""
    if cfg.tinker.trainer:
        return OverGrpc(cfg, cfg.tinker.trainer)
    return InProcess(cfg)
