from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RewardSample(_message.Message):
    __slots__ = ("prompt", "response", "label", "metadata_json")
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_FIELD_NUMBER: _ClassVar[int]
    LABEL_FIELD_NUMBER: _ClassVar[int]
    METADATA_JSON_FIELD_NUMBER: _ClassVar[int]
    prompt: str
    response: str
    label: str
    metadata_json: str
    def __init__(self, prompt: _Optional[str] = ..., response: _Optional[str] = ..., label: _Optional[str] = ..., metadata_json: _Optional[str] = ...) -> None: ...

class ScoreRequest(_message.Message):
    __slots__ = ("samples", "held_out")
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    HELD_OUT_FIELD_NUMBER: _ClassVar[int]
    samples: _containers.RepeatedCompositeFieldContainer[RewardSample]
    held_out: bool
    def __init__(self, samples: _Optional[_Iterable[_Union[RewardSample, _Mapping]]] = ..., held_out: _Optional[bool] = ...) -> None: ...

class Score(_message.Message):
    __slots__ = ("reward", "components")
    class ComponentsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    REWARD_FIELD_NUMBER: _ClassVar[int]
    COMPONENTS_FIELD_NUMBER: _ClassVar[int]
    reward: float
    components: _containers.ScalarMap[str, float]
    def __init__(self, reward: _Optional[float] = ..., components: _Optional[_Mapping[str, float]] = ...) -> None: ...

class ScoreResponse(_message.Message):
    __slots__ = ("scores",)
    SCORES_FIELD_NUMBER: _ClassVar[int]
    scores: _containers.RepeatedCompositeFieldContainer[Score]
    def __init__(self, scores: _Optional[_Iterable[_Union[Score, _Mapping]]] = ...) -> None: ...
