"""Subprocess body for the crash and concurrency tests (run as a script, not collected).

    python store_worker.py SPEC MODE N
MODE "loop": save contexts 0..N-1 over and over until killed (prints "ready" after the first pass).
MODE "once": save contexts 0..N-1, read each back and check it bit for bit, then close.
Context i has tokens(97 + 13*i, seed=i) and make_state(..., seed=i), so any process can rebuild
the exact state a chunk must hold.
"""
import sys

import torch

from kvtier.store import TieredStore

from store_testlib import make_ns, make_state, tokens


def context(i: int):
    t = tokens(97 + 13 * i, seed=i)
    return t, make_state(len(t), seed=i)


def main() -> int:
    spec, mode, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
    store = TieredStore.open(spec, make_ns(), chunk_tokens=16, writer_queue_bytes=1 << 30)
    if mode == "loop":
        first = True
        while True:
            for i in range(n):
                t, (k, v, h) = context(i)
                store.save(t, 0, k, v, None)
            store.flush()
            if first:
                print("ready", flush=True)
                first = False
            store.clear()  # keep rewriting so the kill lands mid-write
    for i in range(n):
        t, (k, v, h) = context(i)
        store.save(t, 0, k, v, None)
    store.flush()
    for i in range(n):
        t, (k, v, h) = context(i)
        m = store.lookup(t)
        for c in m.chunks:
            got = store.read_chunk(c)
            if got is None:
                continue  # a miss is allowed; wrong data is not
            for s in got:
                assert torch.equal(s.k, k[s.layer, c.start:c.end]), (i, c.start)
                assert torch.equal(s.v, v[s.layer, c.start:c.end]), (i, c.start)
    store.close()
    print("ok", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
