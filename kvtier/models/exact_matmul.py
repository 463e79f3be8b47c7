"""Exact CPU attention in bf16 through GEMMs: a query's scores over all the keys it reads in one
row, one softmax over that row, then its values read in fixed blocks: each whole key block before
its own (KEY_BLOCK keys) in one product, its piece in another, their bf16 results summed in block
order (in double, as the CPU's cumulative sum accumulates) and rounded once.

Why: on a CPU with native bf16 (avx512_bf16) oneDNN's bf16 GEMMs turn a query's keys over faster
than the fused flash kernel (`exact_attention`), whose per-block softmax bookkeeping, not its
arithmetic, bounds it (docs/benchmarks.md, "Exact bf16 attention on GEMMs"). The scores are rounded to
bf16 before the softmax, as HF transformers' eager attention rounds them; the probabilities are
rounded to bf16 before the value products, as the flash kernel rounds them.

What makes it exact: a query at position p reads the keys [0, key_rows(p + 1)), a function of p
alone, as one row of scores whatever the call, and every product it takes part in reduces over a
length fixed by p: head_dim for its scores, KEY_BLOCK for each whole block's values, its piece's
keys for the piece's. No product reduces over more than KEY_BLOCK keys: a GEMM library may cut a
long reduction into chunks sized by the whole problem's shape, so that one row is grouped
otherwise in calls of other row counts (docs/exactness.md has the case). Every product's operands
are contiguous (K read as the transpose of its heads-major copy), and its batch is at most
BATCH_BLOCKS x kv_heads entries. What remains is that a
row's bits do not depend on the number of rows or batch entries beside it in a call: `usable`
checks that at first use per head geometry and thread count (every row count at every reduction
length the kernel makes, each batch count at the fewest and most rows, then the kernel itself on a
2,600-token context), and where it fails the flash kernel serves instead. The model's
`Kernels.bf16_attention` (the engine's `--bf16-attention`), passed as `mode`, picks the kernel:
auto (GEMMs on CPUs with avx512_bf16 and no AMX, where `usable`; the flash kernel on AMX, which is
faster there, and where this kernel's 512-key value products are not row-invariant, so `usable`
refuses it: docs/exactness.md), gemm (wherever `usable`) or flash.
"""

from __future__ import annotations

import functools
import logging
import math
import threading
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvtier.dtypes import cpu_has_amx, cpu_has_bf16
from kvtier.models.kernels import BF16_ATTENTION
from kvtier.models.key_split import KEY_BLOCK, PIECE, cut_or_pad, key_rows, split

log = logging.getLogger(__name__)

DECODE_ROWS = 8  # decoding tokens per call: a batch of 32 long contexts copied at once is 2 x 100 MB at 8K
BATCH_BLOCKS = 16  # whole key blocks (times kv_heads) per value product: every batch count the check covers
SCORE_BUDGET = 1 << 23  # scores per call of a prompt's queries (16 MB in bf16): long contexts take fewer queries a call
_local = threading.local()  # per thread: the score, probability and K/V buffers, reused (a fresh 16 MB faults its pages in)


def active(dtype: torch.dtype, heads: int, kv_heads: int, hd: int, mode: str) -> bool:
    """Whether exact attention of this dtype and head geometry runs on GEMMs, where `mode` (a
    model's `Kernels.bf16_attention`: auto, gemm or flash) asks for them."""
    if mode not in BF16_ATTENTION:
        raise ValueError(f"unknown bf16 attention kernel {mode!r}; use one of {', '.join(BF16_ATTENTION)}")
    if dtype != torch.bfloat16 or mode == "flash" or (mode == "auto" and (not cpu_has_bf16() or cpu_has_amx())):
        return False
    ok = usable(heads, kv_heads, hd)
    if not ok and mode == "gemm":
        _refused(heads, kv_heads, hd)
    return ok


def why(dtype: torch.dtype, heads: int, kv_heads: int, hd: int, mode: str) -> str:
    """One line: which kernel exact CPU attention of this dtype and geometry runs under `mode`, and why."""
    if dtype != torch.bfloat16:
        return f"the flash kernel ({str(dtype).removeprefix('torch.')}: GEMM attention is bf16's only)"
    if mode == "flash":
        return "the flash kernel (--bf16-attention flash)"
    if mode == "auto" and not cpu_has_bf16():
        return "the flash kernel (this CPU has no native bf16: no avx512_bf16 or amx_bf16)"
    if mode == "auto" and cpu_has_amx():
        return "the flash kernel (auto on an AMX CPU: faster there than the GEMMs, whose check refuses them there)"
    geometry = f"{heads} heads over {kv_heads}, head_dim {hd}, {torch.get_num_threads()} threads"
    if active(dtype, heads, kv_heads, hd, mode):
        return f"bf16 GEMMs ({'--bf16-attention gemm' if mode == 'gemm' else 'auto'}; checked row-invariant here for {geometry})"
    return f"the flash kernel (this CPU's bf16 GEMMs did not pass the row-invariance check for {geometry})"


@functools.lru_cache(maxsize=16)  # once per geometry, not per call
def _refused(heads: int, kv_heads: int, hd: int) -> None:
    log.warning("bf16 GEMM attention (%d heads over %d, head_dim %d) is not row-invariant on this CPU: "
                "the flash kernel serves instead", heads, kv_heads, hd)


def usable(heads: int, kv_heads: int, hd: int) -> bool:
    """Whether this CPU's bf16 GEMMs give exact attention here (checked once per geometry and threads)."""
    return _usable(heads, kv_heads, hd, torch.get_num_threads())


@dataclass(frozen=True)
class CallShapes:
    """The GEMM shapes the kernel makes for one head geometry: batched products of `rows` rows,
    reducing over `score_depth` (the scores) or one of `value_depths` (a piece's values, or a whole
    block's at KEY_BLOCK), in batches of `batches` entries."""

    rows: tuple[int, ...]  # a prompt's g x 1..PIECE queries (a decode's g among them)
    score_depth: int  # head_dim
    value_depths: tuple[int, ...]  # PIECE, 2 PIECE, ..., KEY_BLOCK
    batches: tuple[int, ...]  # kv_heads x 1..BATCH_BLOCKS (a prompt's heads, times decoding tokens or whole blocks)


def call_shapes(heads: int, kv_heads: int, hd: int) -> CallShapes:
    g = heads // kv_heads
    return CallShapes(tuple(g * m for m in range(1, PIECE + 1)), hd, tuple(range(PIECE, KEY_BLOCK + 1, PIECE)),
                      tuple(kv_heads * j for j in range(1, max(BATCH_BLOCKS, DECODE_ROWS) + 1)))


@functools.lru_cache(maxsize=16)
def _usable(heads: int, kv_heads: int, hd: int, threads: int) -> bool:
    try:
        ok = _rows_invariant(call_shapes(heads, kv_heads, hd)) and _composed(heads, kv_heads, hd)
    except (RuntimeError, ValueError) as e:  # a GEMM this build cannot run: the flash kernel serves
        log.warning("bf16 GEMM attention unavailable, the flash kernel serves: %s", e)
        return False
    return ok


def _rows_invariant(shapes: CallShapes) -> bool:
    """Every row count the kernel makes, at every reduction length, in a call of a prompt's batch
    (kv_heads entries), gives the rows a call of the most rows gives, bit for bit: the scores (over
    key widths of one piece to two blocks) and the values. Then each batch count the kernel makes,
    at the fewest rows (a decode's), and for the whole blocks' values at the most rows too (a
    prompt's piece over many blocks)."""
    g = torch.Generator().manual_seed(0)
    rows, top, one, most = shapes.rows, shapes.rows[-1], shapes.batches[0], shapes.batches[-1]
    products = [(shapes.score_depth, n, True) for n in (PIECE, KEY_BLOCK + PIECE, 2 * KEY_BLOCK)]
    products += [(depth, shapes.score_depth, False) for depth in shapes.value_depths]
    for depth, n, scores in products:
        wide = depth == KEY_BLOCK and not scores  # the whole blocks' values: every batch count at every row count
        a = torch.randn(most, 2 * top, depth, generator=g).to(torch.bfloat16)  # [batch, rows, depth]
        b = torch.randn(most, n, depth, generator=g).to(torch.bfloat16)
        b = b.transpose(1, 2) if scores else b.view(most, depth, n)  # scores read heads-major K transposed
        entries = most if wide else one
        want = torch.cat([torch.matmul(a[:entries, :top], b[:entries]), torch.matmul(a[:entries, top:], b[:entries])], 1)
        for i, m in enumerate(rows):
            at = (i * 7919) % top  # a different offset per count
            if not torch.equal(torch.matmul(a[:one, at : at + m], b[:one]), want[:one, at : at + m]):
                log.info("bf16 GEMM attention: %d rows over %d differ from %d rows", m, depth, top)
                return False
        for m in (rows[0], top) if wide else (rows[0],):
            ref = want[:, :m] if wide else torch.matmul(a[:, :m], b)  # [most, m, n]
            if not torch.equal(ref[:one], want[:one, :m]):
                return False
            for batch in shapes.batches:
                if not torch.equal(torch.matmul(a[:batch, :m], b[:batch]), ref[:batch]):
                    log.info("bf16 GEMM attention: a batch of %d, %d rows over %d, differs", batch, m, depth)
                    return False
    return True


def _composed(heads: int, kv_heads: int, hd: int) -> bool:
    """The kernel itself computes a query alike however it is called, over 2,600 positions (whole
    blocks up to 2,048 keys): a prompt in one call, in chunks of 100 to 1,100 and of 700 after;
    single decodes; decodes batched with tokens of no, one, two and five whole key blocks, ten of
    them reading the same keys (two calls), their whole blocks read as views or from gathered
    contexts."""
    ctx = 2600
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(ctx, h, hd, generator=g).to(torch.bfloat16) for h in (heads, kv_heads, kv_heads))
    whole = causal(q, k, v, 0)
    cuts = [*range(0, 1100, 100), *range(1100, ctx, 700), ctx]
    chunked = torch.cat([causal(q[a:b], k[:b], v[:b], a) for a, b in zip(cuts, cuts[1:])])
    lengths = [6, 64, 513, 600, 600, 1090, 1100, 2049, *range(2590, 2600)]
    lone = [causal(q[n - 1 : n], k[:n], v[:n], n - 1) for n in lengths[:8]]
    splits = [split(n) for n in lengths]
    reach = max(keys for _, keys in splits)
    pk, pv = (torch.zeros(len(lengths), reach, kv_heads, hd, dtype=torch.bfloat16) for _ in range(2))
    for r, (n, (base, _)) in enumerate(zip(lengths, splits)):
        pk[r, : n - base], pv[r, : n - base] = k[base:n], v[base:n]
    last = q[[n - 1 for n in lengths]]
    batch = decode(last, (pk, pv), [(k[:base], v[:base]) if base else None for base, _ in splits], lengths)
    contexts = tuple(cut_or_pad(x, key_rows(ctx))[None].expand(len(lengths), -1, -1, -1) for x in (k, v))
    gathered = decode(last, (pk, pv), [], lengths, padded=(contexts[0], contexts[1]))
    return (torch.equal(chunked, whole)
            and all(torch.equal(o[0], whole[n - 1]) for n, o in zip(lengths, lone))
            and all(torch.equal(batch[r], whole[n - 1]) and torch.equal(gathered[r], whole[n - 1])
                    for r, n in enumerate(lengths)))


def causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int) -> torch.Tensor:
    """Queries at positions [start, start + n) over keys [0, ctx): q [n, heads, hd] (RoPE applied),
    k/v [ctx or more, kv_heads, hd], read in place where they reach key_rows(ctx). -> [n, heads, hd].
    One call per piece of queries (they read the same keys), cut to SCORE_BUDGET scores."""
    n, heads, hd = q.shape
    kv_heads = k.shape[1]
    g = heads // kv_heads
    reach = key_rows(start + n)
    kc = _heads_major(cut_or_pad(k, reach), 2)  # [kvh, keys, hd]
    vb = _blocked(cut_or_pad(v, reach), 3)  # [blocks, kvh, KEY_BLOCK, hd]
    qs = _scaled(q)
    out = q.new_empty(n, heads, hd)
    lo = start
    while lo < start + n:
        end = min(start + n, lo - lo % PIECE + PIECE)  # lo's piece: its queries read the same keys
        base, keys = lo - lo % KEY_BLOCK, key_rows(end)
        nb = base // KEY_BLOCK
        vp = _buffer(4, (1, kv_heads, keys - base, hd), q.dtype).copy_(vb[None, nb, :, : keys - base])  # the piece's values
        step = max(1, SCORE_BUDGET // (heads * keys))
        for a in range(lo, end, step):
            b = min(end, a + step)
            m = b - a
            qg = qs[a - start : b - start].view(m, kv_heads, g, hd).permute(1, 2, 0, 3).reshape(kv_heads, g * m, hd)
            s = torch.matmul(qg, kc[:, :keys].transpose(1, 2), out=_buffer(0, (kv_heads, g * m, keys), q.dtype))  # [kvh, g*m, keys]
            tail = keys - PIECE  # every masked key lies in the last piece
            o = _attend(s[None], _tail_mask(a - tail, b - tail, g, q.dtype, q.device), base, vb[None, :nb], vp)  # [1, kvh, g*m, hd]
            out[a - start : b - start] = o[0].view(kv_heads, g, m, hd).permute(2, 0, 1, 3).reshape(m, heads, hd)
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
    (K heads-major, V block-major).
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
        base, keys = grp.base, grp.keys
        nb = base // KEY_BLOCK
        for lo in range(0, len(grp.rows), DECODE_ROWS):  # a few tokens a call: their copies stay small
            rows = grp.rows[lo : lo + DECODE_ROWS]
            m = len(rows)
            index = None if m == n else torch.tensor(rows, device=q.device)  # None: every token, in order
            kk = _buffer(2, (m, kv_heads, base + keys, hd), q.dtype)  # 3-D per token: B a slice, never folded by matmul
            vw = _buffer(3, (m, nb, kv_heads, KEY_BLOCK, hd), q.dtype)  # the whole blocks' values, block-major
            vp = _buffer(4, (m, kv_heads, keys, hd), q.dtype)  # the piece's values
            if padded is not None:
                ck, cv = (x[:, : base + keys] if index is None else x[:, : base + keys].index_select(0, index)
                          for x in padded)  # [m, base + keys, kvh, hd]
                kk.copy_(ck.transpose(1, 2))
                vw.copy_(cv[:, :base].unflatten(1, (nb, KEY_BLOCK)).transpose(2, 3))
                vp.copy_(cv[:, base : base + keys].transpose(1, 2))
            else:
                pk, pv = (x[:, :keys] if index is None else x[:, :keys].index_select(0, index)
                          for x in pieces)  # [m, keys, kvh, hd]
                kk[:, :, base:].copy_(pk.transpose(1, 2))
                vp.copy_(pv.transpose(1, 2))
                for i, r in enumerate(rows if base else ()):
                    w = wholes[r] if r < len(wholes) else None
                    if w is None or w[0].shape[0] != base or w[1].shape[0] != base:
                        raise ValueError(f"decode row {r} needs its {base} keys before its piece")
                    kk[i, :, :base].copy_(w[0].transpose(0, 1))
                    vw[i].copy_(w[1].unflatten(0, (nb, KEY_BLOCK)).transpose(1, 2))
            qq = (qs if index is None else qs.index_select(0, index)).reshape(m * kv_heads, g, hd)
            s = torch.matmul(qq, kk.view(m * kv_heads, base + keys, hd).transpose(1, 2))  # [m * kvh, g, keys]
            mask = grp.mask[lo * kv_heads : (lo + m) * kv_heads]
            o = _attend(s.view(m, kv_heads, g, base + keys), mask.view(m, kv_heads, 1, PIECE), base, vw, vp)
            if index is None:
                out = o
            else:
                out[index] = o
    return out.reshape(n, heads, hd)


def _attend(s: torch.Tensor, mask: torch.Tensor, base: int, vw: torch.Tensor, vp: torch.Tensor) -> torch.Tensor:
    """Scores s [L, kvh, rows, keys] (scaled; keys [0, key_rows)) -> attention [L, kvh, rows, hd]:
    masked past each row's position (all in the last piece), one softmax per row, then the values:
    the piece's vp [L, kvh, keys - base, hd] in one product, the whole blocks' vw [L, blocks, kvh,
    KEY_BLOCK, hd] in one product a block (batched, BATCH_BLOCKS x kvh a call), their bf16 results
    summed in block order, the piece last."""
    s[..., -PIECE:] += mask
    p = torch.ops.aten._softmax.out(s, -1, False, out=_buffer(1, s.shape, s.dtype)) if s.numel() > 1 << 16 \
        else torch.softmax(s, -1)
    lead, kvh, rows, keys = p.shape
    hd = vp.shape[-1]
    piece = torch.matmul(_buffer(5, (lead, kvh, rows, keys - base), p.dtype).copy_(p[..., base:]), vp)  # [L, kvh, rows, hd]
    if not base:
        return piece
    nb = base // KEY_BLOCK
    n = lead * nb * kvh
    blocks = _buffer(6, (lead, nb, kvh, rows, KEY_BLOCK), p.dtype)  # each block's probabilities, contiguous
    blocks.copy_(p[..., :base].unflatten(-1, (nb, KEY_BLOCK)).permute(0, 3, 1, 2, 4))
    a, b = blocks.view(n, rows, KEY_BLOCK), vw.reshape(n, KEY_BLOCK, hd)
    parts = _buffer(7, (n, rows, hd), p.dtype)  # [L * blocks * kvh, rows, hd]: each block's product, rounded to bf16
    for i in range(0, n, BATCH_BLOCKS * kvh):
        torch.matmul(a[i : i + BATCH_BLOCKS * kvh], b[i : i + BATCH_BLOCKS * kvh], out=parts[i : i + BATCH_BLOCKS * kvh])
    # Summed block after block: a cumulative sum is sequential by definition (the CPU's accumulates
    # in double), where a reduction may order its terms by the tensor's shape.
    total = parts.view(lead, nb, kvh, rows, hd).cumsum(1, dtype=torch.float32)[:, -1]
    return (total + piece.float()).to(piece.dtype)


def _heads_major(x: torch.Tensor, buffer: int) -> torch.Tensor:
    """K [keys, kv_heads, hd] (a view of the pool) copied into this thread's buffer as
    [kv_heads, keys, hd]. Every score product reads K so, as the transpose of a contiguous matrix:
    oneDNN takes that as it is, where K read in place costs it a slow gather of its own. The
    buffers stay with the thread, as large as its longest context needed."""
    out = _buffer(buffer, (x.shape[1], x.shape[0], x.shape[2]), x.dtype)
    return out.copy_(x.transpose(0, 1))


def _blocked(x: torch.Tensor, buffer: int) -> torch.Tensor:
    """V [keys, kv_heads, hd] copied into this thread's buffer block-major, [blocks, kv_heads,
    KEY_BLOCK, hd] (the last block filled up to `keys`): the whole blocks before a query are then
    one contiguous batch of products."""
    keys, kv_heads, hd = x.shape
    full, rest = divmod(keys, KEY_BLOCK)
    out = _buffer(buffer, (full + (rest > 0), kv_heads, KEY_BLOCK, hd), x.dtype)
    out[:full].copy_(x[: full * KEY_BLOCK].unflatten(0, (full, KEY_BLOCK)).transpose(1, 2))
    if rest:
        out[full, :, :rest].copy_(x[full * KEY_BLOCK :].transpose(0, 1))
    return out


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
