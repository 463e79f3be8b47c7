"""Fixtures for the server tests: a tiny random-weight model served on a free loopback port.

The tiny model decodes in milliseconds, so most tests use it; the real smollm2 model is used
where the answer's content matters (tests marked slow).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvtier.engine.factory import build_engine

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
