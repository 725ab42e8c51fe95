from . import common_pb2 as _common_pb2
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class PullWeightsRequest(_message.Message):
    __slots__ = ("have_policy_version",)
    HAVE_POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    have_policy_version: int
    def __init__(self, have_policy_version: _Optional[int] = ...) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class LearnerStatus(_message.Message):
    __slots__ = ("iteration", "total_iterations", "policy_version", "state", "last_reward", "last_eval_reward", "trained_groups", "dropped_stale", "duplicates", "generation_servers", "replay_backlog", "uptime_s", "reward_hacking_suspected")
    ITERATION_FIELD_NUMBER: _ClassVar[int]
    TOTAL_ITERATIONS_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    LAST_REWARD_FIELD_NUMBER: _ClassVar[int]
    LAST_EVAL_REWARD_FIELD_NUMBER: _ClassVar[int]
    TRAINED_GROUPS_FIELD_NUMBER: _ClassVar[int]
    DROPPED_STALE_FIELD_NUMBER: _ClassVar[int]
    DUPLICATES_FIELD_NUMBER: _ClassVar[int]
    GENERATION_SERVERS_FIELD_NUMBER: _ClassVar[int]
    REPLAY_BACKLOG_FIELD_NUMBER: _ClassVar[int]
    UPTIME_S_FIELD_NUMBER: _ClassVar[int]
    REWARD_HACKING_SUSPECTED_FIELD_NUMBER: _ClassVar[int]
    iteration: int
    total_iterations: int
    policy_version: int
    state: str
    last_reward: float
    last_eval_reward: float
    trained_groups: int
    dropped_stale: int
    duplicates: int
    generation_servers: int
    replay_backlog: int
    uptime_s: float
    reward_hacking_suspected: bool
    def __init__(self, iteration: _Optional[int] = ..., total_iterations: _Optional[int] = ..., policy_version: _Optional[int] = ..., state: _Optional[str] = ..., last_reward: _Optional[float] = ..., last_eval_reward: _Optional[float] = ..., trained_groups: _Optional[int] = ..., dropped_stale: _Optional[int] = ..., duplicates: _Optional[int] = ..., generation_servers: _Optional[int] = ..., replay_backlog: _Optional[int] = ..., uptime_s: _Optional[float] = ..., reward_hacking_suspected: _Optional[bool] = ...) -> None: ...
