"""The model runner: the paged KV tensors and one forward pass over a batch of token runs.

A step's tokens from all requests are concatenated ("varlen"), so the projections and MLP run as
one matmul per layer; attention runs per request over that request's blocks in the pool.
K enters the pool with RoPE applied at its position (DESIGN invariant 1); the pre-RoPE K and V,
and each layer's input, can be handed to an optional capture callback on the way.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvtier.models.attention import causal_attention
from kvtier.models.llama import CausalLM
from kvtier.models.rope import Rope, rotate

# capture(layer, request_index, h [n, hidden], k [n, kv_heads, hd], v [n, kv_heads, hd]); all pre-RoPE.
CaptureFn = Callable[[int, int, torch.Tensor, torch.Tensor, torch.Tensor], None]


@dataclass(frozen=True)
class StepBatch:
    """Index tensors for one step, built once and shared by every layer."""

    items: tuple["RunItem", ...]
    ids: torch.Tensor  # [tokens]
    offsets: tuple[int, ...]  # run i is rows offsets[i]:offsets[i+1]
    new_slots: torch.Tensor  # [tokens] pool slot of each token computed now
    ctx_slots: tuple[torch.Tensor | None, ...]  # per run: slots of [0, end), None for fresh runs
    cos: torch.Tensor  # [tokens, 1, head_dim]
    sin: torch.Tensor
    # Single-token runs with history (decodes) attend in one padded batch instead of one by one.
    decode_rows: tuple[int, ...] = ()  # run indices
    decode_slots: torch.Tensor | None = None  # [decodes, max_ctx] pool slots (padding: slot 0)
    decode_mask: torch.Tensor | None = None  # [decodes, 1, 1, max_ctx] True where a key is real


@dataclass(frozen=True)
class RunItem:
    """One request's run of tokens in a step: positions [start, start + len(token_ids))."""

    token_ids: Sequence[int]
    start: int
    block_ids: Sequence[int]
    want_logits: bool


class ModelRunner:
    def __init__(self, model: CausalLM, num_blocks: int, block_size: int, max_positions: int):
        cfg = model.cfg
        self.model = model
        self.block_size = block_size
        self.rope = Rope(cfg, max_positions, model.dtype)
        device = model.lm_head.weight.device
        shape = (cfg.num_layers, num_blocks * block_size, cfg.num_kv_heads, cfg.head_dim)
        # torch.empty, not zeros: zeros writes every page, while a slot is always written before it
        # is read, so an unused part of the budget never becomes resident memory.
        self.k_cache = torch.empty(shape, dtype=model.dtype, device=device)  # [layers, slots, kv_heads, hd]
        self.v_cache = torch.empty(shape, dtype=model.dtype, device=device)

    @staticmethod
    def bytes_per_block(model: CausalLM, block_size: int) -> int:
        cfg = model.cfg
        return 2 * cfg.num_layers * block_size * cfg.kv_dim * model.dtype.itemsize

    def slots(self, block_ids: Sequence[int], start: int, end: int) -> torch.Tensor:
        """Pool slot of every position in [start, end) for a request owning `block_ids`."""
        pos = torch.arange(start, end)
        table = torch.tensor(block_ids, dtype=torch.long)
        return table[pos // self.block_size] * self.block_size + pos % self.block_size

    def prepare(self, items: Sequence[RunItem]) -> "StepBatch":
        lens = [len(it.token_ids) for it in items]
        offsets = [0]
        for n in lens:
            offsets.append(offsets[-1] + n)
        positions = torch.cat([torch.arange(it.start, it.start + n) for it, n in zip(items, lens)])
        cos, sin = self.rope.cos_sin(positions)
        rows = tuple(i for i, (it, n) in enumerate(zip(items, lens)) if n == 1 and it.start > 0)
        dec_slots = dec_mask = None
        if len(rows) > 1:
            ctx = [items[i].start + 1 for i in rows]
            width = max(ctx)
            dec_slots = torch.zeros(len(rows), width, dtype=torch.long)
            for r, i in enumerate(rows):
                dec_slots[r, : ctx[r]] = self.slots(items[i].block_ids, 0, ctx[r])
            dec_mask = (torch.arange(width).unsqueeze(0) < torch.tensor(ctx).unsqueeze(1))[:, None, None, :]
        else:
            rows = ()
        return StepBatch(
            items=tuple(items),
            ids=torch.tensor([t for it in items for t in it.token_ids], dtype=torch.long),
            offsets=tuple(offsets),
            new_slots=torch.cat([self.slots(it.block_ids, it.start, it.start + n) for it, n in zip(items, lens)]),
            # Requests with history read their whole context [0, end) back from the pool.
            ctx_slots=tuple(self.slots(it.block_ids, 0, it.start + n) if it.start > 0 else None
                            for it, n in zip(items, lens)),
            cos=cos,
            sin=sin,
            decode_rows=rows,
            decode_slots=dec_slots,
            decode_mask=dec_mask,
        )

    def run_layer(self, li: int, h: torch.Tensor, b: "StepBatch", capture: CaptureFn | None = None) -> torch.Tensor:
        """Layer `li` for every run in the batch: writes its K/V into the pool, returns the next h."""
        layer = self.model.layers[li]
        q, k, v = layer.qkv(h)  # pre-RoPE
        if capture is not None:
            for i in range(len(b.items)):
                lo, hi = b.offsets[i], b.offsets[i + 1]
                capture(li, i, h[lo:hi], k[lo:hi], v[lo:hi])
        q, k = rotate(q, b.cos, b.sin), rotate(k, b.cos, b.sin)
        kc, vc = self.k_cache[li], self.v_cache[li]
        kc.index_copy_(0, b.new_slots, k)
        vc.index_copy_(0, b.new_slots, v)
        outs: list[torch.Tensor | None] = [None] * len(b.items)
        if b.decode_rows:
            batched = self._decode_attention(q, kc, vc, b)  # [decodes, heads, hd]
            for r, i in enumerate(b.decode_rows):
                outs[i] = batched[r : r + 1]
        for i, it in enumerate(b.items):
            if outs[i] is not None:
                continue
            lo, hi = b.offsets[i], b.offsets[i + 1]
            if b.ctx_slots[i] is None:  # fresh sequence: its K/V are exactly this run's
                outs[i] = causal_attention(q[lo:hi], k[lo:hi], v[lo:hi], 0)
            else:
                ks, vs = kc.index_select(0, b.ctx_slots[i]), vc.index_select(0, b.ctx_slots[i])
                outs[i] = causal_attention(q[lo:hi], ks, vs, it.start)
        return layer.finish(h, torch.cat(outs) if len(outs) > 1 else outs[0])

    def _decode_attention(self, q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, b: "StepBatch") -> torch.Tensor:
        """One SDPA call for every decoding run: contexts padded to the longest and masked."""
        assert b.decode_slots is not None and b.decode_mask is not None
        n, width = b.decode_slots.shape
        heads, kv_heads = q.shape[1], kc.shape[1]
        qd = q[torch.tensor([b.offsets[i] for i in b.decode_rows])].unsqueeze(2)  # [n, heads, 1, hd]
        flat = b.decode_slots.reshape(-1)
        ks = kc.index_select(0, flat).view(n, width, kv_heads, -1).transpose(1, 2)  # [n, kv_heads, width, hd]
        vs = vc.index_select(0, flat).view(n, width, kv_heads, -1).transpose(1, 2)
        if heads != kv_heads:
            ks = ks.repeat_interleave(heads // kv_heads, dim=1)  # [n, heads, width, hd]
            vs = vs.repeat_interleave(heads // kv_heads, dim=1)
        out = F.scaled_dot_product_attention(qd, ks, vs, attn_mask=b.decode_mask)  # [n, heads, 1, hd]
        return out.squeeze(2)

    @torch.inference_mode()
    def execute(
        self,
        items: Sequence[RunItem],
        capture: CaptureFn | None = None,
        layers: range | None = None,
        before_layer: Callable[[int], None] | None = None,
    ) -> torch.Tensor:
        """Run one step. Returns fp32 logits [num items with want_logits, vocab] (last token of each).

        `layers` limits the pass to a prefix of the layers (restoring by recomputing the first
        layers only; no logits then). `before_layer(l)` runs before layer l, which is how a restore
        puts a layer's history into the pool just in time for the new tokens (layer-wise overlap).
        """
        model = self.model
        layers = layers if layers is not None else range(model.cfg.num_layers)
        b = self.prepare(items)
        h = model.embed(b.ids)  # [tokens, hidden]
        for li in layers:
            if before_layer is not None:
                before_layer(li)
            h = self.run_layer(li, h, b, capture)
        last = [b.offsets[i + 1] - 1 for i, it in enumerate(items) if it.want_logits]
        if not last or layers.stop != model.cfg.num_layers:
            return torch.empty(0, model.cfg.vocab_size)
        return model.logits(h[torch.tensor(last)])  # [requests sampling, vocab]

    @torch.inference_mode()
    def place_kv(self, layer: int, slots: torch.Tensor, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Put externally produced pre-RoPE K [n, kv_heads, hd] and V into the pool at `slots`,
        rotating K for the positions [start, start + n) it takes here (which may differ from where
        it was computed)."""
        cos, sin = self.rope.span(start, start + k.shape[0])
        self.k_cache[layer].index_copy_(0, slots, rotate(k.to(self.k_cache.dtype), cos, sin))
        self.v_cache[layer].index_copy_(0, slots, v.to(self.v_cache.dtype))
