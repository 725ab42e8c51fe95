"""The Redis connection of the replay store's parts (streams.py, registry.py, fence.py): timeouts,
retries through a Redis restart, errors that say which operation on which Redis failed, and the
base every part shares (the client and the run's namespace)."""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import redis
from redis.backoff import ExponentialBackoff
from redis.exceptions import BusyLoadingError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeout
from redis.retry import Retry

if TYPE_CHECKING:
    from ..config_sections import ReplayConfig

# A Redis restart (kill -9, a pod rescheduled) is ridden through: every command that finds the
# connection gone (or Redis still loading its AOF) reconnects and is repeated, with backoff up to
# 2 s, for about a minute. The store's writes are safe to repeat (see the contracts above).
REDIS_RETRIES = 40
REDIS_BACKOFF_CAP_S = 2.0
# Every command has a deadline: a Redis that accepts connections but never answers (stopped,
# partitioned) times out instead of blocking its caller forever. Connecting may take
# REDIS_CONNECT_TIMEOUT_S; a reply REDIS_REPLY_S beyond the longest blocking read (block_ms).
REDIS_CONNECT_TIMEOUT_S = 5.0
REDIS_REPLY_S = 10.0


def socket_timeout_s(replay_cfg: ReplayConfig) -> float:
    """Seconds a Redis command waits for its reply: the longest blocking stream read the store
    makes (replay.block_ms; its methods' default 500 ms) plus REDIS_REPLY_S."""
    return max(replay_cfg.block_ms, 500) / 1000 + REDIS_REPLY_S


def redis_worst_s(replay_cfg: ReplayConfig) -> float:
    """The longest one store call can take against a Redis that never answers: each of its
    1 + REDIS_RETRIES tries waits out the socket timeout, then the backoff (at most its cap)."""
    return (REDIS_RETRIES + 1) * (max(socket_timeout_s(replay_cfg), REDIS_CONNECT_TIMEOUT_S) + REDIS_BACKOFF_CAP_S)


PIPELINE_ERROR = " of pipeline caused error: "  # redis-py's annotation of a pipelined command's error


def redis_error_code(e: BaseException) -> str | None:
    """The code of a Redis error reply (`NOGROUP`, `BUSYGROUP`, `WRONGTYPE`, ...): its first word,
    which RESP defines as the machine-readable kind of the error; None for anything else. (In a
    pipeline redis-py puts "Command # N (...) of pipeline caused error: " before the reply.)"""
    if not isinstance(e, redis.ResponseError) or not e.args:
        return None
    reply = str(e.args[0]).rsplit(PIPELINE_ERROR, 1)[-1]
    words = reply.split(maxsplit=1)
    return words[0] if words and words[0].isupper() else None


def connect(replay_cfg: ReplayConfig, url: str | None = None) -> redis.Redis:
    url = url or replay_cfg.url
    if not url:
        raise ValueError(
            "replay.url is not set: start the system with `rlhf up` (it runs an embedded Redis), "
            "or point replay.url at a Redis server (redis://host:6379/0)"
        )
    client = redis.Redis.from_url(
        url,
        password=replay_cfg.resolved_password() or None,
        socket_keepalive=True,
        health_check_interval=30,
        socket_timeout=socket_timeout_s(replay_cfg),
        socket_connect_timeout=REDIS_CONNECT_TIMEOUT_S,
        retry=Retry(ExponentialBackoff(cap=REDIS_BACKOFF_CAP_S, base=0.05), REDIS_RETRIES),
        retry_on_error=[RedisConnectionError, RedisTimeout, BusyLoadingError],
    )
    try:
        client.ping()
    except (RedisTimeout, RedisConnectionError) as e:
        raise type(e)(
            f"replay store connect to redis {redis_peer(client)}: {e} (socket timeout "
            f"{socket_timeout_s(replay_cfg):g} s)"
        ) from e
    return client


def redis_peer(client) -> str:
    """host:port (or the socket path) a client talks to, for messages."""
    kw = getattr(getattr(client, "connection_pool", None), "connection_kwargs", {}) or {}
    if "path" in kw:
        return str(kw["path"])
    return f"{kw.get('host', '?')}:{kw.get('port', '?')}"


def says_where(fn):
    """A store method whose Redis timeouts and lost connections (after the client's retries) say
    which operation and which Redis: 'replay store read_trajectories on redis 10.0.0.7:6379: ...'."""

    @functools.wraps(fn)
    def inner(self, *args, **kwargs):
        try:
            return fn(self, *args, **kwargs)
        except (RedisTimeout, RedisConnectionError) as e:
            if getattr(e, "where", None):  # said by a wrapped method this one called
                raise
            where = f"replay store {fn.__name__} on redis {redis_peer(self.r)}"
            kw = getattr(self.r.connection_pool, "connection_kwargs", {}) or {}
            try:
                said = type(e)(f"{where}: {e} (socket timeout {kw.get('socket_timeout')} s)")
            except Exception:  # an exception class that takes other arguments: as it was
                raise e from None
            said.where = where
            raise said from e

    return inner


def says_where_everywhere(cls):
    """Every public method `cls` defines (not class or static methods) wrapped in `says_where`."""
    for name, fn in list(vars(cls).items()):
        if callable(fn) and not name.startswith("_") and not isinstance(fn, (classmethod, staticmethod)):
            setattr(cls, name, says_where(fn))
    return cls


class RedisPart:
    """A part of the replay store: a Redis client and the run's namespace (every key is `ns:...`)."""

    def __init__(self, client: redis.Redis, namespace: str = "rlhf"):
        self.r = client
        self.ns = namespace

    def now(self) -> float:
        """Redis's clock (every process's heartbeats are compared on one clock)."""
        s, us = self.r.time()
        return s + us / 1e6
