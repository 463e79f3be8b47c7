"""Faults while serving, driven through the official openai client against a live server: a tier that
dies, fills up, disappears or goes read-only, or a chunk flipped on disk, costs cache misses, never a
failed request or a wrong answer; stored data stays intact and a revived tier is used again."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import threading
import time
from pathlib import Path

import openai
import pytest

from kvtier.store import TieredStore
from kvtier.testing.services import RedisServer, redis_binary

from serve_testlib import TINY, Served, metric, metrics, serve

SYSTEM = "You are a careful assistant. " * 8  # long enough to be worth restoring (several chunks)
served_with = contextlib.contextmanager(serve)


def _client(s: Served) -> openai.OpenAI:
    return openai.OpenAI(base_url=s.v1, api_key="unused", max_retries=0, timeout=60)


def _turn1(i: int) -> list[dict]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"Question number {i}?"}]


def _turn2(i: int, answer: str) -> list[dict]:
    return _turn1(i) + [{"role": "assistant", "content": answer}, {"role": "user", "content": "And then?"}]


def ask(s: Served, messages: list[dict], stream: bool = False) -> tuple[str, int]:
    """(text, cached prompt tokens) of a greedy completion; streamed if asked."""
    kw = dict(model=TINY, messages=messages, max_tokens=6, temperature=0)
    if not stream:
        r = _client(s).chat.completions.create(**kw)
        return r.choices[0].message.content, r.usage.prompt_tokens_details.cached_tokens
    text, usage = [], None
    for chunk in _client(s).chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}):
        if chunk.choices:
            text.append(chunk.choices[0].delta.content or "")
        usage = chunk.usage or usage
    assert usage is not None  # the stream ran to its end (usage comes last)
    return "".join(text), usage.prompt_tokens_details.cached_tokens


def _turns(s: Served, oracle: Served, i: int) -> int:
    """Turn 1 and (after its saves are stored) turn 2 of conversation i; both answers equal the
    no-store server's. -> turn 2's cached tokens."""
    a1, _ = ask(s, _turn1(i))
    assert a1 == ask(oracle, _turn1(i))[0]
    assert s.engine.flush(30)
    a2, cached = ask(s, _turn2(i, a1))
    assert a2 == ask(oracle, _turn2(i, a1))[0]
    return cached


@pytest.mark.skipif(redis_binary() is None, reason="redis-server is not installed")
def test_redis_killed_while_streaming_then_restarted(tiny_model, tiny_server):
    srv = RedisServer().start()
    try:
        with served_with(tiny_model, store=srv.url, prefix_cache=False) as s:
            assert _turns(s, tiny_server, 0) > 0  # restored from Redis while it is up
            answers = {i: ask(s, _turn1(i))[0] for i in range(1, 7)}  # saved to Redis
            assert s.engine.flush(30)
            expected = {i: ask(tiny_server, _turn2(i, a))[0] for i, a in answers.items()}

            results: dict[int, tuple[str, int] | BaseException] = {}

            def client(i: int) -> None:
                try:
                    results[i] = ask(s, _turn2(i, answers[i]), stream=True)
                except BaseException as e:  # noqa: BLE001  (reported below)
                    results[i] = e

            threads = [threading.Thread(target=client, args=(i,)) for i in answers]
            for t in threads[:3]:
                t.start()
            srv.kill()  # while those stream
            for t in threads[3:]:
                t.start()
            for t in threads:
                t.join(120)
            for i, r in results.items():
                assert not isinstance(r, BaseException), f"conversation {i}: {r!r}"
                assert r[0] == expected[i], i  # recomputed where Redis was needed: still right
            assert len(results) == len(answers)

            assert _turns(s, tiny_server, 7) == 0  # nothing to restore while Redis is down
            m = metrics(s.url)
            assert metric(m, "kvtier:store_tier_up", tier="redis") == 0
            assert metric(m, "kvtier:store_put_errors_total", tier="redis") > 0  # saves dropped, counted
            assert metric(m, "kvtier:store_unavailable_total", tier="redis") > 0
            assert metric(m, "kvtier:store_corrupt_total", tier="redis") == 0
            assert metric(m, "kvtier:http_requests_total", path="/v1/chat/completions", code="500") == 0

            srv.start()  # same address, empty: the server finds it again without a restart
            deadline, i = time.monotonic() + 30, 8
            while _turns(s, tiny_server, i) == 0:
                assert time.monotonic() < deadline, "the server never used the restarted Redis"
                i += 1
            assert metric(metrics(s.url), "kvtier:store_tier_up", tier="redis") == 1
    finally:
        srv.close()


def _chunk_files(root: Path) -> list[Path]:
    return [p for p in root.rglob("*.kvc") if "tmp" not in p.relative_to(root).parts]


def _stored_bytes(root: Path) -> int:
    """The chunk files' sizes, while the store's writer may be evicting some (a file gone between
    the listing and its stat counts nothing)."""
    total = 0
    for p in _chunk_files(root):
        try:
            total += p.stat().st_size
        except FileNotFoundError:
            pass
    return total


def test_flipped_chunk_file_between_turns_is_a_miss(tiny_model, tiny_server, tmp_path):
    root = tmp_path / "disk"
    with served_with(tiny_model, store=f"disk:{root}:64MB", prefix_cache=False) as s:
        a1, _ = ask(s, _turn1(0))
        assert s.engine.flush(30)
        files = _chunk_files(root)
        assert files
        for f in files:  # every stored chunk has one flipped byte in its payload
            data = bytearray(f.read_bytes())
            data[-50] ^= 0x40
            f.write_bytes(bytes(data))
        a2, cached = ask(s, _turn2(0, a1))
        assert a2 == ask(tiny_server, _turn2(0, a1))[0] and cached == 0
        m = metrics(s.url)
        assert metric(m, "kvtier:store_corrupt_total", tier="disk") >= 1  # found on the read, removed
        admin = TieredStore.open(f"disk:{root}:64MB", None)
        report = admin.verify()  # flipped chunks the request never reached are caught too
        flipped = {f.stem.split("-")[-1] for f in files}
        assert {key for _, key, _ in report.corrupt} <= flipped
        assert admin.verify().clean  # what is left (turn 2's fresh saves included) is intact


def test_disk_directory_deleted_under_a_running_server(tiny_model, tiny_server, tmp_path):
    root = tmp_path / "disk"
    with served_with(tiny_model, store=f"disk:{root}:64MB", prefix_cache=False) as s:
        a1, _ = ask(s, _turn1(0))
        assert s.engine.flush(30)
        shutil.rmtree(root)
        a2, cached = ask(s, _turn2(0, a1))
        assert a2 == ask(tiny_server, _turn2(0, a1))[0] and cached == 0  # a miss, the right answer
        assert _turns(s, tiny_server, 1) > 0  # the tier writes (and serves) again
        assert metric(metrics(s.url), "kvtier:http_requests_total", path="/v1/chat/completions", code="500") == 0


def _can_mount() -> bool:
    return os.geteuid() == 0 and shutil.which("mount") is not None


@contextlib.contextmanager
def tmpfs(path: Path, size: str):
    path.mkdir(parents=True, exist_ok=True)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({r.stderr.decode().strip()}); the disk-full case needs one")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


@pytest.mark.skipif(not _can_mount(), reason="mounting a small tmpfs needs root")
def test_disk_full_and_read_only_keep_serving(tiny_model, tiny_server, tmp_path):
    with tmpfs(tmp_path / "small", "256k") as root, \
            served_with(tiny_model, store=f"disk:{root}:64MB", prefix_cache=False) as s:
        for i in range(12):  # far more state than 256 KB holds
            _turns(s, tiny_server, i)
        m = metrics(s.url)
        assert metric(m, "kvtier:store_put_errors_total", tier="disk") > 0  # ENOSPC, counted
        assert metric(m, "kvtier:http_requests_total", path="/v1/chat/completions", code="500") == 0
        assert not [p for p in root.rglob("*.tmp")]  # no partial file left behind
        assert TieredStore.open(f"disk:{root}:64MB", None).verify().clean  # every visible chunk intact

        subprocess.run(["mount", "-o", "remount,ro", str(root)], check=True)
        before = metric(metrics(s.url), "kvtier:store_put_errors_total", tier="disk")
        for i in range(20, 23):
            _turns(s, tiny_server, i)
        m = metrics(s.url)
        assert metric(m, "kvtier:store_put_errors_total", tier="disk") > before  # EROFS, counted
        assert metric(m, "kvtier:http_requests_total", path="/v1/chat/completions", code="500") == 0


def test_disk_tier_never_grows_past_its_cap(tiny_model, tiny_server, tmp_path):
    cap = 96 << 10
    root = tmp_path / "disk"
    with served_with(tiny_model, store=f"disk:{root}:{cap}", prefix_cache=False) as s:
        for i in range(10):
            _turns(s, tiny_server, i)
            assert _stored_bytes(root) <= cap
        m = metrics(s.url)
        assert 0 < metric(m, "kvtier:store_bytes", tier="disk") <= cap
        assert metric(m, "kvtier:store_evictions_total", tier="disk") > 0
