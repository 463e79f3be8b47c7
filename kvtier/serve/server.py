"""Run an app with uvicorn on a background thread (tests, benchmarks, notebooks)."""

from __future__ import annotations

import errno
import socket
import threading
import time
from collections.abc import Callable
from types import TracebackType

import uvicorn
from starlette.types import ASGIApp


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
    by someone else in between.
    """

    def __init__(self, app: ASGIApp, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning"):
        self.sock = listen_socket(host, port)
        self.host, self.port = self.sock.getsockname()[:2]
        config = uvicorn.Config(app, log_level=log_level, lifespan="on", timeout_graceful_shutdown=5)
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
