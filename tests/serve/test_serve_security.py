"""Several API keys with tenants, auth on every path but /health, per-tenant cache salts and
sessions, and the caps on free-form request fields."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvtier.cli.main import main as kvtier_main
from kvtier.serve import middleware
from kvtier.serve.api_keys import load_api_keys, parse_api_keys
from kvtier.serve.config import ServeConfig
from kvtier.serve.schemas import MAX_ID_CHARS
from kvtier.serve.tenants import SEP, cache_salt, session_id

from serve_testlib import TINY, Served, serve

KEYS = {"key-alice": "alice", "key-bob": "bob"}
ALICE = {"Authorization": "Bearer key-alice"}
BOB = {"Authorization": "Bearer key-bob"}
METRICS_KEY = "key-metrics"
METRICS = {"Authorization": f"Bearer {METRICS_KEY}"}
CHAT = {"model": TINY, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}


@pytest.fixture(scope="module")
def tenants_server(tiny_model) -> Iterator[Served]:
    yield from serve(tiny_model, api_keys=KEYS)


@pytest.fixture(scope="module")
def shared_server(tiny_model) -> Iterator[Served]:
    yield from serve(tiny_model, api_keys=KEYS, shared_cache=True)


class SubmitSpy:
    """Records what the server hands to BackgroundEngine.submit, then submits as usual."""

    def __init__(self, served: Served, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls: list[dict[str, Any]] = []
        real = served.background.submit

        def submit(*args: Any, **kw: Any) -> str:
            self.calls.append(kw)
            return real(*args, **kw)

        monkeypatch.setattr(served.background, "submit", submit)

    def last(self) -> tuple[str | None, str | None]:
        kw = self.calls[-1]
        return kw.get("cache_salt"), kw.get("session_id")


def _chat(c: httpx.Client, headers: dict[str, str] | None = None, **fields: Any) -> httpx.Response:
    resp = c.post("/v1/chat/completions", json={**CHAT, **fields}, headers=headers or {})
    assert resp.status_code == 200, resp.text
    return resp


# ----- authentication ------------------------------------------------------------------------

def test_every_path_but_health_needs_a_key(tenants_server: Served) -> None:
    with tenants_server.client() as c:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "key-alice"},
                        {"Authorization": "Bearer key-ali"}, {"Authorization": "Bearer key-alicex"}):
            for method, path in (("POST", "/v1/chat/completions"), ("POST", "/v1/completions"), ("GET", "/v1/models"),
                                 ("GET", "/metrics"), ("GET", "/openapi.json"), ("GET", "/docs"),
                                 ("GET", "/no-such-path")):
                resp = c.request(method, path, headers=headers)
                assert resp.status_code == 401, (path, headers, resp.text)
                err = resp.json()["error"]
                assert (err["code"], err["type"]) == ("invalid_api_key", "authentication_error")
                assert resp.headers["www-authenticate"] == "Bearer"
        assert c.get("/health").status_code == 200
        for headers in (ALICE, BOB):
            assert c.get("/v1/models", headers=headers).status_code == 200
            assert c.get("/no-such-path", headers=headers).status_code == 404  # a key may map the server
        schema = c.get("/openapi.json", headers=ALICE).json()
    assert schema["components"]["securitySchemes"]["bearer"]["scheme"] == "bearer"
    assert schema["paths"]["/metrics"]["get"]["security"] == [{"bearer": []}]
    assert "security" not in schema["paths"]["/health"]["get"]


def test_metrics_public_opens_only_metrics(tiny_model) -> None:
    for served in serve(tiny_model, api_keys=KEYS, metrics_public=True):
        with served.client() as c:
            assert c.get("/metrics").status_code == 200
            assert c.get("/health").status_code == 200
            for path in ("/v1/models", "/openapi.json", "/docs"):
                assert c.get(path).status_code == 401, path
            schema = c.get("/openapi.json", headers=BOB).json()
        assert "security" not in schema["paths"]["/metrics"]["get"]


def test_tenant_keys_do_not_read_metrics(tenants_server: Served) -> None:
    """The metrics count every tenant's requests and reuse: with several tenants, a tenant's key
    does not read them (it would learn about the others' activity)."""
    with tenants_server.client() as c:
        for headers in (ALICE, BOB):
            resp = c.get("/metrics", headers=headers)
            assert resp.status_code == 403, resp.text
            err = resp.json()["error"]
            assert err["code"] == "metrics_forbidden" and err["type"] == "permission_error"
            assert "--metrics-key" in err["message"] and "--metrics-public" in err["message"]


def _metrics_config(**kw: Any) -> ServeConfig:
    return ServeConfig(metrics_key=METRICS_KEY, default_max_tokens=8, **kw)


def test_metrics_key_reads_metrics_and_nothing_else(tiny_model) -> None:
    for served in serve(tiny_model, config=_metrics_config(api_keys=KEYS)):
        with served.client() as c:
            assert c.get("/metrics", headers=METRICS).status_code == 200
            assert c.get("/metrics").status_code == 401
            resp = c.get("/metrics", headers=ALICE)
            assert resp.status_code == 403 and "--metrics-key" in resp.json()["error"]["message"], resp.text
            # Not a tenant: the metrics key opens no other path.
            assert c.get("/v1/models", headers=METRICS).status_code == 401
            assert c.post("/v1/chat/completions", json=CHAT, headers=METRICS).status_code == 401
            assert c.get("/v1/models", headers=ALICE).status_code == 200
            schema = c.get("/openapi.json", headers=ALICE).json()
        assert schema["paths"]["/metrics"]["get"]["security"] == [{"bearer": []}]


def test_metrics_key_with_one_api_key(tiny_model) -> None:
    for served in serve(tiny_model, config=_metrics_config(api_key="key-one")):
        with served.client() as c:
            assert c.get("/metrics", headers=METRICS).status_code == 200
            assert c.get("/metrics", headers={"Authorization": "Bearer key-one"}).status_code == 403
            assert c.post("/v1/chat/completions", json=CHAT, headers=METRICS).status_code == 401


def test_metrics_key_on_an_open_server_closes_only_metrics(tiny_model) -> None:
    for served in serve(tiny_model, config=_metrics_config()):
        with served.client() as c:
            assert c.get("/metrics").status_code == 401
            assert c.get("/metrics", headers=METRICS).status_code == 200
            assert c.get("/v1/models").status_code == 200
            assert c.post("/v1/chat/completions", json=CHAT).status_code == 200
            schema = c.get("/openapi.json").json()
        assert schema["paths"]["/metrics"]["get"]["security"] == [{"bearer": []}]
        assert "security" not in schema["paths"]["/v1/models"]["get"]


def test_metrics_public_wins_over_a_metrics_key(tiny_model) -> None:
    for served in serve(tiny_model, config=_metrics_config(api_keys=KEYS, metrics_public=True)):
        with served.client() as c:
            for headers in ({}, ALICE, METRICS):
                assert c.get("/metrics", headers=headers).status_code == 200, headers


def test_every_key_is_compared(tenants_server: Served, monkeypatch: pytest.MonkeyPatch) -> None:
    """No early exit on a match: the first key costs as many comparisons as the last or a wrong one."""
    counts: list[int] = []
    real = middleware.secrets.compare_digest

    def counting(a: bytes, b: bytes) -> bool:
        counts.append(len(a) + len(b))
        return real(a, b)

    monkeypatch.setattr(middleware.secrets, "compare_digest", counting)
    with tenants_server.client() as c:
        for headers in (ALICE, BOB, {"Authorization": "Bearer wrong"}, {}):
            counts.clear()
            c.get("/v1/models", headers=headers)
            assert counts == [64] * len(KEYS), headers  # two SHA-256 digests per comparison


# ----- tenants: cache salts and sessions -----------------------------------------------------

def test_keys_give_tenants_their_own_salts_and_sessions(
    tenants_server: Served, monkeypatch: pytest.MonkeyPatch
) -> None:
    spy = SubmitSpy(tenants_server, monkeypatch)
    with tenants_server.client() as c:
        _chat(c, ALICE)
        assert spy.last() == ("alice", None)
        _chat(c, BOB)
        assert spy.last() == ("bob", None)
        _chat(c, ALICE, cache_salt="s1")
        assert spy.last() == (f"alice{SEP}s1", None)
        _chat(c, ALICE, prompt_cache_key="conv")
        assert spy.last() == ("alice", f"alice{SEP}conv")
        _chat(c, BOB, prompt_cache_key="conv")  # the same key names bob's own session
        assert spy.last() == ("bob", f"bob{SEP}conv")
        resp = c.post("/v1/completions", json={"model": TINY, "prompt": "x", "max_tokens": 1, "cache_salt": "bob"},
                      headers=ALICE)
        assert resp.status_code == 200
        assert spy.last() == (f"alice{SEP}bob", None)  # a body salt never becomes another tenant's salt


def test_shared_cache_drops_the_tenant_from_the_salt_but_not_from_sessions(
    shared_server: Served, monkeypatch: pytest.MonkeyPatch
) -> None:
    spy = SubmitSpy(shared_server, monkeypatch)
    with shared_server.client() as c:
        _chat(c, ALICE)
        assert spy.last() == (None, None)
        _chat(c, BOB, cache_salt="s1")
        assert spy.last() == (f"{SEP}s1", None)
        _chat(c, ALICE, prompt_cache_key="conv")
        assert spy.last() == (None, f"alice{SEP}conv")


def test_without_keys_every_request_is_the_default_tenant(
    tiny_server: Served, monkeypatch: pytest.MonkeyPatch
) -> None:
    spy = SubmitSpy(tiny_server, monkeypatch)
    with tiny_server.client() as c:
        _chat(c, prompt_cache_key="conv")
        assert spy.last() == (None, f"default{SEP}conv")  # the unsalted partition, as `kvtier generate`
        _chat(c, cache_salt="s1")
        assert spy.last() == (f"{SEP}s1", None)


def test_one_api_key_is_the_default_tenant(keyed_server: Served, monkeypatch: pytest.MonkeyPatch) -> None:
    spy = SubmitSpy(keyed_server, monkeypatch)
    with keyed_server.client() as c:
        _chat(c, {"Authorization": "Bearer s3cret-key"}, prompt_cache_key="conv")
    assert spy.last() == (None, f"default{SEP}conv")


def test_salts_never_collide() -> None:
    pairs = [(t, s) for t in ("default", "alice", "bob", "a") for s in (None, "x", "alice", f"b{SEP}x", "")]
    salts = [cache_salt(t, s, shared=False) for t, s in pairs if s != ""]
    assert len(set(salts)) == len(salts)
    assert session_id("alice", None) is None


LONG_PROMPT = " ".join(f"Line {i}: the tenants' shared system prompt, long enough for many blocks." for i in range(6))


def _cached(c: httpx.Client, headers: dict[str, str], **fields: Any) -> int:
    body = {"model": TINY, "messages": [{"role": "user", "content": LONG_PROMPT}], "max_tokens": 2,
            "temperature": 0, **fields}
    resp = c.post("/v1/chat/completions", json=body, headers=headers)
    assert resp.status_code == 200, resp.text
    return resp.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


@pytest.mark.parametrize("where", ["device", "store"])
def test_tenants_do_not_share_cached_prompts(tiny_model, where: str) -> None:
    """End to end (needs the engine's cache_salt): the same prompt from another tenant, or with
    another body salt, is computed again; the same tenant's repeat is reused. "device" is the
    engine's prefix cache, "store" the tiered store (no prefix cache, restored from memory)."""
    kw: dict[str, Any] = {} if where == "device" else {"store": "memory:64MB", "prefix_cache": False}
    for served in serve(tiny_model, api_keys=KEYS, **kw):
        with served.client() as c:

            def cached(headers: dict[str, str], **fields: Any) -> int:
                n = _cached(c, headers, **fields)
                assert served.engine.flush(30)  # stored before the next request looks
                return n

            assert cached(ALICE) == 0
            assert cached(ALICE) > 0  # the same tenant's repeat is reused
            assert cached(BOB) == 0  # another tenant's identical prompt is not
            assert cached(ALICE, cache_salt="private") == 0  # nor alice's own other partition
            assert cached(BOB) > 0
            assert cached(ALICE, cache_salt="private") > 0


# ----- request limits --------------------------------------------------------------------------

@pytest.mark.parametrize("field", ["prompt_cache_key", "user", "cache_salt"])
def test_identifier_fields_are_capped(tiny_server: Served, field: str) -> None:
    with tiny_server.client() as c:
        _chat(c, **{field: "k" * MAX_ID_CHARS})
        resp = c.post("/v1/chat/completions", json={**CHAT, field: "k" * (MAX_ID_CHARS + 1)})
        assert resp.status_code == 400, resp.text
        err = resp.json()["error"]
        assert err["param"] == field and err["type"] == "invalid_request_error" and err["code"] == "invalid_value"
        assert field in err["message"] and str(MAX_ID_CHARS) in err["message"]
        resp = c.post("/v1/completions", json={"model": TINY, "prompt": "x", field: "k" * (MAX_ID_CHARS + 1)})
        assert resp.status_code == 400 and resp.json()["error"]["param"] == field


def test_empty_cache_salt_is_refused(tiny_server: Served) -> None:
    with tiny_server.client() as c:
        resp = c.post("/v1/chat/completions", json={**CHAT, "cache_salt": ""})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "cache_salt"


# ----- the --api-keys file, the config and the CLI ------------------------------------------------

def test_api_keys_file(tmp_path: Path) -> None:
    path = tmp_path / "keys"
    path.write_text("# tenants of the staging server\n\nalice   k-1#x\n  bob\tk-2  \n# carol k-3\nteam.a_1-b k-4\n")
    assert load_api_keys(path) == {"k-1#x": "alice", "k-2": "bob", "k-4": "team.a_1-b"}


@pytest.mark.parametrize("text, message", [
    ("alice sk1\nbob sk1\n", "keys:2: this key is already the key of tenant 'alice'"),
    ("alice sk1\nalice sk2\n", "keys:2: tenant 'alice' already has a key (line 1)"),
    ("al/ice sk1\n", "keys:1: invalid tenant name 'al/ice'"),
    (("a" * 65) + " sk1\n", "keys:1: invalid tenant name"),
    ("alice\n", "keys:1: expected 'TENANT KEY'"),
    ("alice sk1 # old\n", "keys:1: expected 'TENANT KEY'"),
    ("alice sk\u00e9\n", "keys:1: the key of tenant 'alice' must be printable ASCII"),
    ("# nothing\n\n", "keys: no 'TENANT KEY' lines"),
])
def test_api_keys_file_errors_name_the_line(text: str, message: str) -> None:
    with pytest.raises(ValueError) as info:
        parse_api_keys(text, "keys")
    assert message in str(info.value)
    assert "sk" not in str(info.value)  # keys are never echoed


def test_api_keys_file_unreadable(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="cannot read the API keys file .*missing"):
        load_api_keys(tmp_path / "missing")
    with pytest.raises(ValueError, match="cannot read the API keys file"):
        load_api_keys(tmp_path)  # a directory


def test_config_validation() -> None:
    with pytest.raises(ValueError, match="not both"):
        ServeConfig(api_key="k", api_keys={"k2": "alice"})
    with pytest.raises(ValueError, match="invalid tenant name"):
        ServeConfig(api_keys={"k": "no spaces"})
    with pytest.raises(ValueError, match="non-empty"):
        ServeConfig(api_keys={"": "alice"})
    with pytest.raises(ValueError, match="more than one key"):
        ServeConfig(api_keys={"k1": "alice", "k2": "alice"})
    keys = {"k1": "alice"}
    config = ServeConfig(api_keys=keys, metrics_public=True)
    keys["k2"] = "bob"  # the config keeps its own frozen copy
    assert dict(config.tenant_keys) == {"k1": "alice"} and config.open_paths == {"/health", "/metrics"}
    assert dict(ServeConfig(api_key="k").tenant_keys) == {"k": "default"}
    assert "k1" not in repr(config) and "top-secret" not in repr(ServeConfig(api_key="top-secret"))


def test_metrics_key_validation() -> None:
    with pytest.raises(ValueError, match="metrics key .* differ"):
        ServeConfig(api_keys={"k1": "alice", "k2": "bob"}, metrics_key="k2")
    with pytest.raises(ValueError, match="metrics key .* differ"):
        ServeConfig(api_key="k1", metrics_key="k1")
    with pytest.raises(ValueError, match="metrics_key must not be empty"):
        ServeConfig(metrics_key="")
    assert "m-secret" not in repr(ServeConfig(metrics_key="m-secret"))


@pytest.mark.parametrize("setup, message", [
    (lambda p: [], "cannot read the API keys file"),
    (lambda p: p.write_text("alice k1\nbob k1\n"), ":2: this key is already"),
    (lambda p: p.write_text("alice k1\n"), "not both"),
    (lambda p: p.write_text("alice k1\n"), "must differ from every tenant's API key"),
])
def test_cli_reports_key_file_problems_in_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture[str], setup, message: str) -> None:
    monkeypatch.delenv("KVTIER_API_KEY", raising=False)
    monkeypatch.delenv("KVTIER_METRICS_KEY", raising=False)
    path = tmp_path / "keys"
    setup(path)
    extra = {"not both": ["--api-key", "one"]}.get(message, ["--metrics-key", "k1"] if "differ" in message else [])
    code = kvtier_main(["serve", "--model", "no-such-model-needed", "--api-keys", str(path), *extra])
    err = capsys.readouterr().err.strip()
    assert code == 2 and message in err and len(err.splitlines()) == 1 and "Traceback" not in err, err
