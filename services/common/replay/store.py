"""The replay store: the one Redis namespace of a run, seen whole. Its parts, each usable alone:

    streams.py    ReplayStreams   prompts -> workers -> trajectories -> learner; dead letters, the ledger
    registry.py   Registry        live generation servers and rollout workers (heartbeats, proofs)
    fence.py      VersionFence    the policy version counter, the learner's epoch and address
    connection.py                 connect (timeouts, retries through a Redis restart), the parts' base

`ReplayStore` is all three on one connection (the learner uses every part; a worker or a
generation server several), plus `reset` of the whole namespace.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import redis

from .connection import RedisPart, connect, says_where_everywhere
from .fence import VersionFence
from .registry import Registry
from .streams import ReplayStreams

if TYPE_CHECKING:
    from ..config import Config


class ReplayStore(ReplayStreams, Registry, VersionFence):
    def __init__(
        self,
        client: redis.Redis,
        namespace: str = "rlhf",
        claim_idle_s: float = 30.0,
        heartbeat_ttl_s: float = 10.0,
        secret: str | None = None,
    ):
        RedisPart.__init__(self, client, namespace)
        self._setup_registry(heartbeat_ttl_s, secret)
        self._setup_fence()
        self._setup_streams(claim_idle_s)

    @classmethod
    def from_config(cls, cfg: Config, url: str | None = None) -> "ReplayStore":
        rc = cfg.replay
        return cls(
            connect(rc, url), rc.namespace, rc.claim_idle_s, rc.heartbeat_ttl_s, secret=cfg.rpc.resolved_auth_token()
        )

    def reset(self) -> int:
        """Delete every key of this namespace (a fresh run); returns how many."""
        keys = list(self.r.scan_iter(match=f"{self.ns}:*", count=1000))
        if keys:
            self.r.delete(*keys)
        self.ensure_groups()
        return len(keys)


says_where_everywhere(ReplayStore)
says_where_everywhere(RedisPart)
