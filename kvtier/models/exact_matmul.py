"""Exact CPU attention in bf16 through GEMMs: a query's scores over all the keys it reads in one
row, one softmax over that row, then the values read in two products split where `key_split`
splits the query's keys (its whole key blocks, then its piece), added in bf16.

Why: on a CPU with native bf16 (avx512_bf16) oneDNN's bf16 GEMMs turn a query's keys over about
twice as fast as the fused flash kernel (`exact_attention`), whose per-block softmax bookkeeping,
not its arithmetic, bounds it; with the copies and the softmax around them, this kernel runs at
0.6-1.0x the flash kernel's time (docs/benchmarks.md, 2026-11-29, a seventh session). The scores are rounded to bf16
before the softmax, as HF transformers' eager attention rounds them; the probabilities are
rounded to bf16 before the value product, as the flash kernel rounds them.

What makes it exact: a query at position p reads the keys [0, key_rows(p + 1)), a function of p
alone, as one row of scores whatever the call; oneDNN's bf16 matmul gives a row the same bits
whatever the number of rows or batch entries in the call, whether B is a strided view of the pool
or a copy, and whether N comes in one product or two; softmax works row by row; the two value
products split at the query's base, a function of p. Those GEMM properties are measured, not
promised: `usable` checks them at first use for each head geometry and thread count, and where
they do not hold (oneDNN's AMX kernels block by row count) the flash kernel serves instead.
`set_mode` (the engine's `--bf16-attention`) picks the kernel: auto (GEMMs on CPUs with native
bf16, where `usable`), gemm or flash.
"""

from __future__ import annotations

import functools
import logging
import math
import threading
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvtier.dtypes import cpu_has_bf16
from kvtier.models.key_split import KEY_BLOCK, PIECE, cut_or_pad, key_rows, split

log = logging.getLogger(__name__)

MODES = ("auto", "gemm", "flash")
DECODE_ROWS = 8  # decoding tokens per call: a batch of 32 long contexts copied at once is 2 x 100 MB at 8K
SCORE_BUDGET = 1 << 23  # scores per call of a prompt's queries (16 MB in bf16): long contexts take fewer queries a call
_mode = "auto"
_local = threading.local()  # per thread: the score and probability buffers, reused (a fresh 16 MB faults its pages in)


def set_mode(mode: str) -> None:
    """Process-wide: which kernel exact bf16 attention uses (auto, gemm or flash)."""
    global _mode
    if mode not in MODES:
        raise ValueError(f"unknown bf16 attention kernel {mode!r}; use one of {', '.join(MODES)}")
    _mode = mode


def active(dtype: torch.dtype, heads: int, kv_heads: int, hd: int) -> bool:
    """Whether exact attention of this dtype and head geometry runs on GEMMs."""
    if dtype != torch.bfloat16 or _mode == "flash" or (_mode == "auto" and not cpu_has_bf16()):
        return False
    ok = usable(heads, kv_heads, hd)
    if not ok and _mode == "gemm":
        _refused(heads, kv_heads, hd)
    return ok


@functools.lru_cache(maxsize=16)  # once per geometry, not per call
def _refused(heads: int, kv_heads: int, hd: int) -> None:
    log.warning("bf16 GEMM attention (%d heads over %d, head_dim %d) is not row-invariant on this CPU: "
                "the flash kernel serves instead", heads, kv_heads, hd)


def usable(heads: int, kv_heads: int, hd: int) -> bool:
    """Whether this CPU's bf16 GEMMs give exact attention here (checked once per geometry and threads)."""
    return _usable(heads, kv_heads, hd, torch.get_num_threads())


@functools.lru_cache(maxsize=16)
def _usable(heads: int, kv_heads: int, hd: int, threads: int) -> bool:
    """Every way a query can be computed gives the same bits: a prompt in one call, in chunks of 100
    (pieces cut at chunk edges), single decodes (a call of one token's grouped heads), and decodes
    batched with tokens of no, one or two whole key blocks, their whole blocks read as views or
    from gathered contexts."""
    ctx = 1100  # three key blocks: queries with no whole-block part, one and two
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(ctx, h, hd, generator=g).to(torch.bfloat16) for h in (heads, kv_heads, kv_heads))
    try:
        whole = causal(q, k, v, 0)
        chunked = torch.cat([causal(q[a : a + 100], k[: a + 100], v[: a + 100], a) for a in range(0, ctx, 100)])
        lengths = [6, 64, 513, 600, 600, 1090, 1100, 1100]  # two tokens reading the same keys: one call
        lone = [causal(q[n - 1 : n], k[:n], v[:n], n - 1) for n in lengths]
        splits = [split(n) for n in lengths]
        reach = max(keys for _, keys in splits)
        pk, pv = (torch.zeros(len(lengths), reach, kv_heads, hd, dtype=torch.bfloat16) for _ in range(2))
        for r, (n, (base, _)) in enumerate(zip(lengths, splits)):
            pk[r, : n - base], pv[r, : n - base] = k[base:n], v[base:n]
        last = q[[n - 1 for n in lengths]]
        batch = decode(last, (pk, pv), [(k[:base], v[:base]) if base else None for base, _ in splits], lengths)
        contexts = tuple(cut_or_pad(x, key_rows(ctx))[None].expand(len(lengths), -1, -1, -1) for x in (k, v))
        gathered = decode(last, (pk, pv), [], lengths, padded=(contexts[0], contexts[1]))
    except (RuntimeError, ValueError) as e:  # a GEMM this build cannot run: the flash kernel serves
        log.warning("bf16 GEMM attention unavailable, the flash kernel serves: %s", e)
        return False
    return (torch.equal(chunked, whole)
            and all(torch.equal(o[0], whole[n - 1]) and torch.equal(batch[r], whole[n - 1])
                    and torch.equal(gathered[r], whole[n - 1])
                    for r, (n, o) in enumerate(zip(lengths, lone))))


def causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int) -> torch.Tensor:
    """Queries at positions [start, start + n) over keys [0, ctx): q [n, heads, hd] (RoPE applied),
    k/v [ctx or more, kv_heads, hd], read in place where they reach key_rows(ctx). -> [n, heads, hd].
    One call per piece of queries (they read the same keys), cut to SCORE_BUDGET scores."""
    n, heads, hd = q.shape
    kv_heads = k.shape[1]
    g = heads // kv_heads
    reach = key_rows(start + n)
    kc, vt = (_heads_major(cut_or_pad(x, reach), i) for i, x in ((2, k), (3, v)))  # [kvh, keys, hd]
    qs = _scaled(q)
    out = q.new_empty(n, heads, hd)
    lo = start
    while lo < start + n:
        end = min(start + n, lo - lo % PIECE + PIECE)  # lo's piece: its queries read the same keys
        base, keys = lo - lo % KEY_BLOCK, key_rows(end)
        step = max(1, SCORE_BUDGET // (heads * keys))
        for a in range(lo, end, step):
            b = min(end, a + step)
            m = b - a
            qg = qs[a - start : b - start].view(m, kv_heads, g, hd).permute(1, 2, 0, 3).reshape(kv_heads, g * m, hd)
            s = torch.matmul(qg, kc[:, :keys].transpose(1, 2), out=_buffer(0, (kv_heads, g * m, keys), q.dtype))  # [kvh, g*m, keys]
            tail = keys - PIECE  # every masked key lies in the last piece
            o = _attend(s, _tail_mask(a - tail, b - tail, g, q.dtype, q.device), base, vt[:, :base], vt[:, base:keys])
            out[a - start : b - start] = o.view(kv_heads, g, m, hd).permute(2, 0, 1, 3).reshape(m, heads, hd)
        lo = end
    return out


def decode(q: torch.Tensor, pieces: tuple[torch.Tensor, torch.Tensor],
           wholes: Sequence[tuple[torch.Tensor, torch.Tensor] | None], lengths: Sequence[int],
           padded: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """A batch of decoding tokens, token r at position lengths[r] - 1, as `exact_attention.decode`
    takes them: its piece from row r of `pieces` (K and V [n, >= its piece's keys, kv_heads, hd],
    any finite value past its position) and its whole key blocks from wholes[r] (K and V [base,
    kv_heads, hd], views of the pool; None where base is 0), or both from row r of `padded` (the
    contexts gathered, [n, >= its keys, kv_heads, hd]). The tokens that read the same keys (the
    same base and piece) attend in batched calls of up to DECODE_ROWS tokens, their contexts copied
    heads-major.
    q: [n, heads, hd] -> [n, heads, hd]."""
    n, heads, hd = q.shape
    kv_heads = pieces[0].shape[2]
    g = heads // kv_heads
    plan = _decode_plan(tuple(lengths), kv_heads, q.dtype, q.device)
    if pieces[0].shape[1] < plan.reach:
        raise ValueError(f"decode pieces of {pieces[0].shape[1]} keys; exact attention reads {plan.reach}")
    qs = _scaled(q).view(n, kv_heads, g, hd)  # a token's heads sharing a K/V head are rows of one matrix
    out = q.new_empty(n, kv_heads, g, hd)
    for grp in plan.groups:
        width = grp.base + grp.keys
        for lo in range(0, len(grp.rows), DECODE_ROWS):  # a few tokens a call: their copies stay small
            rows = grp.rows[lo : lo + DECODE_ROWS]
            m = len(rows)
            index = None if m == n else torch.tensor(rows, device=q.device)  # None: every token, in order
            # [m * kvh, keys, hd]: 3-D, so a product's B is a slice of it, never folded (copied) by matmul
            kv = [_buffer(2 + part, (m, kv_heads, width, hd), q.dtype) for part in (0, 1)]
            for part, buf in enumerate(kv):
                if padded is not None:
                    buf.copy_((padded[part] if index is None else padded[part].index_select(0, index))[:, :width].transpose(1, 2))
                elif not grp.base:
                    buf.copy_((pieces[part] if index is None else pieces[part].index_select(0, index))[:, : grp.keys].transpose(1, 2))
                else:
                    for i, r in enumerate(rows):
                        w = wholes[r] if r < len(wholes) else None
                        if w is None or w[part].shape[0] != grp.base:
                            raise ValueError(f"decode row {r} needs its {grp.base} keys before its piece")
                        buf[i, :, : grp.base].copy_(w[part].transpose(0, 1))
                        buf[i, :, grp.base :].copy_(pieces[part][r, : grp.keys].transpose(0, 1))
            kk, vv = (x.view(m * kv_heads, width, hd) for x in kv)
            qq = (qs if index is None else qs.index_select(0, index)).reshape(m * kv_heads, g, hd)
            s = torch.matmul(qq, kk.transpose(1, 2))  # [m * kvh, g, keys]
            mask = grp.mask[lo * kv_heads : (lo + m) * kv_heads]
            o = _attend(s, mask, grp.base, vv[:, : grp.base], vv[:, grp.base :]).view(m, kv_heads, g, hd)
            if index is None:
                out = o
            else:
                out[index] = o
    return out.reshape(n, heads, hd)


def _attend(s: torch.Tensor, mask: torch.Tensor, base: int, vw: torch.Tensor, vp: torch.Tensor) -> torch.Tensor:
    """Scores s [..., rows, keys] (scaled; keys [0, key_rows)) -> attention [..., rows, hd]: masked
    past each row's position (all in the last piece), one softmax per row, then the whole blocks'
    values [..., base, hd] and the piece's [..., keys - base, hd] in two products, added."""
    s[..., -PIECE:] += mask
    p = torch.ops.aten._softmax.out(s, -1, False, out=_buffer(1, s.shape, s.dtype)) if s.numel() > 1 << 16 \
        else torch.softmax(s, -1)
    o = torch.matmul(p[..., base:], vp)
    if base:
        o.add_(torch.matmul(p[..., :base], vw))
    return o


def _heads_major(x: torch.Tensor, buffer: int) -> torch.Tensor:
    """K or V [keys, kv_heads, hd] (a view of the pool) copied into this thread's buffer as
    [kv_heads, keys, hd]. Every score product reads K so, as the transpose of a contiguous matrix:
    oneDNN takes that as it is, where K read in place costs it a slow gather of its own (0.75
    against 0.16 ms for one token over 8K keys). V is copied too: a prompt's value products run
    faster on the copy, and a batch of decodes needs its tokens' contexts in one tensor. The
    buffers stay with the thread, as large as its longest context needed."""
    out = _buffer(buffer, (x.shape[1], x.shape[0], x.shape[2]), x.dtype)
    return out.copy_(x.transpose(0, 1))


def _scaled(q: torch.Tensor) -> torch.Tensor:
    """q times the softmax scale (a power of two, so exact, for head dims 4**k like 64 and 256)."""
    return q * q.shape[-1] ** -0.5


def _buffer(i: int, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """This thread's buffer i, grown as needed, as a contiguous tensor of `shape`."""
    bufs: dict[tuple[int, torch.dtype], torch.Tensor] = _local.__dict__.setdefault("bufs", {})
    n = math.prod(shape)
    buf = bufs.get((i, dtype))
    if buf is None or buf.numel() < n:
        with torch.inference_mode(False):  # a normal tensor: usable as `out` in and out of inference mode
            buf = bufs[(i, dtype)] = torch.empty(n, dtype=dtype)
    return buf[:n].view(*shape)


@functools.lru_cache(maxsize=64)  # a piece's mask depends on where its queries sit in it: few per step
def _tail_mask(lo: int, hi: int, g: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Additive mask of queries at [lo, hi) of the last piece over its PIECE keys, for g grouped
    heads in (group member, query) order: [g * (hi - lo), PIECE], -inf past each query (read only)."""
    hide = torch.arange(PIECE, device=device)[None, :] > torch.arange(lo, hi, device=device)[:, None]
    return torch.zeros(hide.shape, dtype=dtype, device=device).masked_fill_(hide, float("-inf")).repeat(g, 1)


@dataclass(frozen=True)
class _Group:
    """Decoding tokens that read the same keys: `base` of whole key blocks, then a piece of `keys`."""

    rows: tuple[int, ...]
    base: int
    keys: int
    mask: torch.Tensor  # [m * kv_heads, 1, PIECE] additive


@dataclass(frozen=True)
class _DecodePlan:
    """How a step's decodes read their keys (the same for every layer of the step)."""

    reach: int  # the widest piece
    groups: tuple[_Group, ...]


@functools.lru_cache(maxsize=2)
def _decode_plan(lengths: tuple[int, ...], kv_heads: int, dtype: torch.dtype, device: torch.device) -> _DecodePlan:
    splits = [split(n) for n in lengths]
    rel = [n - 1 - (key_rows(n) - PIECE) for n in lengths]  # each token's place in its last piece
    groups = []
    for base, keys in sorted(set(splits)):
        mine = tuple(r for r, sp in enumerate(splits) if sp == (base, keys))
        mask = torch.cat([_tail_mask(rel[r], rel[r] + 1, 1, dtype, device) for r in mine])  # [m, PIECE]
        mask = mask.repeat_interleave(kv_heads, 0)[:, None]  # [m * kvh, 1, PIECE]: a token's rows, head by head
        groups.append(_Group(mine, base, keys, mask))
    return _DecodePlan(max(keys for _, keys in splits), tuple(groups))
