"""The engine's link to the tiered store, in two typed halves along the seam vLLM's KV connector
uses. It caches nothing itself: it wires the parts that do.

    scheduler side  `StoreScheduling` (kvtier.engine.scheduler.StoreSide): offers, restore compute,
                    starting restores and hearing back from them, look-ahead, sessions
    step side       `StoreStepping` (StepSide): capture for saving, the restore hook, after the step
    the parts       Restorer (restores), Saver (chunks to the store's writer), SessionRetention,
                    look-ahead (CachedAttention §3.3)

`NullStateLink` is the same surface without a store, so the engine never asks "is there one?".
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Protocol

import torch

from kvtier.dtypes import name_of
from kvtier.engine.calibrate.probes import UNCALIBRATED, ProbeCalibration, cached_calibration
from kvtier.engine.config import ImportanceSelection, ReuseConfig
from kvtier.engine.impress.policy import PROBE_GRANULE_TOKENS, ImpressPolicy, probe_kv_heads_for
from kvtier.engine.link.restorer import Restorer
from kvtier.engine.link.saver import Saver
from kvtier.engine.link.sessions import SessionRetention
from kvtier.engine.link.stats import LinkReport, LinkStats
from kvtier.engine.request import Request
from kvtier.engine.runner.model_runner import CaptureFn, ModelRunner
from kvtier.engine.scheduler_api import NoStore, RestoreDone, RestoreTicket, StoreOffer, StoreSide
from kvtier.models import exact_attention
from kvtier.models.attention import exact_cpu
from kvtier.models.loading import LoadedModel
from kvtier.planning.costs import HardwareProfile, ModelShape, links
from kvtier.planning.plan import Method
from kvtier.planning.planner import ImportanceReads, Planner
from kvtier.store import lookahead
from kvtier.store.layout import Repr, StoreNamespace
from kvtier.store.lookahead import LookAheadPolicy
from kvtier.store.preflight import warn_if_unsealed
from kvtier.store.spec import parse_spec
from kvtier.store.tiered import DEFAULT_QUEUE_BYTES, TieredStore

log = logging.getLogger(__name__)


class StepSide(Protocol):
    """The step's half of the link: what the runner captures for saving, the hook that places
    restored layers, and what happens after the forward and after each request's step."""

    def capture_for(self, reqs: Sequence[Request]) -> CaptureFn | None: ...

    def restore_hook(self, request_ids: Sequence[str]) -> Callable[[int], None] | None: ...

    def given_logits(self, request_id: str, start: int) -> torch.Tensor | None:
        """The logits [1, vocab] of a request's token at `start` that the restore attached to this
        step computed already (None: the step computes it)."""
        ...

    def after_execute(self, request_ids: Sequence[str]) -> dict[str, int]:
        """Close the restores this step placed; -> {request: restart position} for those whose
        result is void (not sampled, not saved)."""
        ...

    def before_sample(self, reqs: Sequence[Request]) -> None:
        """The step's forward is enqueued and these requests' positions advanced; the host is about
        to wait for their tokens (work done here runs while the device computes)."""
        ...

    def after_step(self, req: Request, finished: bool) -> None: ...


class StateLink(Protocol):
    """The engine's whole link: its two halves and its lifecycle."""

    store: TieredStore | None  # for statistics and admin; the halves are how the engine uses it

    @property
    def scheduler_side(self) -> StoreSide: ...

    @property
    def step_side(self) -> StepSide: ...

    def idle_wait(self, timeout: float) -> None:
        """Only restores are in flight: sleep until one may be ready, or `timeout`."""
        ...

    def adopt_profile(self, profile: HardwareProfile) -> None:
        """Plan restores on `profile` from now on (measured while the engine was idle)."""
        ...

    def flush(self, timeout: float | None) -> bool: ...

    def report(self, with_store: bool = True) -> LinkReport: ...

    def precompile(self, documents: Sequence[Sequence[int]], salt: str) -> tuple[int, int]:
        """Store each document's state computed alone for blended restores (those stored already
        are left as they are) -> (found stored, computed)."""
        ...

    def close(self) -> None: ...


class NoStoreStep:
    """No store: nothing is captured or placed."""

    def capture_for(self, reqs: Sequence[Request]) -> CaptureFn | None:
        return None

    def restore_hook(self, request_ids: Sequence[str]) -> Callable[[int], None] | None:
        return None

    def given_logits(self, request_id: str, start: int) -> torch.Tensor | None:
        return None

    def after_execute(self, request_ids: Sequence[str]) -> dict[str, int]:
        return {}

    def before_sample(self, reqs: Sequence[Request]) -> None:
        pass

    def after_step(self, req: Request, finished: bool) -> None:
        pass


class NullStateLink:
    """No store: nothing is saved or restored."""

    def __init__(self) -> None:
        self.store: TieredStore | None = None
        self._scheduler_side, self._step_side = NoStore(), NoStoreStep()

    @property
    def scheduler_side(self) -> StoreSide:
        return self._scheduler_side

    @property
    def step_side(self) -> StepSide:
        return self._step_side

    def idle_wait(self, timeout: float) -> None:
        pass

    def adopt_profile(self, profile: HardwareProfile) -> None:
        pass

    def flush(self, timeout: float | None) -> bool:
        return True

    def report(self, with_store: bool = True) -> LinkReport:
        return LinkReport()

    def precompile(self, documents: Sequence[Sequence[int]], salt: str) -> tuple[int, int]:
        raise ValueError("precompiling documents needs a store (start the engine with one, e.g. --store memory:4GB)")

    def close(self) -> None:
        pass


class StoreScheduling:
    """The scheduler side over a store: what the scheduler asks while it schedules a step."""

    def __init__(self, store: TieredStore, restorer: Restorer, saver: Saver, planner: Planner, config: ReuseConfig,
                 stats: LinkStats) -> None:
        self.store, self.restorer, self.saver, self.planner = store, restorer, saver, planner
        self.stats = stats
        self.sessions = SessionRetention(config.session_ttl_s) if config.session_ttl_s else None
        self._next_expiry = 0.0
        self.lookahead = self._steer_eviction() if config.lookahead else []

    def _steer_eviction(self) -> list[LookAheadPolicy]:
        """Wrap every tier's eviction policy so the look-ahead window can steer it."""
        return [p for t in self.store.tiers for p in t.wrap_policies(LookAheadPolicy)]

    # ----- StoreSide ----------------------------------------------------------------------------
    def begin_step(self) -> Sequence[RestoreDone]:
        """Expire idle sessions; -> restores that left RESTORING."""
        self.expire_sessions()
        return self.restorer.poll()

    def offer(self, req: Request) -> StoreOffer:
        return self.restorer.offer(req)

    def charge(self, budget: int) -> int:
        return self.restorer.charge(budget)

    def start(self, req: Request, ticket: RestoreTicket) -> None:
        self.restorer.start(req, ticket)

    def abort(self, request_id: str) -> bool:
        """-> True if a restore is writing into the request's blocks (finish it once that ends)."""
        self.saver.drop(request_id)
        return self.restorer.abort(request_id)

    def end_step(self, waiting: Sequence[Request]) -> None:
        """Look ahead at what is still queued (what was just admitted is being read already)."""
        self.look_ahead(waiting)

    def arrived(self, req: Request) -> None:
        # The prompt's chunks count as the session's from arrival on, so a chunk this request is
        # about to restore is not deleted under it because another session that saved it expired.
        # A request that reads and saves nothing (cache_prompt false) claims none.
        if self.sessions is not None and req.session_id is not None:
            keys = self.store.keys_for(req.all_ids, req.cache_salt) if req.cache_prompt else []
            self.sessions.arrived(req.session_id, keys, time.monotonic(), req.cache_salt)

    def finished(self, req: Request) -> None:
        """A request ended (any reason): what it saved belongs to its session."""
        if self.sessions is not None and req.session_id is not None:
            saves = req.cache_prompt and not req.approximate
            saved = self.store.keys_for(req.all_ids[: req.num_computed], req.cache_salt) if saves else []
            self.sessions.finished(req.session_id, saved, time.monotonic(), req.cache_salt)

    # ----- retention and look-ahead -----------------------------------------------------------
    def expire_sessions(self, now: float | None = None) -> int:
        """Delete the state of sessions idle past the TTL (checked at most once a second). -> chunks removed."""
        if self.sessions is None:
            return 0
        now = time.monotonic() if now is None else now
        if now < self._next_expiry:
            return 0
        self._next_expiry = now + min(1.0, self.sessions.ttl_s)
        gone, keys = self.sessions.expire(now)
        if not gone:
            return 0
        n = self.store.discard(keys)
        self.stats.sessions_expired += len(gone)
        log.info("expired %d idle session(s): removed %d stored chunks", len(gone), n)
        return n

    def look_ahead(self, waiting: Sequence[Request]) -> None:
        """Protect from eviction what the next queued requests need; prefetch it into memory where
        the planner says the copy-up pays for itself (`Planner.prefetch_pays`)."""
        mem = self.store.memory
        if not self.lookahead or mem is None or not waiting:
            return
        matches = [self.store.lookup(r.all_ids, r.cache_salt) for r in waiting]
        next_use: dict[str, int] = {}
        for pos, m in enumerate(matches):
            for c in m.chunks:
                next_use.setdefault(c.key, pos)
        n = lookahead.window([sum(c.nbytes for c in m.chunks) for m in matches], max(mem.capacity - mem.used, 0))
        keys = {c.key for m in matches[:n] for c in m.chunks}
        for p in self.lookahead:
            p.set_future(next_use, keys)
        for m in matches[:n]:
            for c in m.chunks:
                if c.tier != mem.name and self.planner.prefetch_pays(c.tier, c.nbytes, mem.name) \
                        and self.store.prefetch(c):
                    self.stats.prefetches += 1


class StoreStepping:
    """The step side over a store: capture for the saver, the restorer's hook and close-out."""

    def __init__(self, restorer: Restorer, saver: Saver, config: ReuseConfig) -> None:
        self.restorer, self.saver = restorer, saver
        self.save = config.save

    def capture_for(self, reqs: Sequence[Request]) -> CaptureFn | None:
        return self.saver.capture_for(reqs) if self.save else None

    def restore_hook(self, request_ids: Sequence[str]) -> Callable[[int], None] | None:
        return self.restorer.hook(request_ids)

    def given_logits(self, request_id: str, start: int) -> torch.Tensor | None:
        return self.restorer.given_logits(request_id, start)

    def after_execute(self, request_ids: Sequence[str]) -> dict[str, int]:
        failed = self.restorer.finish(request_ids)
        for rid in failed:
            self.saver.drop(rid)
        return failed

    def before_sample(self, reqs: Sequence[Request]) -> None:
        if self.save:
            self.saver.before_sample(reqs)

    def after_step(self, req: Request, finished: bool) -> None:
        if self.save:
            self.saver.after_step(req, finished)


class StoreLink:
    """The link over a store: both halves share one restorer and one saver."""

    def __init__(self, store: TieredStore, layout: Sequence[Repr], runner: ModelRunner, planner: Planner,
                 config: ReuseConfig) -> None:
        self.store: TieredStore | None = store
        self._store = store
        self.layout = tuple(layout)
        self.stats = LinkStats()
        self.saver = Saver(store, self.layout, config.chunk_tokens, runner)
        self.restorer = Restorer(store, runner, planner, self.layout, config, self.stats)
        self._scheduler_side = StoreScheduling(store, self.restorer, self.saver, planner, config, self.stats)
        self._step_side = StoreStepping(self.restorer, self.saver, config)
        self.planner = planner

    @property
    def scheduler_side(self) -> StoreScheduling:
        return self._scheduler_side

    @property
    def step_side(self) -> StoreStepping:
        return self._step_side

    def idle_wait(self, timeout: float) -> None:
        self.restorer.wait_any(timeout)

    def adopt_profile(self, profile: HardwareProfile) -> None:
        self.planner.adopt(profile)

    def flush(self, timeout: float | None) -> bool:
        return self._store.flush(timeout)

    def report(self, with_store: bool = True) -> LinkReport:
        return LinkReport(counters=self.stats.as_dict(self.saver.saves),
                          reused_by_method=dict(self.restorer.reused_by_method),
                          reused_by_tier=dict(self.restorer.reused_by_tier), layout=tuple(r.value for r in self.layout),
                          stored_bytes_per_token=self._store.namespace.bytes_per_token() if self._store.namespace else 0,
                          store=self._store.stats() if with_store else None)

    def precompile(self, documents: Sequence[Sequence[int]], salt: str) -> tuple[int, int]:
        segments = self.restorer.segments
        if segments is None:
            raise ValueError("blended restores need K/V or hidden states in every layer; this store's layout keeps "
                             f"none for some ({', '.join(r.value for r in self.layout)})")
        if not segments.save:
            raise ValueError("precompiling documents stores their state: this engine saves nothing (save is off)")
        stored = 0
        for doc in documents:
            if segments.find(doc, salt) is not None:
                stored += 1
            else:
                segments.compute(doc, salt)
        return stored, len(documents) - stored

    def close(self) -> None:
        self.restorer.close()
        self._store.close()

def open_store_link(model: LoadedModel, runner: ModelRunner, spec: str, reuse: ReuseConfig, profile: HardwareProfile,
                    prefill_chunk_tokens: int, calibration: ProbeCalibration | None = None) -> StoreLink:
    """Choose what to store per layer, open the store in that namespace, wire the planner.
    `calibration`: the importance restore's probe heads (default: the cached one, else the paper's
    first heads)."""
    cfg = model.config
    parsed = parse_spec(spec)
    warn_if_unsealed(parsed, reuse.seal)
    tiers = parsed.tiers()

    importance = reuse.importance
    probes = probe_kv_heads_for(cfg.num_kv_heads) if importance else 0
    calib = calibration or (cached_calibration(model, probes) if importance else None) or UNCALIBRATED

    def namespace(layout: Sequence[Repr]) -> StoreNamespace:
        # State computed with the plain kernels rounds by its chunking: never under an exact key;
        # nor state of one exact kernel under another's (bf16 GEMM attention or the flash kernel).
        kernels = model.module.kernels
        if not kernels.exact:
            fingerprint = f"{model.fingerprint}+inexact"
        elif exact_cpu(runner.device, kernels):
            fingerprint = model.fingerprint + exact_attention.numerics_tag(model.dtype, cfg.num_heads, cfg.num_kv_heads,
                                                                           cfg.head_dim, kernels.bf16_attention)
        else:
            fingerprint = model.fingerprint
        return StoreNamespace(fingerprint, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, cfg.hidden_size,
                              compute_dtype=name_of(model.dtype), storage_dtype=reuse.storage_dtype,
                              layer_reprs=tuple(layout),
                              probe_kv_heads=probes, probe_first=calib.first,
                              granule_tokens=PROBE_GRANULE_TOKENS if importance else 0)

    probe = namespace((Repr.KV,) * cfg.num_layers)  # per-layer sizes do not depend on the layout
    shape = ModelShape(cfg.num_layers, probe.layer_bytes_per_token(Repr.KV), probe.layer_bytes_per_token(Repr.HIDDEN))
    # Share of layers that read only the probe keys and the kept tokens: under the threshold the
    # calibrated share; without it every layer; H2O reads every key in every layer.
    passes = {ImportanceSelection.IMPRESS: calib.pass_rate, ImportanceSelection.PROBES: 1.0,
              ImportanceSelection.H2O: 0.0}[reuse.impress.selection]
    reads = ImportanceReads.initial(reuse.impress.ratio, probes, cfg.num_kv_heads, PROBE_GRANULE_TOKENS,
                                    ImpressPolicy.of(reuse.impress).unit, passes) if importance else None
    planner = Planner(profile, shape, links(profile, [(n, em.bandwidth, em.latency) for n, em in tiers]),
                      prefill_chunk_tokens=prefill_chunk_tokens, importance=reads)
    if reuse.layout is not None:
        if len(reuse.layout) != cfg.num_layers:
            raise ValueError(f"ReuseConfig.layout has {len(reuse.layout)} entries; {model.name} has {cfg.num_layers} layers")
        layout = tuple(Repr(r) for r in reuse.layout)
    else:  # decided for the slowest tier of the stack
        # An importance restore needs K/V in every layer: with lossy allowed, auto stores K/V too.
        layout = planner.choose_layout(Method.IMPRESS if importance else reuse.fixed_method, tiers[-1][0],
                                       reuse.chunk_tokens, cfg.max_position_embeddings)
    # One request's save can hold its whole context (a long prompt prefilled in one step is one
    # snapshot): the writer's queue must take two of those, or it drops them (a long context of a
    # Llama-3-8B-sized model is the whole default bound).
    ns = namespace(layout)
    queue = max(DEFAULT_QUEUE_BYTES, 2 * runner.max_positions * ns.bytes_per_token())
    store = TieredStore.open(spec, ns, chunk_tokens=reuse.chunk_tokens, policy=reuse.eviction_policy.value,
                             pin=runner.device.type == "cuda", seal=reuse.seal, writer_queue_bytes=queue)
    if importance and ImpressPolicy.of(reuse.impress).unit == 1:  # whole granules need no reordering
        store.reorder_every(reuse.impress.reorder_s)
    return StoreLink(store, layout, runner, planner, reuse)
