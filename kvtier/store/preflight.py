"""Check a store spec's tiers before a slow start (the model load, the machine profile), so a bad
store costs a second and one line naming the fix, not minutes and a traceback.

Checked: the spec parses; the memory tier fits in this machine's RAM; each disk directory exists
or can be made, takes a file, and its filesystem is at least as large as its tier; Redis answers
a PING with its credentials. At run time the same problems are only misses (a Redis outage, a
full disk); at startup they are configuration errors.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile

from kvtier.store.seal import Seal
from kvtier.store.spec import DiskSpec, MemorySpec, RedisSpec, StoreSpec, parse_spec

log = logging.getLogger(__name__)


class StoreUnusable(ValueError):
    """A tier that cannot work as given (the message names the tier and the fix)."""


def _gb(n: int) -> str:
    return f"{n / 1e9:.1f} GB"


def check_memory(spec: MemorySpec) -> None:
    try:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # not a POSIX system that reports it
        return
    if spec.capacity > ram:
        raise StoreUnusable(f"the memory tier ({_gb(spec.capacity)}) is larger than this machine's RAM ({_gb(ram)}): "
                            "give memory:SIZE in --store a smaller size")


def check_disk(spec: DiskSpec) -> None:
    from kvtier.store.safe_paths import makedirs_private

    for path, capacity in zip(spec.paths, spec.capacities):
        try:
            makedirs_private(path)
            with tempfile.NamedTemporaryFile(dir=path, prefix=".kvtier-check-"):
                pass
        except OSError as e:
            raise StoreUnusable(f"the disk tier's directory {path} is not writable ({e.strerror or e}): give a "
                                "directory this user can write in --store (disk:PATH:SIZE)") from None
        usage = shutil.disk_usage(path)
        if capacity > usage.total:
            raise StoreUnusable(f"the disk tier at {path} is given {_gb(capacity)} but its filesystem holds "
                                f"{_gb(usage.total)}: give disk:{path}:SIZE a smaller size")
        if capacity > usage.free:
            # Not an error: the tier evicts, and other files may be deleted; saves fail while full.
            log.warning("the disk tier at %s is given %s but only %s are free there", path, _gb(capacity),
                        _gb(usage.free))


def check_redis(spec: RedisSpec) -> None:
    from kvtier.store.tiers.redis_tier import connect_checked

    connect_checked(spec).close()  # a ConnectionError naming the fix when down or refusing the password


def check_store(text: str) -> None:
    """Raise StoreUnusable (or ConnectionError for Redis) on the first tier of `text` that cannot work."""
    spec = parse_spec(text)
    if spec.memory is not None:
        check_memory(spec.memory)
    if spec.disk is not None:
        check_disk(spec.disk)
    if spec.redis is not None:
        check_redis(spec.redis)


def warn_if_unsealed(spec: StoreSpec, seal: Seal) -> None:
    """One warning when a Redis tier is used without a store secret. Redis is the tier other
    servers (and whoever else holds its credentials) write to; unsealed, a well-formed chunk
    anyone stores there is served as this prompt's state. A disk tier gets no such line: nothing
    in its spec says whether another process writes its directory."""
    if spec.redis is None or seal.sealed:
        return
    kind = "Redis Cluster" if spec.redis.cluster else "Redis"
    log.warning("the %s tier %s is not sealed: anyone who can write to that %s can plant state this server will "
                "serve; give every server of this store the same secret with --store-secret-file FILE "
                "(docs/serve.md, Security)", kind, spec.redis.url, kind)
