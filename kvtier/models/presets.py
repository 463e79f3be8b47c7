"""Built-in random-weight models: seeded, no download, for tests and benchmarks."""

from __future__ import annotations

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
}


def random_state_dict(cfg: ModelConfig, seed: int) -> dict[str, torch.Tensor]:
    """Seeded weights with HF names. Embeddings are wide (std 1) so logits are peaked, which keeps
    greedy decoding free of near-ties that would make exactness tests flaky."""
    from kvtier.models.llama import CausalLM

    g = torch.Generator().manual_seed(seed)
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in CausalLM(cfg).state_dict().items()}
    out: dict[str, torch.Tensor] = {}
    for name, shape in shapes.items():
        if name.endswith("layernorm.weight") or name.endswith("norm.weight"):
            out[name] = 1.0 + 0.1 * torch.randn(shape, generator=g)
        elif name == "model.embed_tokens.weight":
            out[name] = torch.randn(shape, generator=g)
        elif name.endswith(".bias"):
            out[name] = 0.1 * torch.randn(shape, generator=g)
        else:
            fan_in = shape[-1]
            out[name] = torch.randn(shape, generator=g) / fan_in**0.5
    return out
