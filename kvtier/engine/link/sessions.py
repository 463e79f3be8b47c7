"""Per-session retention of stored state: a TTL for what a conversation saved.

Reuse is content-addressed, so session ids are optional. When requests carry one and a TTL is
set, the chunks a session's requests saved are deleted from every store tier once the session has
had no request in flight for longer than the TTL (the conversation is over). Chunks that another
live session also saved (a shared system prompt or document) are kept until it expires too.

Session ids come from clients, so the bookkeeping is bounded, per cache partition (a request's
cache salt: the server's tenant) and in all: past either cap, the idle session of that partition
(or of any, for the global cap) seen longest ago is forgotten. A flood of new ids from one tenant
therefore forgets that tenant's own sessions first. A forgotten session's chunks are left to the
tiers' eviction (kept past its TTL) and no longer protect chunks it shares with a session that
expires later; that costs a recompute, never another partition's state (tenants' chunks have
different keys).
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from dataclasses import dataclass, field

MAX_SESSIONS = 4096
MAX_SESSIONS_PER_PARTITION = 1024


@dataclass
class _Session:
    last_seen: float
    partition: str  # the cache salt of its requests
    keys: set[str] = field(default_factory=set)
    in_flight: int = 0


class SessionRetention:
    def __init__(self, ttl_s: float, max_sessions: int = MAX_SESSIONS,
                 max_per_partition: int = MAX_SESSIONS_PER_PARTITION):
        if ttl_s <= 0:
            raise ValueError(f"session TTL must be positive seconds, got {ttl_s}")
        self.ttl_s = ttl_s
        self.max_sessions = max_sessions
        self.max_per_partition = max_per_partition
        self.sessions: OrderedDict[str, _Session] = OrderedDict()  # least recently seen first
        self.per_partition: Counter[str] = Counter()
        self.forgotten = 0

    def arrived(self, session_id: str, keys: list[str], now: float, partition: str = "") -> None:
        s = self._seen(session_id, now, partition)
        s.in_flight += 1
        s.keys.update(keys)

    def finished(self, session_id: str, keys: list[str], now: float, partition: str = "") -> None:
        s = self._seen(session_id, now, partition)
        s.in_flight = max(0, s.in_flight - 1)
        s.keys.update(keys)

    def _seen(self, session_id: str, now: float, partition: str) -> _Session:
        s = self.sessions.get(session_id)
        if s is None:
            self._make_room(partition)
            s = self.sessions[session_id] = _Session(now, partition)
            self.per_partition[partition] += 1
        self.sessions.move_to_end(session_id)
        s.last_seen = now
        return s

    def _make_room(self, partition: str) -> None:
        """Forget idle sessions seen longest ago until a new one of `partition` fits under both caps."""
        while self.per_partition[partition] >= self.max_per_partition and self._forget_oldest(partition):
            pass
        while len(self.sessions) >= self.max_sessions and self._forget_oldest(None):
            pass

    def _forget_oldest(self, partition: str | None) -> bool:
        """Forget the idle session (of `partition`, or of any) seen longest ago; False if none is
        idle (sessions with a request in flight are bounded by the queue)."""
        sid = next((k for k, v in self.sessions.items()
                    if not v.in_flight and (partition is None or v.partition == partition)), None)
        if sid is None:
            return False
        self._drop(sid)
        self.forgotten += 1
        return True

    def _drop(self, sid: str) -> _Session:
        s = self.sessions.pop(sid)
        self.per_partition[s.partition] -= 1
        if not self.per_partition[s.partition]:
            del self.per_partition[s.partition]
        return s

    def expire(self, now: float) -> tuple[list[str], set[str]]:
        """-> (sessions that expired, chunk keys only they held); forgets those sessions."""
        gone = [sid for sid, s in self.sessions.items() if not s.in_flight and now - s.last_seen > self.ttl_s]
        dead = set().union(*(self._drop(sid).keys for sid in gone)) if gone else set()
        live = set().union(*(s.keys for s in self.sessions.values())) if self.sessions else set()
        return gone, dead - live
