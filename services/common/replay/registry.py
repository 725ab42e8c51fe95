"""The registry of live services: generation servers and rollout workers each keep an entry with
a heartbeat; entries older than `heartbeat_ttl_s` are dropped as they are read. With the run's
auth token, an entry carries a proof of it (an HMAC): only a holder of the token can register an
address others will send the token and the weights to.

Keys, under the run's namespace `ns`:

    ns:generation    hash  address -> json     generation servers, with a heartbeat
    ns:workers       hash  name -> json        rollout workers, with a heartbeat
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
from typing import cast

import redis

from .connection import RedisPart, says_where_everywhere

log = logging.getLogger(__name__)


def registration_proof(secret: str, kind: str, name: str) -> str:
    """HMAC of a registry entry's kind and address with the run's auth token: only a holder of
    the token can register an address others will send the token and the weights to."""
    return hmac.new(secret.encode(), f"{kind}|{name}".encode(), hashlib.sha256).hexdigest()


class Registry(RedisPart):
    def __init__(
        self, client: redis.Redis, namespace: str = "rlhf", heartbeat_ttl_s: float = 10.0, secret: str | None = None
    ):
        super().__init__(client, namespace)
        self._setup_registry(heartbeat_ttl_s, secret)

    def _setup_registry(self, heartbeat_ttl_s: float, secret: str | None) -> None:
        self.secret = secret  # the auth token: registry entries carry a proof of it
        self._refused: set[str] = set()
        self.generation_key, self.workers_key = f"{self.ns}:generation", f"{self.ns}:workers"
        self.heartbeat_ttl_s = heartbeat_ttl_s

    def _key(self, kind: str) -> str:
        return self.generation_key if kind == "generation" else self.workers_key

    def heartbeat(self, kind: str, name: str, **info) -> None:
        key = self._key(kind)
        if self.secret:
            info["proof"] = registration_proof(self.secret, kind, name)
        self.r.hset(key, name, json.dumps({**info, "ts": self.now()}))

    def _proven(self, kind: str, name: str, info: dict) -> bool:
        if not self.secret:
            return True
        ok = hmac.compare_digest(str(info.get("proof", "")), registration_proof(self.secret, kind, name))
        if not ok and name not in self._refused:
            self._refused.add(name)
            log.warning(
                "ignoring the %s registration of %s: it does not prove it holds the run's auth token", kind, name
            )
        return ok

    def deregister(self, kind: str, name: str) -> None:
        self.r.hdel(self._key(kind), name)

    def live(self, kind: str) -> dict[str, dict]:
        """Registered services whose last heartbeat is within heartbeat_ttl_s; stale entries are removed."""
        key = self._key(kind)
        now = self.now()
        out, stale = {}, []
        # bytes: the client decodes no replies (`connect`)
        for name, raw in cast("dict[bytes, bytes]", self.r.hgetall(key)).items():
            info = json.loads(raw)
            if now - info["ts"] <= self.heartbeat_ttl_s:
                if self._proven(kind, name.decode(), info):
                    out[name.decode()] = info
            else:
                stale.append(name)
        if stale:
            self.r.hdel(key, *stale)
            log.info(
                "removed %d %s registration(s) without a heartbeat for %.0fs", len(stale), kind, self.heartbeat_ttl_s
            )
        return out


says_where_everywhere(Registry)
