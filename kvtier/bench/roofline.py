"""The roofline of a forward pass on this machine: the bytes a pass must move over the memory
bandwidth, or its arithmetic over the matmul rate, whichever takes longer. Both rates are measured
in the same run as the rows they judge (a device-to-device copy, a large matmul in the compute
dtype), so a row's fraction of the roofline says how far it is from what this machine can do.

A decode step reads every weight once and each sequence's whole KV history; a prefill of n tokens
reads the weights once, writes n tokens' KV and does 2 x weights FLOPs per token plus causal
attention's n^2 / 2 dot products of q.k and p.v per head and layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvtier.engine.calibrate.hardware import _time as median_time
from kvtier.models.llama import CausalLM


@dataclass(frozen=True)
class Rates:
    bandwidth: float  # bytes/s: a device-to-device copy (bytes read + written over its time)
    flops: float  # FLOP/s: a square matmul in the compute dtype


@dataclass(frozen=True)
class Shape:
    weight_bytes: int  # every weight a forward reads (the embedding table only if it is the LM head)
    flops_per_token: int  # 2 x the matmul weights
    kv_bytes_per_token: int  # K and V of every layer
    attn_flops_per_key: int  # per query and key: q.k and p.v over every head and layer


def measure(device: torch.device, dtype: torch.dtype, repeats: int = 5) -> Rates:
    gpu = device.type != "cpu"
    n = (1 << 30) if gpu else (256 << 20)
    src = torch.ones(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    bandwidth = 2 * n / median_time(lambda: dst.copy_(src), repeats)
    m = 8192 if gpu else 2048
    a = torch.randn(m, m, device=device).to(dtype)
    b = torch.randn(m, m, device=device).to(dtype)
    flops = 2 * m ** 3 / median_time(lambda: a @ b, repeats)
    return Rates(bandwidth, flops)


def shape_of(model: CausalLM) -> Shape:
    cfg, item = model.cfg, model.dtype.itemsize
    matmul = sum(p.numel() for name, p in model.named_parameters() if p.dim() == 2 and "embed_tokens" not in name)
    if cfg.tie_word_embeddings:  # the head is the embedding table, which named_parameters lists once
        matmul += model.lm_head.weight.numel()
    return Shape(weight_bytes=matmul * item, flops_per_token=2 * matmul,
                 kv_bytes_per_token=2 * cfg.num_layers * cfg.kv_dim * item,
                 attn_flops_per_key=4 * cfg.num_layers * cfg.num_heads * cfg.head_dim)


def prefill_tok_s(shape: Shape, rates: Rates, n: int, history: int = 0) -> float:
    """The fastest n new tokens after a `history` already in the cache can be computed here, in
    tokens/s (a fresh prompt: history 0)."""
    flops = n * shape.flops_per_token + shape.attn_flops_per_key * (n * history + n * (n + 1) // 2)
    moved = shape.weight_bytes + (history + n) * shape.kv_bytes_per_token  # the history read, the new KV written
    return n / max(moved / rates.bandwidth, flops / rates.flops)


def decode_tok_s(shape: Shape, rates: Rates, batch: int, context: int) -> float:
    """The fastest `batch` sequences with `context`-token histories can decode here, in tokens/s."""
    moved = shape.weight_bytes + batch * context * shape.kv_bytes_per_token
    flops = batch * (shape.flops_per_token + shape.attn_flops_per_key * context)
    return batch / max(moved / rates.bandwidth, flops / rates.flops)
