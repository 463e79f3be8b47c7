"""Parse a store spec string into tier configurations.

    memory:8GB,disk:/data/a:200GB,disk:/data/b:200GB,redis://host:6379/0?ttl=1d

Entries, fastest first (the order in the string does not matter):
    memory:SIZE[:bw=RATE][:lat=TIME]
    disk:PATH:SIZE[:bw=RATE][:lat=TIME]        several disk entries are striped round-robin
    redis://[[USER]:PASSWORD@]HOST:PORT[/DB][?prefix=NAME&ttl=TIME&bw=RATE&lat=TIME&password_file=PATH]
    redis+cluster://HOST:PORT[?...]            a Redis Cluster (any node as entry point)
    rediss://HOST:PORT[?ssl_ca_certs=PATH&ssl_certfile=PATH&ssl_keyfile=PATH&ssl_cert_reqs=required|optional|none
                        &ssl_check_hostname=true|false]    TLS (rediss+cluster:// for a cluster)
SIZE: 512MB, 8GB, 1.5GiB, or plain bytes. RATE: 100MB/s, 1GB/s. TIME: 200us, 1ms, 2s, 1h, 1d.
The Redis password: in the URL, from `password_file=PATH` or from $KVTIER_REDIS_PASSWORD (redis_auth.py);
`RedisSpec.url` never holds it, and every message here prints the spec through `redact`.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from urllib.parse import parse_qs, urlsplit, urlunsplit

from .redact import redact
from .redis_auth import AuthError, RedisAuth, parse_auth
from .throttle import Emulation

SPEC_HELP = (
    "comma-separated tiers, e.g. 'memory:8GB,disk:/data/a:200GB,disk:/data/b:200GB,"
    "redis://host:6379'. memory:SIZE | disk:PATH:SIZE (repeat to stripe) | redis://HOST:PORT[/DB]"
    "[?prefix=P&ttl=1d] | redis+cluster://HOST:PORT. Emulate a slower device with ':bw=100MB/s"
    ":lat=1ms' on memory/disk entries or '?bw=100MB/s&lat=1ms' on redis URLs. Redis password: "
    "'?password_file=PATH' or $KVTIER_REDIS_PASSWORD (or in the URL, masked in every output). TLS: "
    "rediss://HOST:PORT?ssl_ca_certs=CA.pem[&ssl_certfile=CERT.pem&ssl_keyfile=KEY.pem][&ssl_cert_reqs=required]."
)

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40, "K": 10**3, "M": 10**6,
          "G": 10**9, "T": 10**12}
_TIMES = {"us": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*$")


class SpecError(ValueError):
    pass


def parse_size(text: str, what: str = "size") -> int:
    m = _SIZE_RE.match(text)
    unit = m.group(2).upper() if m else None
    if not m or unit not in _UNITS:
        raise SpecError(f"bad {what} {text!r}: write a number with a unit, e.g. 512MB, 8GB, 1.5GiB")
    return int(float(m.group(1)) * _UNITS[unit])


def parse_rate(text: str) -> float:
    if not text.lower().endswith("/s"):
        raise SpecError(f"bad bandwidth {text!r}: write a rate such as bw=100MB/s or bw=2GB/s")
    return float(parse_size(text[:-2], "bandwidth"))


def parse_time(text: str) -> float:
    m = re.match(r"^\s*([0-9]*\.?[0-9]+)\s*(us|ms|s|m|h|d)?\s*$", text)
    if not m:
        raise SpecError(f"bad time {text!r}: write e.g. 200us, 1ms, 30s, 1h, 1d")
    return float(m.group(1)) * _TIMES[m.group(2) or "s"]


@dataclass(frozen=True)
class MemorySpec:
    capacity: int
    emulation: Emulation = Emulation()


@dataclass(frozen=True)
class DiskSpec:
    paths: tuple[str, ...]
    capacities: tuple[int, ...]  # one per path
    emulation: Emulation = Emulation()


@dataclass(frozen=True)
class RedisSpec:
    url: str  # without the kvtier options and without the password: safe to print
    cluster: bool = False
    prefix: str = "kvtier"
    ttl: float | None = None
    emulation: Emulation = Emulation()
    auth: RedisAuth = RedisAuth()  # the password (never printed) and the TLS files


@dataclass(frozen=True)
class StoreSpec:
    memory: MemorySpec | None = None
    disk: DiskSpec | None = None
    redis: RedisSpec | None = None
    text: str = field(default="", compare=False, repr=False)  # as given: may hold a password (print redact(text))

    def tiers(self) -> list[tuple[str, Emulation]]:
        """(tier name, emulated limits) of each tier present, fastest first."""
        entries = (("memory", self.memory), ("disk", self.disk), ("redis", self.redis))
        return [(name, t.emulation) for name, t in entries if t is not None]


def _emulation(opts: dict[str, str], entry: str) -> Emulation:
    bw = opts.pop("bw", None)
    lat = opts.pop("lat", None)
    if opts:
        known = "prefix=, ttl=, password_file=, ssl_*=, bw= and lat=" if "://" in entry else "bw= and lat="
        raise SpecError(f"unknown option(s) {sorted(opts)} in {entry!r}: only {known} are known")
    return Emulation(parse_rate(bw) if bw else None, parse_time(lat) if lat else 0.0)


def _split_opts(fields: list[str]) -> tuple[list[str], dict[str, str]]:
    plain, opts = [], {}
    for f in fields:
        if "=" in f:
            k, _, v = f.partition("=")
            opts[k.strip().lower()] = v.strip()
        else:
            plain.append(f)
    return plain, opts


def _parse_redis(entry: str) -> RedisSpec:
    parts = urlsplit(entry)
    cluster = parts.scheme.endswith("+cluster")
    scheme = parts.scheme.replace("+cluster", "")
    if not parts.hostname:
        # Not quoted back: what follows '//' may be the head of a password cut at an unencoded character.
        raise SpecError(f"a {parts.scheme}:// entry has no host: write {parts.scheme}://HOST:PORT (in a password, "
                        "write ',' '/' '?' '#' '@' as %2C %2F %3F %23 %40)")
    q = {k: v[-1] for k, v in parse_qs(parts.query).items()}
    prefix = q.pop("prefix", "kvtier")
    ttl = parse_time(q.pop("ttl")) if "ttl" in q else None
    try:
        auth, netloc = parse_auth(parts, q)
    except AuthError as e:
        raise SpecError(f"{e} (in {entry!r})") from None
    em = _emulation(q, entry)
    url = urlunsplit((scheme, netloc, parts.path, "", ""))
    return RedisSpec(url, cluster, prefix, ttl, em, auth)


def parse_spec(text: str) -> StoreSpec:
    try:
        return _parse_spec(text)
    except SpecError as e:  # every message may quote an entry: a password in a URL is masked in all of them
        raise SpecError(redact(e)) from None


def _parse_spec(text: str) -> StoreSpec:
    if not text or not text.strip():
        raise SpecError(f"empty store spec: {SPEC_HELP}")
    memory = redis = None
    disk_paths: list[str] = []
    disk_caps: list[int] = []
    disk_em: Emulation | None = None
    for raw in text.split(","):
        entry = raw.strip()
        if not entry:
            continue
        kind = entry.split(":", 1)[0].lower()
        if kind.startswith("redis") and "://" in entry:
            if redis is not None:
                raise SpecError("more than one redis entry: use one redis URL per store")
            redis = _parse_redis(entry)
        elif kind == "memory":
            plain, opts = _split_opts(entry.split(":")[1:])
            if memory is not None or len(plain) != 1:
                raise SpecError(f"bad memory entry {entry!r}: write memory:SIZE once, e.g. memory:8GB")
            memory = MemorySpec(parse_size(plain[0]), _emulation(opts, entry))
        elif kind == "disk":
            plain, opts = _split_opts(entry.split(":")[1:])
            if len(plain) < 2:
                raise SpecError(f"bad disk entry {entry!r}: write disk:PATH:SIZE, e.g. disk:/data/a:200GB")
            path, size = ":".join(plain[:-1]), plain[-1]
            em = _emulation(opts, entry)
            if disk_em is not None and em != disk_em:
                raise SpecError("striped disk entries must share the same bw=/lat= options")
            disk_em = em
            disk_paths.append(path)
            disk_caps.append(parse_size(size))
        elif "@" in entry:  # the tail of a password cut at an unencoded ',': not quoted back
            raise SpecError(f"unknown tier entry with an '@' (a ',' in a Redis password is written %2C): {SPEC_HELP}")
        else:
            raise SpecError(f"unknown tier {entry!r}: {SPEC_HELP}")
    if len(set(disk_paths)) != len(disk_paths):
        raise SpecError("the same disk directory is listed twice")
    disk = DiskSpec(tuple(disk_paths), tuple(disk_caps), disk_em or Emulation()) if disk_paths else None
    return StoreSpec(memory, disk, redis, text)
