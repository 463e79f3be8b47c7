"""Variable-length flash attention on CUDA (`torch.nn.attention.varlen.varlen_attn`), where this
torch has it and it computes what SDPA computes on this device.

Chunked prefill over a history and batched decode need masks under SDPA (a bottom-right causal
mask, a padding mask), and a mask rules the flash kernel out. varlen_attn takes packed sequences
with cumulative lengths instead: no padding, no mask, and grouped K/V heads natively. Its
`block_table` (a paged pool, no gather at all) exists only in newer torch releases than the GPU
machines' 2.11; `paged` says whether this one has it. Every (device, dtype, heads) combination is
checked once against SDPA on random data before it is used; a kernel that refuses the shapes or
disagrees leaves the SDPA path in place.
"""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)
_checked: dict[tuple, bool] = {}


@functools.lru_cache(maxsize=1)
def _kernel() -> tuple[Callable[..., Any] | None, frozenset[str]]:
    """torch's varlen_attn and its parameters (typed loosely: the signature differs between torch
    releases), or None. Imported on first use on CUDA: the module pulls in torch._dynamo and
    inductor, seconds of every CPU process's start on a small machine."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:  # torch without it
        return None, frozenset()
    return varlen_attn, frozenset(inspect.signature(varlen_attn).parameters)


def paged() -> bool:
    """Whether this torch's varlen_attn reads a paged pool itself (a block table)."""
    return {"block_table", "seqused_k"} <= _kernel()[1]


def usable(device: torch.device, dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int) -> bool:
    """varlen_attn runs and agrees with SDPA for these shapes here (checked once, cached)."""
    if device.type != "cuda" or dtype not in (torch.bfloat16, torch.float16) or _kernel()[0] is None:
        return False
    key = (device, dtype, heads, kv_heads, head_dim)
    if key not in _checked:
        _checked[key] = _check(device, dtype, heads, kv_heads, head_dim)
    return _checked[key]


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor,
           max_q: int, max_k: int) -> torch.Tensor:
    """Causal attention of packed runs: run i's queries are rows cu_q[i]:cu_q[i+1] of q [Tq, heads, hd]
    and sit at the end of its keys, rows cu_k[i]:cu_k[i+1] of k/v [Tk, kv_heads, hd] (the causal
    mask aligned bottom-right, as flash attention aligns it). cu_*: int32 on q's device."""
    varlen_attn, params = _kernel()
    assert varlen_attn is not None  # callers check usable() first
    kw = {"enable_gqa": True} if "enable_gqa" in params and k.shape[1] != q.shape[1] else {}
    if k.shape[1] != q.shape[1] and not kw:  # an older signature: grouped heads must be repeated
        g = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    return varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, window_size=(-1, 0), **kw)


def spans(lengths_q: int, lengths_k: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cu_q, cu_k of one run, built on the device (no host-to-device copy in the step)."""
    return (torch.arange(0, 2 * lengths_q, lengths_q, device=device, dtype=torch.int32),
            torch.arange(0, 2 * lengths_k, lengths_k, device=device, dtype=torch.int32))


def _check(device: torch.device, dtype: torch.dtype, heads: int, kv_heads: int, hd: int) -> bool:
    from torch.nn.attention.bias import causal_lower_right

    g = torch.Generator(device=device).manual_seed(0)
    runs = [(5, 37), (1, 20), (16, 16)]  # (queries, keys): a chunk on a history, a decode, a fresh run
    q = torch.randn(sum(a for a, _ in runs), heads, hd, device=device, dtype=dtype, generator=g)
    k = torch.randn(sum(b for _, b in runs), kv_heads, hd, device=device, dtype=dtype, generator=g)
    v = torch.randn_like(k)
    cu_q = torch.tensor([0, 5, 6, 22], device=device, dtype=torch.int32)
    cu_k = torch.tensor([0, 37, 57, 73], device=device, dtype=torch.int32)
    try:
        got = attend(q, k, v, cu_q, cu_k, 16, 37)
    except Exception as e:  # shapes or head counts this kernel refuses
        log.info("varlen_attn unusable for %s heads=%d/%d hd=%d: %s", dtype, heads, kv_heads, hd, e)
        return False
    qo = ko = 0
    for n, m in runs:
        qh = q[qo:qo + n].transpose(0, 1)[None]
        kh = k[ko:ko + m].repeat_interleave(heads // kv_heads, 1).transpose(0, 1)[None]
        vh = v[ko:ko + m].repeat_interleave(heads // kv_heads, 1).transpose(0, 1)[None]
        want = F.scaled_dot_product_attention(qh.float(), kh.float(), vh.float(), attn_mask=causal_lower_right(n, m))
        if (got[qo:qo + n].float() - want[0].transpose(0, 1)).abs().max().item() > 2e-2:
            log.warning("varlen_attn disagrees with SDPA on %s; using SDPA", device)
            return False
        qo, ko = qo + n, ko + m
    return True
