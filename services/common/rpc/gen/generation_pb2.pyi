from . import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class ChatMessage(_message.Message):
    __slots__ = ("role", "content")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ...) -> None: ...

class Chat(_message.Message):
    __slots__ = ("messages",)
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    def __init__(self, messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ...) -> None: ...

class Prompt(_message.Message):
    __slots__ = ("tokens", "text", "chat", "first_prompt_tokens")
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    CHAT_FIELD_NUMBER: _ClassVar[int]
    FIRST_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    tokens: TokenIds
    text: str
    chat: Chat
    first_prompt_tokens: int
    def __init__(self, tokens: _Optional[_Union[TokenIds, _Mapping]] = ..., text: _Optional[str] = ..., chat: _Optional[_Union[Chat, _Mapping]] = ..., first_prompt_tokens: _Optional[int] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("n", "temperature", "top_p", "top_k", "max_new_tokens", "stop_token_ids", "seed")
    N_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    n: int
    temperature: float
    top_p: float
    top_k: int
    max_new_tokens: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    seed: int
    def __init__(self, n: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., max_new_tokens: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., seed: _Optional[int] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("prompts", "params")
    PROMPTS_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    prompts: _containers.RepeatedCompositeFieldContainer[Prompt]
    params: SamplingParams
    def __init__(self, prompts: _Optional[_Iterable[_Union[Prompt, _Mapping]]] = ..., params: _Optional[_Union[SamplingParams, _Mapping]] = ...) -> None: ...

class Completion(_message.Message):
    __slots__ = ("token_ids", "log_probs", "finish_reason", "text", "token_versions")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOG_PROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_VERSIONS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    log_probs: _containers.RepeatedScalarFieldContainer[float]
    finish_reason: str
    text: str
    token_versions: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., log_probs: _Optional[_Iterable[float]] = ..., finish_reason: _Optional[str] = ..., text: _Optional[str] = ..., token_versions: _Optional[_Iterable[int]] = ...) -> None: ...

class PromptResult(_message.Message):
    __slots__ = ("prompt_token_ids", "completions")
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    COMPLETIONS_FIELD_NUMBER: _ClassVar[int]
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    completions: _containers.RepeatedCompositeFieldContainer[Completion]
    def __init__(self, prompt_token_ids: _Optional[_Iterable[int]] = ..., completions: _Optional[_Iterable[_Union[Completion, _Mapping]]] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("results", "policy_version")
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[PromptResult]
    policy_version: int
    def __init__(self, results: _Optional[_Iterable[_Union[PromptResult, _Mapping]]] = ..., policy_version: _Optional[int] = ...) -> None: ...

class InfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GenerationInfo(_message.Message):
    __slots__ = ("model", "backend", "policy_version", "vocab_size", "prompt_length", "response_length", "eos_token_id", "pad_token_id", "engine_version", "dtype", "device", "partial_updates")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_LENGTH_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    PAD_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    ENGINE_VERSION_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    PARTIAL_UPDATES_FIELD_NUMBER: _ClassVar[int]
    model: str
    backend: str
    policy_version: int
    vocab_size: int
    prompt_length: int
    response_length: int
    eos_token_id: int
    pad_token_id: int
    engine_version: str
    dtype: str
    device: str
    partial_updates: bool
    def __init__(self, model: _Optional[str] = ..., backend: _Optional[str] = ..., policy_version: _Optional[int] = ..., vocab_size: _Optional[int] = ..., prompt_length: _Optional[int] = ..., response_length: _Optional[int] = ..., eos_token_id: _Optional[int] = ..., pad_token_id: _Optional[int] = ..., engine_version: _Optional[str] = ..., dtype: _Optional[str] = ..., device: _Optional[str] = ..., partial_updates: _Optional[bool] = ...) -> None: ...

class SharedWeights(_message.Message):
    __slots__ = ("file_name", "file_bytes", "header", "piece_bytes", "digest", "piece_digests")
    FILE_NAME_FIELD_NUMBER: _ClassVar[int]
    FILE_BYTES_FIELD_NUMBER: _ClassVar[int]
    HEADER_FIELD_NUMBER: _ClassVar[int]
    PIECE_BYTES_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    PIECE_DIGESTS_FIELD_NUMBER: _ClassVar[int]
    file_name: str
    file_bytes: int
    header: _common_pb2.WeightHeader
    piece_bytes: int
    digest: str
    piece_digests: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, file_name: _Optional[str] = ..., file_bytes: _Optional[int] = ..., header: _Optional[_Union[_common_pb2.WeightHeader, _Mapping]] = ..., piece_bytes: _Optional[int] = ..., digest: _Optional[str] = ..., piece_digests: _Optional[_Iterable[int]] = ...) -> None: ...

class ScoredSequence(_message.Message):
    __slots__ = ("token_ids", "prompt_tokens")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    prompt_tokens: int
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., prompt_tokens: _Optional[int] = ...) -> None: ...

class ScoreTokensRequest(_message.Message):
    __slots__ = ("sequences",)
    SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    sequences: _containers.RepeatedCompositeFieldContainer[ScoredSequence]
    def __init__(self, sequences: _Optional[_Iterable[_Union[ScoredSequence, _Mapping]]] = ...) -> None: ...

class TokenLogProbs(_message.Message):
    __slots__ = ("log_probs",)
    LOG_PROBS_FIELD_NUMBER: _ClassVar[int]
    log_probs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, log_probs: _Optional[_Iterable[float]] = ...) -> None: ...

class ScoreTokensResponse(_message.Message):
    __slots__ = ("results", "policy_version", "dtype")
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[TokenLogProbs]
    policy_version: int
    dtype: str
    def __init__(self, results: _Optional[_Iterable[_Union[TokenLogProbs, _Mapping]]] = ..., policy_version: _Optional[int] = ..., dtype: _Optional[str] = ...) -> None: ...
