"""Per-session retention of stored state: a TTL for what a conversation saved.

Reuse is content-addressed, so session ids are optional. When requests carry one and a TTL is
set, the chunks a session's requests saved are deleted from every store tier once the session has
had no request in flight for longer than the TTL (the conversation is over). Chunks that another
live session also saved (a shared system prompt or document) are kept until it expires too.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class _Session:
    last_seen: float
    keys: set[str] = field(default_factory=set)
    in_flight: int = 0


class SessionRetention:
    def __init__(self, ttl_s: float):
        if ttl_s <= 0:
            raise ValueError(f"session TTL must be positive seconds, got {ttl_s}")
        self.ttl_s = ttl_s
        self.sessions: dict[str, _Session] = {}

    def arrived(self, session_id: str, keys: list[str], now: float) -> None:
        s = self.sessions.setdefault(session_id, _Session(now))
        s.in_flight += 1
        s.keys.update(keys)
        s.last_seen = now

    def finished(self, session_id: str, keys: list[str], now: float) -> None:
        s = self.sessions.setdefault(session_id, _Session(now))
        s.in_flight = max(0, s.in_flight - 1)
        s.keys.update(keys)
        s.last_seen = now

    def expire(self, now: float) -> tuple[list[str], set[str]]:
        """-> (sessions that expired, chunk keys only they held); forgets those sessions."""
        gone = [sid for sid, s in self.sessions.items() if not s.in_flight and now - s.last_seen > self.ttl_s]
        dead = set().union(*(self.sessions.pop(sid).keys for sid in gone)) if gone else set()
        live = set().union(*(s.keys for s in self.sessions.values())) if self.sessions else set()
        return gone, dead - live
