"""Several `kvtier serve` processes over one Redis (and one Redis Cluster): a conversation whose turn 1
went to server A is restored on server B; a server with another model sees only misses."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest

from kvtier.testing.services import free_port, redis_binary

from serve_testlib import metric, metrics

pytestmark = pytest.mark.skipif(redis_binary() is None, reason="redis-server is not installed")
SYSTEM = "You are a careful assistant. " * 8


@dataclass
class Proc:
    name: str
    url: str
    proc: subprocess.Popen
    log: Path

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _start(name: str, model: str, store: list[str], home: Path, logs: Path) -> Proc:
    port = free_port()
    log = logs / f"{name}.log"
    cmd = [sys.executable, "-m", "kvtier", "serve", "--model", model, "--dtype", "fp32", "--port", str(port),
           "--max-model-len", "256", "--kv-cache-gb", "0.05", "--restore-method", "kv", "--chunk-tokens", "16",
           "--no-prefix-cache", *store]
    env = dict(os.environ, KVTIER_HOME=str(home), PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(cmd, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT)
    return Proc(name, f"http://127.0.0.1:{port}", proc, log)


def _wait_healthy(p: Proc, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert p.proc.poll() is None, f"{p.name} exited:\n{p.log.read_text()}"
        try:
            if httpx.get(p.url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise AssertionError(f"{p.name} did not come up:\n{p.log.read_text()}")


def _stop(procs: list[Proc]) -> None:
    for p in procs:
        if p.proc.poll() is None:
            p.proc.terminate()
    for p in procs:
        try:
            p.proc.wait(30)
        except subprocess.TimeoutExpired:
            p.proc.kill()
        assert "Traceback" not in p.log.read_text(), p.log.read_text()


@pytest.fixture(scope="module", params=["redis", "redis-cluster"])
def servers(request, tmp_path_factory) -> Iterator[dict[str, Proc]]:
    shared = request.getfixturevalue("redis_server" if request.param == "redis" else "redis_cluster_server")
    base = tmp_path_factory.mktemp(f"servers-{request.param}")
    redis = f"{shared}/0?prefix=shared" if request.param == "redis" else f"{shared}?prefix=shared"
    # One home for both params: the machine profiles are measured by the first only (CI time).
    home = tmp_path_factory.getbasetemp() / "shared-tier-home"
    procs: list[Proc] = []
    try:
        first = _start("A", "tiny-gqa", ["--store", f"memory:64MB,disk:{base}/a:256MB,{redis}"], home, base)
        procs.append(first)
        _wait_healthy(first)  # measures the machine profile once; the others load it
        procs += [
            _start("B", "tiny-gqa", ["--store", f"memory:64MB,disk:{base}/b:256MB,{redis}"], home, base),
            _start("plain", "tiny-gqa", ["--no-store"], home, base),
            _start("other", "tiny-mha", ["--store", f"memory:64MB,{redis}"], home, base),
        ]
        for p in procs[1:]:
            _wait_healthy(p)
        yield {p.name: p for p in procs}
    finally:
        _stop(procs)


def _ask(p: Proc, messages: list[dict]) -> tuple[str, int, int]:
    model = "tiny-mha" if p.name == "other" else "tiny-gqa"
    r = p.client().chat.completions.create(model=model, messages=messages, max_tokens=6, temperature=0)
    return r.choices[0].message.content, r.usage.prompt_tokens, r.usage.prompt_tokens_details.cached_tokens


def _saves_settled(p: Proc, timeout: float = 60) -> None:
    """Until the server's writer is idle (nothing queued, nothing being written) with chunks written.
    The engine hands a request's saves to the writer before the response goes out."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        m = metrics(p.url)
        idle = metric(m, "kvtier:store_write_queue_depth") == 0 and metric(m, "kvtier:store_writer_busy") == 0
        if idle and metric(m, "kvtier:store_chunks_written_total") > 0:
            return
        time.sleep(0.1)
    raise AssertionError(f"{p.name}'s saves did not settle")


def test_turn_two_on_another_server_restores_from_the_shared_tier(servers):
    a, b, plain, other = servers["A"], servers["B"], servers["plain"], servers["other"]
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Where is turn one?"}]
    answer, prompt1, cached1 = _ask(a, messages)
    assert cached1 == 0
    _saves_settled(a)
    messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": "And turn two?"}]

    text, prompt2, cached = _ask(b, messages)
    assert text == _ask(plain, messages)[0]  # greedy output equals a server without reuse
    assert cached >= prompt1 - prompt1 % 16 - 16 and cached > 0  # turn 1's chunks, from server A's saves
    mb = metrics(b.url)
    assert metric(mb, "kvtier:prompt_tokens_reused_total", tier="redis") == cached  # all of it from Redis
    assert metric(mb, "kvtier:store_hits_total", tier="redis") > 0

    # Another model on the same Redis: same prompt, only misses (namespaces never mix).
    _, _, cached_other = _ask(other, messages)
    assert cached_other == 0
    mo = metrics(other.url)
    assert metric(mo, "kvtier:store_hits_total", tier="redis") == 0
    assert metric(mo, "kvtier:prompt_tokens_reused_total", tier="redis") == 0
