"""Llama-family decoder (Llama 2/3, Mistral, Qwen2, Qwen3, Phi-3, SmolLM) as plain nn.Modules.

Parameter names match Hugging Face's `LlamaForCausalLM` (and `Qwen3ForCausalLM`'s q_norm/k_norm), so
a transformers state dict loads as is; Phi-3's fused projections are split at load (checkpoint.py).
Each layer exposes its steps (`qkv`, `kv`, `finish`) instead of one opaque forward, so the engine
can capture a layer's input hidden state and pre-RoPE K/V, rebuild K/V from a stored hidden state,
and run new tokens against KV that someone else placed in the pool.

`CausalLM.run_layers` is the project's one loop over the decoder layers: every pass (the engine's
step, the plain reference forward, the probe calibration, the importance restore) runs it and
passes a `LayerAttention` for what differs between them, namely which rows enter a layer and
what their queries attend to.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Iterable, Sequence
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from kvtier.models.attention import causal_attention
from kvtier.models.config import ModelConfig
from kvtier.models.invariant import Fused, Linear
from kvtier.models.kernels import Kernels
from kvtier.models.rope import Rope, rotate, rotate_into


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 and cast back before the weight, as HF does, so bf16 rounding matches;
        # F.rms_norm is one fused kernel instead of five elementwise passes.
        return self.weight * F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.q_proj = Linear(cfg.hidden_size, cfg.num_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.k_proj = Linear(cfg.hidden_size, cfg.kv_dim, bias=cfg.qkv_bias)
        self.v_proj = Linear(cfg.hidden_size, cfg.kv_dim, bias=cfg.qkv_bias)
        self.o_proj = Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=False)
        if cfg.qk_norm:  # Qwen3: one RMSNorm over each head of q (and of k), shared by the heads
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.qkv_proj = Fused(self.q_proj, self.k_proj, self.v_proj)  # not a module: no parameters of its own

    def heads(self, x: torch.Tensor, cfg: ModelConfig, with_q: bool = True) -> list[torch.Tensor]:
        """x: [tokens, hidden] normed layer input -> pre-RoPE [q [tokens, heads, hd],] k, v [tokens,
        kv_heads, hd], q- and k-norm included (so K rebuilt from a stored hidden state, without q,
        is the K the forward pass computed)."""
        out = self.qkv_proj.tail(x, 0 if with_q else 1)
        heads = ([cfg.num_heads] if with_q else []) + [cfg.num_kv_heads] * 2
        out = [o.view(-1, n, cfg.head_dim) for o, n in zip(out, heads)]
        if cfg.qk_norm:
            norms = ([self.q_norm] if with_q else []) + [self.k_norm]
            out[: len(norms)] = [norm(o) for norm, o in zip(norms, out)]
        return out


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_proj = Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.gate_up_proj = Fused(self.gate_proj, self.up_proj)  # not a module: no parameters of its own

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def qkv(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """h: [tokens, hidden] layer input -> pre-RoPE q [tokens, heads, hd], k, v [tokens, kv_heads, hd]."""
        q, k, v = self.self_attn.heads(self.input_layernorm(h), self.cfg)
        return q, k, v

    def kv(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rebuild pre-RoPE K/V from a stored layer input (HCache): norm -> W_k (-> k-norm), norm -> W_v."""
        k, v = self.self_attn.heads(self.input_layernorm(h), self.cfg, with_q=False)
        return k, v

    def finish(self, h: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """Residual + o_proj + MLP. h: [tokens, hidden], attn: [tokens, heads, hd] -> next layer input."""
        h = h + self.self_attn.o_proj(attn.flatten(1))
        return h + self.mlp(self.post_attention_layernorm(h))


class Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        # Given its (uninitialised) weight: built under the meta device, the default init's normal_
        # runs through torch._refs, whose first call imports torch._dynamo (seconds of every process start).
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size,
                                         _weight=torch.empty(cfg.vocab_size, cfg.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class CausalLM(nn.Module):
    """The decoder. `forward` is a plain single-sequence pass used as the simplest reference (the
    HF oracle checks it); `run_layers` is the layer loop every pass shares."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.model = Backbone(cfg)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.kernels = Kernels()

    def set_kernels(self, kernels: Kernels) -> None:
        """The kernels every pass over this model runs (its linears' and its attention's)."""
        self.kernels = kernels
        for m in self.modules():
            if isinstance(m, Linear):
                m.exact = kernels.exact

    @property
    def layers(self) -> Sequence[DecoderLayer]:
        # nn.ModuleList is not generic: its items are typed as plain Modules.
        return cast("Sequence[DecoderLayer]", self.model.layers)

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(ids)  # [tokens, hidden]

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """h: [tokens, hidden] final residual stream -> fp32 logits [tokens, vocab]."""
        return self.lm_head(self.model.norm(h)).float()

    def run_layers(self, h: torch.Tensor, attention: LayerAttention, layers: Iterable[int] | None = None) -> torch.Tensor:
        """The decoder layers (`layers`, default all) over the rows h [tokens, hidden]; `attention`
        says what each layer's queries attend to. -> the last layer's output rows [tokens', hidden]
        (fewer rows than h where `attention.enter` let some leave)."""
        for li in layers if layers is not None else range(self.cfg.num_layers):
            h = attention.enter(li, h)
            layer = self.layers[li]
            q, k, v = layer.qkv(h)  # [tokens, heads | kv_heads, hd], before RoPE
            q, k = attention.rotate(q, k)
            h = layer.finish(h, attention.attend(li, h, q, k, v))
        return h

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, rope: Rope | None = None) -> torch.Tensor:
        """ids: [tokens] -> logits [tokens, vocab] for one sequence starting at position 0."""
        dev = self.lm_head.weight.device
        ids = ids.to(dev)
        rope = rope or Rope(self.cfg, ids.shape[0], self.dtype, dev)
        positions = torch.arange(ids.shape[0], device=dev)
        return self.logits(self.run_layers(self.embed(ids), _HFRotation(rope, positions, self.kernels)))


class LayerAttention(abc.ABC):
    """What differs between the passes over the decoder layers (`CausalLM.run_layers`): the rows
    that enter each layer, their RoPE tables, and the keys and values their queries attend to."""

    @property
    @abc.abstractmethod
    def rope(self) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin half tables [tokens, 1, hd/2] at the positions of the rows entering the layer."""

    def rotate(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q [tokens, heads, hd] and k [tokens, kv_heads, hd] rotated at the rows' positions, each into
        a fresh tensor (a capture may keep k past the step)."""
        cos, sin = self.rope
        return rotate_into(q, cos, sin, torch.empty_like(q)), rotate_into(k, cos, sin, torch.empty_like(k))

    def enter(self, li: int, h: torch.Tensor) -> torch.Tensor:
        """Before layer `li`, whose input rows are h [tokens, hidden]: -> the rows that go through it
        (a pass may place restored K/V in time for it, or let rows leave). Default: every row."""
        return h

    @abc.abstractmethod
    def attend(self, li: int, h: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Layer `li`'s attention for the rows h [tokens, hidden]: q [tokens, heads, hd] and k [tokens,
        kv_heads, hd] rotated at their positions, v [tokens, kv_heads, hd]. -> [tokens, heads, hd]."""


# observe(layer, q, k, v): a layer's rotated q [tokens, heads, hd], k, v [tokens, kv_heads, hd].
ObserveFn = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], None]


class SelfAttention(LayerAttention):
    """One fresh sequence attending causally to itself, its rows at positions [0, tokens).
    `observe` sees each layer's q/k/v before the layer attends (the probe calibration's scores)."""

    def __init__(self, cos: torch.Tensor, sin: torch.Tensor, kernels: Kernels, observe: ObserveFn | None = None) -> None:
        self.cos, self.sin, self.observe = cos, sin, observe  # [tokens, 1, hd/2]
        self.kernels = kernels

    @property
    def rope(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cos, self.sin

    def attend(self, li: int, h: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if self.observe is not None:
            self.observe(li, q, k, v)
        return causal_attention(q, k, v, 0, self.kernels)


class _HFRotation(SelfAttention):
    """`CausalLM.forward`'s pass: RoPE in HF's own arithmetic (`rotate`, full tables) rather than
    the engine's fused `rotate_into`, which rounds differently (bf16 logits move by up to ~0.5), so
    the plain reference stays what the HF oracle checks."""

    def __init__(self, rope: Rope, positions: torch.Tensor, kernels: Kernels) -> None:
        super().__init__(*rope.halves(positions), kernels)
        self.full = rope.cos_sin(positions)  # [tokens, 1, hd]

    def rotate(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = self.full
        return rotate(q, cos, sin), rotate(k, cos, sin)
