"""The measurements that choose the GPU data paths of the restore copies and decode attention, on one GPU, in one run.

    python scripts/gpu_candidates.py OUT.json [--quick]

Copies: a restore of N tokens of llama3-8b-shaped bf16 KV (32 layers, 8 KV heads x 128)
from a pinned host arena of 64-token chunks into a paged device pool (16-token blocks, scattered),
by each candidate:
  peak            one contiguous pinned copy of the same bytes (the bound)
  chunk_layer     one DMA per (chunk, layer) into a staging buffer, then one placement per layer
                  (today's granularity: O(chunks x layers) host-issued copies)
  chunk           one DMA per whole chunk (all layers contiguous), then one placement per layer
                  and K/V: chunks + 2 x layers operations
  batched         the chunk copies in one cuMemcpyBatchAsync driver call (cuda-bindings)
  uva_gather      no DMA: each layer's placement reads the pinned arena directly (zero-copy through
                  unified addressing), 2 x layers kernels
Each row: device time (CUDA events, median), host time to enqueue, GB/s, host-issued operations.

Paged decode attention: one layer's decode step, B sequences x T tokens of context in a
paged pool, by
  gather_sdpa     gather each sequence's K/V out of the pool, SDPA (grouped heads)
  packed_varlen   gather into packed rows, varlen_attn (today's decode path)
  flex_pageP      FlexAttention over the pool in place, a block mask over the page table (page P)
each against gather_sdpa's output (max abs difference) and timed (median of CUDA-event times).

A prefill chunk continuing a history : gathered for varlen_attn (today),
gathered for SDPA with a bottom-right causal mask, or FlexAttention over the pool in place.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import traceback

import torch

DEV = torch.device("cuda")
BF16 = torch.bfloat16


def _timed(fn, repeats: int = 5) -> dict:
    """Median device time (events on the current stream) and host enqueue time of fn()."""
    fn()
    if DEV.type != "cuda":  # a smoke run of the code paths
        return {}
    torch.cuda.synchronize()
    dev, host = [], []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        a.record()
        fn()
        b.record()
        host.append(time.perf_counter() - t0)
        b.synchronize()
        dev.append(a.elapsed_time(b) / 1e3)
    return {"device_s": statistics.median(dev), "host_enqueue_s": statistics.median(host)}


# ----- copies ----------------------------------------------------------------------------------
def copies(tokens: int, layers: int = 32, kvh: int = 8, hd: int = 128, chunk: int = 64, block: int = 16) -> list[dict]:
    chunks, blocks = tokens // chunk, tokens // block
    per = chunk // block  # pool blocks per chunk
    # The arena: [chunks, layers, 2 (k, v), chunk tokens, kvh, hd], every chunk's layers contiguous.
    arena = torch.randn(chunks, layers, 2, chunk, kvh, hd, dtype=BF16).pin_memory()
    nbytes = arena.numel() * arena.element_size()
    # The pool: per layer K and V [pool blocks, block, kvh, hd]; the restore's blocks are scattered.
    pool_blocks = blocks * 2
    pool_k = [torch.empty(pool_blocks, block, kvh, hd, dtype=BF16, device=DEV) for _ in range(layers)]
    pool_v = [torch.empty(pool_blocks, block, kvh, hd, dtype=BF16, device=DEV) for _ in range(layers)]
    ids = torch.randperm(pool_blocks, device=DEV)[:blocks]  # [blocks]: logical block -> pool block
    stage = torch.empty(chunks, layers, 2, chunk, kvh, hd, dtype=BF16, device=DEV)
    flat = torch.empty(nbytes, dtype=torch.uint8, device=DEV)

    at = ids.view(chunks, per)  # [chunks, blocks per chunk]

    def place(src) -> None:
        """One placement per layer and K/V: src [chunks, layers, 2, chunk, kvh, hd] (device or UVA),
        read strided in place (a reshape would copy it first)."""
        for li in range(layers):
            pool_k[li].index_put_((at,), src[:, li, 0].unflatten(1, (per, block)))  # [chunks, per, block, kvh, hd]
            pool_v[li].index_put_((at,), src[:, li, 1].unflatten(1, (per, block)))

    def peak():
        flat.copy_(arena.view(-1).view(torch.uint8), non_blocking=True)

    def chunk_layer():
        torch._foreach_copy_([stage[c, li] for c in range(chunks) for li in range(layers)],
                             [arena[c, li] for c in range(chunks) for li in range(layers)], non_blocking=True)
        place(stage)

    def whole_chunk():
        torch._foreach_copy_(list(stage.unbind(0)), list(arena.unbind(0)), non_blocking=True)
        place(stage)

    def placed(fn) -> dict:
        """fn timed on an emptied pool, then one block of each of K and V checked against the arena
        (so a candidate cannot pass on what an earlier one wrote)."""
        for t in pool_k + pool_v:
            t.zero_()
        out = _timed(fn)
        b, li = 5, 3
        lo = (b % per) * block  # logical block b: chunk b // per, tokens lo:lo + block
        out["equal"] = all(bool(torch.equal(pool[li][ids[b]].cpu(), arena[b // per, li, kv, lo:lo + block]))
                           for kv, pool in ((0, pool_k), (1, pool_v)))
        return out

    rows = [dict(candidate="peak", ops=1, **_timed(peak)),
            dict(candidate="chunk_layer", ops=chunks * layers + 2 * layers, **placed(chunk_layer)),
            dict(candidate="chunk", ops=chunks + 2 * layers, **placed(whole_chunk))]
    try:
        batched = _batched_copy(stage, arena, chunks)
        rows.append(dict(candidate="batched", ops=1 + 2 * layers, **placed(lambda: (batched(), place(stage)))))
    except Exception as e:
        rows.append(dict(candidate="batched", error=f"{type(e).__name__}: {e}"[:300]))
    try:
        uva = _uva_view(arena)
        rows.append(dict(candidate="uva_gather", ops=2 * layers, **placed(lambda: place(uva))))
    except Exception as e:
        rows.append(dict(candidate="uva_gather", error=f"{type(e).__name__}: {e}"[:300]))
    for r in rows:
        r.update(tokens=tokens, bytes=nbytes)
        if "device_s" in r:
            r["GBps"] = nbytes / r["device_s"] / 1e9
    return rows


def _batched_copy(stage: torch.Tensor, arena: torch.Tensor, chunks: int):
    """The chunk copies as one cuMemcpyBatchAsync call (CUDA 12.8+ driver, cuda-bindings)."""
    from cuda.bindings import driver

    size = arena[0].numel() * arena.element_size()
    dsts = [driver.CUdeviceptr(stage[c].data_ptr()) for c in range(chunks)]
    srcs = [driver.CUdeviceptr(arena[c].data_ptr()) for c in range(chunks)]
    attr = driver.CUmemcpyAttributes()
    attr.srcAccessOrder = driver.CUmemcpySrcAccessOrder.CU_MEMCPY_SRC_ACCESS_ORDER_STREAM
    attr.flags = driver.CUmemcpyFlags.CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE
    side = torch.cuda.Stream()  # batched copies refuse the legacy default stream
    handle = driver.CUstream(side.cuda_stream)

    def run():
        side.wait_stream(torch.cuda.current_stream())
        out = driver.cuMemcpyBatchAsync(dsts, srcs, [size] * chunks, chunks, [attr], [0], 1, handle)
        err = out[0] if isinstance(out, tuple) else out  # CUDA 12.8 also returns a failing index
        if err != driver.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"cuMemcpyBatchAsync: {err}")
        torch.cuda.current_stream().wait_stream(side)

    return run


def _uva_view(host: torch.Tensor) -> torch.Tensor:
    """The pinned host tensor as a CUDA tensor over the same memory (unified addressing): kernels
    read it across the bus, no staging copy. Built through CuPy's unowned memory and DLPack."""
    import cupy

    nbytes = host.numel() * host.element_size()
    mem = cupy.cuda.UnownedMemory(host.data_ptr(), nbytes, host, torch.cuda.current_device())
    raw = cupy.ndarray((nbytes,), dtype=cupy.uint8, memptr=cupy.cuda.MemoryPointer(mem, 0))
    return torch.utils.dlpack.from_dlpack(raw).view(BF16).view(host.shape)


# ----- paged decode attention ------------------------------------------------------------------
def attention(batch: int, context: int, heads: int, kvh: int, hd: int, pages: tuple[int, ...]) -> list[dict]:
    import torch.nn.functional as F

    g = torch.Generator(device=DEV).manual_seed(0)
    rows: list[dict] = []
    q = torch.randn(batch, heads, 1, hd, dtype=BF16, device=DEV, generator=g)  # [B, H, 1, hd]
    for page in pages:
        n_pages = batch * context // page
        pool_k = torch.randn(n_pages * 2, page, kvh, hd, dtype=BF16, device=DEV, generator=g)  # [pages, P, kvh, hd]
        pool_v = torch.randn_like(pool_k)
        table = torch.randperm(n_pages * 2, device=DEV, generator=g)[:n_pages].view(batch, context // page)  # [B, T/P]
        lens = torch.full((batch,), context, device=DEV, dtype=torch.int32)
        lens[0] = context - page // 2 - 1  # a ragged last page

        def gathered():
            k = pool_k[table].reshape(batch, context, kvh, hd).transpose(1, 2)  # [B, kvh, T, hd]
            v = pool_v[table].reshape(batch, context, kvh, hd).transpose(1, 2)
            pos = torch.arange(context, device=DEV)
            mask = (pos[None, :] < lens[:, None])[:, None, None, :]  # [B, 1, 1, T]
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)

        ref = gathered()
        if page == pages[0]:
            rows.append(dict(candidate="gather_sdpa", **_timed(gathered)))
            try:
                from kvtier.models.varlen import attend  # grouped heads as this torch's varlen_attn allows

                cu_k = torch.cat([lens.new_zeros(1), lens.cumsum(0)]).int()
                cu_q = torch.arange(batch + 1, device=DEV, dtype=torch.int32)
                pos = torch.arange(context, device=DEV)
                slots = (table[:, pos // page] * page + pos % page)[pos[None, :] < lens[:, None]]  # [sum(lens)]

                def packed():
                    k = pool_k.view(-1, kvh, hd)[slots]  # [sum(lens), kvh, hd]
                    v = pool_v.view(-1, kvh, hd)[slots]
                    return attend(q.view(batch, heads, hd), k, v, cu_q, cu_k, 1, context)

                out = packed().view(batch, heads, 1, hd)
                rows.append(dict(candidate="packed_varlen", diff=(out - ref).abs().max().item(), **_timed(packed)))
            except Exception as e:
                rows.append(dict(candidate="packed_varlen", error=f"{type(e).__name__}: {e}"[:300]))
        try:
            flex = _flex_paged(q, pool_k, pool_v, table, lens, page)
            out = flex().transpose(1, 2)  # [B, H, 1, hd]
            rows.append(dict(candidate=f"flex_page{page}", diff=(out - ref).abs().max().item(), **_timed(flex)))
        except Exception as e:
            traceback.print_exc()
            rows.append(dict(candidate=f"flex_page{page}", error=f"{type(e).__name__}: {e}"[:300]))
    kv_bytes = 2 * batch * context * kvh * hd * 2
    for r in rows:
        r.update(batch=batch, context=context, heads=heads, kv_heads=kvh, head_dim=hd, kv_bytes=kv_bytes)
        if "device_s" in r:
            r["GBps"] = kv_bytes / r["device_s"] / 1e9
    return rows


def _flex_paged(q, pool_k, pool_v, table, lens, page: int):
    """Decode attention over the pool in place, as the engine's paged option runs it
    (kvtier.models.paged: a block mask over each sequence's pages, compiled on CUDA)."""
    from kvtier.models.paged import PageTable, paged_attention

    used = set(table.flatten().tolist())
    pad = next(b for b in range(pool_k.shape[0]) if b not in used)  # a page no sequence owns
    pages = PageTable(table.long(), (lens - 1).long(), lens.long(), pad)
    k, v = pool_k.view(-1, *pool_k.shape[2:]), pool_v.view(-1, *pool_v.shape[2:])  # [pages x P, kvh, hd]
    qs = q.transpose(1, 2)  # [B, 1, H, hd]
    return lambda: paged_attention(qs, k, v, pages, page, compiled=DEV.type == "cuda")  # [B, 1, H, hd]


# ----- a prefill chunk continuing a history -----------------------------------------------------
def continuation(history: int, chunk: int, heads: int, kvh: int, hd: int, page: int = 16) -> list[dict]:
    """One layer's attention of a `chunk`-token prefill chunk after `history` tokens whose K/V sit in
    scattered pool pages, by
      gather_varlen   gather the context out of the pool, varlen_attn (today's path for scattered blocks)
      gather_sdpa     gather it, SDPA with a bottom-right causal mask (grouped heads)
      flex_paged      FlexAttention over the pool in place (kvtier.models.paged, compiled)
    each against gather_sdpa's output in fp32."""
    import torch.nn.functional as F
    from torch.nn.attention.bias import causal_lower_right

    from kvtier.models import varlen
    from kvtier.models.paged import PageTable, paged_attention

    g = torch.Generator(device=DEV).manual_seed(1)
    ctx = history + chunk
    n_pages = -(-ctx // page)
    pool_blocks = 2 * n_pages + 1
    k_pool = torch.randn(pool_blocks * page, kvh, hd, dtype=BF16, device=DEV, generator=g)
    v_pool = torch.randn_like(k_pool)
    table = torch.randperm(pool_blocks - 1, device=DEV, generator=g)[:n_pages]  # [pages]
    slots = (table[:, None] * page + torch.arange(page, device=DEV)).flatten()[:ctx]
    q = torch.randn(chunk, heads, hd, dtype=BF16, device=DEV, generator=g)

    def gather_sdpa():
        k, v = k_pool[slots].transpose(0, 1)[None], v_pool[slots].transpose(0, 1)[None]  # [1, kvh, ctx, hd]
        out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k, v, attn_mask=causal_lower_right(chunk, ctx),
                                             enable_gqa=True)
        return out[0].transpose(0, 1)  # [chunk, heads, hd]

    def gather_varlen():
        return varlen.attend(q, k_pool[slots], v_pool[slots], *varlen.spans(chunk, ctx, DEV), chunk, ctx)

    pt = PageTable(table[None], torch.tensor([history], device=DEV), torch.tensor([ctx], device=DEV), pool_blocks - 1)

    def flex_paged():
        return paged_attention(q[None], k_pool, v_pool, pt, page, compiled=True)[0]

    ref = gather_sdpa().float()
    rows = []
    for name, fn in (("gather_sdpa", gather_sdpa), ("gather_varlen", gather_varlen), ("flex_paged", flex_paged)):
        try:
            diff = (fn().float() - ref).abs().max().item()
            rows.append(dict(candidate=f"continuation_{name}", diff=diff, **_timed(fn)))
        except Exception as e:
            traceback.print_exc()
            rows.append(dict(candidate=f"continuation_{name}", error=f"{type(e).__name__}: {e}"[:300]))
    for r in rows:
        r.update(history=history, chunk=chunk, heads=heads, kv_heads=kvh, head_dim=hd, page=page)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out")
    ap.add_argument("--quick", action="store_true", help="small sizes (a smoke run)")
    ap.add_argument("--device", default="cuda", help="cpu: the attention candidates' code paths only, untimed")
    args = ap.parse_args()
    global DEV
    DEV = torch.device(args.device)
    name = torch.cuda.get_device_name() if DEV.type == "cuda" else "cpu"
    res: dict = {"device": name, "torch": torch.__version__, "copies": [], "attention": []}

    def save():
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)

    for tokens in ((1024,) if args.quick else (8192, 16384)) if DEV.type == "cuda" else ():
        res["copies"] += copies(tokens)
        save()
        torch.cuda.empty_cache()
    # (batch, context, heads, kv heads, head dim, page sizes): smollm2's and llama3-8b's shapes
    shapes = [(2, 1024, 9, 3, 64, (128, 16))] if args.quick else [
        (1, 8192, 9, 3, 64, (128,)), (32, 8192, 9, 3, 64, (128, 16)), (32, 8192, 32, 8, 128, (128,))]
    for b, t, h, kvh, hd, pages in shapes:
        res["attention"] += attention(b, t, h, kvh, hd, pages)
        save()
    res["continuation"] = []
    for hist, chunk, h, kvh, hd in ([(1024, 256, 9, 3, 64)] if args.quick else
                                   [(8192, 2048, 9, 3, 64), (8192, 2048, 32, 8, 128), (16384, 512, 32, 8, 128)]):
        res["continuation"] += continuation(hist, chunk, h, kvh, hd)
        save()
    for r in res["copies"] + res["attention"] + res["continuation"]:
        print({k: (round(v, 6) if isinstance(v, float) else v) for k, v in r.items()})


if __name__ == "__main__":
    main()
