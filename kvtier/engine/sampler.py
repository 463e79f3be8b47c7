"""Batched next-token sampling: every row of a step's logits in one pass of tensor ops, one transfer.

Meanings are vLLM's `SamplingParams` (and, per processor, transformers' logits processors: tests
check each against them). The order, as vLLM v1 applies it: logit_bias, the min_tokens hold-back
of stop tokens and the grammar's token mask, then the repetition, frequency and presence
penalties (greedy rows get these too), then temperature, min_p, top_k and top_p, then the draw.

The draw is the exponential race, `argmax(log p - log q)` with q ~ Exp(1) drawn from the row's own
generator on the logits' device: it samples from p exactly, and in log space it needs no
normalisation. Each sampled row is warped and drawn on its own (over its top-k candidates when it
has a top_k, so no full-vocabulary sort), so a seeded request draws the same tokens whatever else
shares its batch; a row that is not sampled this step draws nothing.

Temperature divides `logits - max`, so the likeliest token sits at 0 and no temperature above 0,
however small, makes inf - inf: a tiny temperature samples the argmax (or among exact ties).
top_k keeps exactly k tokens (transformers also keeps ties with the k-th).

Logprobs are of the model's own distribution (log-softmax of the raw logits, before any of the
above), as vLLM returns them by default and as the OpenAI API describes them.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass

import torch

from kvtier.engine.penalties import Seen, penalize
from kvtier.engine.request import SamplingParams
from kvtier.engine.structured import Constraint, allocate_bitmask, apply_bitmask

_TINY = torch.finfo(torch.float32).tiny  # an exponential draw of exactly 0 would give log 0


@dataclass(frozen=True)
class Row:
    """One row of the step's logits to sample, with what its processors read."""

    params: SamplingParams
    generator: torch.Generator | None  # None: greedy (draws nothing)
    prompt: Sequence[int]
    output: Sequence[int]
    constraint: Constraint | None = None
    seen: Seen | None = None  # kept across steps by the engine; built from prompt and output if None


@dataclass(frozen=True)
class TokenLogprobs:
    token: int
    logprob: float
    top: tuple[tuple[int, float], ...]  # the k likeliest (id, logprob), likeliest first
    rank: int | None = None  # the token's rank in its distribution (1 = the likeliest); prompt tokens


@dataclass(frozen=True)
class Sampled:
    token: int
    logprobs: TokenLogprobs | None  # with SamplingParams(logprobs=k)


def make_generator(params: SamplingParams, device: torch.device, offset: int = 0) -> torch.Generator | None:
    """The request's generator on the logits' device; `offset` gives the samples of an n > 1
    request different seeds (seed + i)."""
    if params.greedy:
        return None
    g = torch.Generator(device=device)
    g.manual_seed((params.seed + offset) % 2**64 if params.seed is not None else g.seed())
    return g


def sample_batch(logits: torch.Tensor, rows: Sequence[Row], stop_ids: Collection[int]) -> list[Sampled]:
    """logits: [n, vocab] fp32 (the model's, untouched) -> one Sampled per row. `stop_ids`: the
    model's EOS ids (held back, with each row's stop_token_ids, until min_tokens)."""
    if all(r.params.greedy and _plain(r) for r in rows):
        return [Sampled(t, None) for t in logits.argmax(dim=-1).tolist()]
    dev = logits.device
    x = process(logits, rows, stop_ids)  # [n, vocab]
    tokens = x.argmax(dim=-1)  # [n]
    sampled = [i for i, r in enumerate(rows) if not r.params.greedy]
    if sampled:
        idx = torch.tensor(sampled, device=dev)
        picked = [rows[i] for i in sampled]
        drawn = _draw(x.index_select(0, idx), picked)  # [len(sampled)]
        tokens = tokens.index_copy(0, idx, drawn)
    wants = [r.params.logprobs for r in rows]
    if all(w is None for w in wants):
        return [Sampled(t, None) for t in tokens.tolist()]
    scored = score(logits, tokens, wants)
    return [Sampled(s.token, s if w is not None else None) for s, w in zip(scored, wants)]


def score(logits: torch.Tensor, tokens: torch.Tensor, wants: Sequence[int | None],
          rank: bool = False) -> list[TokenLogprobs]:
    """logits: [n, vocab], tokens: [n] -> each token's logprob under its row's log-softmax and the
    row's `wants[i]` likeliest (None: none), with one transfer; `rank`: also each token's rank
    (1 = the likeliest), as vLLM reports for prompt tokens."""
    k = max((w for w in wants if w is not None), default=0)
    lp = torch.log_softmax(logits, dim=-1)  # [n, vocab]
    chosen = lp.gather(1, tokens[:, None])  # [n, 1]
    top_v, top_i = lp.topk(k, dim=-1) if k else (lp[:, :0], lp[:, :0])  # [n, k]
    ranks = (lp > chosen).sum(dim=-1, keepdim=True) + 1 if rank else chosen[:, :0]  # [n, 1 or 0]
    # One transfer: ids and ranks below 2**53 are exact in float64.
    packed = torch.cat([tokens[:, None].double(), chosen.double(), top_v.double(), top_i.double(),
                        ranks.double()], dim=1).cpu()  # [n, 2 + 2k (+ 1)]
    out = []
    for w, row in zip(wants, packed.tolist()):
        w = w or 0
        top = tuple((int(i), v) for v, i in zip(row[2:2 + w], row[2 + k:2 + k + w]))
        out.append(TokenLogprobs(int(row[0]), row[1], top, int(row[-1]) if rank else None))
    return out


def process(logits: torch.Tensor, rows: Sequence[Row], stop_ids: Collection[int]) -> torch.Tensor:
    """logits [n, vocab] -> a processed copy: bias, hold-backs, grammar masks and penalties (what
    greedy rows take the argmax of)."""
    x = logits.clone()  # logits stay raw for logprobs
    _bias_and_masks(x, rows, stop_ids)
    penalize(x, [(i, r.params, r.seen if r.seen is not None else Seen(r.prompt, r.output, x.device))
                 for i, r in enumerate(rows) if r.params.penalized])
    return x


def _plain(r: Row) -> bool:
    p = r.params
    return (r.constraint is None and not p.logit_bias and not p.penalized and p.logprobs is None
            and len(r.output) >= p.min_tokens)


def _bias_and_masks(x: torch.Tensor, rows: Sequence[Row], stop_ids: Collection[int]) -> None:
    """In place on x [n, vocab]: logit_bias added; stop tokens banned before min_tokens; tokens
    outside each constrained row's grammar banned."""
    n, vocab = x.shape
    adds: list[tuple[int, int, float]] = []  # (row, token, added to its logit)
    for i, r in enumerate(rows):
        adds += [(i, t, b) for t, b in r.params.logit_bias]
        if len(r.output) < r.params.min_tokens:
            adds += [(i, t, float("-inf")) for t in sorted(set(stop_ids) | set(r.params.stop_token_ids))]
    if adds:
        at, tok, val = zip(*adds)
        dev = x.device
        x.index_put_((torch.tensor(at, device=dev), torch.tensor(tok, device=dev)),
                     torch.tensor(val, device=dev), accumulate=True)
    constrained = [(i, r.constraint) for i, r in enumerate(rows) if r.constraint is not None]
    if constrained:
        mask = allocate_bitmask(n, vocab)  # [n, ceil(vocab / 32)] int32, host
        for i, c in constrained:
            c.fill_mask(mask, i)
        apply_bitmask(x, mask)


def warp(x: torch.Tensor, params: SamplingParams) -> tuple[torch.Tensor, torch.Tensor | None]:
    """x: [vocab] one row's processed logits -> (vals, ids): the candidates it samples among,
    temperature-scaled, likeliest first; ids None when they are the whole vocabulary in order.
    Tokens min_p, top_k or top_p leave out are at -inf or absent."""
    x = (x - x.max()) / params.temperature  # the likeliest at 0: stable for any temperature
    if params.min_p > 0:  # p_j >= min_p * p_max  <=>  x_j >= log(min_p), with no softmax
        x = x.masked_fill(x < math.log(params.min_p), float("-inf"))
    ids = None
    if params.top_k > 0:
        x, ids = x.topk(min(params.top_k, x.shape[-1]))  # [k], sorted: no full-vocabulary sort
    elif params.top_p < 1.0:
        x, ids = x.sort(descending=True)
    if params.top_p < 1.0:
        p = torch.softmax(x, dim=-1)
        # Keep the smallest prefix whose mass reaches top_p: a token goes when the mass before it does.
        drop = (torch.cumsum(p, dim=-1) - p) >= params.top_p
        drop[0] = False  # the likeliest token always stays, however small top_p is
        x = x.masked_fill(drop, float("-inf"))
    return x, ids


def _draw(x: torch.Tensor, rows: Sequence[Row]) -> torch.Tensor:
    """x: [m, vocab] processed logits of the sampled rows -> [m] token ids.

    Row by row: each row has its own generator, and its arithmetic (over its own k candidates, never
    the batch's largest k) must not depend on what else is in the batch. The race is in log space,
    argmax(x - log q), so no normalisation enters it."""
    out = []
    for i, r in enumerate(rows):
        vals, ids = warp(x[i], r.params)
        q = torch.empty_like(vals).exponential_(generator=r.generator).clamp_min_(_TINY)
        j = torch.argmax(vals - q.log())
        out.append(ids[j] if ids is not None else j)
    return torch.stack(out)
