"""Per-session retention of stored state: a TTL for what a conversation saved.

Reuse is content-addressed, so session ids are optional. When requests carry one and a TTL is
set, the chunks a session's requests saved are deleted from every store tier once the session has
had no request in flight for longer than the TTL (the conversation is over). Chunks that another
live session also saved (a shared system prompt or document) are kept until it expires too.

Session ids come from clients, so the bookkeeping is bounded: past `max_sessions`, the idle session
seen longest ago is forgotten. Its chunks are then left to the tiers' eviction (kept past its TTL),
and no longer protect chunks it shares with a session that expires later; what that costs is a
recompute, never another cache partition's state (the server scopes session ids to tenants, and
tenants' chunks have different keys).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

MAX_SESSIONS = 4096


@dataclass
class _Session:
    last_seen: float
    keys: set[str] = field(default_factory=set)
    in_flight: int = 0


class SessionRetention:
    def __init__(self, ttl_s: float, max_sessions: int = MAX_SESSIONS):
        if ttl_s <= 0:
            raise ValueError(f"session TTL must be positive seconds, got {ttl_s}")
        self.ttl_s = ttl_s
        self.max_sessions = max_sessions
        self.sessions: OrderedDict[str, _Session] = OrderedDict()  # least recently seen first
        self.forgotten = 0

    def arrived(self, session_id: str, keys: list[str], now: float) -> None:
        s = self._seen(session_id, now)
        s.in_flight += 1
        s.keys.update(keys)

    def finished(self, session_id: str, keys: list[str], now: float) -> None:
        s = self._seen(session_id, now)
        s.in_flight = max(0, s.in_flight - 1)
        s.keys.update(keys)

    def _seen(self, session_id: str, now: float) -> _Session:
        s = self.sessions.get(session_id)
        if s is None:
            self._make_room()
            s = self.sessions[session_id] = _Session(now)
        self.sessions.move_to_end(session_id)
        s.last_seen = now
        return s

    def _make_room(self) -> None:
        """Forget the idle sessions seen longest ago until a new one fits under the cap."""
        while len(self.sessions) >= self.max_sessions:
            sid = next((k for k, v in self.sessions.items() if not v.in_flight), None)
            if sid is None:
                return  # every session has a request in flight: those are bounded by the queue
            del self.sessions[sid]
            self.forgotten += 1

    def expire(self, now: float) -> tuple[list[str], set[str]]:
        """-> (sessions that expired, chunk keys only they held); forgets those sessions."""
        gone = [sid for sid, s in self.sessions.items() if not s.in_flight and now - s.last_seen > self.ttl_s]
        dead = set().union(*(self.sessions.pop(sid).keys for sid in gone)) if gone else set()
        live = set().union(*(s.keys for s in self.sessions.values())) if self.sessions else set()
        return gone, dead - live
