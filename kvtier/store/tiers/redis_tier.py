"""Redis tier: chunks as Redis strings, shared by every engine process that points at the server.

Keys (prefix configurable, `ns` = store digest so models never mix):
    {prefix}:{ns}:c:{key}       the packed chunk (one SET: readers see all of it or none)
    {prefix}:{ns}:p:{parent}[:{lead}]  set of "tokens:key" for the chunks under `parent` that begin as
                                `lead` says (keys.lead_key; none: too short to have one)
Layer reads use GETRANGE, so one layer (or K without V) costs only its bytes on the wire; a
restore's reads of one layer group over all its chunks go out as one pipeline (one round trip).
Works with a single server or Redis Cluster; capacity is Redis's own (maxmemory) plus an optional TTL.
No operation relies on two keys changing together: a child's set entry is an index that readers
check against the value (dropped when the value is gone), so in a cluster the two may live on
different nodes.

A dead server costs misses and dropped saves, never a failed request: every call goes through a
`Breaker` (short socket timeouts, fail fast while down, probe again after a backoff).
"""
from __future__ import annotations

import math
import re
import warnings
from collections.abc import Sequence
from typing import Iterator

import redis
import torch
from redis.backoff import NoBackoff
from redis.exceptions import ClusterDownError, ClusterError, RedisClusterException
from redis.retry import Retry

from ..format import FormatError, PackedChunk, Segment, check_segment
from ..keys import Child, lead_of
from ..redact import redact
from ..redis_auth import PASSWORD_ENV
from ..spec import RedisSpec
from ..validate import child_entry, is_key
from .base import OpenChunk, PoolTarget, Reader, Segments, Tier, log
from .breaker import Breaker, Outage, Refused

# A request never waits long on a dead tier: connecting and each reply are bounded, and a broken
# pooled connection (the server restarted) gets one immediate retry on a fresh one.
CLIENT_OPTIONS = dict(socket_timeout=1.0, socket_connect_timeout=0.5, retry=Retry(NoBackoff(), 1))
UNREACHABLE = (redis.ConnectionError, redis.TimeoutError, ClusterDownError, ClusterError, OSError)

# Reads only ever read what they get: a tensor over the reply's immutable bytes needs no copy.
warnings.filterwarnings("ignore", message="The given buffer is not writable")


def glob_literal(text: str) -> str:
    """`text` to be matched literally in a SCAN pattern (a prefix given in --store may hold the
    pattern's special characters: * ? [ ] and the backslash)."""
    return re.sub(r"([*?\[\]\\])", r"\\\1", text)


def _child_entry(member: bytes, lead: str) -> Child | None:
    """The child a set member b"tokens:key" names, or None if it is not one."""
    tok, colon, key = member.decode("ascii", "replace").partition(":")
    return child_entry(tok, key, lead) if colon else None


def _tensor(raw: bytes, out: torch.Tensor | None) -> torch.Tensor:
    if not raw:
        return torch.empty(0, dtype=torch.uint8)
    t = torch.frombuffer(raw, dtype=torch.uint8)
    return t if out is None else out[:t.numel()].copy_(t)


class _RedisReader(Reader):
    def __init__(self, tier: "RedisTier", rkey: str, size: int) -> None:
        self.tier = tier
        self.rkey = rkey
        self.size = size

    def read(self, offset: int, nbytes: int, out: torch.Tensor | None = None) -> torch.Tensor:
        if nbytes <= 0:
            return torch.empty(0, dtype=torch.uint8)
        raw = self.tier.call(lambda c: c.getrange(self.rkey, offset, offset + nbytes - 1))
        return _tensor(raw, out)


def connect(spec: RedisSpec) -> redis.Redis | redis.RedisCluster:
    """A client for `spec` with its password, TLS options and this tier's timeouts (not pinged)."""
    options = {**CLIENT_OPTIONS, **spec.auth.client_kwargs()}
    if spec.cluster:
        from redis.cluster import RedisCluster
        return RedisCluster.from_url(spec.url, **options)
    return redis.Redis.from_url(spec.url, **options)


def connect_checked(spec: RedisSpec) -> redis.Redis | redis.RedisCluster:
    """`connect` and ping: a ConnectionError whose one line names the fix when the server is down
    or refuses the password (at startup an unreachable URL is a configuration error)."""
    # spec.url has no password: it comes apart (spec.auth), so the URL is safe in every message.
    url = redact(spec.url)
    try:
        client = connect(spec)
        client.ping()
        return client
    except redis.AuthenticationError as e:  # checked before its base class, ConnectionError
        # Where the password came from, never the password: the message is printed and logged.
        why = redact(e).rstrip(".")
        if spec.auth.password:
            raise ConnectionError(f"Redis at {url} refused the password from {spec.auth.password_from}: "
                                  f"{why}. Fix it there") from e
        raise ConnectionError(f"Redis at {url} wants a password and none was given: {why}. Give it with "
                              f"password_file=PATH in the URL's options or ${PASSWORD_ENV}") from e
    except (redis.RedisError, RedisClusterException) as e:
        raise ConnectionError(
            f"cannot reach Redis at {url}: {redact(e).rstrip('.')}. Start the server or fix the URL in --store"
        ) from e


class RedisTier(Tier):
    name = "redis"

    def __init__(self, spec: RedisSpec, ns: str | None) -> None:
        super().__init__(spec.emulation)
        self.spec = spec
        self.ns = ns
        self.client = connect_checked(spec)
        url = redact(spec.url)
        self.breaker = Breaker(f"redis tier {url}", UNREACHABLE)
        self._admin_keys: dict[str, str] = {}
        self.ex = int(math.ceil(spec.ttl)) if spec.ttl else None

    def call(self, fn):
        """`fn(client)` through the breaker; raises Outage while the server is unreachable and
        Refused when it answers with an error (every caller treats both as a miss)."""
        try:
            return self.breaker.call(lambda: fn(self.client))
        except redis.RedisError as e:  # not an outage (the breaker turned those into Outage)
            raise Refused(f"{type(e).__name__}: {e}") from e

    def _guarded(self, what: str, fn, default):
        """`call(fn)`, or `default` while unreachable or when refused (counted)."""
        try:
            return self.call(fn)
        except Outage:
            return default
        except Refused as e:
            self.refused(what, e)
            return default

    def _c(self, key: str) -> str:
        return f"{self.spec.prefix}:{self.ns}:c:{key}"

    def value_key(self, key: str) -> str:
        """The Redis key a chunk's value lies under (a raw GET of it is the tier's floor)."""
        return self._c(key)

    def _p(self, parent: str, lead: str = "") -> str:
        return f"{self.spec.prefix}:{self.ns}:p:{parent}" + (f":{lead}" if lead else "")

    def _pattern(self, kind: str, key: str = "*") -> str:
        """SCAN pattern of this namespace's (every namespace's, in admin mode) keys of `kind`
        ("c" or "p"): `key` "*" or one key, matched literally."""
        ns = glob_literal(self.ns) if self.ns is not None else "*"
        return f"{glob_literal(self.spec.prefix)}:{ns}:{kind}:{key if key == '*' else glob_literal(key)}"

    def contains(self, key: str) -> bool:
        if self.ns is None:
            return False
        # One EXISTS (the writer asks this per chunk): no pipeline for a single key.
        return self._guarded("contains", lambda c: c.exists(self._c(key)), 0) == 1

    def contains_many(self, keys: list[str]) -> list[bool]:
        if self.ns is None or not keys:
            return [False] * len(keys)

        def exists(client) -> list:
            pipe = client.pipeline(transaction=False)
            for k in keys:
                pipe.exists(self._c(k))
            return pipe.execute()

        return [x == 1 for x in self._guarded("contains", exists, [0] * len(keys))]

    def children(self, parent: str, lead: str) -> list[Child]:
        if self.ns is None or not is_key(parent):
            return []
        sets = [("", self._p(parent))] + ([(lead, self._p(parent, lead))] if lead else [])

        def smembers(client) -> list:
            pipe = client.pipeline(transaction=False)
            for _, rk in sets:
                pipe.smembers(rk)
            return pipe.execute()

        # Refused: an index key holds another type, or the ACL refuses it.
        raws = self._guarded("children", smembers, [set() for _ in sets])
        out: list[Child] = []
        for (lead_, rk), raw in zip(sets, raws):
            if not isinstance(raw, set):
                continue  # (an error reply in the pipeline: that set is as good as empty)
            out += self._live_children(rk, raw, lead_)
        return out

    def _live_children(self, rk: str, raw: set, lead: str) -> list[Child]:
        # Members are "tokens:key" as put() writes them; anyone who can write to the server can add
        # others: those are ignored (and dropped below), never parsed into an error.
        pairs: list[Child] = []
        members: list[bytes] = []
        junk: list[bytes] = []
        for m in raw:
            entry = _child_entry(m, lead)
            if entry is None:
                junk.append(m)
            else:
                members.append(m)
                pairs.append(entry)
        if junk:
            self.counters["errors"] += 1
            self._quietly(lambda c: c.srem(rk, *junk))
        if not pairs:
            return []
        alive = self.contains_many([c.key for c in pairs])
        dead = [m for m, ok in zip(members, alive) if not ok]
        if dead and self.breaker.up:  # values expired or deleted elsewhere: drop their index entries
            self._quietly(lambda c: c.srem(rk, *dead))
        return [p for p, ok in zip(pairs, alive) if ok]

    def _quietly(self, fn) -> None:
        """Best-effort housekeeping: skipped while the server is unreachable or refuses."""
        self._guarded("housekeeping", fn, None)

    def _open(self, key: str) -> Reader | None:
        try:
            rkey = self._rkey_any(key)
            size = self.call(lambda c: c.strlen(rkey)) if rkey is not None else 0
        except Outage:
            return None
        if type(size) is not int:
            raise FormatError("STRLEN did not answer a length")
        return _RedisReader(self, rkey, size) if rkey is not None and size else None

    def _rkey_any(self, key: str) -> str | None:
        if self.ns is not None:
            return self._c(key)
        if key in self._admin_keys:  # filled by iterate(): admin tools walk every namespace
            return self._admin_keys[key]
        found = self.call(lambda c: next(c.scan_iter(match=self._pattern("c", key), count=1000), None))
        return None if found is None else found.decode()

    def read_runs(self, opened: Sequence[OpenChunk], runs: Sequence[list[list[Segment]]],
                  out: Sequence[torch.Tensor | None], into: Sequence[PoolTarget | None] | None = None) -> list[Segments] | None:
        """Every range of every chunk in one pipeline: a layer group costs one round trip."""
        def getranges(client) -> list:
            pipe = client.pipeline(transaction=False)
            for oc, rs in zip(opened, runs):
                for run in rs:
                    lo, hi = run[0].offset, run[-1].offset + run[-1].nbytes
                    pipe.getrange(oc.reader.rkey, lo, hi - 1)  # type: ignore[attr-defined]
            return pipe.execute()

        try:
            replies = iter(self.call(getranges))
        except (Outage, Refused) as e:
            log.warning("redis read failed: %s", e)
            self.counters["misses"] += len(opened)
            return None
        got: list[Segments] = []
        for oc, rs, o in zip(opened, runs, out):
            segs: Segments = {}
            pos = nbytes = 0
            try:
                for run in rs:
                    lo, hi = run[0].offset, run[-1].offset + run[-1].nbytes
                    buf = _tensor(next(replies), None if o is None else o[pos:pos + hi - lo])
                    pos += hi - lo
                    if buf.numel() != hi - lo:
                        raise FormatError("truncated payload")
                    nbytes += buf.numel()
                    for s in run:
                        view = buf[s.offset - lo:s.offset - lo + s.nbytes]
                        check_segment(s, view, oc.header.digest)
                        segs[(s.layer, s.part)] = view
            except FormatError as e:
                self.discard_corrupt(oc.expect.key, str(e))
                return None
            except Exception as e:  # noqa: BLE001 - a refused GETRANGE comes back as an error object
                self.refused("read", e)
                return None
            self._count_read(oc.expect.key, nbytes)
            got.append(segs)
        return got

    def put(self, packed: PackedChunk) -> bool:
        if self.ns is None:
            raise RuntimeError("admin-mode store cannot write chunks")
        h = packed.header

        def write(client) -> None:
            pipe = client.pipeline(transaction=not self.spec.cluster)
            pipe.set(self._c(h.key), packed.to_bytes(), ex=self.ex)
            index = self._p(h.parent, lead_of(h.prefix))
            pipe.sadd(index, f"{h.tokens}:{h.key}")
            if self.ex:
                pipe.expire(index, self.ex)
            pipe.execute()

        try:
            self.call(write)
        except (Outage, Refused) as e:  # dropped, counted; the server keeps serving
            if not isinstance(e, Outage) or self.breaker.up:
                log.warning("redis write of %s failed: %s", h.key, e)
            self.counters["put_errors"] += 1
            return False
        self.counters["bytes_written"] += packed.nbytes
        self.counters["puts"] += 1
        return True

    def replace(self, packed: PackedChunk) -> bool:
        """SET overwrites in one step: readers see the old value or the new one."""
        return not packed.header.partial and self.contains(packed.header.key) and self.put(packed)

    def delete(self, key: str) -> None:
        try:
            rkey = self._rkey_any(key)
        except Outage:
            return
        except Refused as e:
            self.refused("delete", e)
            return
        if rkey is not None:
            self._quietly(lambda c: c.delete(rkey))
        # A child's set entry is dropped lazily by children() once its value is gone.

    def iterate(self) -> Iterator[str]:
        for rk in self.client.scan_iter(match=self._pattern("c"), count=1000):
            rk = rk.decode()
            key = rk.rsplit(":", 1)[-1]
            if self.ns is None:
                self._admin_keys[key] = rk
            yield key

    def clear(self) -> int:
        n = 0
        for kind in ("c", "p"):
            batch = []
            for rk in self.client.scan_iter(match=self._pattern(kind), count=1000):
                batch.append(rk)
                n += kind == "c"
                if len(batch) >= 500:
                    self._delete_many(batch)
                    batch = []
            self._delete_many(batch)
        return n

    def _delete_many(self, rkeys: list) -> None:
        if not rkeys:
            return
        if self.spec.cluster:  # keys live in different hash slots: one DEL each
            for rk in rkeys:
                self.client.delete(rk)
        else:
            self.client.delete(*rkeys)

    def usage(self) -> dict:
        """The server's own memory figures (one INFO per node; shared with anything else stored
        there). Entries are counted (a full SCAN) only in admin mode, not on every /metrics scrape."""
        out = dict(url=redact(self.spec.url), ttl_s=self.spec.ttl, bytes_used=None, capacity=None, **self.breaker.stats())
        try:
            if self.spec.cluster:
                from redis.cluster import RedisCluster
                nodes = list(self.call(lambda c: c.info("memory", target_nodes=RedisCluster.PRIMARIES)).values())
            else:
                nodes = [self.call(lambda c: c.info("memory"))]
            out["bytes_used"] = sum(int(n.get("used_memory", 0)) for n in nodes)
            out["capacity"] = sum(int(n.get("maxmemory", 0)) for n in nodes) or None
            if self.ns is None:
                out["entries"] = sum(1 for _ in self.iterate())
        except (Outage, Refused):  # stats without the server's figures; never a failed scrape
            pass
        return out

    def close(self) -> None:
        try:
            self.client.close()
        except Exception:
            pass
