"""Next-token sampling: greedy, temperature, top-k, top-p, per-request seeds."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvtier.engine.request import SamplingParams


def make_generator(params: SamplingParams) -> torch.Generator | None:
    """A host generator: sampling runs on host logits, so a seed gives the same tokens on every device."""
    if params.greedy:
        return None
    g = torch.Generator()
    g.manual_seed(params.seed if params.seed is not None else torch.seed())
    return g


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """logits: [vocab] fp32 -> token id."""
    if params.greedy:
        return int(torch.argmax(logits))
    logits = logits / params.temperature
    if params.top_k > 0:
        kth = torch.topk(logits, min(params.top_k, logits.shape[-1])).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_p, order = torch.sort(probs, descending=True)
        # Keep the smallest set whose mass reaches top_p (the token crossing the line stays in).
        drop = torch.cumsum(sorted_p, 0) - sorted_p >= params.top_p
        drop[0] = False  # the most likely token always stays, however small top_p is
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_p)
    return int(torch.multinomial(probs, 1, generator=generator))


def sample_rows(logits: torch.Tensor, params: Sequence[SamplingParams],
                generators: Sequence[torch.Generator | None]) -> list[int]:
    """logits: [n, vocab] fp32 on any device -> n token ids, with exactly one device-to-host
    transfer (the argmax ids when every row is greedy, else the logits once)."""
    if all(p.greedy for p in params):
        return logits.argmax(dim=-1).tolist()
    host = logits.cpu()
    return [sample(host[i], p, g) for i, (p, g) in enumerate(zip(params, generators))]
