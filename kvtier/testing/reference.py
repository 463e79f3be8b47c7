"""Reference computations for tests and benchmarks, built on the engine's own runner
(`ModelRunner.execute`), which runs the project's one decoder-layer loop, `CausalLM.run_layers`
(as do `CausalLM.forward`, the plain single-sequence reference the HF oracle checks, the probe
calibration and the importance restore).

    context_state        a context's storable state (layer inputs, K rotated, V), as the engine captures it
    continuation_logits  logits of new tokens after a context given as stored K/V, optionally moved
    truncation_fidelity  perplexity after a context truncation, three ways (CachedAttention Table 1)
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvtier.engine.block_pool import BlockPool
from kvtier.engine.runner.model_runner import ModelRunner, RunItem
from kvtier.models.llama import CausalLM
from kvtier.planning.truncation import TruncationConfig, kept_positions

BLOCK = 16


@dataclass(frozen=True)
class ContextState:
    k: torch.Tensor  # [layers, tokens, kv_heads, hd], rotated at each token's position
    v: torch.Tensor  # [layers, tokens, kv_heads, hd]
    h: torch.Tensor  # [layers, tokens, hidden] input of each layer


def _runner(model: CausalLM, tokens: int) -> tuple[ModelRunner, list[int]]:
    n = -(-tokens // BLOCK)
    return ModelRunner(model, n, BLOCK, n * BLOCK), BlockPool(n, BLOCK).allocate(n)


@torch.inference_mode()
def context_state(model: CausalLM, ids: Sequence[int], chunk: int = 1024) -> ContextState:
    """One chunked prefill through the runner, capturing what the engine's saver captures."""
    n, cfg = len(ids), model.cfg
    runner, blocks = _runner(model, n)
    k = torch.empty(cfg.num_layers, n, cfg.num_kv_heads, cfg.head_dim, dtype=model.dtype)
    v = torch.empty_like(k)
    h = torch.empty(cfg.num_layers, n, cfg.hidden_size, dtype=model.dtype)
    for a in range(0, n, chunk):
        b = min(n, a + chunk)

        def capture(li: int, _offsets: tuple[int, ...], hh: torch.Tensor, kk: torch.Tensor, vv: torch.Tensor,
                    a: int = a, b: int = b) -> None:
            h[li, a:b], k[li, a:b], v[li, a:b] = hh, kk, vv

        runner.execute([RunItem(list(ids[a:b]), a, blocks, want_logits=False)], capture)
    return ContextState(k, v, h)


@torch.inference_mode()
def continuation_logits(model: CausalLM, k_ctx: torch.Tensor, v_ctx: torch.Tensor, shift: torch.Tensor,
                        new_ids: Sequence[int]) -> torch.Tensor:
    """Logits [new, vocab] of `new_ids` after a context of stored K/V placed at positions 0..ctx-1.

    k_ctx/v_ctx: [layers, ctx, kv_heads, hd] as stored (K rotated where it was computed); K is
    rotated by `shift` [ctx] more positions on the way in (0: keep the stored rotation)."""
    ctx = k_ctx.shape[1]
    runner, blocks = _runner(model, ctx + len(new_ids))
    slots = runner.slots(blocks, 0, ctx)
    for li in range(model.cfg.num_layers):
        runner.shift_in(li, k_ctx[li], v_ctx[li], shift, slots)
    return runner.execute([RunItem(list(new_ids), ctx, blocks, want_logits=True)], every_token=True)


def continuation_nll(model: CausalLM, k_ctx: torch.Tensor, v_ctx: torch.Tensor, shift: torch.Tensor,
                     new_ids: Sequence[int]) -> float:
    """Mean next-token NLL of `new_ids` (teacher forcing) after the stored context."""
    logits = continuation_logits(model, k_ctx, v_ctx, shift, new_ids)[:-1]
    return F.cross_entropy(logits, torch.tensor(list(new_ids[1:]))).item()


@dataclass(frozen=True)
class TruncationFidelity:
    ppl_token_truncation: float  # drop tokens, recompute the kept ones: the reference
    ppl_kv_rerope: float  # reuse stored KV of kept tokens, K moved to the new positions (kvtier)
    ppl_kv_naive: float  # reuse stored KV with its old positions baked in

    @property
    def rerope_vs_tokens(self) -> float:
        return self.ppl_kv_rerope / self.ppl_token_truncation - 1.0


def truncation_fidelity(model: CausalLM, context: Sequence[int], continuation: Sequence[int], limit: int,
                        cfg: TruncationConfig) -> TruncationFidelity:
    """Perplexity of `continuation` after truncating `context` to fit `limit` tokens, three ways."""
    keep = kept_positions(len(context), limit, cfg)
    idx = torch.tensor(keep)
    full = context_state(model, context)  # what the store holds for the original context
    fresh = context_state(model, [context[i] for i in keep])  # recomputed after dropping tokens
    m = len(keep)
    tok = continuation_nll(model, fresh.k, fresh.v, torch.zeros(m, dtype=torch.long), continuation)
    rerope = continuation_nll(model, full.k[:, idx], full.v[:, idx], torch.arange(m) - idx, continuation)
    naive = continuation_nll(model, full.k[:, idx], full.v[:, idx], torch.zeros(m, dtype=torch.long), continuation)
    return TruncationFidelity(math.exp(tok), math.exp(rerope), math.exp(naive))
