"""Reproduce known security findings against whichever kvtier is importable, one line per finding.

Run it against the code before the fixes and after, each on its own tree:

    git worktree add /tmp/before <commit before the fixes>
    PYTHONPATH=/tmp/before .venv/bin/python scripts/security_findings.py --json out/security/before.json
    .venv/bin/python scripts/security_findings.py --json out/security/after.json

Each check drives the real code and prints whether the finding reproduces ("OPEN") or not ("closed").
Findings 1-8 use the tiny-gqa engine, real Redis and disk tiers and the FastAPI app through
Starlette's TestClient. Findings 9-15 (grammars, JSON schemas, /tokenize, slow headers) go over
HTTP to a real `kvtier serve` started as a subprocess from the tree under test (its cwd and
PYTHONPATH are that tree, KVTIER_HOME a temp dir): one server for all of them, restarted only when
a check killed it, and each row says whether the server was alive afterwards. Findings 16-17 plant
symbolic links in a real disk tier's directories and reopen it.
The checks use only APIs both versions have, plus the new ones (a store secret, tenant keys)
where they exist: a check that needs a feature the code lacks reports the finding open.
"""
from __future__ import annotations

import argparse
import http.client
import json
import logging
import os
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

from kvtier.engine.config import EngineConfig, ReuseConfig
from kvtier.engine.engine import Engine
from kvtier.engine.request import SamplingParams
from kvtier.models.loading import load_model
from kvtier.planning.costs import HardwareProfile, TierRates
from kvtier.store import TieredStore
from kvtier.store import format as fmt
from kvtier.testing.services import RedisServer

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
C = 16
SECRET = b"0123456789abcdef0123456789abcdef"


def _prompt(n: int, seed: int, vocab: int) -> list[int]:
    return torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _profile(model) -> HardwareProfile:
    """A profile under which loading always beats recomputing (the tiny model computes in no time)."""
    rates = TierRates(1e9, 1e9, 1e-5)
    return HardwareProfile(model.fingerprint, "float32", 2, 1e-3, 5e-8, 2.5e-5, 5e-6,
                           {"memory": rates, "disk": rates, "redis": rates})


def _engine(model, spec: str, **reuse) -> Engine:
    return Engine(model, EngineConfig(kv_cache_bytes=32 << 20, enable_prefix_cache=False), store=spec,
                  reuse=ReuseConfig(method="kv", chunk_tokens=C, **reuse), profile=_profile(model))


def _finish(engine: Engine) -> dict[str, list[int]]:
    outs = {}
    while engine.has_work():
        for o in engine.step():
            if o.finished:
                outs[o.request_id] = o.output_ids
    return outs


def f1_oversized_chunk(model, work: Path) -> tuple[bool, str]:
    vocab = model.config.vocab_size
    victim, neighbour = _prompt(3 * C + 5, 1, vocab), _prompt(40, 2, vocab)
    plain = Engine(model, EngineConfig(kv_cache_bytes=32 << 20))
    want = [o.output_ids for o in plain.generate([neighbour, victim + [5, 6]], GREEDY)]
    engine = _engine(model, f"disk:{work}/f1:1GB")
    engine.generate([victim], GREEDY)
    engine.flush(30)
    store = engine.link.store
    ns, first = store.namespace, store.lookup(victim).chunks[0]
    shape = ns.part_shape("k", 12 * C)
    layers = {li: {"k": torch.randn(shape) * 100, "v": torch.randn(shape) * 100} for li in range(ns.num_layers)}
    disk = store.tier("disk")
    disk.delete(first.key)
    disk.put(fmt.pack(ns, store.root, first.key, store.root, 0, 0, False, layers))
    a = engine.add_request(neighbour, GREEDY)
    engine.step()
    b = engine.add_request(victim + [5, 6], GREEDY)
    outs = _finish(engine)
    corrupt = engine.link.store.stats()["tiers"]["disk"]["corrupt"]
    engine.close()
    changed = [name for name, rid, w in (("neighbour", a, want[0]), ("victim", b, want[1])) if outs[rid] != w]
    return bool(changed), f"outputs changed: {changed or 'none'}; planted chunk refused: {corrupt > 0}"


def f2_junk_index(model, work: Path, redis_url: str) -> tuple[bool, str]:
    import redis

    vocab = model.config.vocab_size
    prompt = _prompt(C + 5, 3, vocab)
    broken = []
    for spec in (f"{redis_url}/0?prefix=f2", f"disk:{work}/f2:1GB"):
        engine = _engine(model, spec)
        engine.generate([prompt], GREEDY)
        engine.flush(30)
        store = engine.link.store
        parent = store.keys_for(prompt)[0]
        tier = store.tiers[0]
        if spec.startswith("redis"):
            redis.Redis.from_url(redis_url).sadd(tier._p(parent), b"x:y")
        else:
            (pdir,) = [p for p in Path(work, "f2").rglob(parent) if p.is_dir()]
            (pdir / "x-y.kvc").write_bytes(b"junk")
        try:
            engine.generate([prompt + [9]], GREEDY)
        except Exception as e:  # noqa: BLE001 - the finding: the engine step raises
            broken.append(f"{spec.split(':')[0]}: {type(e).__name__}")
        engine.close()
    admin = redis.Redis.from_url(redis_url)
    admin.execute_command("ACL", "SETUSER", "f2-nokeys", "on", ">pw", "~elsewhere:*", "+@all")
    host = redis_url.split("//", 1)[1]
    try:
        engine = _engine(model, f"redis://f2-nokeys:pw@{host}/0?prefix=f2acl")
        engine.generate([prompt], GREEDY)
        engine.close()
    except Exception as e:  # noqa: BLE001
        broken.append(f"ACL user: {type(e).__name__}")
    finally:
        admin.execute_command("ACL", "DELUSER", "f2-nokeys")
    return bool(broken), f"engine errors: {broken or 'none'}"


def f3_parent_path_store(work: Path) -> tuple[bool, str]:
    from kvtier.store import StoreNamespace

    ns = StoreNamespace("m", 2, 2, 8, 32)
    store = TieredStore.open(f"memory:1MB,disk:{work}/f3:64MB", ns, chunk_tokens=C)
    escape = work / "escaped"
    k = torch.randn(2, 5, 2, 8)
    key = store.keys_for(list(range(5)))[0]
    packed = fmt.pack(ns, store.root, key, str(escape), 0, 0, True, {li: {"k": k[li], "v": k[li]} for li in range(2)})
    store.memory.put(packed)
    try:
        store._demote(store.memory, key)
    except Exception:  # noqa: BLE001
        pass
    store.close()
    written = [str(p) for p in escape.rglob("*") if p.is_file()] if escape.exists() else []
    return bool(written), f"files written outside the tier: {len(written)}"


def f4_forged_chunk(work: Path) -> tuple[bool, str]:
    from kvtier.store import StoreNamespace

    ns = StoreNamespace("m", 2, 2, 8, 32)
    kw: dict = {}
    try:
        from kvtier.store.seal import Seal
        kw["seal"] = Seal(SECRET)
    except ImportError:
        pass
    store = TieredStore.open(f"disk:{work}/f4:64MB", ns, chunk_tokens=C, **kw)
    a, b = list(range(C)), list(range(100, 100 + C))
    k = torch.randn(2, C, 2, 8)
    store.save(a, 0, k, k, None)
    store.flush()
    (key_a,), (key_b,) = store.keys_for(a), store.keys_for(b)
    path_a = store.tier("disk").path_of(key_a)
    # A writer without the secret plants A's state under B's key with a valid checksum.
    forged = fmt.pack(ns, store.root, key_b, store.root, 0, 0, False, {li: {"k": k[li], "v": k[li]} for li in range(2)})
    dest = Path(path_a).parent.parent / key_b[:2] / f"{key_b}.kvc"
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_bytes(forged.to_bytes())
    match = store.lookup(b)
    served = bool(match.chunks) and store.read_layers(match.chunks[0], range(2)) is not None
    store.close()
    return served, f"forged chunk served: {served} (store secret: {'seal' in kw})"


def _app(model, spec: str, **keys):
    from kvtier.serve import create_app

    engine = Engine(model, EngineConfig(kv_cache_bytes=32 << 20, max_model_len=512), store=spec,
                    reuse=ReuseConfig(method="kv", chunk_tokens=C), profile=_profile(model))
    try:
        return create_app(engine, **keys)
    except TypeError:  # no tenant keys in this version: one key for everybody
        return create_app(engine, api_key=next(iter(keys["api_keys"])))


def f5_tenants(model, work: Path) -> tuple[bool, str]:
    from starlette.testclient import TestClient

    keys = {"key-a": "alice", "key-b": "bob"}
    vocab = model.config.vocab_size
    prompt = _prompt(7 * C + 5, 5, vocab)
    with TestClient(_app(model, f"disk:{work}/f5:1GB", api_keys=keys)) as client:
        def ask(key: str) -> int:
            r = client.post("/v1/completions", headers={"Authorization": f"Bearer {key}"},
                            json={"model": "tiny-gqa", "prompt": prompt, "max_tokens": 2, "temperature": 0})
            if r.status_code == 401:  # this version has one key only: bob shares alice's
                r = client.post("/v1/completions", headers={"Authorization": "Bearer key-a"},
                                json={"model": "tiny-gqa", "prompt": prompt, "max_tokens": 2, "temperature": 0})
            return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

        ask("key-a")
        bob = ask("key-b")
        metrics = client.get("/metrics").status_code
    return bob > 0 or metrics == 200, f"bob's cached_tokens for alice's prompt: {bob}; /metrics without a key: {metrics}"


def f6_long_fields(model, work: Path) -> tuple[bool, str]:
    from starlette.testclient import TestClient

    with TestClient(_app(model, f"disk:{work}/f6:1GB", api_keys={"k": "t"})) as client:
        r = client.post("/v1/completions", headers={"Authorization": "Bearer k"},
                        json={"model": "tiny-gqa", "prompt": [5, 6, 7], "max_tokens": 1,
                              "prompt_cache_key": "x" * (3 << 20)})
    return r.status_code == 200, f"3 MB prompt_cache_key: HTTP {r.status_code}"


def f7_at_rest(work: Path, caplog_path: Path) -> tuple[bool, str]:
    from kvtier.store import StoreNamespace

    old = os.umask(0o022)
    try:
        ns = StoreNamespace("m", 2, 2, 8, 32)
        store = TieredStore.open(f"disk:{work}/f7:64MB", ns, chunk_tokens=C)
        k = torch.randn(2, C, 2, 8)
        store.save(list(range(C)), 0, k, k, None)
        store.flush()
        store.close()
    finally:
        os.umask(old)
    modes = {oct(stat.S_IMODE(p.stat().st_mode)) for p in Path(work, "f7").rglob("*")}
    leaks = "hunter2-secret" in caplog_path.read_text() if caplog_path.exists() else False
    return modes - {"0o700", "0o600"} != set() or leaks, f"modes {sorted(modes)}; password in logs: {leaks}"


def f7_password(redis_pw_url: str, log: Path) -> None:
    """Open a store with a password in the URL whose server is down: what gets logged or raised."""
    try:
        store = TieredStore.open(redis_pw_url, None)
        store.close()
    except Exception as e:  # noqa: BLE001
        logging.getLogger("f7").warning("startup error: %s", e)


def f8_hf_peer() -> tuple[bool, str]:
    import ast
    import inspect

    import kvtier.bench.hf as hf

    calls = [n for n in ast.walk(ast.parse(inspect.getsource(hf))) if isinstance(n, ast.Call)
             and getattr(n.func, "attr", "") == "load"
             and any(k.arg == "weights_only" and getattr(k.value, "value", None) is False for k in n.keywords)]
    return bool(calls), f"torch.load(..., weights_only=False) calls in bench/hf.py: {len(calls)}"


class Server:
    """`kvtier serve` from the tree under test in a subprocess, restarted when a check killed it."""

    def __init__(self, tree: Path, work: Path) -> None:
        self.tree, self.work, self.proc, self.starts = tree, work, None, 0
        self.env = dict(os.environ, PYTHONPATH=str(tree), KVTIER_HOME=str(work / "kvtier-home"))

    def imported(self) -> str:
        """Where the server's interpreter imports kvtier from (cwd first on sys.path with -m)."""
        out = subprocess.run([sys.executable, "-c", "import kvtier; print(kvtier.__file__)"], cwd=self.tree,
                             env=self.env, capture_output=True, text=True, timeout=120)
        return out.stdout.strip() or out.stderr.strip()[-200:]

    def start(self) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.starts += 1
        self.log = self.work / f"serve-{self.starts}.log"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvtier", "serve", "--model", "tiny-gqa", "--dtype", "fp32", "--port",
             str(self.port), "--max-model-len", "256", "--kv-cache-gb", "0.05", "--no-store"],
            cwd=self.tree, env=self.env, stdout=self.log.open("w"), stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited {self.proc.returncode}: {self.log.read_text()[-300:]}")
            if _http(self.port, "GET", "/health", timeout=2)[0] == 200:
                return
            time.sleep(0.5)
        raise RuntimeError("server did not come up in 180 s")

    def ensure(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            self.start()

    def alive(self) -> str:
        time.sleep(1)  # a crashing server may answer (or drop the connection) just before it exits
        code = self.proc.poll()
        return "alive" if code is None else f"dead (exit {code})"

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def _http(port: int, method: str, path: str, body: dict | None = None,
          timeout: float = 180) -> tuple[int | None, dict | str, float]:
    """(status or None, the JSON answer or why there is none, seconds)."""
    t0 = time.monotonic()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        data = None if body is None else json.dumps(body).encode()
        conn.request(method, path, body=data, headers={"Content-Type": "application/json"} if data else {})
        r = conn.getresponse()
        text = r.read()
        try:
            answer = json.loads(text)
        except ValueError:
            answer = text[:200].decode(errors="replace")
        return r.status, answer, time.monotonic() - t0
    except (OSError, http.client.HTTPException) as e:
        return None, f"no answer ({type(e).__name__})", time.monotonic() - t0
    finally:
        conn.close()


class HealthProbe(threading.Thread):
    """GET /health every 50 ms from another thread; `worst` is the slowest answer (or failure)."""

    def __init__(self, port: int) -> None:
        super().__init__(daemon=True)
        self.port, self.worst, self.stopping = port, 0.0, threading.Event()

    def run(self) -> None:
        while not self.stopping.is_set():
            _, _, took = _http(self.port, "GET", "/health", timeout=60)
            self.worst = max(self.worst, took)
            time.sleep(0.05)

    def __enter__(self) -> HealthProbe:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stopping.set()
        self.join()


def _complete(server: Server, **constraint) -> tuple[int | None, dict | str, float]:
    return _http(server.port, "POST", "/v1/completions",
                 dict(model="tiny-gqa", prompt="hi", max_tokens=2, temperature=0, **constraint))


def _answer(status: int | None, answer: dict | str) -> str:
    if isinstance(answer, dict) and "error" in answer:
        err = answer["error"]
        return f"HTTP {status} {err.get('code') or err.get('type')} param={err.get('param')}"
    return f"HTTP {status}" if status is not None else str(answer)


def _refused(server: Server, field: str, **constraint) -> tuple[bool, str]:
    """A constraint the server must refuse with a 400 naming the field, and stay up."""
    status, answer, took = _complete(server, **constraint)
    named = isinstance(answer, dict) and field in json.dumps(answer.get("error", {}))
    alive = server.alive()
    return (status != 400 or not named or alive != "alive",
            f"{_answer(status, answer)} in {took:.1f} s, field named: {named}; server {alive}")


def f9_lark_chain(server: Server) -> tuple[bool, str]:
    grammar = "start: r0\n" + "".join(f"r{i}: r{i + 1}\n" for i in range(4000)) + 'r4000: "a"'
    return _refused(server, "structured_outputs.grammar", structured_outputs={"grammar": grammar})


def _json_schema(schema: dict) -> dict:
    return {"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}}


def f10_ref_chain(server: Server) -> tuple[bool, str]:
    defs = {f"d{i}": {"type": "array", "items": {"$ref": f"#/$defs/d{i + 1}"}} for i in range(4000)}
    defs["d4000"] = {"type": "string"}
    return _refused(server, "response_format", **_json_schema({"$ref": "#/$defs/d0", "$defs": defs}))


def f11_repeat(server: Server, kind: str, text: str) -> tuple[bool, str]:
    status, answer, took = _complete(server, structured_outputs={kind: text})
    return status != 400, f"{_answer(status, answer)} in {took:.1f} s; server {server.alive()}"


def f12_wide_schema(server: Server) -> tuple[bool, str]:
    schema = {"type": "object", "properties": {f"property_{i:05d}": {"type": "string"} for i in range(10000)}}
    size = len(json.dumps(schema))
    with HealthProbe(server.port) as probe:
        answers = [_complete(server, **_json_schema(schema)) for _ in range(2)]
    statuses = [a[0] for a in answers]
    return (any(s != 400 for s in statuses) or probe.worst > 0.5,
            f"{size // 1000} KB schema twice: HTTP {statuses} in {', '.join(f'{a[2]:.1f}' for a in answers)} s; "
            f"/health worst {probe.worst:.2f} s; server {server.alive()}")


def f13_gbnf_chain(server: Server) -> tuple[bool, str]:
    grammar = "root ::= r-00000\n" + "".join(f'r-{i:05d} ::= "a" r-{i + 1:05d}\n' for i in range(3000))
    grammar += 'r-03000 ::= "a"\n'
    status, answer, took = _complete(server, grammar=grammar)
    return (status != 400 or took > 2,
            f"{len(grammar) // 1000} KB GBNF: {_answer(status, answer)} after {took:.1f} s; server {server.alive()}")


def f14_tokenize(server: Server) -> tuple[bool, str]:
    text = "hello world " * ((2 << 20) // 12)
    with HealthProbe(server.port) as probe:
        status, answer, took = _http(server.port, "POST", "/tokenize", {"model": "tiny-gqa", "prompt": text})
    return (probe.worst > 1.0,
            f"2 MB /tokenize: {_answer(status, answer)} after {took:.1f} s; /health worst {probe.worst:.2f} s; "
            f"server {server.alive()}")


def f15_slow_headers(server: Server) -> tuple[bool, str]:
    t0 = time.monotonic()
    with socket.create_connection(("127.0.0.1", server.port)) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        s.settimeout(1)
        got = b""
        while time.monotonic() - t0 < 20:
            try:
                chunk = s.recv(4096)
            except TimeoutError:
                continue
            except OSError:  # reset: closed too
                break
            if not chunk:
                break
            got += chunk
        else:
            return True, f"half-sent headers: connection still open after {time.monotonic() - t0:.0f} s"
    first = got.split(b"\r\n", 1)[0].decode(errors="replace") or "no answer"
    return False, f"half-sent headers: closed after {time.monotonic() - t0:.1f} s ({first})"


def _disk_store(root: Path):
    from kvtier.store import StoreNamespace

    return TieredStore.open(f"disk:{root}:64MB", StoreNamespace("m", 2, 2, 8, 32), chunk_tokens=C)


def _save(store, tokens: list[int]) -> None:
    k = torch.randn(2, C, 2, 8)
    store.save(tokens, 0, k, k, None)
    store.flush()


def f16_tmp_link(work: Path) -> tuple[bool, str]:
    root, victim = work / "f16", work / "f16-victim"
    victim.mkdir()
    names = ["notes.txt", f"{'ab' * 16}.999999999.deadbeef.tmp"]  # one named like the tier's temp files
    for n in names:
        (victim / n).write_text("keep me")
    store = _disk_store(root)
    _save(store, list(range(C)))
    nsdir = Path(store.tier("disk").path_of(store.keys_for(list(range(C)))[0])).parents[2]
    store.close()
    tmp = nsdir / "tmp"
    if tmp.is_dir():
        shutil.rmtree(tmp)
    tmp.symlink_to(victim)
    try:
        _disk_store(root).close()
    except Exception as e:  # noqa: BLE001 - refusing to open is not the finding
        logging.getLogger("f16").warning("reopen: %s", e)
    left = sorted(p.name for p in victim.iterdir())
    gone = [n for n in names if n not in left]
    return bool(gone), f"tmp/ linked to a directory of {len(names)} files; deleted at reopen: {len(gone)}"


def f17_shard_link(work: Path) -> tuple[bool, str]:
    root, outside = work / "f17a", work / "f17a-outside"
    outside.mkdir()
    store = _disk_store(root)
    first = list(range(C))
    _save(store, first)
    nsdir = Path(store.tier("disk").path_of(store.keys_for(first)[0])).parents[2]
    second = list(range(500, 500 + C))
    shard = nsdir / "c" / store.keys_for(second)[0][:2]
    store.close()
    if shard.is_dir():
        shutil.rmtree(shard)
    shard.symlink_to(outside)
    try:
        store = _disk_store(root)
        _save(store, second)
        store.close()
    except Exception as e:  # noqa: BLE001
        logging.getLogger("f17").warning("write through a linked shard: %s", e)
    written = [p.name for p in outside.iterdir()]
    return bool(written), f"shard c/{shard.name} linked outside: files written there: {len(written)}"


def f17_mark_link(work: Path) -> tuple[bool, str]:
    root, outside = work / "f17b", work / "f17b-outside"
    outside.mkdir()
    tokens = list(range(1000, 1000 + C))
    store = _disk_store(root)
    _save(store, tokens)
    chunk = Path(store.tier("disk").path_of(store.keys_for(tokens)[0]))
    store.close()
    marks = list(chunk.parents[2].joinpath("p").rglob("*.kvl"))
    if len(marks) != 1:
        return True, f"check could not find the chunk's mark (found {len(marks)})"
    mark = marks[0]
    chunk.unlink()
    mark.unlink()
    store = _disk_store(root)  # the chunk is gone from the index: the next save writes it and its mark
    mark.symlink_to(outside / "created-by-mark")
    try:
        _save(store, tokens)
    except Exception as e:  # noqa: BLE001
        logging.getLogger("f17").warning("mark through a dangling link: %s", e)
    store.close()
    created = (outside / "created-by-mark").exists()
    return created, f"dangling link at the mark: file created outside: {created}; chunk rewritten: {chunk.exists()}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    import kvtier

    where = Path(kvtier.__file__).parent.parent
    print(f"kvtier imported from {kvtier.__file__}", flush=True)
    work = Path(tempfile.mkdtemp(prefix="kvtier-findings-"))
    log = work / "log.txt"
    logging.basicConfig(filename=log, level=logging.DEBUG, force=True)
    model = load_model("tiny-gqa", dtype="fp32", tokenizer=False)
    rows = []

    def run(name: str, fn) -> None:
        try:
            open_, detail = fn()
        except Exception as e:  # noqa: BLE001 - a check that cannot run reports why
            open_, detail = True, f"check raised {type(e).__name__}: {e}"[:200]
        rows.append(dict(finding=name, open=open_, detail=detail))
        print(f"{'OPEN  ' if open_ else 'closed'}  {name}: {detail}", flush=True)

    with RedisServer() as srv:
        base = srv.url.rsplit("/", 1)[0]
        f7_password(base.replace("redis://", "redis://:hunter2-secret@").rsplit(":", 1)[0] + ":1/0", log)
        for name, fn in [
            ("1 stored chunk overwrites other requests' KV", lambda: f1_oversized_chunk(model, work)),
            ("2 one write to the shared store fails requests", lambda: f2_junk_index(model, work, base)),
            ("3 a header's parent writes files anywhere", lambda: f3_parent_path_store(work)),
            ("4 forged state is served", lambda: f4_forged_chunk(work)),
            ("5 no tenant isolation", lambda: f5_tenants(model, work)),
            ("6 unbounded request fields", lambda: f6_long_fields(model, work)),
            ("7 data at rest not private, password logged", lambda: f7_at_rest(work, log)),
            ("8 benchmark peer unpickles Redis bytes", f8_hf_peer),
        ]:
            run(name, fn)

    server = Server(where, work)
    served = server.imported()
    print(f"kvtier serve imports {served}", flush=True)
    if Path(served).resolve() != Path(kvtier.__file__).resolve():
        raise SystemExit(f"the server would import {served}, not the tree under test")
    try:
        for name, fn in [
            ("9 a Lark grammar of 4,000 chained rules crashes the server", lambda: f9_lark_chain(server)),
            ("10 a JSON schema of 4,000 chained $defs crashes the server", lambda: f10_ref_chain(server)),
            ("11a regex a{99999999} fails in the engine, not with a 400",
             lambda: f11_repeat(server, "regex", "a{99999999}")),
            ("11b regex (a{1000}){1000} fails in the engine, not with a 400",
             lambda: f11_repeat(server, "regex", "(a{1000}){1000}")),
            ("11c Lark (\"a\"{1000}){1000} fails in the engine, not with a 400",
             lambda: f11_repeat(server, "grammar", 'start: ("a"{1000}){1000}')),
            ("12 a 10,000-property schema blocks the event loop", lambda: f12_wide_schema(server)),
            ("13 a GBNF of 3,000 chained rules compiles for seconds", lambda: f13_gbnf_chain(server)),
            ("14 /tokenize of 2 MB blocks the event loop", lambda: f14_tokenize(server)),
            ("15 half-sent headers hold a connection open", lambda: f15_slow_headers(server)),
        ]:
            run(name, lambda fn=fn: (server.ensure(), fn())[1])
    finally:
        server.stop()
    for name, fn in [
        ("16 a linked disk tmp/ gets its target's files deleted", lambda: f16_tmp_link(work)),
        ("17a a linked shard directory gets chunks written outside", lambda: f17_shard_link(work)),
        ("17b a dangling link at a mark creates a file outside", lambda: f17_mark_link(work)),
    ]:
        run(name, fn)
    result = dict(code=str(where), server_starts=server.starts, rows=rows)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
