"""Passwords out of anything that gets printed: `redact("redis://:pw@h:6379")` -> "redis://:***@h:6379".

Every place that logs, prints or raises with a store spec or a Redis URL goes through `redact`, so
a password given in the URL never reaches a terminal, a log file or a stats endpoint. It works on
free text too (a whole comma-separated spec, an error message, a log line), for any scheme
(redis, rediss, redis+cluster, rediss+cluster, ...).
"""
from __future__ import annotations

import re

MASK = "***"

# scheme://[user]:PASSWORD@ -- the password runs to the last '@' of the token, as urlsplit reads a
# netloc (a password with an unencoded '@' is cut where the client cuts it). The token ends at
# whitespace or a quote only, not at '/', '?', ',' or '#': a malformed URL (a password with an
# unencoded '/' or ',') is masked too, at worst with more than its password. Masking too much is
# harmless; leaking is not.
_USERINFO = re.compile(r"(?P<head>[A-Za-z][A-Za-z0-9+.-]*://[^\s'\"<>:/?#@]*):[^\s'\"<>]*@")
# ?password=... or &password=...: a query form redis-py's own URL parser accepts.
_QUERY = re.compile(r"(?P<head>[?&;]password=)[^&\s'\"<>#]*", re.IGNORECASE)


def redact(text: object) -> str:
    """`text` (a URL, a spec, a message, an exception) as a string with every URL password masked."""
    s = str(text)
    if "@" in s:
        s = _USERINFO.sub(rf"\g<head>:{MASK}@", s)
    if "password=" in s.lower():
        s = _QUERY.sub(rf"\g<head>{MASK}", s)
    return s
