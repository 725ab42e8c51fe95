"""The sessions of an agents' endpoint by id (`Sessions`): each forgotten after its time to live
idle, the longest idle first past a count and past a total of bytes (`Session.bytes`); a session a
turn starts kept only once a turn of it succeeds; a forgotten session's id remembered so that its
next turn is refused (`Forgotten`), not started afresh without the turns before."""

from __future__ import annotations

import threading
import time
import uuid
from collections import OrderedDict

from .sessions import Session


class Forgotten(LookupError):
    """A turn names a session this endpoint forgot (`why`: one of `Sessions.EVICTIONS`): its
    earlier turns are gone, so the turn cannot go on from them token-exactly."""

    def __init__(self, session_id: str, why: str):
        super().__init__(session_id, why)
        self.session_id, self.why = session_id, why


class Sessions:
    """The gateway's sessions by id, each forgotten after `ttl_s` idle; at most `limit` of them
    and, with `max_bytes`, at most that many bytes of them all (`Session.bytes`): the longest
    idle goes first. `max_session_bytes`: what one session may hold before its next turn is
    refused (the gateway asks `over_limit`). A forgotten session's id is remembered for `ttl_s`
    (the newest `limit` of them): a turn naming it is refused (`Forgotten`), not started afresh
    as a session whose record would lack the turns before."""

    EVICTIONS = ("idle", "count", "bytes")  # why a session was forgotten (`evicted`)

    def __init__(
        self,
        ttl_s: float = 3600.0,
        limit: int = 10_000,
        create_unknown: bool = True,
        max_bytes: int | None = None,
        max_session_bytes: int | None = None,
    ):
        """`create_unknown`: a request naming an unknown session starts it (the endpoint for any
        client); False: only `open` starts one (a rollout worker's own endpoint, whose sessions
        the worker opens and ends: a late request of an ended one is refused)."""
        self.ttl_s, self.limit, self.create_unknown = ttl_s, limit, create_unknown
        self.max_bytes, self.max_session_bytes = max_bytes, max_session_bytes
        self._by_id: OrderedDict[str, Session] = OrderedDict()  # the longest idle first
        # new sessions no turn has succeeded in yet, each with its turns in flight
        self._pending: dict[str, tuple[Session, int]] = {}
        self._forgotten: OrderedDict[str, tuple[str, float]] = OrderedDict()  # id: (why, when), oldest first
        self._lock = threading.Lock()
        self.bytes = 0  # what the sessions hold together (each as of its last turn)
        self.evicted = dict.fromkeys(self.EVICTIONS, 0)

    def get(self, session_id: str | None, create: bool | None = None) -> Session | None:
        """The session `session_id` names; an unknown one is started (a fresh id when None) if
        `create` (default `create_unknown`), else None."""
        create = self.create_unknown if create is None else create
        now = time.monotonic()
        with self._lock:
            while self._by_id and now - next(iter(self._by_id.values())).used > self.ttl_s:
                self._drop(next(iter(self._by_id)), "idle")
            sid = session_id or uuid.uuid4().hex
            session = self._by_id.get(sid)
            if session is None:
                if not create:
                    return None
                session = Session(sid)
                self._admit(session)
            session.used = now
            self._by_id.move_to_end(sid)
            return session

    def begin(self, session_id: str | None) -> Session | None:
        """The session a turn is for: the one `session_id` names, or, for an unknown one (a fresh
        id when None) when `create_unknown`, a new session that is not kept, counted or let evict
        another until a turn of it succeeds (`settle`); None for an unknown one otherwise. Turns of
        one new id at once share its new session. A forgotten one: `Forgotten`."""
        if not self.create_unknown:
            return self.get(session_id)
        sid = session_id or uuid.uuid4().hex
        with self._lock:
            found = self._by_id.get(sid)
            if found is not None:
                found.used = time.monotonic()
                self._by_id.move_to_end(sid)
                return found
            self._forget_expired()
            if sid in self._forgotten:
                raise Forgotten(sid, self._forgotten[sid][0])
            new, turns = self._pending.get(sid, (None, 0))
            new = new or Session(sid)
            self._pending[sid] = (new, turns + 1)
            return new

    def settle(self, session: Session) -> None:
        """After a turn of `session` (taken or refused), under its lock: a new session that holds a
        turn now is kept (counted, evicting as `get` does); one whose turns all failed is forgotten
        once none is in flight."""
        with self._lock:
            new, turns = self._pending.get(session.id, (None, 0))
            if new is not session:
                return
            if session.segments:
                del self._pending[session.id]
                self._admit(session)
            elif turns <= 1:
                del self._pending[session.id]
            else:
                self._pending[session.id] = (session, turns - 1)

    def _admit(self, session: Session) -> None:
        """Keep `session` (under the lock): the longest idle ones forgotten past the count and the bytes."""
        while len(self._by_id) >= self.limit:
            self._drop(next(iter(self._by_id)), "count")
        self._by_id[session.id] = session
        session.counted = session.bytes
        self.bytes += session.counted
        self._evict_bytes(session.id)
        session.used = time.monotonic()

    def open(self, session_id: str, min_version: int = 0) -> Session:
        """A session of this id (new, or the one there), its turns preferring servers at `min_version`."""
        session = self.get(session_id, create=True)
        assert session is not None
        session.min_version = min_version
        return session

    def over_limit(self, session: Session) -> bool:
        """Whether `session` holds more than `max_session_bytes` (its next turn is refused)."""
        return self.max_session_bytes is not None and session.bytes > self.max_session_bytes

    def resized(self, session: Session) -> None:
        """`session` had a turn (`Session.apply`): count what it holds now, and forget the longest
        idle others while all of them hold more than `max_bytes`."""
        with self._lock:
            if self._by_id.get(session.id) is not session:
                return  # ended or forgotten while its turn was sampled
            self.bytes += session.bytes - session.counted
            session.counted = session.bytes
            self._evict_bytes(session.id)

    def _evict_bytes(self, keep: str) -> None:
        if self.max_bytes is None:
            return
        while self.bytes > self.max_bytes and len(self._by_id) > 1:
            oldest = next(iter(self._by_id))
            if oldest == keep:  # the session in use stays
                oldest = next(s for s in self._by_id if s != keep)
            self._drop(oldest, "bytes")

    def _drop(self, sid: str, why: str) -> None:
        session = self._by_id.pop(sid)
        self.bytes -= session.counted
        self.evicted[why] += 1
        self._forgotten[sid] = (why, time.monotonic())
        while len(self._forgotten) > self.limit:
            self._forgotten.popitem(last=False)

    def _forget_expired(self) -> None:
        """The forgotten ids remembered past `ttl_s` let go (a turn naming one starts it afresh)."""
        now = time.monotonic()
        while self._forgotten and now - next(iter(self._forgotten.values()))[1] > self.ttl_s:
            self._forgotten.popitem(last=False)

    def find(self, session_id: str) -> Session | None:
        with self._lock:
            return self._by_id.get(session_id)

    def end(self, session_id: str) -> Session | None:
        with self._lock:
            session = self._by_id.pop(session_id, None)
            if session is not None:
                self.bytes -= session.counted
            return session

    def __len__(self) -> int:
        with self._lock:
            return len(self._by_id)
