"""The importance-only restore (IMPRESS) inside the engine: a request's stored prefix read by
token (store/selective.py), with its new tokens computed on the way (prefill.py).

Choosing needs the new tokens' queries at every layer, so the restore computes the new tokens
itself (on the restore worker, like Cake's front), places the kept prefix and all new tokens but
the last into the request's slots, and the request's step computes the last one and samples.
The request carries `dropped` (prefix tokens not in its slots) for the rest of its life and is
approximate: never saved, published to the device prefix cache or reported as exact.
`ImpressRestore` offers the same surface as `Restore` (prepare, ready, place, finish, abort).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

import torch

from kvtier.engine.impress.policy import ImpressPolicy
from kvtier.engine.impress.prefill import impress_prefill
from kvtier.engine.restore.job import LossyChoice
from kvtier.engine.restore.layerwise import RestoreMiss, RestoreStats
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


class ImpressRestore:
    blended = None  # (RestoreJob) an importance restore blends nothing

    def __init__(self, plan: Plan, policy: ImpressPolicy, store: TieredStore, runner: ModelRunner,
                 token_ids: Sequence[int], block_ids: Sequence[int]) -> None:
        self.plan, self.policy, self.store, self.runner = plan, policy, store, runner
        self.new_ids = list(token_ids[plan.history_tokens:])  # computed here; the last again by the step
        self.block_ids = list(block_ids)
        self.start = 0  # the request's slots are all rewritten (a failure recomputes from its start)
        self.stats = RestoreStats()
        self.chose: LossyChoice | None = None
        self._prepared = threading.Event()
        self._error: str | None = None

    def prepare(self) -> None:
        t0 = time.perf_counter()
        reads = None
        try:
            if self._error is not None:
                raise RestoreMiss(self._error)
            reads = TokenReads(self.store, self.plan.chunks)
            _, cache, st = impress_prefill(self.runner.model, self.runner.rope, reads, self.new_ids, self.policy)
            n = cache.slots - 1  # every slot but the last new token's (the step computes it and samples)
            slots = self.runner.upload(self.runner.slots(self.block_ids, 0, n))
            with torch.inference_mode():
                for li in range(len(cache.k)):
                    self.runner.k_cache[li].index_copy_(0, slots, cache.k[li][:n])
                    self.runner.v_cache[li].index_copy_(0, slots, cache.v[li][:n])
            self.runner.transfer.sync_compute()  # done means written
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
        except (TokenReadMiss, RestoreMiss, OSError, ValueError) as e:
            self._error = str(e) or type(e).__name__
            raise RestoreMiss(self._error) from e
        finally:
            if reads is not None:
                reads.close()
            self.stats.seconds = time.perf_counter() - t0
            self._prepared.set()

    def ready(self) -> bool:
        return self._prepared.is_set()

    @property
    def failed(self) -> bool:
        return self._error is not None

    def place(self, layer: int) -> None:
        """Everything was placed while preparing: nothing to do layer by layer."""

    def finish(self) -> RestoreStats:
        self._prepared.wait()
        if self._error is not None:
            raise RestoreMiss(self._error)
        return self.stats

    def abort(self) -> None:
        self._error = self._error or "aborted"
