"""Causal attention of a run of query tokens over a contiguous key/value history.

Exact (the default on the CPU, `exact_attention`): a token's attention output is the same bits
however its prompt was cut into prefill chunks, whatever came from a cache, and whichever other
requests share the step.

A model whose kernels are not exact (`Kernels.exact`, `--fast-inexact`) takes the earlier,
faster-by-a-little paths whose rounding depends on the chunking. CUDA uses flash varlen attention where it is usable (not yet shown
invariant on a GPU).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from kvtier.dtypes import cpu_has_amx
from kvtier.models import exact_attention, exact_matmul, varlen
from kvtier.models.exact_attention import FLASH_CPU as _FLASH_CPU
from kvtier.models.exact_attention import key_rows as key_rows  # re-exported: the engine sizes buffers by it
from kvtier.models.kernels import Kernels

# Backends for small attention calls outside a CUDA graph. Not cuDNN's: it builds or looks up a graph
# on the host for every call (far longer than the kernel itself), which a captured graph pays once
# but an eager step pays per layer.
_EAGER_BACKENDS = [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.MATH]


def _eager_backends(t: torch.Tensor) -> contextlib.AbstractContextManager:
    """SDPA restricted to _EAGER_BACKENDS on CUDA; elsewhere (no cuDNN) as it is: entering the
    restriction has a host cost, a decode step's layers' worth of which is not worth paying for nothing."""
    return sdpa_kernel(_EAGER_BACKENDS) if t.is_cuda else contextlib.nullcontext()


def exact_cpu(device: torch.device, kernels: Kernels) -> bool:
    """Whether a model with these kernels attends with the exact CPU kernel on `device`."""
    return device.type == "cpu" and _FLASH_CPU is not None and kernels.exact


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_start: int, kernels: Kernels) -> torch.Tensor:
    """Queries at positions [q_start, q_start + n) attend to keys at positions [0, ctx), with the
    attention kernels of the model's `kernels`.

    q: [n, heads, hd] (RoPE applied), k/v: [ctx, kv_heads, hd] with ctx = q_start + n; k/v may be
    strided views (a request's slots in the pool), read in place. Returns [n, heads, hd].
    """
    n, ctx = q.shape[0], k.shape[0]
    if exact_cpu(q.device, kernels):
        return exact_attention.causal(q, k, v, q_start, kernels.bf16_attention)
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
            # torch.nn.attention.bias is imported here: it pulls in torch._dynamo (seconds of a CPU
            # process's start), and the exact CPU path never comes here
            from torch.nn.attention.bias import causal_lower_right

            mask = None if n == 1 else causal_lower_right(n, ctx)  # the causal mask aligned bottom-right
            out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, enable_gqa=gqa)
    return out[0].transpose(0, 1)  # [n, heads, hd]


def piece_rows(dtype: torch.dtype, device: torch.device) -> int:
    """How many scattered rows a piece holds. In bf16 on a CPU with AMX the fused kernel pays a
    cost per query block and key block (its tiles packed for each) that outweighs the masked keys
    of wider pieces, so a piece there holds up to 256 rows (a blend's few rows a document and its
    question in one call); elsewhere, fp32 on the same CPU included, a piece of 64 costs less."""
    return 256 if device.type == "cpu" and dtype == torch.bfloat16 and cpu_has_amx() else 64


# Above this many bytes of masks a pass builds each piece's mask per layer instead of keeping them
# all (a pass holds at most a restore chunk's rows, but over a long context each piece is wide).
MASK_CACHE_BYTES = 64 << 20


def scattered_gemm(device: torch.device, dtype: torch.dtype, heads: int, kv_heads: int, hd: int,
                   kernels: Kernels | None) -> bool:
    """Whether scattered rows attend through GEMMs: on a CPU where the model's exact bf16
    attention runs on them (`exact_matmul.active`: native bf16, `--bf16-attention` auto or gemm),
    whose thin products there turn keys over faster than the fused flash kernel
    (scripts/blend_attention_kernels.py). A recomputed row then rounds as a full prefill's rows
    do there: scores and probabilities in bf16."""
    return (kernels is not None and device.type == "cpu"
            and exact_matmul.active(dtype, heads, kv_heads, hd, kernels.bf16_attention))


@dataclass(frozen=True)
class ScatteredRows:
    """Queries at ascending prompt positions, each to attend to the keys at or before its own: cut
    into pieces of consecutive rows, each piece over the keys up to its last row's position (no
    work past it), with its additive mask (0 at or before a row's position, -inf after: the values
    SDPA makes of a boolean mask, so the same bits), built once for every layer of a pass where
    they fit in MASK_CACHE_BYTES. `kernels`: the model's, which pick the kernel
    (`scattered_gemm`); None, SDPA's fused kernel."""

    at: torch.Tensor  # [m] the rows' positions
    pieces: tuple[tuple[int, int, int], ...]  # (first row, end row, keys the piece sees)
    dtype: torch.dtype
    masks: tuple[torch.Tensor, ...] | None  # per piece [rows, keys] in the queries' dtype (None: built per call)
    kernels: Kernels | None = None

    @staticmethod
    def of(positions: Sequence[int], dtype: torch.dtype, device: torch.device, rows: int | None = None,
           kernels: Kernels | None = None) -> ScatteredRows:
        """`rows`: a piece's most rows (None: `piece_rows`)."""
        rows = piece_rows(dtype, device) if rows is None else rows
        at = torch.as_tensor(list(positions), device=device)
        pieces = tuple((a, min(a + rows, len(positions)), int(positions[min(a + rows, len(positions)) - 1]) + 1)
                       for a in range(0, len(positions), rows))
        out = ScatteredRows(at, pieces, dtype, None, kernels)
        if sum((e - a) * n for a, e, n in pieces) * dtype.itemsize > MASK_CACHE_BYTES:
            return out
        return ScatteredRows(at, pieces, dtype, tuple(out.mask(i) for i in range(len(pieces))), kernels)

    def mask(self, i: int) -> torch.Tensor:
        """Piece i's additive mask [rows, keys]."""
        if self.masks is not None:
            return self.masks[i]
        a, e, n = self.pieces[i]
        seen = torch.arange(n, device=self.at.device)[None, :] <= self.at[a:e, None]  # [r, n]
        # On CUDA rows at a stride of whole 16 elements: the memory-efficient kernel's alignment,
        # which SDPA would otherwise meet with a padded copy per call.
        width = -(-n // 16) * 16 if self.at.is_cuda else n
        mask = torch.zeros(e - a, width, dtype=self.dtype, device=self.at.device)[:, :n]
        return mask.masked_fill_(~seen, float("-inf"))

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [m, heads, hd] at the positions, k/v [ctx, kv_heads, hd] at positions [0, ctx) ->
        [m, heads, hd]; the bits depend on these rows and keys alone, never on a batch."""
        if scattered_gemm(q.device, q.dtype, q.shape[1], k.shape[1], q.shape[2], self.kernels):
            return self._gemms(q, k, v)
        if q.is_cuda:
            return self._grouped(q, k, v)
        kh, vh = (x.transpose(0, 1).unsqueeze(0) for x in (k, v))  # [1, kv_heads, ctx, hd]
        gqa = q.shape[1] != k.shape[1]
        out = []
        with _eager_backends(q):
            for i, (a, e, n) in enumerate(self.pieces):
                qh = q[a:e].transpose(0, 1).unsqueeze(0)  # [1, heads, r, hd]
                out.append(F.scaled_dot_product_attention(qh, kh[:, :, :n], vh[:, :, :n], attn_mask=self.mask(i),
                                                          enable_gqa=gqa)[0].transpose(0, 1))
        return torch.cat(out) if len(out) > 1 else out[0]

    def _grouped(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """SDPA per piece with each K/V head's query heads as the heads of one batch entry, over
        that head's K and V expanded (a view, nothing copied), so the memory-efficient kernel
        takes the additive mask: called with `enable_gqa`, SDPA runs its math kernel on CUDA,
        a dozen kernels and an fp32 copy of every input per call."""
        m, heads, hd = q.shape
        kvh = k.shape[1]
        g = heads // kvh
        kh, vh = (x.transpose(0, 1).unsqueeze(1) for x in (k, v))  # [kvh, 1, ctx, hd]
        out = q.new_empty(m, heads, hd)
        with _eager_backends(q):
            for i, (a, e, n) in enumerate(self.pieces):
                qh = q[a:e].unflatten(1, (kvh, g)).permute(1, 2, 0, 3)  # [kvh, g, r, hd]
                o = F.scaled_dot_product_attention(qh, kh[:, :, :n].expand(kvh, g, n, hd),
                                                   vh[:, :, :n].expand(kvh, g, n, hd), attn_mask=self.mask(i))
                out[a:e].view(e - a, kvh, g, hd).copy_(o.permute(2, 0, 1, 3))  # [r, kvh, g, hd]
        return out

    def _gemms(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """HF eager attention's arithmetic per piece: the query heads sharing a K/V head as the rows
        of one product, scores rounded to the queries' dtype (q scaled first: the same bits where
        the scale is a power of two, as for head_dim 64), one softmax per row (torch's in that
        dtype, which may round a probability one ulp otherwise than HF's cast of an fp32 softmax),
        then the values. K and V are copied heads-major once for every piece (oneDNN reads K best
        as the transpose of a contiguous matrix)."""
        m, heads, hd = q.shape
        kvh = k.shape[1]
        g = heads // kvh
        reach = self.pieces[-1][2]
        kt, vt = (x[:reach].transpose(0, 1).contiguous() for x in (k, v))  # [kvh, keys, hd]
        qs = q * hd**-0.5
        out = q.new_empty(m, heads, hd)
        for i, (a, e, n) in enumerate(self.pieces):
            r = e - a
            qg = qs[a:e].view(r, kvh, g, hd).permute(1, 2, 0, 3).reshape(kvh, g * r, hd)
            s = qg.new_empty(kvh, g * r, n)
            for h in range(kvh):  # a product per K/V head: as one batch, a slice of K is first copied whole
                torch.mm(qg[h], kt[h, :n].t(), out=s[h])  # [g*r, n]
            s.view(kvh, g, r, n).add_(self.mask(i))
            o = torch.matmul(torch.softmax(s, -1), vt[:, :n])  # [kvh, g*r, hd]
            out[a:e] = o.view(kvh, g, r, hd).permute(2, 0, 1, 3).reshape(r, heads, hd)
        return out


def attention_at(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: Sequence[int],
                 rows: int | None = None, kernels: Kernels | None = None) -> torch.Tensor:
    """Queries at ascending positions attend to the keys at or before their own: q [m, heads, hd]
    at `positions` (m ints), k/v [ctx, kv_heads, hd] at positions [0, ctx). Queries go `rows` at a
    time (None: `piece_rows`; `ScatteredRows`, which a pass through many layers builds once). -> [m, heads, hd]."""
    return ScatteredRows.of(positions, q.dtype, q.device, rows, kernels).attend(q, k, v)


def column_importance(q: torch.Tensor, k_prefix: torch.Tensor, k_own: torch.Tensor | None = None) -> torch.Tensor:
    """Importance of each prefix token to each query head.

    q: [n, heads, hd] the new rows' queries (RoPE applied); k_prefix: [m, kv, hd] the prefix keys of
    the KV heads these query heads read (RoPE applied at their original positions), with heads a
    multiple of kv (query head h reads KV head h // (heads // kv)); k_own: [n, kv, hd] the new rows'
    own keys (causal), which share the softmax's normaliser. -> [heads, m] fp32: the attention
    weights' column sums over the n rows.
    """
    n, heads, hd = q.shape
    m, kv = k_prefix.shape[0], k_prefix.shape[1]
    g = heads // kv
    qf = q.float().permute(1, 0, 2)  # [heads, n, hd]
    keys = k_prefix.to(q.device) if k_own is None else torch.cat([k_prefix.to(q.device), k_own])  # [m (+ n), kv, hd]
    kf = keys.float().permute(1, 2, 0).repeat_interleave(g, dim=0)  # [heads, hd, m (+ n)]
    scores = torch.bmm(qf, kf) / math.sqrt(hd)  # [heads, n, m (+ n)]
    if k_own is not None:
        own = torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1)  # row i sees own keys 0..i
        scores[:, :, m:].masked_fill_(own, float("-inf"))
    return scores.softmax(dim=-1)[:, :, :m].sum(dim=1).cpu()  # [heads, m] (selection runs on the host)


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


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: list[int],
                     kernels: Kernels) -> torch.Tensor:
    """Exact attention of a batch of decoding tokens over contexts gathered to one width
    (`exact_attention.decode_padded`): token r sits at position lengths[r] - 1 and attends to row r
    of k/v [n, key_rows(max(lengths)), kv_heads, hd], zero past its context. q: [n, heads, hd] ->
    [n, heads, hd]. The engine's CPU decodes read the pool in place instead (`exact_attention.decode`)."""
    return exact_attention.decode_padded(q, k, v, lengths, kernels.bf16_attention)


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
