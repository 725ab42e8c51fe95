import itertools

import pytest

from services.common.replay import ReplayStore

_ns = itertools.count()


@pytest.fixture
def store(redis_server):
    import redis

    s = ReplayStore(
        redis.Redis.from_url(redis_server.url), namespace=f"test{next(_ns)}", claim_idle_s=0.3, heartbeat_ttl_s=1.0
    )
    yield s
    s.reset()
