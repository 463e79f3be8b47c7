"""Shared fixtures: random-weight configs for the oracle tests and the real smollm2 model."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time

import pytest
import torch

from kvtier.models.loading import LoadedModel, load_model

torch.set_num_threads(2)


@pytest.fixture(scope="session")
def smollm2_fp32() -> LoadedModel:
    return load_model("smollm2-135m", dtype="fp32")


@pytest.fixture(scope="session")
def tiny_gqa() -> LoadedModel:
    return load_model("tiny-gqa", dtype="fp32", tokenizer=False)


@pytest.fixture(scope="session")
def tiny_mha() -> LoadedModel:
    return load_model("tiny-mha", dtype="fp32", tokenizer=False)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory):
    """URL of a fresh redis-server on a free loopback port (skipped only if the binary is missing)."""
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.skip("redis-server is not installed (CI installs it from Debian packages)")
    import redis

    workdir = tmp_path_factory.mktemp("redis")
    for _attempt in range(3):
        port = _free_port()
        proc = subprocess.Popen(
            [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", str(workdir)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = redis.Redis(port=port)
        for _ in range(100):
            try:
                client.ping()
                break
            except redis.ConnectionError:
                if proc.poll() is not None:
                    break
                time.sleep(0.05)
        else:
            proc.kill()
            continue
        if proc.poll() is None:
            break
    else:
        pytest.fail("could not start redis-server")
    yield f"redis://127.0.0.1:{port}"
    proc.terminate()
    proc.wait(10)


@pytest.fixture
def redis_url(redis_server, request):
    """A per-test key prefix on the shared server, so tests do not see each other's chunks."""
    import redis

    prefix = "t" + str(abs(hash(request.node.nodeid)) % 10**10)
    yield f"{redis_server}/0?prefix={prefix}"
    client = redis.Redis.from_url(redis_server)
    for k in client.scan_iter(match=f"{prefix}:*"):
        client.delete(k)


@pytest.fixture(params=["memory", "disk", "redis"])
def tier_spec(request, tmp_path):
    """A one-tier store spec per tier kind (the redis case uses the real server above)."""
    if request.param == "memory":
        return "memory:1GB"
    if request.param == "disk":
        return f"disk:{tmp_path}/store:1GB"
    return request.getfixturevalue("redis_url")
