"""The roofline `bench forward` sets its rows beside (bench/roofline.py): a model's bytes and FLOPs
counted from its config, and the bound of a prefill and a decode on given rates."""

from __future__ import annotations

import torch

from kvtier.bench import roofline
from kvtier.models.loading import load_model


def test_shape_counts_the_weights_a_forward_reads():
    m = load_model("tiny-gqa", dtype="bf16", tokenizer=False)
    c = m.config
    per_layer = (c.hidden_size * c.num_heads * c.head_dim * 2 + c.hidden_size * c.kv_dim * 2
                 + 3 * c.hidden_size * c.intermediate_size)  # q, o; k, v; gate, up, down
    matmul = c.num_layers * per_layer + c.vocab_size * c.hidden_size  # and the LM head, tied or not
    s = roofline.shape_of(m.module)
    assert s.weight_bytes == 2 * matmul and s.flops_per_token == 2 * matmul
    assert s.kv_bytes_per_token == 2 * c.num_layers * c.kv_dim * 2
    assert s.attn_flops_per_key == 4 * c.num_layers * c.num_heads * c.head_dim


def test_bounds_take_the_slower_of_bytes_and_flops():
    s = roofline.Shape(weight_bytes=1000, flops_per_token=100, kv_bytes_per_token=10, attn_flops_per_key=1)
    r = roofline.Rates(bandwidth=1000.0, flops=1e4)
    # Decode, 4 x 100 tokens: 1000 + 4000 bytes (5 s) against 4 x (100 + 100) FLOPs (0.08 s).
    assert roofline.decode_tok_s(s, r, 4, 100) == 4 / 5.0
    # Prefill of 100 tokens: 1000 + 1000 bytes (2 s) against 100 x 100 + 5050 FLOPs (1.505 s).
    assert roofline.prefill_tok_s(s, r, 100) == 100 / 2.0
    fast_io = roofline.Rates(bandwidth=1e9, flops=1e4)
    assert roofline.prefill_tok_s(s, fast_io, 100) == 100 / ((100 * 100 + 5050) / 1e4)
    # 10 tokens after a 90-token history: 10 x 100 + (10 x 90 + 55) FLOPs.
    assert roofline.prefill_tok_s(s, fast_io, 10, 90) == 10 / ((1000 + 955) / 1e4)


def test_measure_gives_positive_rates():
    r = roofline.measure(torch.device("cpu"), torch.float32, repeats=1)
    assert r.bandwidth > 1e8 and r.flops > 1e8
