"""Fixtures for the server tests: a tiny random-weight model served on a free loopback port.

The tiny model decodes in milliseconds, so most tests use it; the real smollm2 model is used
where the answer's content matters (tests marked slow).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from kvtier.engine.factory import build_engine
from kvtier.testing.services import free_port

from serve_testlib import TINY, WINDOW, Served, serve


@pytest.fixture(scope="session")
def tiny_model():
    return build_engine(TINY, kv_cache_bytes=16 << 20, max_model_len=WINDOW).model


@pytest.fixture(scope="session")
def tiny_server(tiny_model) -> Iterator[Served]:
    yield from serve(tiny_model)


@pytest.fixture(scope="session")
def keyed_server(tiny_model) -> Iterator[Served]:
    yield from serve(tiny_model, api_key="s3cret-key")


@dataclass
class KvtierProcess:
    url: str
    proc: subprocess.Popen
    log: Path
    home: Path

    def tail(self) -> str:
        return self.log.read_text()[-3000:]


@pytest.fixture(scope="session")
def kvtier_process(tmp_path_factory) -> Iterator[KvtierProcess]:
    """`kvtier serve` in its own process, as a user starts it: the tiny model, its default limits and
    body size, a memory store, and a KVTIER_HOME of its own (no saved machine profile)."""
    home = tmp_path_factory.mktemp("kvtier-process-home")
    port = free_port()
    log = home / "serve.log"
    cmd = [sys.executable, "-m", "kvtier", "serve", "--model", TINY, "--dtype", "fp32", "--port", str(port),
           "--max-model-len", "256", "--kv-cache-gb", "0.05", "--store", "memory:64MB"]
    proc = subprocess.Popen(cmd, env=dict(os.environ, KVTIER_HOME=str(home)), stdout=log.open("w"),
                            stderr=subprocess.STDOUT)
    served = KvtierProcess(f"http://127.0.0.1:{port}", proc, log, home)
    try:
        deadline = time.monotonic() + 240
        while True:
            assert proc.poll() is None, f"the server exited:\n{served.tail()}"
            try:
                if httpx.get(served.url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, f"the server did not come up:\n{served.tail()}"
            time.sleep(0.2)
        yield served
        assert proc.poll() is None, f"the server died:\n{served.tail()}"
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
