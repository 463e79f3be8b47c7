"""A Redis password never shows: not in a log line (outages included), a printed spec, stats, an error
or the CLI's output; it can come from a file or the environment instead of the URL; rediss:// takes
a CA, a client certificate and its key; the HF benchmark peer loads what it reads back from Redis
with torch.load(weights_only=True)."""

from __future__ import annotations

import io
import json
import logging
import os
import pickle
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from kvtier.store import StoreNamespace, TieredStore
from kvtier.store.redact import redact
from kvtier.store.redis_auth import PASSWORD_ENV
from kvtier.store.spec import SpecError, parse_spec
from kvtier.testing.services import RedisServer, free_port, redis_binary

PW = "S3cret-pw-7f1d"  # distinctive: a search for it in any output cannot match by chance
ODD_PW = "p@ss,w/rd?#%x"  # every character a URL must encode
ODD_PW_URL = "p%40ss%2Cw%2Frd%3F%23%25x"

needs_redis = pytest.mark.skipif(redis_binary() is None, reason="redis-server is not installed")


def _with_password(url: str, password: str, user: str = "") -> str:
    return url.replace("redis://", f"redis://{user}:{password}@", 1)


def _ns(model: str = "secrets") -> StoreNamespace:
    return StoreNamespace(model, 2, 2, 8, 32, compute_dtype="float32")


def _state(n: int, seed: int = 0) -> tuple[list[int], torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 50000, (n,), generator=g).tolist()
    return ids, torch.randn(2, n, 2, 8, generator=g), torch.randn(2, n, 2, 8, generator=g)


def _assert_hidden(text: str, *secrets: str) -> None:
    for s in secrets:
        assert s not in text, f"secret {s!r} leaked in: {text[:2000]}"


# ----- redact() ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("text, expected", [
    ("redis://h:6379/0", "redis://h:6379/0"),
    ("redis://h:6379/0?prefix=x&ttl=1d", "redis://h:6379/0?prefix=x&ttl=1d"),
    ("redis://user@h:6379", "redis://user@h:6379"),  # a user name alone is no secret
    (f"redis://:{PW}@h:6379/0", "redis://:***@h:6379/0"),
    (f"redis://alice:{PW}@h:6379/2?prefix=p", "redis://alice:***@h:6379/2?prefix=p"),
    (f"rediss://alice:{PW}@h:6380/0?ssl_ca_certs=/ca.pem", "rediss://alice:***@h:6380/0?ssl_ca_certs=/ca.pem"),
    (f"redis+cluster://:{PW}@n1:7000", "redis+cluster://:***@n1:7000"),
    (f"rediss+cluster://u:{PW}@n1:7000", "rediss+cluster://u:***@n1:7000"),
    (f"redis://:{ODD_PW_URL}@h:1/0", "redis://:***@h:1/0"),  # percent-encoded
    ("redis://:p@ss@h:1", "redis://:***@h:1"),  # an unencoded '@': cut at the last one, as clients do
    ("redis://:a/b@h:1", "redis://:***@h:1"),  # malformed (unencoded '/'): masked all the same
    ("redis://:@h:1", "redis://:***@h:1"),
    (f"redis://h:1/0?password={PW}&ttl=1", "redis://h:1/0?password=***&ttl=1"),  # redis-py's query form
    ("memory:1GB,disk:/data/a:1GB", "memory:1GB,disk:/data/a:1GB"),
    (f"memory:2GB,disk:/d:20GB:bw=1GB/s,redis://:{PW}@h:6379/0?ttl=1d",
     "memory:2GB,disk:/d:20GB:bw=1GB/s,redis://:***@h:6379/0?ttl=1d"),
    (f"cannot reach Redis at redis://u:{PW}@h:1/0: Error 111", "cannot reach Redis at redis://u:***@h:1/0: Error 111"),
    (f"{{'url': 'redis://:{PW}@h:1', 'x': 1}}", "{'url': 'redis://:***@h:1', 'x': 1}"),
    (f"two: redis://:{PW}@a:1 and rediss://b:{PW}@c:2", "two: redis://:***@a:1 and rediss://b:***@c:2"),
])
def test_redact_masks_url_passwords(text: str, expected: str) -> None:
    assert redact(text) == expected


def test_redact_takes_exceptions() -> None:
    assert redact(ValueError(f"bad redis://:{PW}@h:1")) == "bad redis://:***@h:1"


# ----- the spec: password sources, TLS options, messages -----------------------------------------------------
@pytest.fixture
def no_env_password(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(PASSWORD_ENV, raising=False)


def test_url_password_is_taken_out_of_the_url(no_env_password) -> None:
    s = parse_spec(f"memory:1MB,redis://alice:{ODD_PW_URL}@h:6379/1?prefix=x").redis
    assert s is not None
    assert s.url == "redis://alice@h:6379/1" and s.prefix == "x"
    assert s.auth.password == ODD_PW and s.auth.password_from == "the URL"
    assert s.auth.client_kwargs() == {"password": ODD_PW}
    _assert_hidden(repr(s), ODD_PW, ODD_PW_URL)


def test_password_from_file_then_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pw_file = tmp_path / "redis.pw"
    pw_file.write_text(PW + "\n")  # `echo PW > file`: the newline is not part of it
    monkeypatch.setenv(PASSWORD_ENV, "from-env")
    s = parse_spec(f"redis://h:1/0?password_file={pw_file}").redis
    assert s is not None and s.auth.password == PW and s.auth.password_from == f"password_file={pw_file}"
    s = parse_spec("redis://h:1/0").redis
    assert s is not None and s.auth.password == "from-env" and s.auth.password_from == f"${PASSWORD_ENV}"
    s = parse_spec(f"redis://:{PW}@h:1/0").redis  # the URL's own password wins over the environment
    assert s is not None and s.auth.password == PW
    monkeypatch.delenv(PASSWORD_ENV)
    s = parse_spec("redis://h:1/0").redis
    assert s is not None and s.auth.password is None and s.auth.client_kwargs() == {}


def test_password_file_errors(tmp_path: Path, no_env_password) -> None:
    with pytest.raises(SpecError, match="password_file=.*cannot read"):
        parse_spec(f"redis://h:1?password_file={tmp_path}/missing")
    (tmp_path / "empty").write_text("")
    with pytest.raises(SpecError, match="password_file=.*empty"):
        parse_spec(f"redis://h:1?password_file={tmp_path}/empty")
    (tmp_path / "pw").write_text(PW)
    with pytest.raises(SpecError, match="give one of them") as e:
        parse_spec(f"redis://:{PW}@h:1?password_file={tmp_path}/pw")
    _assert_hidden(str(e.value), PW)


@pytest.mark.parametrize("spec", [
    f"memory:1MB,redis://:{PW}@h:1/0?nope=1",  # unknown option (the entry is quoted back)
    f"redis://:{PW}@h:1/0?ttl=soon",
    f"redis://:{PW}@h:1/0?ssl_ca_certs=/nonexistent/ca.pem",  # TLS options on a plain redis:// URL
    f"rediss://u:{PW}@h:1/0?ssl_ca_certs=/nonexistent/ca.pem",
    f"redis://:{PW}@h:1/0,redis://:{PW}@h:2/0",  # two redis entries
    f"redis://:{PW}@h:1/0,disk:/d",  # a bad entry beside a good one
    "redis://:pa,ss-S3cret@h:1/0",  # an unencoded ',' cuts the entry in two
    "redis://:pa/ss-S3cret@h:1/0",  # an unencoded '/' leaves no host
    "redis://:pa#ss-S3cret@h:1/0",
])
def test_spec_errors_never_quote_the_password(spec: str, no_env_password) -> None:
    with pytest.raises(SpecError) as e:
        parse_spec(spec)
    _assert_hidden(str(e.value), PW, "S3cret", "pa,ss", "pa/ss", "pa#ss")


def test_cli_rejects_a_bad_spec_without_printing_the_password(capsys: pytest.CaptureFixture[str]) -> None:
    from kvtier.cli.main import main

    with pytest.raises(SystemExit):
        main(["store", "stats", "--store", f"redis://:{PW}@h:1/0?ttl=soon"])
    err = capsys.readouterr().err
    assert "bad time" in err
    _assert_hidden(err, PW)


def _certs(tmp_path: Path) -> dict[str, Path]:
    """A CA, a server certificate for 127.0.0.1 and a client certificate, made with the openssl CLI."""
    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.skip("openssl is not installed")
    d = tmp_path / "tls"
    d.mkdir()

    def run(*args: str) -> None:
        subprocess.run([openssl, *args], cwd=d, check=True, capture_output=True)

    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.crt", "-days", "1",
        "-subj", "/CN=kvtier-test-ca")
    (d / "san.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    for name in ("server", "client"):
        run("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.csr",
            "-subj", f"/CN=kvtier-test-{name}")
        run("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
            "-out", f"{name}.crt", "-days", "1", "-extfile", "san.ext")
    return {n: d / n for n in ("ca.crt", "server.crt", "server.key", "client.crt", "client.key")}


def _tls_files(tmp_path: Path) -> dict[str, Path]:
    d = tmp_path / "files"
    d.mkdir()
    for n in ("ca.pem", "client.pem", "client.key"):
        (d / n).write_text("not read: the client constructor is a fake\n")
    return {n: d / n for n in ("ca.pem", "client.pem", "client.key")}


class _FakeClient:
    """Stands in for redis.Redis / RedisCluster: records how it was built, answers PING."""
    built: list[tuple[str, str, dict]] = []

    @classmethod
    def maker(cls, kind: str):
        def from_url(url: str, **kwargs):
            cls.built.append((kind, url, kwargs))
            return cls()
        return from_url

    def ping(self) -> bool:
        return True

    def close(self) -> None:
        pass


@pytest.mark.parametrize("cluster", [False, True])
def test_rediss_options_reach_the_client(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, no_env_password,
                                         cluster: bool) -> None:
    import redis
    import redis.cluster

    from kvtier.store.tiers.redis_tier import RedisTier

    monkeypatch.setattr(redis.Redis, "from_url", _FakeClient.maker("redis"))
    monkeypatch.setattr(redis.cluster.RedisCluster, "from_url", _FakeClient.maker("cluster"))
    _FakeClient.built.clear()
    f = _tls_files(tmp_path)
    (tmp_path / "pw").write_text(PW)
    scheme = "rediss+cluster" if cluster else "rediss"
    spec = parse_spec(f"{scheme}://alice@h:6380{'' if cluster else '/0'}?ssl_ca_certs={f['ca.pem']}"
                      f"&ssl_certfile={f['client.pem']}&ssl_keyfile={f['client.key']}&ssl_cert_reqs=REQUIRED"
                      f"&ssl_check_hostname=false&password_file={tmp_path}/pw&prefix=t").redis
    assert spec is not None and spec.cluster == cluster and spec.prefix == "t"
    RedisTier(spec, "ns").close()
    [(kind, url, kw)] = _FakeClient.built
    assert kind == ("cluster" if cluster else "redis")
    assert url == ("rediss://alice@h:6380" if cluster else "rediss://alice@h:6380/0")
    assert kw["ssl_ca_certs"] == str(f["ca.pem"]) and kw["ssl_certfile"] == str(f["client.pem"])
    assert kw["ssl_keyfile"] == str(f["client.key"]) and kw["ssl_cert_reqs"] == "required"
    assert kw["ssl_check_hostname"] is False and kw["password"] == PW
    assert kw["socket_timeout"] == 1.0  # the tier's own options are kept


@pytest.mark.parametrize("query, error", [
    ("ssl_ca_certs={missing}", r"ssl_ca_certs=.*missing\.pem: no such file"),
    ("ssl_certfile={missing}", r"ssl_certfile=.*: no such file"),
    ("ssl_certfile={ca}&ssl_keyfile={missing}", r"ssl_keyfile=.*: no such file"),
    ("ssl_keyfile={ca}", "ssl_keyfile= needs ssl_certfile="),
    ("ssl_cert_reqs=maybe", "ssl_cert_reqs=maybe: write one of required, optional, none"),
    ("ssl_check_hostname=perhaps", "ssl_check_hostname=perhaps: write true or false"),
])
def test_rediss_option_errors_are_clean(tmp_path: Path, query: str, error: str, no_env_password) -> None:
    ca = tmp_path / "ca.pem"
    ca.write_text("x")
    q = query.format(missing=tmp_path / "missing.pem", ca=ca)
    with pytest.raises(SpecError, match=error):
        parse_spec(f"rediss://:{PW}@h:6380/0?{q}")
    with pytest.raises(SpecError, match="TLS options need a rediss:// URL"):
        parse_spec("redis://h:6379/0?ssl_cert_reqs=none")


# ----- a real password-protected server -------------------------------------------------------------------
@pytest.fixture
def pw_server():
    if redis_binary() is None:
        pytest.skip("redis-server is not installed")
    srv = RedisServer(password=PW).start()
    yield srv
    srv.close()


def _exercise(spec: str, srv: RedisServer, caplog: pytest.LogCaptureFixture) -> dict:
    """Save, read back, lose the server mid-run, get it back: every log line of it is captured."""
    caplog.set_level(logging.DEBUG)
    store = TieredStore.open(spec, _ns(), chunk_tokens=16)
    try:
        redis_tier = store.tier("redis")
        ids, k, v = _state(32)
        store.save(ids, 0, k, v, None)
        assert store.flush(10)
        for c in store.lookup(ids).chunks:
            store.tier("memory").delete(c.key)  # only Redis holds them now
        assert [c.tier for c in store.lookup(ids).chunks] == ["redis", "redis"]
        assert store.read_chunk(store.lookup(ids).chunks[0]) is not None
        stats = store.stats()

        srv.kill()  # an outage: misses, a dropped save, warnings
        assert "redis" not in [c.tier for c in store.lookup(ids).chunks]  # (the chunk read above was copied up)
        ids2, k2, v2 = _state(16, seed=3)
        store.save(ids2, 0, k2, v2, None)
        assert store.flush(10)
        assert not redis_tier.breaker.up
        down = store.stats()

        srv.start()  # back on the same port (empty): the breaker finds it again by itself
        deadline = time.monotonic() + 15
        while not redis_tier.contains(store.keys_for(ids)[0]):
            store.save(ids, 0, k, v, None)
            assert store.flush(10)
            assert time.monotonic() < deadline, "the store never went back to Redis"
            time.sleep(0.2)
        assert redis_tier.breaker.up
    finally:
        store.close()
    assert "unreachable" in caplog.text and "reachable again" in caplog.text  # the outage was logged
    return dict(stats=stats, down=down)


@needs_redis
@pytest.mark.redis
@pytest.mark.parametrize("source", ["url", "url-user", "file", "env"])
def test_password_never_logged(pw_server: RedisServer, source: str, tmp_path: Path,
                               monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.delenv(PASSWORD_ENV, raising=False)
    url = f"{pw_server.url}?prefix=sec-{source}"
    if source == "url":
        spec = f"memory:1MB,{_with_password(url, PW)}"
    elif source == "url-user":
        spec = f"memory:1MB,{_with_password(url, PW, user='default')}"  # the ACL form, user 'default'
    elif source == "file":
        (tmp_path / "pw").write_text(PW + "\n")
        spec = f"memory:1MB,{url}&password_file={tmp_path}/pw"
    else:
        monkeypatch.setenv(PASSWORD_ENV, PW)
        spec = f"memory:1MB,{url}"
    seen = _exercise(spec, pw_server, caplog)
    out = caplog.text + json.dumps(seen, default=str) + repr(parse_spec(spec))
    _assert_hidden(out, PW)
    assert seen["stats"]["tiers"]["redis"]["url"].startswith("redis://")
    assert seen["down"]["tiers"]["redis"]["up"] is False


@needs_redis
@pytest.mark.redis
def test_wrong_or_missing_password_is_a_clean_startup_error(pw_server: RedisServer, tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch,
                                                            caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    monkeypatch.delenv(PASSWORD_ENV, raising=False)
    wrong = "Wr0ng-pw-91ab"
    with pytest.raises(ConnectionError, match="refused the password from the URL") as e:
        TieredStore.open(_with_password(pw_server.url, wrong), _ns())
    _assert_hidden(str(e.value) + caplog.text, wrong, PW)
    (tmp_path / "pw").write_text(wrong)
    with pytest.raises(ConnectionError, match=r"refused the password from password_file=.*/pw"):
        TieredStore.open(f"{pw_server.url}?password_file={tmp_path}/pw", _ns())
    monkeypatch.setenv(PASSWORD_ENV, wrong)
    with pytest.raises(ConnectionError, match=rf"refused the password from \${PASSWORD_ENV}") as e:
        TieredStore.open(pw_server.url, _ns())
    _assert_hidden(str(e.value) + caplog.text, wrong, PW)
    monkeypatch.delenv(PASSWORD_ENV)
    with pytest.raises(ConnectionError, match="wants a password and none was given"):
        TieredStore.open(pw_server.url, _ns())


def _kvtier(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if k != PASSWORD_ENV}
    return subprocess.run([sys.executable, "-m", "kvtier", "--log-level", "DEBUG", *args], capture_output=True,
                          text=True, timeout=120, env={**base, **(env or {})})


@needs_redis
@pytest.mark.redis
def test_cli_store_commands_never_print_the_password(pw_server: RedisServer, tmp_path: Path) -> None:
    spec = f"memory:1MB,{_with_password(pw_server.url, PW)}?prefix=cli"
    for extra in ([], ["--json"]):
        r = _kvtier("store", "stats", "--store", spec, *extra)
        assert r.returncode == 0, r.stderr
        assert "redis" in r.stdout and "***" in r.stdout  # the spec is shown, masked
        _assert_hidden(r.stdout + r.stderr, PW)
    r = _kvtier("store", "stats", "--store", f"{pw_server.url}?prefix=cli", env={PASSWORD_ENV: PW})
    assert r.returncode == 0, r.stderr
    _assert_hidden(r.stdout + r.stderr, PW)
    # A wrong password: one line on stderr, exit 2, neither password in it.
    r = _kvtier("store", "stats", "--store", _with_password(pw_server.url, "Wr0ng-pw-91ab"))
    assert r.returncode == 2 and "refused the password from the URL" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr
    _assert_hidden(r.stdout + r.stderr, PW, "Wr0ng-pw-91ab")
    # The server gone at startup: the same.
    pw_server.kill()
    r = _kvtier("store", "clear", "--store", _with_password(pw_server.url, PW))
    assert r.returncode == 2 and "cannot reach Redis" in r.stderr, r.stderr
    _assert_hidden(r.stdout + r.stderr, PW)


@needs_redis
@pytest.mark.redis
def test_serve_banner_masks_the_password(pw_server: RedisServer, tmp_path: Path) -> None:
    spec = f"memory:64MB,{_with_password(pw_server.url, PW)}?prefix=serve"
    env = {k: v for k, v in os.environ.items() if k != PASSWORD_ENV}
    env.update(KVTIER_HOME=str(tmp_path / "home"), PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([sys.executable, "-m", "kvtier", "--log-level", "DEBUG", "serve", "--model", "tiny-gqa",
                             "--dtype", "fp32", "--kv-cache-gb", "0.05", "--port", str(free_port()), "--store", spec,
                             "--log-level", "debug"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    lines: list[str] = []
    try:
        assert proc.stdout is not None
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line)
            if "kvtier serving" in line:
                break
    finally:
        proc.terminate()
        try:
            rest, _ = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            rest, _ = proc.communicate()
    out = "".join(lines) + rest
    banner = [x for x in lines if "kvtier serving" in x]
    assert banner and "redis://:***@127.0.0.1" in banner[0], out[-3000:]
    _assert_hidden(out, PW)


def test_profile_warning_masks_the_password(tiny_gqa, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                            caplog: pytest.LogCaptureFixture) -> None:
    """A saved profile without a Redis tier gets it measured: the warning names the tier's spec, masked."""
    import dataclasses

    from kvtier.engine.calibrate import hardware

    from kvtier_testlib import fake_profile

    caplog.set_level(logging.DEBUG)
    prof = fake_profile(tiny_gqa.fingerprint)
    prof = dataclasses.replace(prof, tiers={k: r for k, r in prof.tiers.items() if k != "redis"})
    monkeypatch.setattr(hardware, "load_profile", lambda model, home: prof)
    monkeypatch.setattr(hardware, "_measure_spec", lambda model, spec, tick=None: {})  # no server needed
    monkeypatch.setattr(hardware, "save_profile", lambda p, path: None)
    hardware.load_or_measure(tiny_gqa, tmp_path, f"memory:1MB,redis://:{PW}@127.0.0.1:1/0")
    assert "lacks tier(s) redis://:***@127.0.0.1:1/0" in caplog.text
    _assert_hidden(caplog.text, PW)


# ----- TLS end to end: a real redis-server with tls-port and client certificates -------------------------------
@needs_redis
@pytest.mark.redis
def test_rediss_with_ca_and_client_certificate(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                               caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    monkeypatch.delenv(PASSWORD_ENV, raising=False)
    c = _certs(tmp_path)
    tls_port = free_port()
    srv = RedisServer(password=PW, extra=(
        "--tls-port", str(tls_port), "--tls-cert-file", str(c["server.crt"]), "--tls-key-file", str(c["server.key"]),
        "--tls-ca-cert-file", str(c["ca.crt"]), "--tls-auth-clients", "yes"))
    try:
        srv.start()
    except RuntimeError:
        pytest.skip("this redis-server was built without TLS")
    try:
        (tmp_path / "pw").write_text(PW)
        base = f"rediss://127.0.0.1:{tls_port}/0?prefix=tls&password_file={tmp_path}/pw&ssl_ca_certs={c['ca.crt']}"
        spec = f"{base}&ssl_certfile={c['client.crt']}&ssl_keyfile={c['client.key']}"
        with TieredStore.open(spec, _ns(), chunk_tokens=16) as store:
            ids, k, v = _state(32)
            store.save(ids, 0, k, v, None)
            assert store.flush(10)
            assert [ch.tier for ch in store.lookup(ids).chunks] == ["redis", "redis"]
            got = store.read_layers(store.lookup(ids).chunks[0], [0])
            assert got is not None and torch.equal(got[0].k, k[0, :16])
        with pytest.raises(ConnectionError, match="cannot reach Redis"):  # no client certificate: refused
            TieredStore.open(base, _ns())
        _assert_hidden(caplog.text, PW)
    finally:
        srv.close()


# ----- the HF benchmark peer: tensors back from Redis, never a pickle ------------------------------------------
class _Evil:
    def __reduce__(self):
        return (os.getpid, ())  # harmless, but a global a weights-only load must refuse to call


@needs_redis
@pytest.mark.redis
def test_hf_peer_loads_redis_bytes_weights_only(tiny_gqa, tmp_path: Path) -> None:
    import redis

    from kvtier.bench.hf import HFPeers, build_hf

    hf = build_hf(tiny_gqa)
    ids = list(range(10, 90))
    peers = ["hf_floor", "hf_load_bytes", "hf_load_cold_file", "hf_load_redis"]
    with RedisServer() as srv:
        client = redis.Redis.from_url(srv.url)
        peer = HFPeers(hf, ids, 64, peers, tmp_path / "hf.pt", client, "hf-peer-test")
        try:
            assert isinstance(torch.load(io.BytesIO(peer.blob), weights_only=True), list)  # tensors only
            tokens = {p: getattr(peer, p)() for p in peers}
            assert len(set(tokens.values())) == 1, tokens  # the rebuilt cache gives hf_floor's token
            client.set("hf-peer-test", pickle.dumps(_Evil()))  # what anyone with access to Redis could write
            with pytest.raises(pickle.UnpicklingError):
                peer.hf_load_redis()
        finally:
            peer.close()
            client.close()
