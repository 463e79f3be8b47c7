"""Measure once, keep the result: one JSON cache under KVTIER_HOME for every calibration.

Each job names its kind (a folder: profiles, partial, probes) and a key that says what the value
depends on (model fingerprint, dtype, threads or device, options). A value that is missing or
unreadable is measured and written atomically; nothing here times anything itself.
"""

from __future__ import annotations

import json
import logging
import os
import re
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from kvtier import paths

log = logging.getLogger(__name__)

T = TypeVar("T")


def cache_path(kind: str, key: str, home: Path | None = None) -> Path:
    safe = re.sub(r"[^A-Za-z0-9._-]+", "_", key)
    return (home or paths.home()) / kind / f"{safe}.json"


def load(kind: str, key: str, decode: Callable[[dict[str, Any]], T], home: Path | None = None) -> T | None:
    """The cached value, or None when there is none or it cannot be read (a warning says which)."""
    path = cache_path(kind, key, home)
    try:
        text = path.read_text()
    except OSError:
        return None
    try:
        return decode(json.loads(text))
    except (ValueError, TypeError, KeyError) as e:
        log.warning("ignoring an unreadable %s cache %s (%s)", kind, path, e)
        return None


def save(kind: str, key: str, doc: dict[str, Any], home: Path | None = None) -> Path:
    return write_json(cache_path(kind, key, home), doc)


def write_json(path: Path, doc: dict[str, Any]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    # a name of this writer's own: two processes saving one key at once each replace whole
    tmp = path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    tmp.write_text(json.dumps(doc, indent=2))
    tmp.replace(path)  # readers see the old file or the new one, never half of one
    return path


def load_or_measure(kind: str, key: str, measure: Callable[[], T], decode: Callable[[dict[str, Any]], T],
                    encode: Callable[[T], dict[str, Any]], refresh: bool = False, home: Path | None = None) -> T:
    """The cached value for (kind, key), else `measure()` now and cache it."""
    if not refresh:
        got = load(kind, key, decode, home)
        if got is not None:
            return got
    log.info("measuring %s for %s (once; cached under %s)", kind, key, cache_path(kind, key, home).parent)
    value = measure()
    save(kind, key, encode(value), home)
    return value
