"""Built-in random-weight models: seeded, no download, for tests and benchmarks."""

from __future__ import annotations

import os
import zlib
from concurrent.futures import ThreadPoolExecutor

import torch

from kvtier.models.config import ModelConfig

# All presets share the SmolLM2 vocabulary so its tokenizer can drive them from the CLI.
_VOCAB = 49152

PRESETS: dict[str, ModelConfig] = {
    "tiny-mha": ModelConfig(
        model_type="llama", vocab_size=_VOCAB, hidden_size=64, intermediate_size=128, num_layers=4,
        num_heads=4, num_kv_heads=4, head_dim=16, max_position_embeddings=4096, tie_word_embeddings=True,
        bos_token_id=1, eos_token_ids=(2,),
    ),
    "tiny-gqa": ModelConfig(
        model_type="llama", vocab_size=_VOCAB, hidden_size=64, intermediate_size=128, num_layers=4,
        num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=4096, tie_word_embeddings=True,
        bos_token_id=1, eos_token_ids=(2,),
    ),
    # Llama-2-style MHA: the hidden state (2048) is half the size of K+V (2 x 2048) per token.
    "mha-1b": ModelConfig(
        model_type="llama", vocab_size=_VOCAB, hidden_size=2048, intermediate_size=5504, num_layers=24,
        num_heads=16, num_kv_heads=16, head_dim=128, max_position_embeddings=16384, bos_token_id=1,
        eos_token_ids=(2,),
    ),
    # A small MHA model (GPT-2-small-like shape): K+V per token 4x SmolLM2's, for serving benches
    # where the KV budget binds (bench partial).
    "mha-small": ModelConfig(
        model_type="llama", vocab_size=_VOCAB, hidden_size=768, intermediate_size=2048, num_layers=12,
        num_heads=12, num_kv_heads=12, head_dim=64, max_position_embeddings=8192, bos_token_id=1,
        eos_token_ids=(2,),
    ),
    # SmolLM2-135M's shape with random weights: the real model's speed where its GGUF cannot travel.
    "smollm2-shape": ModelConfig(
        model_type="llama", vocab_size=_VOCAB, hidden_size=576, intermediate_size=1536, num_layers=30,
        num_heads=9, num_kv_heads=3, head_dim=64, rope_theta=100000.0, max_position_embeddings=32768,
        tie_word_embeddings=True, bos_token_id=1, eos_token_ids=(2,),
    ),
    # GPU benchmark shapes (context raised to 32K so 16K histories fit; the vocabulary stays the
    # shared one, so the LM head is smaller than the real models').
    "llama3-8b": ModelConfig(  # GQA: K+V per token is a quarter of the hidden state's size x 2
        model_type="llama", vocab_size=_VOCAB, hidden_size=4096, intermediate_size=14336, num_layers=32,
        num_heads=32, num_kv_heads=8, head_dim=128, rope_theta=500000.0, max_position_embeddings=32768,
        bos_token_id=1, eos_token_ids=(2,),
    ),
    "llama2-7b": ModelConfig(  # MHA: the hidden state is half of K+V per token (HCache's case)
        model_type="llama", vocab_size=_VOCAB, hidden_size=4096, intermediate_size=11008, num_layers=32,
        num_heads=32, num_kv_heads=32, head_dim=128, max_position_embeddings=32768, bos_token_id=1,
        eos_token_ids=(2,),
    ),
}


def random_state_dict(cfg: ModelConfig, seed: int, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """Seeded weights with HF names, generated on the CPU (so every device gets the same bits).
    Each tensor has its own generator seeded from (seed, name): tensors are drawn in parallel
    threads (an 8B shape in seconds, not a minute) and do not depend on each other's order.
    Embeddings are wide (std 1) so logits are peaked, which keeps greedy decoding free of
    near-ties that would make exactness tests flaky. `dtype`: cast each tensor once drawn."""
    from kvtier.models.llama import CausalLM

    with torch.device("meta"):
        shapes = {k: v.shape for k, v in CausalLM(cfg).state_dict().items()}

    def draw(name: str) -> torch.Tensor:
        g = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
        shape = shapes[name]
        if name.endswith("norm.weight"):
            t = 1.0 + 0.1 * torch.randn(shape, generator=g)
        elif name == "model.embed_tokens.weight":
            t = torch.randn(shape, generator=g)
        elif name.endswith(".bias"):
            t = 0.1 * torch.randn(shape, generator=g)
        else:
            t = torch.randn(shape, generator=g) / shape[-1] ** 0.5
        return t if dtype is None else t.to(dtype)

    with ThreadPoolExecutor(max_workers=min(16, os.cpu_count() or 1)) as pool:
        return dict(zip(shapes, pool.map(draw, shapes)))
