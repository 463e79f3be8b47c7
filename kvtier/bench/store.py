"""`kvtier bench store`: store read/write throughput per tier beside the raw device bandwidth.

For each tier it writes one long context through the store (save + flush: packing, checksums and
writes, as the background writer does them), then reads every chunk back whole and layer by
layer, and measures the raw sequential read bandwidth of the same device in the same run:
  memory  a plain copy of a buffer of one chunk's size (DRAM bandwidth)
  disk    plain reads of the very chunk files the store wrote, warm (page cache) and cold
          (pages dropped with posix_fadvise DONTNEED before each pass, for raw and store alike)
  redis   plain GETs of the very values the store wrote
Emulated bandwidth/latency (bw=/lat= in the spec) is applied to store reads only and every row
that used it says so. Times are medians of --reps runs. With --sealed every tier runs twice in the
same process, without and with a store secret (BLAKE3 segment digests and an HMAC per header,
store/seal.py): what authenticated state costs.
"""
from __future__ import annotations

import json
import os
import shutil
import statistics
import tempfile
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kvtier.bench.stats import best_of, median_of
from kvtier.store import StoreNamespace, TieredStore
from kvtier.store.seal import Seal
from kvtier.store.spec import parse_spec

RESTORE_GROUP = 6  # layers per planned read: a layer-wise restore reads a group of layers of every chunk

# SmolLM2-135M shapes: the default real model of kvtier.
SMOLLM2 = dict(num_layers=30, num_kv_heads=3, head_dim=64, hidden_size=576, params=134.5e6)


def _drop_cache(paths: list[str]) -> None:
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _raw_file_read(paths: list[str], bufsize: int) -> None:
    buf = bytearray(bufsize)
    for p in paths:
        with open(p, "rb", buffering=0) as f:
            f.readinto(buf)


def estimate_prefill_tokens_per_s(params: float) -> float:
    """Rough smollm2 prefill rate here: measured fp32 matmul FLOP/s over 2 FLOPs per parameter."""
    a = torch.randn(512, 576)
    b = torch.randn(576, 1536)
    secs = best_of(lambda: [a @ b for _ in range(20)], 3)
    flops = 20 * 2 * 512 * 576 * 1536 / secs
    return flops / (2 * params)


@dataclass
class _Stored:
    """One tier's store holding the benchmark's context, and what the read phases need of it."""

    store: TieredStore
    ns: StoreNamespace
    kind: str
    match: Any  # the lookup of the whole context
    total: int  # its bytes
    note: str  # the tier's emulation, if any
    reps: int

    @property
    def tier(self) -> Any:
        return self.store.tier(self.kind)

    def read_whole(self) -> None:
        for c in self.match.chunks:
            assert self.store.read_chunk(c) is not None

    def read_layers(self) -> None:
        for c in self.match.chunks:
            for layer in range(self.ns.num_layers):
                assert self.store.read_layers(c, [layer]) is not None

    def restore_reads(self) -> None:
        """What a layer-wise restore does: open every chunk once (header checks), then read a
        group of layers of all of them per call, checked segment by segment."""
        reads = self.store.planned_reads(self.match.chunks)
        assert reads.open()
        try:
            for lo in range(0, self.ns.num_layers, RESTORE_GROUP):
                layers = range(lo, min(lo + RESTORE_GROUP, self.ns.num_layers))
                assert reads.read(layers, ("k", "v")) is not None
        finally:
            reads.close()

    def row(self, op: str, seconds: float, note: str | None = None, nbytes: int | None = None) -> dict:
        return dict(tier=self.kind, op=op, bytes=self.total if nbytes is None else nbytes, seconds=seconds,
                    note=self.note if note is None else note, sealed=self.store.seal.sealed)


def _write(store: TieredStore, ns: StoreNamespace, kind: str, tokens: int, reps: int) -> tuple[_Stored, dict]:
    """Save one long context and flush it: the write row, and the stored context to read back."""
    ids = list(range(tokens))
    k = torch.randn(ns.num_layers, tokens, ns.num_kv_heads, ns.head_dim)  # [layers, tokens, kv_heads, head_dim]
    v = torch.randn_like(k)
    t0 = time.perf_counter()
    store.save(ids, 0, k, v, None)
    store.flush()
    wsec = time.perf_counter() - t0
    match = store.lookup(ids)
    assert match.num_tokens == tokens, "benchmark chunks were not all stored (capacity too small?)"
    total = sum(c.nbytes for c in match.chunks)
    note = store.tier(kind).emulation.describe()
    stored = _Stored(store, ns, kind, match, total, note, reps)
    return stored, dict(tier=kind, op="write (save+flush)", bytes=total, seconds=wsec, tokens_per_s=tokens / wsec,
                        sealed=store.seal.sealed,
                        note=note and "reads only: " + note)


def _raw_memory(s: _Stored) -> list[dict]:
    buf = torch.empty(max(c.nbytes for c in s.match.chunks), dtype=torch.uint8)
    n = len(s.match.chunks)
    src, dst = buf.numpy(), np.empty_like(buf.numpy())

    def memcpy() -> None:  # numpy: a single-threaded memcpy, free of torch's intra-op thread hand-off
        for _ in range(n):
            np.copyto(dst, src)

    return [s.row("raw: memcpy (DRAM)", median_of(memcpy, s.reps), "into a reused buffer", buf.numel() * n),
            s.row("raw: memcpy into fresh buffers",
                  median_of(lambda: [torch.empty_like(buf).copy_(buf) for _ in range(n)], s.reps),
                  "page faults, as a read that returns new tensors pays", buf.numel() * n)]


def _raw_disk(s: _Stored) -> list[dict]:
    paths = [s.tier.path_of(c.key) for c in s.match.chunks]
    size = max(os.path.getsize(p) for p in paths)

    def cold(fn):
        def run():
            _drop_cache(paths)
            t = time.perf_counter()
            fn()
            return time.perf_counter() - t
        return statistics.median(run() for _ in range(s.reps))

    return [s.row("raw: sequential file read (warm)", median_of(lambda: _raw_file_read(paths, size), s.reps),
                  "page cache"),
            s.row("read whole chunks (cold)", cold(s.read_whole)),
            s.row("raw: sequential file read (cold)", cold(lambda: _raw_file_read(paths, size)), "fadvise DONTNEED")]


def _raw_redis(s: _Stored) -> list[dict]:
    tier = s.tier
    rkeys = [tier.value_key(c.key) for c in s.match.chunks]
    return [s.row("raw: GET of the same values", median_of(lambda: [tier.client.get(r) for r in rkeys], s.reps), "")]


def bench_tier(entry: str, ns: StoreNamespace, tokens: int, chunk_tokens: int, reps: int,
               seal: Seal = Seal()) -> list[dict]:
    spec = parse_spec(entry)
    kind = "memory" if spec.memory else "disk" if spec.disk else "redis"
    store = TieredStore.open(entry, ns, chunk_tokens=chunk_tokens, writer_queue_bytes=1 << 40, seal=seal)
    try:
        store.clear()
        stored, write_row = _write(store, ns, kind, tokens, reps)
        rows = [write_row, stored.row("read whole chunks", median_of(stored.read_whole, reps)),
                stored.row("read per layer", median_of(stored.read_layers, reps)),
                stored.row(f"restore reads ({RESTORE_GROUP}-layer groups)", median_of(stored.restore_reads, reps))]
        if not seal.sealed:  # the raw peers do not depend on the secret
            rows += {"memory": _raw_memory, "disk": _raw_disk, "redis": _raw_redis}[kind](stored)
        store.clear()
    finally:
        store.close()
    for r in rows:
        r["GB_per_s"] = r["bytes"] / r["seconds"] / 1e9
    return rows


def run(args) -> dict:
    ns = StoreNamespace("bench-smollm2-shape", SMOLLM2["num_layers"], SMOLLM2["num_kv_heads"],
                        SMOLLM2["head_dim"], SMOLLM2["hidden_size"], compute_dtype="float32")
    tmp = args.dir or tempfile.mkdtemp(prefix="kvtier-bench-", dir="/tmp")
    entries = [f"memory:{args.capacity}", f"disk:{tmp}/disk:{args.capacity}{args.disk_opts}"]
    if args.redis:
        entries.append(args.redis)
    rows: list[dict] = []
    try:
        print(f"warm-up: {entries[0].split(':')[0]} tier (not recorded)", flush=True)
        bench_tier(entries[0], ns, args.tokens, args.chunk_tokens, 1)
        seals = [Seal(), Seal(os.urandom(32))] if args.sealed else [Seal()]
        for e in entries:
            for seal in seals:
                rows += bench_tier(e, ns, args.tokens, args.chunk_tokens, args.reps, seal)
    finally:
        if not args.dir:
            shutil.rmtree(tmp, ignore_errors=True)
    prefill = estimate_prefill_tokens_per_s(SMOLLM2["params"])
    return dict(model_shape="smollm2-135M (30 layers, 3 kv heads, head_dim 64), KV fp32",
                tokens=args.tokens, chunk_tokens=args.chunk_tokens, reps=args.reps, stat="median",
                chunk_bytes=ns.bytes_per_token() * args.chunk_tokens,
                estimated_prefill_tokens_per_s=prefill, rows=rows)


def to_markdown(res: dict) -> str:
    lines = [f"{res['model_shape']}; {res['tokens']} tokens in chunks of {res['chunk_tokens']} "
             f"({res['chunk_bytes'] / 1e6:.2f} MB each)", "",
             "| tier | operation | sealed | GB/s | tokens/s | note |", "|---|---|---|---:|---:|---|"]
    for r in res["rows"]:
        tps = f"{r['tokens_per_s']:,.0f}" if "tokens_per_s" in r else ""
        sealed = "yes" if r.get("sealed") else ""
        lines.append(f"| {r['tier']} | {r['op']} | {sealed} | {r['GB_per_s']:.2f} | {tps} | {r['note']} |")
    lines.append("")
    lines.append(f"Estimated smollm2 prefill rate on this machine (matmul FLOP/s / 2·params): "
                 f"{res['estimated_prefill_tokens_per_s']:,.0f} tokens/s.")
    return "\n".join(lines)


def cmd_bench_store(args) -> int:
    from rich.console import Console
    from rich.table import Table

    res = run(args)
    t = Table(title=f"kvtier bench store: {res['model_shape']}")
    for c in ("tier", "operation", "sealed", "GB/s", "tokens/s", "note"):
        t.add_column(c, justify="right" if c in ("GB/s", "tokens/s") else "left")
    for r in res["rows"]:
        t.add_row(r["tier"], r["op"], "yes" if r.get("sealed") else "", f"{r['GB_per_s']:.2f}",
                  f"{r['tokens_per_s']:,.0f}" if "tokens_per_s" in r else "", r["note"])
    Console().print(t)
    print(f"estimated smollm2 prefill rate: {res['estimated_prefill_tokens_per_s']:,.0f} tokens/s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(to_markdown(res) + "\n")
    return 0
