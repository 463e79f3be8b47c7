"""Exact causal attention on the CPU: a token's output is the same bits however its prompt was cut
into prefill chunks, whatever came from a cache, and whichever other requests share the step.

Every query reads its keys as `key_split` splits them, by its position alone. In bf16 on a CPU
with native bf16 whose GEMMs pass its check, `exact_matmul` computes that with oneDNN's GEMMs;
otherwise (fp32, fp16, and bf16 elsewhere) the fused CPU flash kernel does, as follows.

The kernel's per-row arithmetic does not depend on how many query rows share a call (as long as
none of its query blocks is left with a handful of rows: see `_pad_rows`), nor on key blocks of
`KEY_BLOCK` that are wholly masked (they add exactly nothing). It does depend on the length of a
call's last key block. So a query at position p reads:
- its whole key blocks before its own, [0, base) with base = p - p % KEY_BLOCK: one unmasked call
  shared by every query of that block (most of a long context's work, in large calls);
- its piece, [base, key_rows(p + 1)): from its block's start to the end of its `PIECE` of
  positions, masked past p, in one call per piece of queries (at most KEY_BLOCK keys);
merged by their log-sum-exp, elementwise (`_merge`). A fresh prompt, a chunk continuing a history,
a single decode and a batch of decodes all reduce to that, and no call reads more than PIECE - 1
keys past its last query. (Whole key blocks alone, as before, read up to 511 past it: 1,536 keys
for a 1,088-key context.)
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvtier.models import exact_matmul
from kvtier.models.key_split import KEY_BLOCK, PIECE, cut_or_pad, key_rows, split

__all__ = ["FLASH_CPU", "KEY_BLOCK", "PIECE", "causal", "decode", "decode_padded", "key_rows", "numerics_tag", "split"]

# The fused CPU flash kernel SDPA dispatches to, called directly: it returns the log-sum-exp and
# takes the key layout we give it.
FLASH_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
_MIN_ROWS = 8  # the fewest query rows a kernel query block may have (fewer take another GEMM path)


def numerics_tag(dtype: torch.dtype, heads: int, kv_heads: int, hd: int, mode: str) -> str:
    """What stored state computed with exact attention in `dtype` is tagged with: the GEMM kernel
    rounds otherwise than the flash kernel, so their states never share keys."""
    return "+bf16-gemm-attention-blocked" if exact_matmul.active(dtype, heads, kv_heads, hd, mode) else ""


def causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int, mode: str) -> torch.Tensor:
    """Queries at positions [start, start + n) over keys [0, ctx): q [n, heads, hd] (RoPE applied),
    k/v [ctx or more, kv_heads, hd], read in place where they reach key_rows(ctx); `mode`: the
    model's bf16 attention kernel (`Kernels.bf16_attention`). -> [n, heads, hd]."""
    n, heads, hd = q.shape
    kv_heads = k.shape[1]
    if exact_matmul.active(q.dtype, heads, kv_heads, hd, mode):
        return exact_matmul.causal(q, k, v, start)
    g = heads // kv_heads
    kt, vt = (cut_or_pad(x, key_rows(start + n)).transpose(0, 1)[None] for x in (k, v))  # [1, kvh, keys, hd]
    out = q.new_empty(n, kv_heads, g, hd)
    lo = start
    while lo < start + n:
        base = lo - lo % KEY_BLOCK
        hi = min(start + n, base + KEY_BLOCK)  # the queries in lo's key block
        m = hi - lo
        # Grouped heads as rows, in (group member, token) order: no K/V repeat.
        qg = q[lo - start : hi - start].view(m, kv_heads, g, hd).permute(1, 2, 0, 3)  # [kvh, g, m, hd]
        cuts = [lo, *range(lo - lo % PIECE + PIECE, hi, PIECE), hi]
        whole = _padded(qg.reshape(1, kv_heads, g * m, hd))  # [1, kvh, g*m + pad, hd]
        pieces = []
        for a, b in zip(cuts, cuts[1:]):  # the queries of one piece
            keys = key_rows(b) - base
            rows = whole if len(cuts) == 2 else _padded(qg[:, :, a - lo : b - lo].reshape(1, kv_heads, g * (b - a), hd))
            mask = _piece_mask(a - base, b - base, keys, g, q.dtype, q.device)
            o, lse = _call(rows, kt[:, :, base : base + keys], vt[:, :, base : base + keys], mask, g * (b - a))
            pieces.append((o.view(kv_heads, g, b - a, hd), lse.view(kv_heads, g, b - a)))
        o, lse = pieces[0] if len(pieces) == 1 else (torch.cat([p[0] for p in pieces], 2), torch.cat([p[1] for p in pieces], 2))
        if base:  # every query of the block sees [0, base): one unmasked call
            full, full_lse = _call(whole, kt[:, :, :base], vt[:, :, :base], None, g * m)
            o = _merge(full.view(kv_heads, g, m, hd), full_lse.view(kv_heads, g, m), o, lse)
        out[lo - start : hi - start] = o.permute(2, 0, 1, 3)  # [m, kvh, g, hd]
        lo = hi
    return out.view(n, heads, hd)


def decode(q: torch.Tensor, pieces: tuple[torch.Tensor, torch.Tensor],
           wholes: Sequence[tuple[torch.Tensor, torch.Tensor] | None], lengths: Sequence[int], mode: str,
           padded: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """A batch of decoding tokens, token r at position lengths[r] - 1, each reading the split
    `causal` gives its position (`split`):
    - its piece from row r of `pieces`, K and V [n, >= its piece's keys, kv_heads, hd] (keys from
      its base on; past its position any finite value: masked, it adds exactly nothing, where NaN
      would leak through), one masked call per piece length for the rows sharing it;
    - its whole key blocks from wholes[r], K and V [base, kv_heads, hd] (None where base is 0):
      views of the pool where its slots are consecutive, so a long context is read in place and
      never copied. One unmasked call per token: the kernel's rows do not depend on the batch, so
      this is the very call a lone decode or a prompt's query at that position makes.
    `padded`: the contexts gathered, K and V [n, >= the longest base, kv_heads, hd] (any finite value
    past each row's own): the whole key blocks then attend in one call, each row's past its own base
    masked (whole masked key blocks add exactly nothing), and `wholes` is not read. One call is
    cheaper than a call per token where contexts are short enough that gathering them costs little.
    `mode`: the model's bf16 attention kernel, as `causal`'s. q: [n, heads, hd] -> [n, heads, hd]."""
    n, heads, hd = q.shape
    kv_heads = pieces[0].shape[2]
    if exact_matmul.active(q.dtype, heads, kv_heads, hd, mode):
        return exact_matmul.decode(q, pieces, wholes, lengths, padded)
    g = heads // kv_heads
    plan = _decode_plan(tuple(lengths), g, q.dtype, q.device)
    reach = plan.pieces[-1].keys
    if pieces[0].shape[1] < reach:
        raise ValueError(f"decode pieces of {pieces[0].shape[1]} keys; exact attention reads {reach}")
    qp = _padded(q.view(n, kv_heads, g, hd))  # a token's heads sharing a K/V head are rows of one matrix
    pk, pv = (x.transpose(1, 2) for x in pieces)  # [n, kvh, piece width, hd]
    if len(plan.pieces) == 1 and plan.pieces[0].rows is None:  # one piece length: the rows in order
        p = plan.pieces[0]
        o, lse = _call(qp, pk[:, :, : p.keys], pv[:, :, : p.keys], p.mask, g)
    else:
        o = q.new_empty(n, kv_heads, g, hd)
        lse = torch.empty(n, kv_heads, g, dtype=torch.float32, device=q.device)
        for p in plan.pieces:
            assert p.rows is not None  # more than one length
            kp, vp = (x.index_select(0, p.rows)[:, :, : p.keys] for x in (pk, pv))  # [m, kvh, keys, hd]
            o[p.rows], lse[p.rows] = _call(qp.index_select(0, p.rows), kp, vp, p.mask, g)
    if plan.based and padded is not None:  # every token's whole key blocks in one call
        kk, vv = (x[:, : max(plan.bases)].transpose(1, 2) for x in padded)  # [n, kvh, longest base, hd]
        full, full_lse = _call(qp, kk, vv, plan.full_mask, g)
        merged = _merge(full, full_lse, o, lse)
        o = merged if plan.some is None else torch.where(plan.some, merged, o)  # no whole blocks: the piece alone
    elif plan.based:  # the tokens with whole key blocks: each over its own, then merged with its piece
        fulls = []
        for r in plan.based:
            w = wholes[r]
            if w is None or w[0].shape[0] != plan.bases[r]:
                raise ValueError(f"decode row {r} needs its {plan.bases[r]} keys before its piece")
            fulls.append(_call(qp[r : r + 1], w[0].transpose(0, 1)[None], w[1].transpose(0, 1)[None], None, g))
        full, full_lse = (torch.cat([f[i] for f in fulls]) for i in (0, 1))  # [m, kvh, g, hd], [m, kvh, g]
        if plan.based_at is None:
            o = _merge(full, full_lse, o, lse)
        else:
            at = plan.based_at
            o[at] = _merge(full, full_lse, o[at], lse[at])
    return o.reshape(n, heads, hd)


def decode_padded(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: Sequence[int], mode: str) -> torch.Tensor:
    """`decode` over contexts gathered and padded: row r of k/v [n, width, kv_heads, hd] holds
    token r's context, any finite value past it, with width = key_rows(max(lengths)).
    q: [n, heads, hd] -> [n, heads, hd]."""
    n, width = k.shape[:2]
    if width != key_rows(max(lengths)):
        raise ValueError(f"decode contexts are {width} rows; exact attention reads {key_rows(max(lengths))}")
    splits = [split(ln) for ln in lengths]
    reach = max(keys for _, keys in splits)
    # Each row's piece [base, base + reach), cut at the row's end of the buffer (masked there anyway).
    bases = torch.tensor([base for base, _ in splits], device=k.device)
    along = torch.clamp(bases[:, None] + torch.arange(reach, device=k.device), max=width - 1)  # [n, reach]
    index = (along + torch.arange(n, device=k.device)[:, None] * width).view(-1)
    flat_k, flat_v = (x.reshape(n * width, *x.shape[2:]) for x in (k, v))
    pieces = tuple(x.index_select(0, index).view(n, reach, *x.shape[1:]) for x in (flat_k, flat_v))
    return decode(q, (pieces[0], pieces[1]), [], lengths, mode, padded=(k, v))


@dataclass(frozen=True)
class _Piece:
    """Decoding rows whose pieces have `keys` keys."""

    rows: torch.Tensor | None  # [m] (None: every row, in order)
    keys: int
    mask: torch.Tensor  # [m, 1, padded g, keys] additive


@dataclass(frozen=True)
class _DecodePlan:
    """How a step's decodes split their keys (the same for every layer of the step)."""

    bases: tuple[int, ...]  # per row: its whole key blocks' keys
    based: tuple[int, ...]  # the rows with whole key blocks
    based_at: torch.Tensor | None  # those rows as an index where some row has none (None: every row)
    pieces: tuple[_Piece, ...]
    # One call over padded contexts: -inf past each row's own base ([n, 1, padded g, longest base];
    # None if every base is the longest), and the rows with whole key blocks ([n, 1, 1, 1]; None if all).
    full_mask: torch.Tensor | None
    some: torch.Tensor | None


@functools.lru_cache(maxsize=2)
def _decode_plan(lengths: tuple[int, ...], g: int, dtype: torch.dtype, device: torch.device) -> _DecodePlan:
    splits = [split(ln) for ln in lengths]
    rows = g + _pad_rows(g)
    pieces = []
    for c in sorted({keys for _, keys in splits}):
        mine = [r for r, (_, keys) in enumerate(splits) if keys == c]
        mask = _mask([lengths[r] - 1 - splits[r][0] for r in mine], c, dtype, device)[:, None, None].expand(-1, 1, rows, -1)
        pieces.append(_Piece(None if len(mine) == len(lengths) else torch.tensor(mine, device=device), c, mask))
    bases = tuple(base for base, _ in splits)
    top = max(bases)
    full_mask = some = None
    if top and len(set(bases)) > 1:
        hide = torch.arange(top)[None] >= torch.tensor(bases)[:, None]  # [n, longest base]
        full_mask = torch.zeros(hide.shape, dtype=dtype).masked_fill_(hide, float("-inf"))
        full_mask = full_mask.to(device)[:, None, None].expand(-1, 1, rows, -1)
        if min(bases) == 0:
            some = torch.tensor(bases, device=device).view(-1, 1, 1, 1) > 0
    based = tuple(r for r, base in enumerate(bases) if base)
    based_at = None if len(based) == len(bases) else torch.tensor(based, dtype=torch.long, device=device)
    return _DecodePlan(bases, based, based_at, tuple(pieces), full_mask, some)


def _merge(o1: torch.Tensor, lse1: torch.Tensor, o2: torch.Tensor, lse2: torch.Tensor) -> torch.Tensor:
    """Attention over two disjoint key sets, o [..., rows, hd] with lse [..., rows], as attention over
    both: (o1 e^lse1 + o2 e^lse2) / (e^lse1 + e^lse2), in fp32, rounded once to o's dtype. Only ops
    that give an element the same bits wherever it lies in a tensor: IEEE arithmetic, and exp on a
    contiguous input (computed whole-vector, tail included). Not sigmoid or a fused lerp: their
    vector body and scalar tail round differently, so a row's bits would depend on its index."""
    top = torch.maximum(lse1, lse2)
    e1, e2 = torch.exp(lse1 - top).unsqueeze(-1), torch.exp(lse2 - top).unsqueeze(-1)  # [..., rows, 1]
    # The same products, sum and quotient as (o1 e1 + o2 e2) / (e1 + e2), in place on fp32 copies.
    num = o1.to(torch.float32, copy=True).mul_(e1).add_(o2.to(torch.float32, copy=True).mul_(e2))
    return num.div_(e1 + e2).to(o1.dtype)


@functools.lru_cache(maxsize=32)  # a piece's mask depends on its place in its key block: few per step
def _piece_mask(lo: int, hi: int, keys: int, g: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The mask of queries [lo, hi) over keys [0, keys) of their block, for g grouped heads, with
    the rows `_padded` adds: [1, 1, g*(hi-lo) + pad, keys] (read only)."""
    mask = _mask(list(range(lo, hi)), keys, dtype, device).repeat(g, 1)
    extra = _pad_rows(mask.shape[0])
    return torch.cat([mask, mask[-1:].expand(extra, -1)])[None, None]


def _mask(positions: list[int], keys: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Additive mask [len(positions), keys]: 0 for keys at or before each query's position, -inf after."""
    pos = torch.tensor(positions, device=device)
    hide = torch.arange(keys, device=device)[None, :] > pos[:, None]
    return torch.zeros(hide.shape, dtype=dtype, device=device).masked_fill_(hide, float("-inf"))


def _padded(q: torch.Tensor) -> torch.Tensor:
    """q [b, h, rows, hd] with `_pad_rows` copies of its last row appended (computed, then dropped)."""
    extra = _pad_rows(q.shape[2])
    return torch.cat([q, q[:, :, -1:].expand(-1, -1, extra, -1)], 2) if extra else q


def _call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
          rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The CPU flash kernel on `_padded` q [b, h, padded rows, hd], k/v [b, h, keys, hd], mask
    [b, 1, padded rows, keys] or None -> (o [b, h, rows, hd], lse [b, h, rows] fp32), cut back to `rows`."""
    assert FLASH_CPU is not None  # the caller checked it
    o, lse = FLASH_CPU(q, k, v, 0.0, False, attn_mask=mask)[:2]
    return o[:, :, :rows], lse[:, :, :rows]


def _pad_rows(rows: int) -> int:
    """Rows to add so that no query block of the flash kernel is left with fewer than _MIN_ROWS
    (its blocks are 32, 64 or 256 rows by the row count; a block of one or two rows takes a GEMM
    path that rounds differently)."""
    total = rows
    while True:
        split = 256 if total >= 768 else 64 if total >= 192 else 32
        tail = total % split
        if tail == 0 or tail >= _MIN_ROWS:
            return total - rows
        total += _MIN_ROWS - tail
