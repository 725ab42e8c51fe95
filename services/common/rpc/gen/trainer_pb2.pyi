from . import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TrainerModelSpec(_message.Message):
    __slots__ = ("rank", "targets", "seed")
    RANK_FIELD_NUMBER: _ClassVar[int]
    TARGETS_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    rank: int
    targets: _containers.RepeatedScalarFieldContainer[str]
    seed: int
    def __init__(self, rank: _Optional[int] = ..., targets: _Optional[_Iterable[str]] = ..., seed: _Optional[int] = ...) -> None: ...

class TrainerCreate(_message.Message):
    __slots__ = ("model", "spec", "owner")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    OWNER_FIELD_NUMBER: _ClassVar[int]
    model: str
    spec: TrainerModelSpec
    owner: str
    def __init__(self, model: _Optional[str] = ..., spec: _Optional[_Union[TrainerModelSpec, _Mapping]] = ..., owner: _Optional[str] = ...) -> None: ...

class TrainerModelRef(_message.Message):
    __slots__ = ("model",)
    MODEL_FIELD_NUMBER: _ClassVar[int]
    model: str
    def __init__(self, model: _Optional[str] = ...) -> None: ...

class TrainerModelState(_message.Message):
    __slots__ = ("model", "steps", "pending")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    PENDING_FIELD_NUMBER: _ClassVar[int]
    model: str
    steps: int
    pending: int
    def __init__(self, model: _Optional[str] = ..., steps: _Optional[int] = ..., pending: _Optional[int] = ...) -> None: ...

class TrainerForwardBackward(_message.Message):
    __slots__ = ("model", "op", "request", "backward")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    OP_FIELD_NUMBER: _ClassVar[int]
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    BACKWARD_FIELD_NUMBER: _ClassVar[int]
    model: str
    op: str
    request: bytes
    backward: bool
    def __init__(self, model: _Optional[str] = ..., op: _Optional[str] = ..., request: _Optional[bytes] = ..., backward: _Optional[bool] = ...) -> None: ...

class TrainerForwardBackwardResult(_message.Message):
    __slots__ = ("output",)
    OUTPUT_FIELD_NUMBER: _ClassVar[int]
    output: bytes
    def __init__(self, output: _Optional[bytes] = ...) -> None: ...

class TrainerOptimStep(_message.Message):
    __slots__ = ("model", "op", "learning_rate", "beta1", "beta2", "eps", "weight_decay", "grad_clip_norm")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    OP_FIELD_NUMBER: _ClassVar[int]
    LEARNING_RATE_FIELD_NUMBER: _ClassVar[int]
    BETA1_FIELD_NUMBER: _ClassVar[int]
    BETA2_FIELD_NUMBER: _ClassVar[int]
    EPS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_DECAY_FIELD_NUMBER: _ClassVar[int]
    GRAD_CLIP_NORM_FIELD_NUMBER: _ClassVar[int]
    model: str
    op: str
    learning_rate: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    grad_clip_norm: float
    def __init__(self, model: _Optional[str] = ..., op: _Optional[str] = ..., learning_rate: _Optional[float] = ..., beta1: _Optional[float] = ..., beta2: _Optional[float] = ..., eps: _Optional[float] = ..., weight_decay: _Optional[float] = ..., grad_clip_norm: _Optional[float] = ...) -> None: ...

class TrainerOptimStepResult(_message.Message):
    __slots__ = ("metrics",)
    class MetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    METRICS_FIELD_NUMBER: _ClassVar[int]
    metrics: _containers.ScalarMap[str, float]
    def __init__(self, metrics: _Optional[_Mapping[str, float]] = ...) -> None: ...

class TrainerStateChunk(_message.Message):
    __slots__ = ("header", "data")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    header: TrainerStateHeader
    data: bytes
    def __init__(self, header: _Optional[_Union[TrainerStateHeader, _Mapping]] = ..., data: _Optional[bytes] = ...) -> None: ...

class TrainerStateHeader(_message.Message):
    __slots__ = ("model", "optimizer", "total_bytes")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    OPTIMIZER_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    model: str
    optimizer: bool
    total_bytes: int
    def __init__(self, model: _Optional[str] = ..., optimizer: _Optional[bool] = ..., total_bytes: _Optional[int] = ...) -> None: ...

class TrainerInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TrainerInfo(_message.Message):
    __slots__ = ("model_path", "vocab_size", "models", "max_models", "max_request_bytes", "incarnation", "started_at")
    MODEL_PATH_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    MODELS_FIELD_NUMBER: _ClassVar[int]
    MAX_MODELS_FIELD_NUMBER: _ClassVar[int]
    MAX_REQUEST_BYTES_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    STARTED_AT_FIELD_NUMBER: _ClassVar[int]
    model_path: str
    vocab_size: int
    models: int
    max_models: int
    max_request_bytes: int
    incarnation: str
    started_at: float
    def __init__(self, model_path: _Optional[str] = ..., vocab_size: _Optional[int] = ..., models: _Optional[int] = ..., max_models: _Optional[int] = ..., max_request_bytes: _Optional[int] = ..., incarnation: _Optional[str] = ..., started_at: _Optional[float] = ...) -> None: ...
