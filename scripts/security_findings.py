"""Reproduce issue 26's findings against whichever kvtier is importable, one line per finding.

Run it against the code before the fix and after, each on its own tree:

    git worktree add /tmp/before 09a5f2b
    PYTHONPATH=/tmp/before .venv/bin/python scripts/security_findings.py --json out/security/before.json
    .venv/bin/python scripts/security_findings.py --json out/security/after.json

Each check drives the real code (tiny-gqa engine, real Redis and disk tiers, the FastAPI app through
Starlette's TestClient) and prints whether the finding reproduces ("OPEN") or not ("closed").
The checks use only APIs both versions have, plus the new ones (a store secret, tenant keys)
where they exist: a check that needs a feature the code lacks reports the finding open.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import stat
import tempfile
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    import kvtier

    where = Path(kvtier.__file__).parent.parent
    work = Path(tempfile.mkdtemp(prefix="kvtier-findings-"))
    log = work / "log.txt"
    logging.basicConfig(filename=log, level=logging.DEBUG, force=True)
    model = load_model("tiny-gqa", dtype="fp32", tokenizer=False)
    rows = []
    with RedisServer() as srv:
        base = srv.url.rsplit("/", 1)[0]
        f7_password(base.replace("redis://", "redis://:hunter2-secret@").rsplit(":", 1)[0] + ":1/0", log)
        checks = [
            ("1 stored chunk overwrites other requests' KV", lambda: f1_oversized_chunk(model, work)),
            ("2 one write to the shared store fails requests", lambda: f2_junk_index(model, work, base)),
            ("3 a header's parent writes files anywhere", lambda: f3_parent_path_store(work)),
            ("4 forged state is served", lambda: f4_forged_chunk(work)),
            ("5 no tenant isolation", lambda: f5_tenants(model, work)),
            ("6 unbounded request fields", lambda: f6_long_fields(model, work)),
            ("7 data at rest not private, password logged", lambda: f7_at_rest(work, log)),
            ("8 benchmark peer unpickles Redis bytes", f8_hf_peer),
        ]
        for name, fn in checks:
            try:
                open_, detail = fn()
            except Exception as e:  # noqa: BLE001 - a check that cannot run reports why
                open_, detail = True, f"check raised {type(e).__name__}: {e}"[:200]
            rows.append(dict(finding=name, open=open_, detail=detail))
            print(f"{'OPEN  ' if open_ else 'closed'}  {name}: {detail}", flush=True)
    result = dict(code=str(where), rows=rows)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
