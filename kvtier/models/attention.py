"""Causal attention of a run of query tokens over a contiguous key/value history.

Exact (the default on the CPU): a token's attention output is the same bits however its prompt was
cut into prefill chunks, whatever came from a cache, and whichever other requests share the step.
The fused CPU flash kernel walks the keys in blocks of `KEY_BLOCK` from key 0 with an online
softmax, and its per-row arithmetic does not depend on how many query rows share the call (as
long as none of its query blocks is left with a handful of rows: see `_pad_rows`), nor on key
blocks that are wholly masked (they add exactly nothing). So every query at position p is
computed by one call over the keys [0, (p // KEY_BLOCK + 1) * KEY_BLOCK), zero-padded past the
history, with a mask that hides the keys after p: a fresh prompt, a chunk continuing a history
and a batch of decodes all reduce to that. Queries are grouped by their key block, so a long
chunk costs one call per 512 positions and only the last key block of each is masked work.

`set_exact(False)` (`--fast-inexact`) keeps the earlier, faster-by-a-little paths whose rounding
depends on the chunking. CUDA uses flash varlen attention where it is usable (not yet shown
invariant on a GPU).
"""

from __future__ import annotations

import contextlib
import functools

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from kvtier.models import invariant, varlen

# The fused CPU flash kernel SDPA dispatches to, called directly: it returns the log-sum-exp and
# takes the key layout we give it.
_FLASH_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
KEY_BLOCK = 512  # the CPU flash kernel's key split: every call's keys are a whole number of these
_MIN_ROWS = 8  # the fewest query rows a kernel query block may have (fewer take another GEMM path)


# Backends for small attention calls outside a CUDA graph. Not cuDNN's: it builds or looks up a graph
# on the host for every call (1.5-2 ms each on an H200, 45-65 ms of a 30-layer step, against ~10 us
# of kernel), which a captured graph pays once but an eager step pays per layer.
_EAGER_BACKENDS = [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.MATH]


def _eager_backends(t: torch.Tensor) -> contextlib.AbstractContextManager:
    """SDPA restricted to _EAGER_BACKENDS on CUDA; elsewhere (no cuDNN) as it is: entering the
    restriction costs ~15 us, a decode step's layers' worth of which is not worth paying for nothing."""
    return sdpa_kernel(_EAGER_BACKENDS) if t.is_cuda else contextlib.nullcontext()


def key_rows(ctx: int) -> int:
    """The keys the exact kernel reads for a context of `ctx` positions: whole key blocks."""
    return -(-ctx // KEY_BLOCK) * KEY_BLOCK


def exact_cpu(device: torch.device) -> bool:
    return device.type == "cpu" and _FLASH_CPU is not None and invariant.exact()


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_start: int) -> torch.Tensor:
    """Queries at positions [q_start, q_start + n) attend to keys at positions [0, ctx).

    q: [n, heads, hd] (RoPE applied), k/v: [ctx, kv_heads, hd] with ctx = q_start + n; k/v may be
    strided views (a request's slots in the pool), read in place. Returns [n, heads, hd].
    """
    n, ctx = q.shape[0], k.shape[0]
    if exact_cpu(q.device):
        return _blocked(q, k, v, q_start)
    if 1 < n < ctx and q.device.type == "cpu" and _FLASH_CPU is not None:
        return _history_then_own(q, k, v, q_start)
    if 1 < n < ctx and varlen.usable(q.device, q.dtype, q.shape[1], k.shape[1], q.shape[2]):
        # CUDA: flash attention with the causal mask aligned bottom-right, no mask tensor
        return varlen.attend(q, k, v, *varlen.spans(n, ctx, q.device), n, ctx)
    qh, kh, vh = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))  # [1, heads | kv_heads, tokens, hd]
    # SDPA's fused CPU kernel (torch >= 2.5) handles grouped K/V heads itself: no repeat_interleave copy.
    gqa = q.shape[1] != k.shape[1]
    if n == ctx:  # a whole prompt: one call whose kernel time dwarfs any backend's host cost
        out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, enable_gqa=gqa)
    else:
        with _eager_backends(q):  # one decoding token, or a chunk continuing a history
            # torch.nn.attention.bias is imported here: it pulls in torch._dynamo (~2 s of a CPU
            # process's start), and the exact CPU path never comes here
            from torch.nn.attention.bias import causal_lower_right

            mask = None if n == 1 else causal_lower_right(n, ctx)  # the causal mask aligned bottom-right
            out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, enable_gqa=gqa)
    return out[0].transpose(0, 1)  # [n, heads, hd]


def masked_decode_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """One decoding token per row attends to its padded context: q [n, heads, hd], k/v
    [n, kv_heads, width, hd], mask [n, 1, 1, width] (True where a key is real) -> [n, heads, hd].
    A token's query heads sharing a K/V head are the rows of one query matrix (query head h reads
    K/V head h // group, as `enable_gqa` does), so the call has no grouped heads and the
    memory-efficient kernel takes it, masks and all, with no K/V copy per head."""
    n, heads, hd = q.shape
    kv_heads = k.shape[1]
    qg = q.reshape(n, kv_heads, heads // kv_heads, hd)  # [n, kv_heads, group, hd]
    with _eager_backends(q):
        out = F.scaled_dot_product_attention(qg, k, v, attn_mask=mask)  # the mask broadcasts over the group
    return out.reshape(n, heads, hd)


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    """Exact attention of a batch of decoding tokens: token r sits at position lengths[r] - 1 and
    attends to row r of k/v [n, width, kv_heads, hd]: its context gathered, padded with zeros (any
    finite value: masked, it adds exactly nothing; NaN would leak through) to `width`, the whole
    key blocks up to the longest context. q: [n, heads, hd] -> [n, heads, hd]."""
    n, width, kv_heads, hd = k.shape
    g = q.shape[1] // kv_heads
    keys = key_rows(max(lengths))
    if width != keys:
        raise ValueError(f"decode contexts are {width} rows; exact attention reads {keys} (whole key blocks)")
    kz, vz = k.transpose(1, 2), v.transpose(1, 2)  # [n, kvh, keys, hd]
    qg = q.view(n, kv_heads, g, hd)  # a token's heads sharing a K/V head are rows of one matrix
    mask = _decode_mask(tuple(lengths), keys, q.dtype, q.device).expand(n, 1, g, keys)
    out = _flash(qg, kz, vz, mask)  # [n, kvh, g, hd]
    return out.reshape(n, kv_heads * g, hd)


def _blocked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int) -> torch.Tensor:
    """causal_attention, exact: one masked call per group of queries sharing a key block."""
    n, heads, hd = q.shape
    kv_heads = k.shape[1]
    g = heads // kv_heads
    outs = []
    lo = start
    while lo < start + n:
        hi = min(start + n, (lo // KEY_BLOCK + 1) * KEY_BLOCK)  # the queries in lo's key block
        keys = hi - 1 - (hi - 1) % KEY_BLOCK + KEY_BLOCK  # [0, keys): whole blocks up to hi's
        m = hi - lo
        kk, vv = (_keys(x, keys).transpose(0, 1)[None] for x in (k, v))  # [1, kvh, keys, hd]
        # Grouped heads as rows: [1, kvh, g * m, hd] in (group member, token) order, no K/V repeat.
        qg = q[lo - start : hi - start].view(m, kv_heads, g, hd).permute(1, 2, 0, 3).reshape(1, kv_heads, g * m, hd)
        mask = _group_mask(lo, hi, keys, g, q.dtype, q.device)  # [1, 1, g*m, keys]
        o = _flash(qg, kk, vv, mask)  # [1, kvh, g*m, hd]
        outs.append(o.view(kv_heads, g, m, hd).permute(2, 0, 1, 3).reshape(m, heads, hd))
        lo = hi
    return torch.cat(outs) if len(outs) > 1 else outs[0]


def _keys(x: torch.Tensor, keys: int) -> torch.Tensor:
    """x [ctx, kv_heads, hd] as exactly `keys` rows: cut, or zero-padded past the history (a copy:
    the engine passes contexts already padded to `key_rows`, see ModelRunner.attend)."""
    if x.shape[0] >= keys:
        return x[:keys]
    return F.pad(x, (0, 0, 0, 0, 0, keys - x.shape[0]))


@functools.lru_cache(maxsize=6)  # a step has at most 5 groups per request (2,048-token budget)
def _group_mask(lo: int, hi: int, keys: int, g: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The mask of queries [lo, hi) over [0, keys) for g grouped heads, [1, 1, g*(hi-lo), keys]: the
    same for every layer of a step, so built once (read only)."""
    return _mask(list(range(lo, hi)), keys, dtype, device).repeat(g, 1)[None, None]


@functools.lru_cache(maxsize=2)
def _decode_mask(lengths: tuple[int, ...], keys: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The decodes' mask [n, 1, 1, keys]: the same for every layer of a step, so built once (read only)."""
    return _mask([ln - 1 for ln in lengths], keys, dtype, device)[:, None, None, :]


def _mask(positions: list[int], keys: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Additive mask [len(positions), keys]: 0 for keys at or before each query's position, -inf after."""
    pos = torch.tensor(positions, device=device)
    hide = torch.arange(keys, device=device)[None, :] > pos[:, None]
    return torch.zeros(hide.shape, dtype=dtype, device=device).masked_fill_(hide, float("-inf"))


def _flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The CPU flash kernel on q [b, h, rows, hd], k/v [b, h, keys, hd], mask [b, 1, rows, keys],
    with query rows padded (`_pad_rows`) and cut back. -> [b, h, rows, hd]."""
    assert _FLASH_CPU is not None  # exact_cpu checked it
    rows = q.shape[2]
    extra = _pad_rows(rows)
    if extra:  # repeat the last row: its result is computed and dropped
        q = torch.cat([q, q[:, :, -1:].expand(-1, -1, extra, -1)], 2)
        mask = torch.cat([mask, mask[:, :, -1:].expand(-1, -1, extra, -1)], 2)
    return _FLASH_CPU(q, k, v, 0.0, False, attn_mask=mask)[0][:, :, :rows]


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


def _history_then_own(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int) -> torch.Tensor:
    """Inexact mode: a chunk continuing a history, as two unmasked-or-square attentions merged by
    their log-sum-exp: every query sees the whole history [0, start) (no mask), and its own chunk
    causally. Faster than the exact path, but its rounding depends on where the chunk starts."""
    flash = _FLASH_CPU
    assert flash is not None  # causal_attention checked it
    n, heads, hd = q.shape
    kv_heads = k.shape[1]
    g = heads // kv_heads
    # History: no mask, so the query heads sharing a K/V head can be rows of one matrix (no copy of K/V).
    qg = q.view(n, kv_heads, g, hd).permute(1, 2, 0, 3).reshape(1, kv_heads, g * n, hd)  # [1, kv_heads, g*n, hd]
    hist_k, hist_v = k[:start].transpose(0, 1).unsqueeze(0), v[:start].transpose(0, 1).unsqueeze(0)
    o1, lse1 = flash(qg, hist_k, hist_v, 0.0, False)[:2]
    o1, lse1 = o1.reshape(1, heads, n, hd), lse1.reshape(1, heads, n)  # head order kv-major, as GQA repeats
    # Own chunk: square and causal (small: its K/V are expanded for the grouped heads).
    own_k, own_v = k[start:].transpose(0, 1).unsqueeze(0), v[start:].transpose(0, 1).unsqueeze(0)
    if g > 1:
        own_k, own_v = own_k.repeat_interleave(g, dim=1), own_v.repeat_interleave(g, dim=1)  # [1, heads, n, hd]
    o2, lse2 = flash(q.transpose(0, 1).unsqueeze(0), own_k, own_v, 0.0, True)[:2]
    m = torch.maximum(lse1, lse2)
    w1, w2 = torch.exp(lse1 - m).unsqueeze(-1), torch.exp(lse2 - m).unsqueeze(-1)  # [1, heads, n, 1] fp32
    out = (o1.float() * w1 + o2.float() * w2) / (w1 + w2)  # [1, heads, n, hd]
    return out[0].transpose(0, 1).to(q.dtype)
