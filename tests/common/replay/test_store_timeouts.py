"""Every Redis command of the replay store has a deadline: the client is built with a socket
timeout (longer than the longest blocking stream read) and a connect timeout, so a Redis that
accepts connections and never answers (stopped, partitioned) ends each call in bounded time
instead of blocking its caller forever; the error then names the store operation and the Redis."""

import socket
import threading
import time

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from services.common.config import config_from_dict
from services.common.replay import ReplayStore
from services.common.replay import connection as store_mod


@pytest.fixture
def silent_redis():
    """A TCP server that accepts connections and never answers a byte."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(16)
    held, stop = [], threading.Event()

    def accept():
        srv.settimeout(0.1)
        while not stop.is_set():
            try:
                held.append(srv.accept()[0])
            except OSError:
                pass

    t = threading.Thread(target=accept, daemon=True)
    t.start()
    yield srv.getsockname()[1]
    stop.set()
    t.join(5)
    for c in held:
        c.close()
    srv.close()


def test_the_client_has_a_socket_timeout_beyond_the_longest_blocking_read(redis_server):
    cfg = config_from_dict({"replay": {"url": redis_server.url, "block_ms": 2000}})
    client = store_mod.connect(cfg.replay)
    kw = client.connection_pool.connection_kwargs
    assert kw["socket_timeout"] == 2.0 + store_mod.REDIS_REPLY_S
    assert kw["socket_connect_timeout"] == store_mod.REDIS_CONNECT_TIMEOUT_S
    assert store_mod.socket_timeout_s(config_from_dict({}).replay) == 0.5 + store_mod.REDIS_REPLY_S
    # a blocking read of block_ms still works under that timeout
    s = ReplayStore(client, namespace="timeouts")
    t0 = time.monotonic()
    assert s.read_trajectories(1, block_ms=300) == []
    assert 0.25 < time.monotonic() - t0 < 60  # it blocked for its block_ms, and it ended
    s.reset()


def test_connecting_to_a_redis_that_never_answers_ends_in_bounded_time(silent_redis, monkeypatch):
    monkeypatch.setattr(store_mod, "REDIS_REPLY_S", 0.2)
    monkeypatch.setattr(store_mod, "REDIS_RETRIES", 1)
    cfg = config_from_dict({"replay": {"url": f"redis://127.0.0.1:{silent_redis}/0", "block_ms": 100}})
    t0 = time.monotonic()
    with pytest.raises(redis.exceptions.TimeoutError, match=f"127.0.0.1:{silent_redis}"):
        store_mod.connect(cfg.replay)
    assert time.monotonic() - t0 < 60  # ended (forever is what this rules out)


def test_a_store_call_that_times_out_names_the_operation_and_the_redis(silent_redis):
    client = redis.Redis(
        host="127.0.0.1",
        port=silent_redis,
        socket_timeout=0.3,
        socket_connect_timeout=1,
        retry=Retry(NoBackoff(), 1),
        retry_on_error=[redis.exceptions.TimeoutError],
    )
    t0 = time.monotonic()
    with pytest.raises(redis.exceptions.TimeoutError) as e:
        ReplayStore(client, namespace="silent")  # its first command: ensure_groups
    assert time.monotonic() - t0 < 60  # ended (forever is what this rules out)
    assert str(e.value).startswith(f"replay store ensure_groups on redis 127.0.0.1:{silent_redis}: Timeout reading")
    assert str(e.value).endswith("(socket timeout 0.3 s)")


def test_a_method_calling_another_says_where_once(silent_redis):
    """heartbeat reads the server's clock first (`now`, itself wrapped): the error names one
    operation and one Redis, not a prefix per wrapped call."""
    from services.common.replay.registry import Registry

    client = redis.Redis(
        host="127.0.0.1",
        port=silent_redis,
        socket_timeout=0.3,
        socket_connect_timeout=1,
        retry=Retry(NoBackoff(), 1),
        retry_on_error=[redis.exceptions.TimeoutError],
    )
    with pytest.raises(redis.exceptions.TimeoutError) as e:
        Registry(client, namespace="silent").heartbeat("generation", "gen-1")
    assert str(e.value).count("replay store ") == 1 and str(e.value).count("(socket timeout") == 1, str(e.value)
    assert f"on redis 127.0.0.1:{silent_redis}" in str(e.value)
