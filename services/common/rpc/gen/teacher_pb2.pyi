from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TeacherSequence(_message.Message):
    __slots__ = ("prompt_ids", "response_ids")
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_IDS_FIELD_NUMBER: _ClassVar[int]
    prompt_ids: _containers.RepeatedScalarFieldContainer[int]
    response_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, prompt_ids: _Optional[_Iterable[int]] = ..., response_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class TeacherScoreRequest(_message.Message):
    __slots__ = ("sequences", "top_k")
    SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    sequences: _containers.RepeatedCompositeFieldContainer[TeacherSequence]
    top_k: int
    def __init__(self, sequences: _Optional[_Iterable[_Union[TeacherSequence, _Mapping]]] = ..., top_k: _Optional[int] = ...) -> None: ...

class TeacherTokenScores(_message.Message):
    __slots__ = ("log_probs", "top_ids", "top_log_probs")
    LOG_PROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOG_PROBS_FIELD_NUMBER: _ClassVar[int]
    log_probs: _containers.RepeatedScalarFieldContainer[float]
    top_ids: _containers.RepeatedScalarFieldContainer[int]
    top_log_probs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, log_probs: _Optional[_Iterable[float]] = ..., top_ids: _Optional[_Iterable[int]] = ..., top_log_probs: _Optional[_Iterable[float]] = ...) -> None: ...

class TeacherScoreResponse(_message.Message):
    __slots__ = ("results", "top_k")
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[TeacherTokenScores]
    top_k: int
    def __init__(self, results: _Optional[_Iterable[_Union[TeacherTokenScores, _Mapping]]] = ..., top_k: _Optional[int] = ...) -> None: ...

class TeacherInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TeacherInfo(_message.Message):
    __slots__ = ("model_path", "vocab_size", "dtype", "tokenizer_fingerprint", "incarnation", "started_at")
    MODEL_PATH_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    STARTED_AT_FIELD_NUMBER: _ClassVar[int]
    model_path: str
    vocab_size: int
    dtype: str
    tokenizer_fingerprint: str
    incarnation: str
    started_at: float
    def __init__(self, model_path: _Optional[str] = ..., vocab_size: _Optional[int] = ..., dtype: _Optional[str] = ..., tokenizer_fingerprint: _Optional[str] = ..., incarnation: _Optional[str] = ..., started_at: _Optional[float] = ...) -> None: ...
