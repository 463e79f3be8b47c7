"""The header and body read deadlines, over raw sockets against a live tiny-model server: a client
that stalls in its headers or its body is answered 408 or closed, instead of holding a
connection (and a file descriptor) open forever; a well-behaved keep-alive client is unaffected.

The bounds are generous (ten times the deadline): these tests check that a connection is closed,
not how fast."""

from __future__ import annotations

import argparse
import json
import socket
import time
from collections.abc import Iterator

import httpx
import pytest

from kvtier.cli import serve as cli
from kvtier.cli.main import main as kvtier_main
from kvtier.engine.background import BackgroundEngine
from kvtier.engine.config import EngineConfig
from kvtier.engine.engine import Engine
from kvtier.serve import create_app
from kvtier.serve.config import DEFAULT_BODY_TIMEOUT_S, DEFAULT_HEADER_TIMEOUT_S
from kvtier.serve.server import ReadDeadlineProtocol, ReadyServer, ServerThread

from serve_testlib import BODY_LIMIT, TINY, WINDOW

HEADER_S = 0.5
BODY_S = 1.0
PARTIAL_HEADERS = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"


@pytest.fixture(scope="module")
def server(tiny_model) -> Iterator[tuple[str, int]]:
    engine = Engine(tiny_model, EngineConfig(kv_cache_bytes=16 << 20, max_model_len=WINDOW))
    background = BackgroundEngine(engine)
    app = create_app(background, max_body_bytes=BODY_LIMIT)
    try:
        with ServerThread(app, header_timeout=HEADER_S, body_timeout=BODY_S) as s:
            yield s.host, s.port
    finally:
        background.close()
        engine.close()


def _connect(addr: tuple[str, int], timeout: float) -> socket.socket:
    sock = socket.create_connection(addr, timeout=timeout)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def _read_until_closed(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes; socket.timeout (a failure) if it never does."""
    got = b""
    while chunk := sock.recv(65536):
        got += chunk
    return got


def _read_response(sock: socket.socket) -> tuple[int, bytes]:
    """One response with a Content-Length body, leaving the connection open."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"the server closed the connection mid-response: {data!r}"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    length = next(int(v) for k, _, v in (line.partition(":") for line in lines[1:]) if k.lower() == "content-length")
    while len(body) < length:
        body += sock.recv(65536)
    return int(lines[0].split()[1]), body


def _closed_quietly_or_408(reply: bytes) -> bool:
    return reply == b"" or reply.startswith(b"HTTP/1.1 408 ")


def _healthy(addr: tuple[str, int]) -> bool:
    return httpx.get(f"http://{addr[0]}:{addr[1]}/health", timeout=10).status_code == 200


def test_a_client_stalled_in_its_headers_is_closed(server) -> None:
    with _connect(server, timeout=10 * HEADER_S) as sock:
        sock.sendall(PARTIAL_HEADERS)
        reply = _read_until_closed(sock)
    assert _closed_quietly_or_408(reply), reply
    assert _healthy(server)


def test_a_client_that_sends_nothing_is_closed(server) -> None:
    with _connect(server, timeout=10 * HEADER_S) as sock:
        assert _read_until_closed(sock) == b""  # there was no request to answer
    assert _healthy(server)


def test_keep_alive_requests_each_get_a_fresh_header_deadline(server) -> None:
    """Requests on one connection, idle shorter than the deadline between them, for longer than
    the deadline in all: each works. Then a next request stalled in its headers is closed."""
    request = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"
    with _connect(server, timeout=10 * HEADER_S) as sock:
        start = time.monotonic()
        while time.monotonic() - start < 2.5 * HEADER_S:
            sock.sendall(request)
            assert _read_response(sock)[0] == 200
            time.sleep(HEADER_S / 2)
        sock.sendall(PARTIAL_HEADERS)
        assert _closed_quietly_or_408(_read_until_closed(sock))


def test_headers_sent_in_pieces_within_the_deadline_are_served(server) -> None:
    request = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"
    with _connect(server, timeout=10 * HEADER_S) as sock:
        for piece in (request[:10], request[10:20], request[20:]):
            sock.sendall(piece)
            time.sleep(HEADER_S / 10)
        assert _read_response(sock)[0] == 200


def test_a_body_sent_half_gets_408_and_is_closed(server) -> None:
    body = b'{"model": "%s", "prompt": "hello", "max_tokens": 1}' % TINY.encode()
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n" % (len(body) + 100))
    with _connect(server, timeout=10 * BODY_S) as sock:
        sock.sendall(head + body)  # 100 bytes short
        reply = _read_until_closed(sock)
    assert _closed_quietly_or_408(reply), reply
    assert _healthy(server)


@pytest.mark.parametrize("raw", [
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n{}\r\n0\r\n\r\n",
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\n{}",
    b"GET /health HTTP/1.1\r\nHost x\r\n\r\n",
], ids=["malformed chunk size", "two lengths", "header without a colon"])
def test_bytes_that_are_not_http_get_a_json_400_and_are_closed(server, raw: bytes) -> None:
    """Answered by the server itself, before any app: the error shape of every other answer."""
    with _connect(server, timeout=10) as sock:
        sock.sendall(raw)
        reply = _read_until_closed(sock)
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400 ") and b"content-type: application/json" in head.lower(), reply
    err = json.loads(body)["error"]
    assert err["code"] == "invalid_http" and err["message"].startswith("the request is not valid HTTP/1.1"), err
    assert _healthy(server)


def test_a_complete_body_is_served(server) -> None:
    body = {"model": TINY, "prompt": "hello", "max_tokens": 1}
    r = httpx.post(f"http://{server[0]}:{server[1]}/v1/completions", json=body, timeout=30)
    assert r.status_code == 200, r.text


def test_kvtier_serve_applies_the_deadlines_from_flags_or_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """`kvtier serve` (not only ServerThread) runs uvicorn with the deadline protocol: the options
    reach it from flags and from KVTIER_<NAME> variables, and the defaults are the documented ones."""
    ran: list = []
    monkeypatch.setattr(ReadyServer, "run", lambda self, sockets=None: ran.append(self.config.http))
    monkeypatch.setattr(cli, "freeze_startup_heap", lambda: None)  # not in the test process
    for name in (cli.API_KEY_ENV, "KVTIER_HEADER_TIMEOUT", "KVTIER_BODY_TIMEOUT"):
        monkeypatch.delenv(name, raising=False)
    base = ["serve", "--model", TINY, "--no-store", "--port", "0", "--kv-cache-gb", "0.01"]
    monkeypatch.setenv("KVTIER_BODY_TIMEOUT", "7")
    assert kvtier_main([*base, "--header-timeout", "2.5"]) == 0
    monkeypatch.delenv("KVTIER_BODY_TIMEOUT")
    assert kvtier_main(base) == 0
    (flagged, default) = ran
    assert issubclass(flagged, ReadDeadlineProtocol) and issubclass(default, ReadDeadlineProtocol)
    assert (flagged.header_timeout, flagged.body_timeout) == (2.5, 7.0)
    assert (default.header_timeout, default.body_timeout) == (DEFAULT_HEADER_TIMEOUT_S, DEFAULT_BODY_TIMEOUT_S)


@pytest.mark.parametrize("bad", [["--header-timeout", "0"], ["--body-timeout", "-1"], ["--body-timeout", "nan"]])
def test_deadlines_must_be_positive(bad: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="kvtier")
    cli.register(parser.add_subparsers(dest="command"))
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", *bad])
