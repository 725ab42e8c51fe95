from . import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ValuesRequest(_message.Message):
    __slots__ = ("batch",)
    BATCH_FIELD_NUMBER: _ClassVar[int]
    batch: _common_pb2.TokenBatch
    def __init__(self, batch: _Optional[_Union[_common_pb2.TokenBatch, _Mapping]] = ...) -> None: ...

class ValuesResponse(_message.Message):
    __slots__ = ("values",)
    VALUES_FIELD_NUMBER: _ClassVar[int]
    values: _common_pb2.Tensor
    def __init__(self, values: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ...) -> None: ...

class TrainRequest(_message.Message):
    __slots__ = ("batch", "returns", "old_values")
    BATCH_FIELD_NUMBER: _ClassVar[int]
    RETURNS_FIELD_NUMBER: _ClassVar[int]
    OLD_VALUES_FIELD_NUMBER: _ClassVar[int]
    batch: _common_pb2.TokenBatch
    returns: _common_pb2.Tensor
    old_values: _common_pb2.Tensor
    def __init__(self, batch: _Optional[_Union[_common_pb2.TokenBatch, _Mapping]] = ..., returns: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., old_values: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ...) -> None: ...

class TrainResponse(_message.Message):
    __slots__ = ("metrics", "step")
    class MetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    METRICS_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    metrics: _containers.ScalarMap[str, float]
    step: int
    def __init__(self, metrics: _Optional[_Mapping[str, float]] = ..., step: _Optional[int] = ...) -> None: ...

class CheckpointRequest(_message.Message):
    __slots__ = ("path",)
    PATH_FIELD_NUMBER: _ClassVar[int]
    path: str
    def __init__(self, path: _Optional[str] = ...) -> None: ...

class CheckpointResponse(_message.Message):
    __slots__ = ("path", "step")
    PATH_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    path: str
    step: int
    def __init__(self, path: _Optional[str] = ..., step: _Optional[int] = ...) -> None: ...

class CriticInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class CriticInfo(_message.Message):
    __slots__ = ("step", "loaded_from", "incarnation", "started_at")
    STEP_FIELD_NUMBER: _ClassVar[int]
    LOADED_FROM_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    STARTED_AT_FIELD_NUMBER: _ClassVar[int]
    step: int
    loaded_from: str
    incarnation: str
    started_at: float
    def __init__(self, step: _Optional[int] = ..., loaded_from: _Optional[str] = ..., incarnation: _Optional[str] = ..., started_at: _Optional[float] = ...) -> None: ...
