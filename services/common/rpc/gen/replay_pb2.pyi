from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PromptTask(_message.Message):
    __slots__ = ("uid", "attempt", "record_id", "epoch", "prompt", "label", "metadata_json", "min_version", "group_size", "fed_at_version")
    UID_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    RECORD_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    LABEL_FIELD_NUMBER: _ClassVar[int]
    METADATA_JSON_FIELD_NUMBER: _ClassVar[int]
    MIN_VERSION_FIELD_NUMBER: _ClassVar[int]
    GROUP_SIZE_FIELD_NUMBER: _ClassVar[int]
    FED_AT_VERSION_FIELD_NUMBER: _ClassVar[int]
    uid: str
    attempt: int
    record_id: str
    epoch: int
    prompt: str
    label: str
    metadata_json: str
    min_version: int
    group_size: int
    fed_at_version: int
    def __init__(self, uid: _Optional[str] = ..., attempt: _Optional[int] = ..., record_id: _Optional[str] = ..., epoch: _Optional[int] = ..., prompt: _Optional[str] = ..., label: _Optional[str] = ..., metadata_json: _Optional[str] = ..., min_version: _Optional[int] = ..., group_size: _Optional[int] = ..., fed_at_version: _Optional[int] = ...) -> None: ...

class Sample(_message.Message):
    __slots__ = ("response_ids", "log_probs", "values", "score", "components", "finish_reason", "text", "loss_mask", "token_versions", "teacher_log_probs", "teacher_top_ids", "teacher_top_log_probs", "teacher_top_k")
    class ComponentsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    RESPONSE_IDS_FIELD_NUMBER: _ClassVar[int]
    LOG_PROBS_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    SCORE_FIELD_NUMBER: _ClassVar[int]
    COMPONENTS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    LOSS_MASK_FIELD_NUMBER: _ClassVar[int]
    TOKEN_VERSIONS_FIELD_NUMBER: _ClassVar[int]
    TEACHER_LOG_PROBS_FIELD_NUMBER: _ClassVar[int]
    TEACHER_TOP_IDS_FIELD_NUMBER: _ClassVar[int]
    TEACHER_TOP_LOG_PROBS_FIELD_NUMBER: _ClassVar[int]
    TEACHER_TOP_K_FIELD_NUMBER: _ClassVar[int]
    response_ids: _containers.RepeatedScalarFieldContainer[int]
    log_probs: bytes
    values: bytes
    score: float
    components: _containers.ScalarMap[str, float]
    finish_reason: str
    text: str
    loss_mask: bytes
    token_versions: _containers.RepeatedScalarFieldContainer[int]
    teacher_log_probs: bytes
    teacher_top_ids: bytes
    teacher_top_log_probs: bytes
    teacher_top_k: int
    def __init__(self, response_ids: _Optional[_Iterable[int]] = ..., log_probs: _Optional[bytes] = ..., values: _Optional[bytes] = ..., score: _Optional[float] = ..., components: _Optional[_Mapping[str, float]] = ..., finish_reason: _Optional[str] = ..., text: _Optional[str] = ..., loss_mask: _Optional[bytes] = ..., token_versions: _Optional[_Iterable[int]] = ..., teacher_log_probs: _Optional[bytes] = ..., teacher_top_ids: _Optional[bytes] = ..., teacher_top_log_probs: _Optional[bytes] = ..., teacher_top_k: _Optional[int] = ...) -> None: ...

class TrajectoryGroup(_message.Message):
    __slots__ = ("task", "prompt_ids", "samples", "policy_version", "worker", "generation_server", "created_at", "generate_seconds", "tokens", "batch_tokens")
    TASK_FIELD_NUMBER: _ClassVar[int]
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    WORKER_FIELD_NUMBER: _ClassVar[int]
    GENERATION_SERVER_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    GENERATE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    BATCH_TOKENS_FIELD_NUMBER: _ClassVar[int]
    task: PromptTask
    prompt_ids: _containers.RepeatedScalarFieldContainer[int]
    samples: _containers.RepeatedCompositeFieldContainer[Sample]
    policy_version: int
    worker: str
    generation_server: str
    created_at: float
    generate_seconds: float
    tokens: int
    batch_tokens: int
    def __init__(self, task: _Optional[_Union[PromptTask, _Mapping]] = ..., prompt_ids: _Optional[_Iterable[int]] = ..., samples: _Optional[_Iterable[_Union[Sample, _Mapping]]] = ..., policy_version: _Optional[int] = ..., worker: _Optional[str] = ..., generation_server: _Optional[str] = ..., created_at: _Optional[float] = ..., generate_seconds: _Optional[float] = ..., tokens: _Optional[int] = ..., batch_tokens: _Optional[int] = ...) -> None: ...
