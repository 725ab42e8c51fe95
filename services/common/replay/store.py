"""The replay buffer on Redis Streams, and the registry of live services.

Keys, under the run's namespace `ns`:

    ns:prompts       stream, group "workers"   PromptTask records the learner feeds
    ns:trajectories  stream, group "learner"   TrajectoryGroup records the workers produce
    ns:dead          stream                    prompts no worker could process (with the error)
    ns:produced      set   "uid#attempt"       a prompt attempt already has its trajectory
    ns:trained       set   "uid"               prompts whose update is checkpointed
    ns:version       int                       the newest policy version (only goes up)
    ns:generation    hash  address -> json     generation servers, with a heartbeat
    ns:workers       hash  name -> json        rollout workers, with a heartbeat
    ns:learner       hash                      the learner's address and version

The contracts (docs/architecture.md, "Data contracts that keep samples safe"):
- a prompt is acknowledged in the same atomic script that appends its trajectories (`produce`);
  a second attempt of the same prompt (a reclaimed entry whose first worker was only slow)
  appends nothing;
- a trajectory stays pending in the learner's group until the checkpoint that includes its update
  is written, then `commit` acknowledges it and records its prompt as trained, atomically;
- a consumer that died leaves pending entries; `claim_prompts` reclaims the ones idle longer than
  `claim_idle_s` (XAUTOCLAIM) before reading new ones.
Records are protobuf (`proto/rlhf/v1/replay.proto`); nothing is pickled.
"""
from __future__ import annotations

import functools
import hashlib
import hmac
import json
import logging
from typing import Iterable

import redis
from redis.backoff import ExponentialBackoff
from redis.exceptions import BusyLoadingError, ConnectionError as RedisConnectionError, TimeoutError as RedisTimeout
from redis.retry import Retry

from ..rpc.gen import replay_pb2 as rpb

log = logging.getLogger(__name__)

WORKERS_GROUP = "workers"
LEARNER_GROUP = "learner"
LEARNER_CONSUMER = "learner"

# KEYS: produced, trajectories, prompts   ARGV: group, prompt entry id, "uid#attempt", payload
_PRODUCE = """
local added = redis.call('SADD', KEYS[1], ARGV[3])
if added == 1 then redis.call('XADD', KEYS[2], '*', 'd', ARGV[4]) end
redis.call('XACK', KEYS[3], ARGV[1], ARGV[2])
redis.call('XDEL', KEYS[3], ARGV[2])
return added
"""
# KEYS: dead, prompts   ARGV: group, prompt entry id, payload, error, worker
_DEAD_LETTER = """
redis.call('XADD', KEYS[1], '*', 'd', ARGV[3], 'error', ARGV[4], 'worker', ARGV[5])
redis.call('XACK', KEYS[2], ARGV[1], ARGV[2])
redis.call('XDEL', KEYS[2], ARGV[2])
return 1
"""


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


def socket_timeout_s(replay_cfg) -> float:
    """Seconds a Redis command waits for its reply: the longest blocking stream read the store
    makes (replay.block_ms; its methods' default 500 ms) plus REDIS_REPLY_S."""
    return max(replay_cfg.block_ms, 500) / 1000 + REDIS_REPLY_S


def redis_worst_s(replay_cfg) -> float:
    """The longest one store call can take against a Redis that never answers: each of its
    1 + REDIS_RETRIES tries waits out the socket timeout, then the backoff (at most its cap)."""
    return (REDIS_RETRIES + 1) * (max(socket_timeout_s(replay_cfg), REDIS_CONNECT_TIMEOUT_S) + REDIS_BACKOFF_CAP_S)


def connect(replay_cfg, url: str | None = None) -> redis.Redis:
    url = url or replay_cfg.url
    if not url:
        raise ValueError("replay.url is not set: start the system with `rlhf up` (it runs an embedded Redis), "
                         "or point replay.url at a Redis server (redis://host:6379/0)")
    client = redis.Redis.from_url(url, password=replay_cfg.resolved_password() or None,
                                  socket_keepalive=True, health_check_interval=30,
                                  socket_timeout=socket_timeout_s(replay_cfg),
                                  socket_connect_timeout=REDIS_CONNECT_TIMEOUT_S,
                                  retry=Retry(ExponentialBackoff(cap=REDIS_BACKOFF_CAP_S, base=0.05), REDIS_RETRIES),
                                  retry_on_error=[RedisConnectionError, RedisTimeout, BusyLoadingError])
    try:
        client.ping()
    except (RedisTimeout, RedisConnectionError) as e:
        raise type(e)(f"replay store connect to redis {redis_peer(client)}: {e} (socket timeout "
                      f"{socket_timeout_s(replay_cfg):g} s)") from e
    return client


def redis_peer(client) -> str:
    """host:port (or the socket path) a client talks to, for messages."""
    kw = getattr(getattr(client, "connection_pool", None), "connection_kwargs", {}) or {}
    if "path" in kw:
        return str(kw["path"])
    return f"{kw.get('host', '?')}:{kw.get('port', '?')}"


def _says_where(fn):
    """A store method whose Redis timeouts and lost connections (after the client's retries) say
    which operation and which Redis: 'replay store read_trajectories on redis 10.0.0.7:6379: ...'."""
    @functools.wraps(fn)
    def inner(self, *args, **kwargs):
        try:
            return fn(self, *args, **kwargs)
        except (RedisTimeout, RedisConnectionError) as e:
            where = f"replay store {fn.__name__} on redis {redis_peer(self.r)}"
            if str(e).startswith(where):
                raise
            kw = getattr(self.r.connection_pool, "connection_kwargs", {}) or {}
            try:
                said = type(e)(f"{where}: {e} (socket timeout {kw.get('socket_timeout')} s)")
            except Exception:  # an exception class that takes other arguments: as it was
                raise e from None
            raise said from e
    return inner


def registration_proof(secret: str, kind: str, name: str) -> str:
    """HMAC of a registry entry's kind and address with the run's auth token: only a holder of
    the token can register an address others will send the token and the weights to."""
    return hmac.new(secret.encode(), f"{kind}|{name}".encode(), hashlib.sha256).hexdigest()


class ReplayStore:
    def __init__(self, client: redis.Redis, namespace: str = "rlhf", claim_idle_s: float = 30.0,
                 heartbeat_ttl_s: float = 10.0, secret: str | None = None):
        self.r = client
        self.secret = secret  # the auth token: registry entries carry a proof of it
        self._refused: set[str] = set()
        self.ns = namespace
        self.prompts, self.trajectories, self.dead = f"{namespace}:prompts", f"{namespace}:trajectories", f"{namespace}:dead"
        self.produced, self.trained = f"{namespace}:produced", f"{namespace}:trained"
        self.version_key, self.learner_key = f"{namespace}:version", f"{namespace}:learner"
        self.generation_key, self.workers_key = f"{namespace}:generation", f"{namespace}:workers"
        self.claim_idle_ms = int(claim_idle_s * 1000)
        self.heartbeat_ttl_s = heartbeat_ttl_s
        self._produce = self.r.register_script(_PRODUCE)
        self._dead_letter = self.r.register_script(_DEAD_LETTER)
        self.ensure_groups()

    @classmethod
    def from_config(cls, cfg, url: str | None = None) -> "ReplayStore":
        rc = cfg.replay
        return cls(connect(rc, url), rc.namespace, rc.claim_idle_s, rc.heartbeat_ttl_s,
                   secret=cfg.rpc.resolved_auth_token())

    def ensure_groups(self) -> None:
        for stream, group in ((self.prompts, WORKERS_GROUP), (self.trajectories, LEARNER_GROUP)):
            try:
                self.r.xgroup_create(stream, group, id="0", mkstream=True)
            except redis.ResponseError as e:
                if "BUSYGROUP" not in str(e):
                    raise

    def reset(self) -> int:
        """Delete every key of this namespace (a fresh run); returns how many."""
        keys = list(self.r.scan_iter(match=f"{self.ns}:*", count=1000))
        if keys:
            self.r.delete(*keys)
        self.ensure_groups()
        return len(keys)

    def now(self) -> float:
        s, us = self.r.time()
        return s + us / 1e6

    # ------------------------------------------------------------------ prompts (learner -> workers)
    def feed(self, tasks: Iterable[rpb.PromptTask]) -> int:
        pipe = self.r.pipeline(transaction=True)
        n = 0
        for t in tasks:
            pipe.xadd(self.prompts, {"d": t.SerializeToString()})
            n += 1
        pipe.execute()
        return n

    @staticmethod
    def _decode(entries, cls) -> list[tuple[bytes, object]]:
        out = []
        for entry_id, fields in entries:
            if not fields:  # deleted while pending (XAUTOCLAIM reports it with no fields)
                continue
            msg = cls()
            msg.ParseFromString(fields[b"d"])
            out.append((entry_id, msg))
        return out

    def reclaim_prompts(self, consumer: str, count: int) -> list[tuple[bytes, rpb.PromptTask]]:
        """Take over prompts pending longer than claim_idle_s at another (presumably dead) worker."""
        res = self.r.xautoclaim(self.prompts, WORKERS_GROUP, consumer, self.claim_idle_ms, "0-0", count=count)
        return self._decode(res[1], rpb.PromptTask)

    def claim_prompts(self, consumer: str, count: int, block_ms: int = 500) -> tuple[list, int]:
        """Up to `count` prompts for `consumer`: reclaimed ones first, then new ones (blocking up
        to block_ms). Returns (entries, how many of them were reclaimed)."""
        got = self.reclaim_prompts(consumer, count)
        if got:
            return got, len(got)
        res = self.r.xreadgroup(WORKERS_GROUP, consumer, {self.prompts: ">"}, count=count, block=block_ms)
        return (self._decode(res[0][1], rpb.PromptTask) if res else []), 0

    def renew_claims(self, consumer: str, entry_ids: list) -> int:
        """A live worker still works on these prompts: reset their idle time (XCLAIM to itself) so
        no other worker reclaims them. Returns how many it still holds."""
        if not entry_ids:
            return 0
        return len(self.r.xclaim(self.prompts, WORKERS_GROUP, consumer, 0, entry_ids, justid=True))

    def produce(self, items: list[tuple[bytes, rpb.TrajectoryGroup]]) -> list[bool]:
        """For each (prompt entry id, group): append the prompt's trajectories and acknowledge the
        prompt, atomically (one script call per prompt, all in one round trip). False where this
        attempt of the prompt already had its trajectories (nothing appended)."""
        pipe = self.r.pipeline(transaction=False)
        for entry_id, group in items:
            self._produce(keys=[self.produced, self.trajectories, self.prompts],
                          args=[WORKERS_GROUP, entry_id, f"{group.task.uid}#{group.task.attempt}",
                                group.SerializeToString()], client=pipe)
        return [bool(x) for x in pipe.execute()]

    def dead_letter(self, prompt_entry_id: bytes, task: rpb.PromptTask, error: str, worker: str) -> None:
        self._dead_letter(keys=[self.dead, self.prompts],
                          args=[WORKERS_GROUP, prompt_entry_id, task.SerializeToString(), error[:2000], worker])

    def read_dead(self, after: bytes | str = "0-0", count: int = 1000) -> list[tuple[bytes, rpb.PromptTask, str]]:
        res = self.r.xread({self.dead: after}, count=count)
        out = []
        for entry_id, fields in (res[0][1] if res else []):
            t = rpb.PromptTask()
            t.ParseFromString(fields[b"d"])
            out.append((entry_id, t, fields.get(b"error", b"").decode()))
        return out

    def prompt_backlog(self) -> int:
        return int(self.r.xlen(self.prompts))

    def prompt_queue(self) -> tuple[int, int]:
        """(waiting, pending) of the prompt stream: `waiting` = prompts not done, whether not yet
        delivered to any worker or delivered and pending; `pending` = the latter. A prompt is
        acknowledged and deleted in one script (`produce`, `dead_letter`), so the stream holds
        exactly the prompts not done (XLEN); XPENDING counts the delivered ones. Redis 6.2 has
        both (XINFO GROUPS' `lag` is 7.0's)."""
        pipe = self.r.pipeline(transaction=True)
        pipe.xlen(self.prompts)
        pipe.xpending(self.prompts, WORKERS_GROUP)
        length, pending = pipe.execute()
        pending = int(pending["pending"])
        return max(int(length), pending), pending

    # ------------------------------------------------------------------ trajectories (workers -> learner)
    def read_trajectories(self, count: int, block_ms: int = 500, pending: bool = False) -> list:
        """Up to `count` groups. pending=True re-reads the learner's own unacknowledged entries
        (after a restart) instead of new ones."""
        res = self.r.xreadgroup(LEARNER_GROUP, LEARNER_CONSUMER, {self.trajectories: "0" if pending else ">"},
                                count=count, block=None if pending else block_ms)
        return self._decode(res[0][1], rpb.TrajectoryGroup) if res else []

    def learner_pending(self) -> int:
        return int(self.r.xpending(self.trajectories, LEARNER_GROUP)["pending"])

    def backlog(self) -> int:
        """Trajectory groups produced and not yet read by the learner."""
        pipe = self.r.pipeline(transaction=False)
        pipe.xlen(self.trajectories)
        pipe.xpending(self.trajectories, LEARNER_GROUP)
        length, pending = pipe.execute()
        return max(int(length) - int(pending["pending"]), 0)

    def discard(self, entry_id: bytes, refeed: rpb.PromptTask | None = None) -> None:
        """Acknowledge and delete a trajectory that will not be trained on (stale or a duplicate);
        with `refeed`, put its prompt back in the same transaction."""
        pipe = self.r.pipeline(transaction=True)
        if refeed is not None:
            pipe.xadd(self.prompts, {"d": refeed.SerializeToString()})
        pipe.xack(self.trajectories, LEARNER_GROUP, entry_id)
        pipe.xdel(self.trajectories, entry_id)
        pipe.execute()

    def commit(self, entries: list[tuple[bytes, str]]) -> None:
        """The update that used these (entry id, prompt uid) is checkpointed: acknowledge the
        trajectories and record their prompts as trained, atomically."""
        if not entries:
            return
        ids = [e for e, _ in entries]
        pipe = self.r.pipeline(transaction=True)
        pipe.sadd(self.trained, *[u for _, u in entries])
        pipe.xack(self.trajectories, LEARNER_GROUP, *ids)
        pipe.xdel(self.trajectories, *ids)
        pipe.execute()

    def trained_among(self, uids: list[str]) -> list[bool]:
        return [bool(x) for x in self.r.smismember(self.trained, uids)] if uids else []

    def trained_count(self) -> int:
        return int(self.r.scard(self.trained))

    # ------------------------------------------------------------------ policy version and registry
    def version(self) -> int:
        return int(self.r.get(self.version_key) or 0)

    def next_version(self) -> int:
        return int(self.r.incr(self.version_key))

    def raise_version_to(self, version: int) -> None:
        """Make the version counter at least `version` (it never goes down)."""
        self.r.set(self.version_key, max(version, self.version()))

    def new_learner_epoch(self) -> int:
        """A learner process starts: its epoch, above every earlier one's (the fencing token its
        weight pushes carry)."""
        return int(self.r.incr(f"{self.ns}:learner_epoch"))

    def publish_learner(self, address: str, version: int, run_id: str = "", epoch: int = 0) -> None:
        """The learner's address, its newest published policy version and its identity (run id,
        epoch): generation servers accept weight pushes only from this writer."""
        self.r.hset(self.learner_key, mapping={"address": address, "version": version, "run_id": run_id,
                                               "epoch": epoch, "ts": self.now()})

    def learner_info(self) -> dict:
        """{address, version, run_id, epoch, ts} as strings; {} before a learner published."""
        raw = self.r.hgetall(self.learner_key)
        return {k.decode(): v.decode() for k, v in raw.items()}

    def heartbeat(self, kind: str, name: str, **info) -> None:
        key = self.generation_key if kind == "generation" else self.workers_key
        if self.secret:
            info["proof"] = registration_proof(self.secret, kind, name)
        self.r.hset(key, name, json.dumps({**info, "ts": self.now()}))

    def _proven(self, kind: str, name: str, info: dict) -> bool:
        if not self.secret:
            return True
        ok = hmac.compare_digest(str(info.get("proof", "")), registration_proof(self.secret, kind, name))
        if not ok and name not in self._refused:
            self._refused.add(name)
            log.warning("ignoring the %s registration of %s: it does not prove it holds the run's auth token",
                        kind, name)
        return ok

    def deregister(self, kind: str, name: str) -> None:
        self.r.hdel(self.generation_key if kind == "generation" else self.workers_key, name)

    def live(self, kind: str) -> dict[str, dict]:
        """Registered services whose last heartbeat is within heartbeat_ttl_s; stale entries are removed."""
        key = self.generation_key if kind == "generation" else self.workers_key
        now = self.now()
        out, stale = {}, []
        for name, raw in self.r.hgetall(key).items():
            info = json.loads(raw)
            if now - info["ts"] <= self.heartbeat_ttl_s:
                if self._proven(kind, name.decode(), info):
                    out[name.decode()] = info
            else:
                stale.append(name)
        if stale:
            self.r.hdel(key, *stale)
            log.info("removed %d %s registration(s) without a heartbeat for %.0fs", len(stale), kind,
                     self.heartbeat_ttl_s)
        return out


for _name, _fn in list(vars(ReplayStore).items()):
    if callable(_fn) and not _name.startswith("_") and not isinstance(_fn, (classmethod, staticmethod)):
        setattr(ReplayStore, _name, _says_where(_fn))
