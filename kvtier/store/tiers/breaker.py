"""Fail fast while a remote tier is unreachable, and find it again by itself.

A dead tier must cost a cache miss, not a request: while it is down, calls fail at once (no socket
timeout per request) and the caller treats the failure as a miss or a dropped save. After a backoff
(doubling from `first_backoff` up to `max_backoff`) one call is let through to probe it; the first
success closes the breaker again, so a restarted server is used without restarting kvtier.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import TypeVar

from ..redact import redact

log = logging.getLogger(__name__)
T = TypeVar("T")


class Outage(OSError):
    """The tier could not be reached. A miss (or a dropped save), never evidence of corruption."""


class Refused(OSError):
    """The tier answered with an error (an ACL refusal, a key of the wrong type): a miss, counted
    as a tier error, never evidence that the stored value is bad, never a failed request."""


class Breaker:
    def __init__(self, name: str, errors: tuple[type[BaseException], ...], first_backoff: float = 0.25,
                 max_backoff: float = 5.0) -> None:
        self.name = redact(name)  # it is in every outage message: a URL in it loses its password
        self.errors = errors  # what counts as "unreachable" (not, e.g., a server's refusal to store)
        self.first_backoff, self.max_backoff = first_backoff, max_backoff
        self._lock = threading.Lock()
        self._down_until = 0.0
        self._backoff = 0.0  # 0 while up
        self.outages = 0  # transitions to down
        self.failed_calls = 0  # calls that failed or were refused while down

    @property
    def up(self) -> bool:
        return self._backoff == 0.0

    def call(self, fn: Callable[[], T]) -> T:
        """Run `fn`; raise Outage at once while down, or when `fn` fails with one of `errors`."""
        with self._lock:
            wait = self._down_until - time.monotonic()
            if wait > 0:
                self.failed_calls += 1
                raise Outage(f"{self.name} is unreachable (next try in {wait:.2f} s)")
            if self._backoff:  # this call is the probe: later ones fail fast until it answers
                self._down_until = time.monotonic() + self._backoff
        try:
            out = fn()
        except self.errors as e:
            self._trip(e)
            raise Outage(f"{self.name} is unreachable: {redact(e)}") from e
        if self._backoff:
            with self._lock:
                self._backoff, self._down_until = 0.0, 0.0
            log.warning("%s is reachable again", self.name)
        return out

    def _trip(self, err: BaseException) -> None:
        with self._lock:
            self.failed_calls += 1
            if not self._backoff:
                self.outages += 1
                log.warning("%s is unreachable (%s): treating it as a miss; retrying in the background",
                            self.name, redact(err))
            self._backoff = min(self.max_backoff, max(self.first_backoff, 2 * self._backoff))
            self._down_until = time.monotonic() + self._backoff

    def stats(self) -> dict:
        return dict(up=self.up, outages=self.outages, unavailable=self.failed_calls)
