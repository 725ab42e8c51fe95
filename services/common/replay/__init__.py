"""The Redis replay buffer shared by the learner, rollout workers and generation servers: its
streams, the registry of live services and the version fence (store.py says which is where)."""

from .connection import connect, redis_error_code  # noqa: F401
from .fence import VersionFence  # noqa: F401
from .registry import Registry  # noqa: F401
from .store import ReplayStore  # noqa: F401
from .streams import ReplayStreams  # noqa: F401
