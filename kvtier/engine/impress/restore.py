"""The importance-only restore (IMPRESS) inside the engine: a request's stored prefix read by
token (store/selective.py), with its new tokens computed on the way (prefill.py).

Choosing needs the new tokens' queries at every layer, so the restore computes the new tokens
itself (on the restore worker, like Cake's front), places the kept prefix and all new tokens but
the last into the request's slots, and the request's step computes the last one and samples.
The prefix tokens not in its slots stay out for the rest of the request's life (the offer's
`dropped`), and its state is lossy: never saved, published to the device prefix cache or
reported as exact. Its lifecycle is a `PreparedRestore`'s (everything done in `prepare`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvtier.engine.impress.policy import ImpressPolicy
from kvtier.engine.impress.prefill import impress_prefill
from kvtier.engine.restore.job import LossyChoice
from kvtier.engine.restore.prepared import PreparedRestore
from kvtier.engine.runner.model_runner import ModelRunner
from kvtier.planning.plan import Plan
from kvtier.store.reorder import kept_masks
from kvtier.store.selective import TokenReadMiss, TokenReads
from kvtier.store.tiered import TieredStore


def chunk_ratios(kept: list[torch.Tensor], chunks: Sequence[tuple[str, int, int]]) -> dict[str, float]:
    """Per chunk (key, start, end), the share of its tokens the layers kept, averaged over layers."""
    if not kept:
        return {}
    bounds = torch.tensor([end for _, _, end in chunks])
    counts = torch.zeros(len(chunks))
    for layer in kept:  # [k] prefix indices
        counts += torch.bincount(torch.bucketize(layer, bounds, right=True), minlength=len(chunks))[: len(chunks)]
    return {key: float(counts[i]) / (len(kept) * (end - start)) for i, (key, start, end) in enumerate(chunks)}


class ImpressRestore(PreparedRestore):
    blended = None  # (RestoreJob) an importance restore blends nothing
    misses = (*PreparedRestore.misses, TokenReadMiss)

    def __init__(self, plan: Plan, policy: ImpressPolicy, store: TieredStore, runner: ModelRunner,
                 token_ids: Sequence[int], block_ids: Sequence[int]) -> None:
        if policy.layer_slope:  # the pool gives a request the same slots in every layer
            raise ValueError("an importance restore in the engine keeps the same share in every layer (layer_slope 0)")
        super().__init__(runner)
        self.plan, self.policy, self.store = plan, policy, store
        self.new_ids = list(token_ids[plan.history_tokens:])  # computed here; the last again by the step
        self.placed_to = len(token_ids) - 1  # the request's step computes its last token only
        self.block_ids = list(block_ids)
        self.start = 0  # the request's slots are all rewritten (a failure recomputes from its start)
        self.chose: LossyChoice | None = None
        self._reads: TokenReads | None = None

    def _cleanup(self) -> None:
        if self._reads is not None:
            self._reads.close()
            self._reads = None

    def _work(self) -> None:
        self._reads = TokenReads(self.store, self.plan.chunks)
        _, cache, st = impress_prefill(self.runner.model, self.runner.rope, self._reads, self.new_ids, self.policy)
        n = cache.slots - 1  # every slot but the last new token's (the step computes it and samples)
        slots = self.runner.upload(self.runner.slots(self.block_ids, 0, n))
        for li in range(len(cache.k)):
            self.runner.k_cache[li].index_copy_(0, slots, cache.k[li][:n])
            self.runner.v_cache[li].index_copy_(0, slots, cache.v[li][:n])
        self.runner.transfer.sync_compute()  # written before the stats say it is
        self.chose = LossyChoice(st.chosen_share, st.layers_passed / st.layers) if st.layers else None
        spans = [(c.key, c.start - self.plan.chunks[0].start, c.end - self.plan.chunks[0].start)
                 for c in self.plan.chunks]  # prefix-relative, as the kept indices
        self.store.observe_importance(chunk_ratios(st.kept, spans))
        if self.policy.unit == 1:  # whole-granule choices say nothing about order within a granule
            self.store.observe_kept(kept_masks(st.kept, spans))
        self.store.promote(self.plan.chunks)
        self.stats.bytes_read = st.bytes_read
        self.stats.chunks_loaded = len(self.plan.chunks)
        self.stats.prefix_attended = st.kept_tokens
