"""SIGKILL mid-write, and two processes writing the same keys into one directory and one Redis."""
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch
from store_worker import context

from kvtier.store import TieredStore

from store_testlib import make_ns

HERE = Path(__file__).parent
ROOT = HERE.parent.parent


def _spawn(spec: str, mode: str, n: int) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(HERE)]))
    return subprocess.Popen([sys.executable, str(HERE / "store_worker.py"), spec, mode, str(n)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, text=True)


def _check_all_exact(store, n):
    found = 0
    for i in range(n):
        t, (k, v, _) = context(i)
        m = store.lookup(t)
        for c in m.chunks:
            got = store.read_chunk(c)
            assert got is not None
            for s in got:
                assert torch.equal(s.k, k[s.layer, c.start:c.end])
                assert torch.equal(s.v, v[s.layer, c.start:c.end])
        found += m.num_tokens == len(t)
    return found


def test_sigkill_mid_write_leaves_nothing_served_wrong(tmp_path):
    spec = f"disk:{tmp_path}/d:100MB"
    proc = _spawn(spec, "loop", 6)
    assert proc.stdout.readline().strip() == "ready", proc.stderr.read()
    time.sleep(0.3)  # let it get back into the middle of writing
    proc.send_signal(signal.SIGKILL)
    proc.wait(10)
    # Plant what a kill can leave at worst: a half-written temp file of the dead writer.
    tmps = list((tmp_path / "d").rglob("tmp"))
    if tmps:
        (tmps[0] / f"{'0' * 32}.{proc.pid}.deadbeef.tmp").write_bytes(b"KVTC" + b"\0" * 100)
    with TieredStore.open(spec, make_ns(), chunk_tokens=16) as store:
        assert not list((tmp_path / "d").rglob("*.tmp")), "temp files of dead writers are removed"
        report = store.verify()
        assert report.clean, report.corrupt
        _check_all_exact(store, 6)
        st = store.stats()["tiers"]["disk"]
        on_disk = sum(p.stat().st_size for p in (tmp_path / "d").rglob("*.kvc"))
        assert st["bytes_used"] == on_disk  # the index matches the files


def test_two_processes_same_keys_one_dir_one_redis(tmp_path, redis_url):
    n = 5
    spec = f"disk:{tmp_path}/shared:100MB,{redis_url}"
    procs = [_spawn(spec, "once", n) for _ in range(2)]
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0 and "ok" in out, err
    for one in (f"disk:{tmp_path}/shared:100MB", redis_url):
        with TieredStore.open(one, make_ns(), chunk_tokens=16) as store:
            assert _check_all_exact(store, n) == n
            assert store.verify().clean
