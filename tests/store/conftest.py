"""Fixtures for the store tests: a small namespace, deterministic tensors, a real redis-server."""
from __future__ import annotations

import pytest

from kvtier.store import Repr

from store_testlib import make_ns


@pytest.fixture
def ns():
    return make_ns()


@pytest.fixture
def mixed_ns():
    return make_ns(reprs=(Repr.KV, Repr.HIDDEN, Repr.NONE, Repr.KV))


@pytest.fixture(params=["memory", "disk", "redis", "redis-cluster"])
def spec(request, tmp_path):
    """One store spec per tier kind (the redis cases start real servers: one, and a 3-master cluster)."""
    if request.param == "memory":
        return "memory:64MB"
    if request.param == "disk":
        return f"disk:{tmp_path}/d:64MB"
    return request.getfixturevalue("redis_url" if request.param == "redis" else "redis_cluster_url")
