"""Checkpoint tensor names of other families mapped onto llama.py's (HF Llama's) names.

Phi-3 fuses q/k/v into one `qkv_proj` and gate/up into one `gate_up_proj`. They are split once at
load rather than kept fused: every layer then has the same separate `k_proj`/`v_proj` the engine's
hidden-state restore (`DecoderLayer.kv`) runs, and a split matmul's rows are the fused one's.
"""

from __future__ import annotations

import torch

from kvtier.models.config import ModelConfig


def to_llama_names(cfg: ModelConfig, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """-> `state` with every fused projection split into llama.py's parameters (views, no copy);
    other tensors are passed through as they are."""
    if cfg.model_type != "phi3":
        return state
    q_rows, kv_rows = cfg.num_heads * cfg.head_dim, cfg.kv_dim
    out: dict[str, torch.Tensor] = {}
    fused_rows = {"qkv_proj.weight": q_rows + 2 * kv_rows, "gate_up_proj.weight": 2 * cfg.intermediate_size}
    for name, t in state.items():
        rows = next((n for suffix, n in fused_rows.items() if name.endswith(suffix)), None)
        if rows is not None and t.shape[0] != rows:
            raise ValueError(f"{name} has {t.shape[0]} rows; the config says {rows}")
        if name.endswith("self_attn.qkv_proj.weight"):  # [q_rows + 2 * kv_rows, hidden]: q, then k, then v
            base = name.removesuffix("qkv_proj.weight")
            q, k, v = t.split([q_rows, kv_rows, kv_rows], dim=0)
            out.update({base + "q_proj.weight": q, base + "k_proj.weight": k, base + "v_proj.weight": v})
        elif name.endswith("mlp.gate_up_proj.weight"):  # [2 * intermediate, hidden]: gate, then up (HF's chunk(2))
            base = name.removesuffix("gate_up_proj.weight")
            gate, up = t.split([cfg.intermediate_size, cfg.intermediate_size], dim=0)
            out.update({base + "gate_proj.weight": gate, base + "up_proj.weight": up})
        else:
            out[name] = t
    return out
