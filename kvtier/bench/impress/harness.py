"""The accuracy tasks' harness: a model's store of importance-layout documents, restores of them by
a policy, greedy answers and log-likelihoods over the restored (reduced) cache, and each row's
tally of measurements."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from kvtier.engine.impress.policy import ImpressPolicy, ImpressStats
from kvtier.engine.impress.prefill import impress_prefill
from kvtier.models.loading import LoadedModel
from kvtier.models.rope import Rope
from kvtier.store import TieredStore
from kvtier.store.selective import TokenReads
from kvtier.testing.impress_harness import ReducedCache, extend

ANSWER_TOKENS = 12  # greedy tokens after the answer prefix: enough for "19494." or a full name


@dataclass
class Tally:
    """One (task, variant)'s measurements, an entry per item."""

    correct: list[int] = field(default_factory=list)
    kl: list[float] = field(default_factory=list)
    nll: list[float] = field(default_factory=list)
    bytes: list[int] = field(default_factory=list)
    passed: list[float] = field(default_factory=list)
    identify: list[float] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)
    granules: list[float] = field(default_factory=list)
    jaccard: list[list[float]] = field(default_factory=list)
    cells: list[str] = field(default_factory=list)  # the item's (length, facts) cell, for the breakdown
    answers: list[str] = field(default_factory=list)  # retrieval: the decoded answers
    labels: list[tuple[str, ...]] = field(default_factory=list)  # haystacks: the item's slices
    fact_kept: list[list[float]] = field(default_factory=list)  # haystacks: per layer, share of the value kept

    def add(self, st: ImpressStats) -> None:
        self.bytes.append(st.bytes_read)
        self.passed.append(st.layers_passed / st.layers)
        self.identify.append(st.identify_s / st.seconds)
        self.seconds.append(st.seconds)
        self.granules.append(st.granules_read / max(st.granules_whole, 1))
        if st.jaccard:
            self.jaccard.append(st.jaccard)


def kl(full: torch.Tensor, other: torch.Tensor) -> float:
    """Mean over rows of KL(full || other), logits [rows, vocab]."""
    p, q = torch.log_softmax(full, -1), torch.log_softmax(other, -1)
    return (p.exp() * (p - q)).sum(-1).mean().item()


def nll(logits: torch.Tensor, ids: list[int]) -> float:
    """Mean negative log-likelihood of ids[1:] under logits [len(ids), vocab] (row i predicts i + 1)."""
    lp = torch.log_softmax(logits[:-1].float(), -1)
    return -lp.gather(1, torch.tensor(ids[1:])[:, None]).mean().item()


def continuation_logprob(loaded: LoadedModel, rope: Rope, cache: ReducedCache, last: torch.Tensor,
                          ids: list[int]) -> float:
    """log P(ids | everything in cache), the first token's distribution being `last` [vocab]; the
    cache is extended by ids[:-1]."""
    lp = torch.log_softmax(last, -1)[ids[0]].item()
    if len(ids) > 1:
        logits = extend(loaded.module, rope, cache, ids[:-1])  # [len - 1, vocab]
        lp += torch.log_softmax(logits, -1).gather(1, torch.tensor(ids[1:])[:, None]).sum().item()
    return lp


def greedy(loaded: LoadedModel, rope: Rope, cache: ReducedCache, last: torch.Tensor, max_tokens: int,
            stop: set[int]) -> list[int]:
    """Greedy tokens after `cache`, the first from `last` [vocab], until a stop token or max_tokens."""
    out: list[int] = []
    while (t := int(last.argmax())) not in stop:
        out.append(t)
        if len(out) == max_tokens:
            break
        last = extend(loaded.module, rope, cache, [t])[-1]
    return out


def end_ids(loaded: LoadedModel, tok: Any) -> set[int]:
    """Token ids that end a turn: end of text, and the chat template's end of turn."""
    ids = {tok.eos_token_id, tok.convert_tokens_to_ids("<|im_end|>"), *loaded.config.eos_token_ids}
    return {i for i in ids if isinstance(i, int) and i >= 0}


def newline_ids(tok: Any) -> set[int]:
    """Token ids that start a new line (a one-line answer is over)."""
    return {i for t, i in tok.get_vocab().items() if tok.convert_tokens_to_string([t]).startswith("\n")}


class Bench:
    """One model's store and restores: `restore` computes new tokens over a stored document as a
    variant keeps it."""

    def __init__(self, loaded: LoadedModel, tok: Any, rope: Rope, store: TieredStore) -> None:
        self.loaded, self.tok, self.rope, self.store = loaded, tok, rope, store
        self.end = end_ids(loaded, tok)  # a summary runs to the end of its turn
        self.stop = self.end | newline_ids(tok)  # an answer to the end of its line

    def store_document(self, ids: list[int]) -> tuple[object, list[int]]:
        """Compute and store `ids`; -> (the store's match, the tail past the last whole chunk)."""
        c = self.loaded.config
        cache = ReducedCache.empty(c, self.loaded.dtype)
        with torch.inference_mode():
            extend(self.loaded.module, self.rope, cache, ids)
        self.store.save(ids, 0, torch.stack(cache.k), torch.stack(cache.v), None)
        self.store.flush(120)
        match = self.store.lookup(ids)
        return match, ids[match.num_tokens:]

    def restore(self, match, new: list[int], policy: ImpressPolicy,
                given: list[torch.Tensor] | None = None) -> tuple[torch.Tensor, ReducedCache, ImpressStats]:
        reads = TokenReads(self.store, match.chunks)
        try:
            logits, reduced, st = impress_prefill(self.loaded.module, self.rope, reads, new, policy, given)
        finally:
            reads.close()
        return logits, ReducedCache.of(reduced), st
