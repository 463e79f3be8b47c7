"""How a Redis tier authenticates: its password and its TLS files, from a redis:// entry of a store spec.

The password comes from, in this order: the URL (`redis://[user]:PASSWORD@host`), the spec option
`password_file=PATH` (the file's first line), or the environment variable KVTIER_REDIS_PASSWORD.
It is taken out of the URL the tier keeps (`RedisSpec.url` is safe to print) and handed to the
client as its own argument. The file and the variable keep it out of the command line and out of
the spec text altogether, so `ps`, shell history and every log line show only where it came from.

TLS (`rediss://`): `ssl_ca_certs=PATH` (the CA that signed the server's certificate),
`ssl_certfile=PATH` and `ssl_keyfile=PATH` (a client certificate, for servers with
`tls-auth-clients yes`), `ssl_cert_reqs=required|optional|none` (check the server's certificate;
default required) and `ssl_check_hostname=true|false` (default true). They go to redis-py's
arguments of the same names, for a single server and for a cluster alike.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from urllib.parse import SplitResult, unquote

PASSWORD_ENV = "KVTIER_REDIS_PASSWORD"
TLS_FILES = ("ssl_ca_certs", "ssl_certfile", "ssl_keyfile")
CERT_REQS = ("required", "optional", "none")
_BOOLS = {"true": True, "yes": True, "1": True, "false": False, "no": False, "0": False}


class AuthError(ValueError):
    """A bad password or TLS option; spec.py raises it again as a SpecError."""


@dataclass(frozen=True)
class RedisAuth:
    password: str | None = field(default=None, repr=False)  # never in a repr, a log line or an error
    password_from: str = ""  # where it came from, for messages: "the URL", "password_file=...", "$KVTIER_REDIS_PASSWORD"
    ssl_ca_certs: str | None = None
    ssl_certfile: str | None = None
    ssl_keyfile: str | None = None
    ssl_cert_reqs: str | None = None
    ssl_check_hostname: bool | None = None

    def client_kwargs(self) -> dict[str, object]:
        """The redis-py keyword arguments (Redis.from_url and RedisCluster.from_url take the same)."""
        kw: dict[str, object] = {}
        if self.password is not None:
            kw["password"] = self.password
        for name in (*TLS_FILES, "ssl_cert_reqs", "ssl_check_hostname"):
            if getattr(self, name) is not None:
                kw[name] = getattr(self, name)
        return kw


def _password_file(path: str) -> str:
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise AuthError(f"password_file={path}: cannot read it ({e.strerror or e})") from None
    # The first line: `echo secret > file` writes a newline the password does not have.
    password = text.splitlines()[0] if text else ""
    if not password:
        raise AuthError(f"password_file={path} is empty")
    return password


def _password(parts: SplitResult, password_file: str | None) -> tuple[str | None, str]:
    if parts.password and password_file is not None:
        raise AuthError("a password in the URL and password_file=: give one of them")
    if parts.password:  # an empty one (redis://:@host) is none, as redis-py reads it
        return unquote(parts.password), "the URL"
    if password_file is not None:
        return _password_file(password_file), f"password_file={password_file}"
    if os.environ.get(PASSWORD_ENV):
        return os.environ[PASSWORD_ENV], f"${PASSWORD_ENV}"
    return None, ""


def _tls(opts: dict[str, str], tls: bool) -> RedisAuth:
    got = {k: opts.pop(k) for k in (*TLS_FILES, "ssl_cert_reqs", "ssl_check_hostname") if k in opts}
    if got and not tls:
        raise AuthError(f"{', '.join(sorted(got))}: TLS options need a rediss:// URL")
    for name in TLS_FILES:
        if name in got and not Path(got[name]).is_file():
            raise AuthError(f"{name}={got[name]}: no such file")
    if "ssl_keyfile" in got and "ssl_certfile" not in got:
        raise AuthError("ssl_keyfile= needs ssl_certfile= (the client certificate it belongs to)")
    reqs = got.get("ssl_cert_reqs")
    if reqs is not None and reqs.lower() not in CERT_REQS:
        raise AuthError(f"ssl_cert_reqs={reqs}: write one of {', '.join(CERT_REQS)}")
    check = got.get("ssl_check_hostname")
    if check is not None and check.lower() not in _BOOLS:
        raise AuthError(f"ssl_check_hostname={check}: write true or false")
    return RedisAuth(ssl_ca_certs=got.get("ssl_ca_certs"), ssl_certfile=got.get("ssl_certfile"),
                     ssl_keyfile=got.get("ssl_keyfile"), ssl_cert_reqs=reqs.lower() if reqs else None,
                     ssl_check_hostname=_BOOLS[check.lower()] if check is not None else None)


def parse_auth(parts: SplitResult, opts: dict[str, str]) -> tuple[RedisAuth, str]:
    """The auth options popped from `opts` (the entry's query) and the netloc without the password."""
    password, source = _password(parts, opts.pop("password_file", None))
    auth = replace(_tls(opts, parts.scheme.startswith("rediss")), password=password, password_from=source)
    netloc = parts.netloc.rpartition("@")[2]
    if parts.username:
        netloc = f"{parts.username}@{netloc}"  # the ACL user is no secret: it stays in the URL
    return auth, netloc
