"""Throwaway Redis services on free loopback ports, for benchmarks and tests: one server, or a
Redis Cluster of several masters (`redis-server --cluster-enabled yes` + `redis-cli --cluster
create`, both from the Debian `redis-server` package). No persistence; stopped on close.

    with RedisServer() as srv:   srv.url, srv.kill(), srv.start() (same port again)
    RedisServer(password="pw")   requirepass: clients must authenticate (srv.url carries no password)
    with RedisCluster(3) as c:   c.url (redis+cluster://...), c.nodes

Nothing here imports torch or the engine.
"""

from __future__ import annotations

import os
import random
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable


def free_port() -> int:
    """A TCP port on loopback that nobody listens on right now, for a server that binds it later
    (a subprocess, seconds after): chosen at random below the ephemeral range, then checked, since
    a port inside it can be handed meanwhile to any other socket that binds port 0 or connects."""
    rng = random.Random()
    for _ in range(1000):
        port = rng.randrange(10000, max(_ephemeral_low(), 11000))
        if _bindable(port):
            return port
    with socket.socket() as s:  # every one tried was taken: the OS picks one
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def _ephemeral_low() -> int:
    """The first port of the range the OS hands to outgoing connections (Linux default 32768)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_cluster_port() -> int:
    """A free port P with P + 10000 free too (a cluster node's bus port). Both lie below the
    ephemeral range: a port inside it can be taken by any outgoing connection between this check
    and redis binding it (a CI run lost a cluster that way). Chosen at random, then checked."""
    rng = random.Random()
    high = max(_ephemeral_low() - 10000, 11000)
    for _ in range(1000):
        port = rng.randrange(10000, high)
        if _bindable(port) and _bindable(port + 10000):
            return port
    raise RuntimeError("no free port pair (P, P + 10000) on loopback for a Redis Cluster node")


def redis_binary(name: str = "redis-server") -> str | None:
    return shutil.which(name) or (f"/usr/bin/{name}" if os.path.exists(f"/usr/bin/{name}") else None)


class RedisServer:
    """One redis-server. `start()` again after `kill()` reuses the port (a restarted server, as a
    client sees it). Large values are allowed (`proto-max-bulk-len` 2 GB) so a whole serialized KV
    cache fits in one SET. With `password` the server requires it (`requirepass`). Without `port`,
    one comes from `pick_port`; if the server exits at once (another process bound that port first)
    the first start tries a fresh one, up to `ATTEMPTS` times."""

    ATTEMPTS = 5

    def __init__(self, binary: str | None = None, startup_s: float = 10.0, port: int = 0,
                 extra: tuple[str, ...] = (), password: str | None = None,
                 pick_port: Callable[[], int] = free_port) -> None:
        self.binary = binary or redis_binary() or "/usr/bin/redis-server"
        self.startup_s = startup_s
        self.port = port
        self.pick_port = pick_port
        self.extra = extra
        self.password = password
        self.dir: str | None = None
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> "RedisServer":
        if self.port:  # given, or a restart after kill(): that port or nothing
            return self._start_once()
        for _ in range(self.ATTEMPTS - 1):
            self.port = self.pick_port()
            try:
                return self._start_once()
            except _ExitedEarly:
                pass  # its port was taken meanwhile: another
        self.port = self.pick_port()
        return self._start_once()

    def _start_once(self) -> "RedisServer":
        import redis
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        self.dir = self.dir or tempfile.mkdtemp(prefix="kvtier-redis-")  # its cwd: nothing is written with --save ""
        log = os.path.join(self.dir, "redis.log")
        self.proc = subprocess.Popen(
            [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", self.dir, "--proto-max-bulk-len", "2gb", "--logfile", log,
             *(("--requirepass", self.password) if self.password else ()), *self.extra],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        # a timeout per call: if another process holds the port, PING may reach it and hang
        # and no retries inside the client (redis-py 6+ retries timeouts with backoff): this loop retries
        client = redis.Redis(port=self.port, password=self.password, socket_timeout=1.0, socket_connect_timeout=1.0,
                             retry=Retry(NoBackoff(), 0))
        deadline = time.monotonic() + self.startup_s
        while True:
            try:
                if self.proc.poll() is None:
                    client.ping()
                    return self
                raise redis.ConnectionError("exited")
            except (redis.ConnectionError, redis.TimeoutError) as e:
                exited = self.proc.poll() is not None
                if exited or time.monotonic() > deadline:
                    why = _tail(log)
                    self.close()
                    error = _ExitedEarly if exited else RuntimeError
                    raise error(f"redis-server ({self.binary}) did not answer PING on port {self.port}"
                                f"{' (it exited)' if exited else ''}: {why}") from e
                time.sleep(0.05)
            finally:
                client.close()

    def kill(self) -> None:
        """SIGKILL, as a crash or an OOM kill would: no shutdown, the port closes at once."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None
        if self.dir:
            shutil.rmtree(self.dir, ignore_errors=True)
            self.dir = None

    def __enter__(self) -> "RedisServer":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


class _ExitedEarly(RuntimeError):
    """redis-server exited before answering: most often its port was taken."""


def _tail(path: str, lines: int = 3) -> str:
    try:
        with open(path, errors="replace") as f:
            return " | ".join(line.strip() for line in f.readlines()[-lines:]) or "(empty log)"
    except OSError:
        return "(no log)"


class RedisCluster:
    """`masters` cluster-enabled servers joined by `redis-cli --cluster create` (no replicas)."""

    def __init__(self, masters: int = 3, startup_s: float = 30.0) -> None:
        self.nodes = [RedisServer(pick_port=free_cluster_port, extra=(
            "--cluster-enabled", "yes", "--cluster-node-timeout", "2000", "--cluster-config-file", "nodes.conf"))
            for _ in range(masters)]
        self.startup_s = startup_s

    @property
    def url(self) -> str:
        return f"redis+cluster://127.0.0.1:{self.nodes[0].port}"

    def start(self) -> "RedisCluster":
        import redis

        cli = redis_binary("redis-cli")
        if cli is None:
            raise RuntimeError("redis-cli is not installed (Debian package redis-server brings it)")
        try:
            for n in self.nodes:
                n.start()
            addrs = [f"127.0.0.1:{n.port}" for n in self.nodes]
            subprocess.run([cli, "--cluster", "create", *addrs, "--cluster-yes"], check=True,
                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, timeout=self.startup_s)
            deadline = time.monotonic() + self.startup_s
            while True:  # every node must agree the cluster is up before clients use it
                states = []
                for n in self.nodes:
                    client = redis.Redis(port=n.port)
                    states.append(client.cluster("info").get("cluster_state"))
                    client.close()
                if all(s == "ok" for s in states):
                    return self
                if time.monotonic() > deadline:
                    raise RuntimeError(f"redis cluster did not reach state ok: {states}")
                time.sleep(0.1)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        for n in self.nodes:
            n.close()

    def __enter__(self) -> "RedisCluster":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
