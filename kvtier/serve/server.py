"""Run an app with uvicorn: the settings every kvtier server runs with (read deadlines), and a
background-thread server (tests, benchmarks, notebooks)."""

from __future__ import annotations

import asyncio
import errno
import json
import socket
import threading
import time
from collections.abc import Callable
from types import TracebackType
from typing import Any, Literal

import h11
import uvicorn
from starlette.types import ASGIApp
from uvicorn.protocols.http.h11_impl import H11Protocol

from kvtier.serve.config import DEFAULT_BODY_TIMEOUT_S, DEFAULT_HEADER_TIMEOUT_S
from kvtier.serve.errors import error_body


class PortUnavailable(ValueError):
    """The server cannot listen where it was asked to (a user's error: one line, exit 2)."""


def listen_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to (host, port), for uvicorn to listen on: binding before a slow start
    makes a port in use one line at once, and no one can take the port in between. Raises
    PortUnavailable (a ValueError: a user's error) naming the fix."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP explicitly: asyncio sets TCP_NODELAY on accepted connections only when the
    # listening socket says it is TCP; with proto 0, Nagle's algorithm adds ~40 ms per response.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        why = {errno.EADDRINUSE: "the port is in use: stop what listens there or pass --port N (0: any free port)",
               errno.EACCES: "ports below 1024 need root: pass --port 1024 or higher",
               errno.EADDRNOTAVAIL: "that address is not one of this machine's: pass --host 127.0.0.1 or 0.0.0.0"}
        raise PortUnavailable(f"cannot listen on {host}:{port}: {why.get(e.errno or 0, e.strerror or str(e))}") from None
    except socket.gaierror as e:
        sock.close()
        raise PortUnavailable(f"cannot listen on {host}:{port}: {e.strerror}: pass --host 127.0.0.1 or 0.0.0.0") from None
    return sock


class ReadDeadlineProtocol(H11Protocol):
    """uvicorn's h11 protocol with deadlines on reading a request; uvicorn itself starts no timer
    until a request's headers are complete, so a client that stalls in them holds its connection
    forever (and one file descriptor: enough such clients and the server accepts no one).

    - headers: complete within `header_timeout` of the connection opening, or (on a keep-alive
      connection) of the next request's first byte; the idle time between requests is uvicorn's
      keep-alive timeout. Expired: 408 if part of a request came, else just closed.
    - body: complete within `body_timeout` of its headers, as a whole (a timer between chunks would
      let a client trickle a byte per interval forever). Expired: 408 unless a response has
      started, then closed.

    Both are deadlines, not idle timers: sending slowly does not extend them. h11 is pinned (not
    uvicorn's "auto", which prefers httptools when installed) because the deadlines follow h11's
    view of the client (`their_state`); a prompt's parsing is no cost next to its generation.
    """

    header_timeout: float = DEFAULT_HEADER_TIMEOUT_S
    body_timeout: float = DEFAULT_BODY_TIMEOUT_S
    _deadline: asyncio.TimerHandle | None = None
    _reading: Literal["", "headers", "body"] = ""  # what the running deadline is for

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm("headers")  # a connection that never sends a byte is closed too

    def send_400_response(self, msg: str) -> None:
        """uvicorn's answer to bytes h11 cannot read as a request (a malformed header or chunk),
        in OpenAI's error shape instead of uvicorn's plain text; the connection then closes."""
        body = json.dumps(error_body(f"the request is not valid HTTP/1.1 ({msg.rstrip('.')})", "invalid_request_error",
                                     code="invalid_http")).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                   (b"connection", b"close")]
        for event in (h11.Response(status_code=400, headers=headers, reason=b"Bad Request"), h11.Data(data=body),
                      h11.EndOfMessage()):
            self.transport.write(self.conn.send(event))
        self.transport.close()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._follow(started=True)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        # A pipelined request's bytes already buffered have started its header deadline.
        self._follow(started=bool(self.conn.trailing_data[0]))

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _follow(self, started: bool) -> None:
        """Run the deadline for what the connection waits for now; `started`: some of the next
        request's bytes have come (an idle keep-alive connection is uvicorn's to close)."""
        if self.transport.is_closing() or self.transport.get_protocol() is not self:  # closed, or a websocket now
            self._disarm()
        elif self.conn.their_state is h11.IDLE:
            if started:
                self._arm("headers")
        elif self.conn.their_state is h11.SEND_BODY:
            self._arm("body")
        else:  # the request is in (or the connection is done): the app has it
            self._disarm()

    def _arm(self, reading: Literal["headers", "body"]) -> None:
        if self._reading == reading:
            return  # a deadline: more bytes of the same part do not restart it
        self._disarm()
        self._deadline = self.loop.call_later(self._seconds(reading), self._expired)
        self._reading = reading

    def _seconds(self, reading: Literal["", "headers", "body"]) -> float:
        return self.header_timeout if reading == "headers" else self.body_timeout

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
        self._deadline, self._reading = None, ""

    def _expired(self) -> None:
        reading = self._reading
        self._deadline, self._reading = None, ""
        if self.transport.is_closing():
            return
        if reading == "headers":
            answer = bool(self.conn.trailing_data[0])  # nothing came: there is no request to answer
        else:
            answer = self.cycle is not None and not self.cycle.response_started
        self.logger.debug("%s: request %s not complete within the deadline; closing", self.client, reading)
        if answer:
            self.transport.write(request_timeout(f"the request {reading} did not arrive within "
                                                 f"{self._seconds(reading):g} s"))
        self.transport.close()  # the app, if it waits for the body, then sees http.disconnect


def request_timeout(message: str) -> bytes:
    """A whole 408 response in OpenAI's error shape, written as is (bypassing h11) since the
    connection closes right after: with a partial header no request was parsed, so h11 has
    nothing to frame a response against."""
    body = json.dumps(error_body(message, "invalid_request_error", code="request_timeout")).encode()
    head = (f"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\nconnection: close\r\n"
            f"content-length: {len(body)}\r\n\r\n")
    return head.encode() + body


def read_deadline_protocol(header_timeout: float, body_timeout: float) -> type[ReadDeadlineProtocol]:
    """ReadDeadlineProtocol with these deadlines, as the class uvicorn.Config(http=...) takes."""

    class Protocol(ReadDeadlineProtocol):
        pass

    Protocol.header_timeout, Protocol.body_timeout = header_timeout, body_timeout
    return Protocol


def uvicorn_config(app: ASGIApp, *, header_timeout: float = DEFAULT_HEADER_TIMEOUT_S,
                   body_timeout: float = DEFAULT_BODY_TIMEOUT_S, **kw: Any) -> uvicorn.Config:
    """The uvicorn settings every kvtier server runs with (`kvtier serve` and ServerThread alike):
    the read deadlines, and 5 s for in-flight requests at shutdown. `kw`: more uvicorn.Config
    arguments."""
    return uvicorn.Config(app, http=read_deadline_protocol(header_timeout, body_timeout),
                          timeout_graceful_shutdown=5, **kw)


class ReadyServer(uvicorn.Server):
    """A uvicorn server that calls `on_ready` once it really listens (after startup, not before)."""

    def __init__(self, config: uvicorn.Config, on_ready: Callable[[], object]):
        super().__init__(config)
        self.on_ready = on_ready

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets=sockets)
        if not self.should_exit:
            self.on_ready()


class ServerThread:
    """`with ServerThread(app) as s:` serves on 127.0.0.1 at a free port; `s.url` is its base URL.

    The socket is bound here, before the thread starts, so the port is known and cannot be taken
    by someone else in between. Requests are read under the deadlines `kvtier serve` applies
    (`header_timeout`, `body_timeout`: seconds; see ReadDeadlineProtocol).
    """

    def __init__(self, app: ASGIApp, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning",
                 header_timeout: float = DEFAULT_HEADER_TIMEOUT_S, body_timeout: float = DEFAULT_BODY_TIMEOUT_S):
        self.sock = listen_socket(host, port)
        self.host, self.port = self.sock.getsockname()[:2]
        config = uvicorn_config(app, header_timeout=header_timeout, body_timeout=body_timeout,
                                log_level=log_level, lifespan="on")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 30.0) -> "ServerThread":
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive():
                raise RuntimeError("the server thread exited during startup; see the log above")
            if time.monotonic() > deadline:
                raise TimeoutError(f"the server did not start within {timeout} s")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=15)
        self.sock.close()

    def __enter__(self) -> "ServerThread":
        return self.start()

    def __exit__(self, *exc: type[BaseException] | BaseException | TracebackType | None) -> None:
        self.stop()
