"""The replay buffer on Redis Streams: prompts the learner feeds to the rollout workers,
trajectories the workers produce for the learner, the dead letters, and the sets that keep a
prompt from being trained on twice.

Keys, under the run's namespace `ns`:

    ns:prompts       stream, group "workers"   PromptTask records the learner feeds
    ns:trajectories  stream, group "learner"   TrajectoryGroup records the workers produce
    ns:dead          stream                    prompts no worker could process (with the error)
    ns:produced      set   "uid#attempt"       a prompt attempt already has its trajectory
    ns:trained       set   "uid"               prompts whose update is checkpointed

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

from typing import TYPE_CHECKING, Any, Iterable, TypeVar, cast

import redis

from ..rpc.gen import replay_pb2 as rpb
from .connection import RedisPart, redis_error_code, says_where_everywhere

if TYPE_CHECKING:
    from google.protobuf.message import Message

_M = TypeVar("_M", bound="Message")

# the reply of a stream read (XREAD, XREADGROUP) in RESP2, the protocol of the clients `connect`
# makes: [[stream, [(entry id, fields), ...]], ...] (redis-py's type is the union of the RESP2 and
# RESP3 replies)
_StreamsReply = list[list[Any]]

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


class ReplayStreams(RedisPart):
    def __init__(self, client: redis.Redis, namespace: str = "rlhf", claim_idle_s: float = 30.0):
        super().__init__(client, namespace)
        self._setup_streams(claim_idle_s)

    def _setup_streams(self, claim_idle_s: float) -> None:
        ns = self.ns
        self.prompts, self.trajectories, self.dead = f"{ns}:prompts", f"{ns}:trajectories", f"{ns}:dead"
        self.produced, self.trained = f"{ns}:produced", f"{ns}:trained"
        self.claim_idle_ms = int(claim_idle_s * 1000)
        self._produce = self.r.register_script(_PRODUCE)
        self._dead_letter = self.r.register_script(_DEAD_LETTER)
        self.ensure_groups()

    def ensure_groups(self) -> None:
        for stream, group in ((self.prompts, WORKERS_GROUP), (self.trajectories, LEARNER_GROUP)):
            try:
                self.r.xgroup_create(stream, group, id="0", mkstream=True)
            except redis.ResponseError as e:
                if redis_error_code(e) != "BUSYGROUP":
                    raise

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
    def _decode(entries: Iterable[Any], cls: type[_M]) -> list[tuple[bytes, _M]]:
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
        res = cast(
            _StreamsReply,
            self.r.xreadgroup(WORKERS_GROUP, consumer, {self.prompts: ">"}, count=count, block=block_ms),
        )
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
            self._produce(
                keys=[self.produced, self.trajectories, self.prompts],
                args=[WORKERS_GROUP, entry_id, f"{group.task.uid}#{group.task.attempt}", group.SerializeToString()],
                client=pipe,
            )
        return [bool(x) for x in pipe.execute()]

    def dead_letter(self, prompt_entry_id: bytes, task: rpb.PromptTask, error: str, worker: str) -> None:
        self._dead_letter(
            keys=[self.dead, self.prompts],
            args=[WORKERS_GROUP, prompt_entry_id, task.SerializeToString(), error[:2000], worker],
        )

    def read_dead(self, after: bytes | str = "0-0", count: int = 1000) -> list[tuple[bytes, rpb.PromptTask, str]]:
        res = cast(_StreamsReply, self.r.xread({self.dead: after}, count=count))
        out = []
        for entry_id, fields in res[0][1] if res else []:
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
        res = cast(
            _StreamsReply,
            self.r.xreadgroup(
                LEARNER_GROUP,
                LEARNER_CONSUMER,
                {self.trajectories: "0" if pending else ">"},
                count=count,
                block=None if pending else block_ms,
            ),
        )
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


says_where_everywhere(ReplayStreams)
