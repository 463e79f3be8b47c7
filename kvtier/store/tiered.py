"""TieredStore: the one object the engine talks to.

Reads go to the fastest tier holding a chunk; a hit in a slower tier is promoted to memory in the
background. Saves are write-through: the background writer puts each chunk in memory (a cache)
and in every durable tier (disk, redis); an entry evicted from a tier is demoted to the next one
if no lower tier already holds it.
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Iterable, Mapping, Sequence

import torch

from . import format as fmt
from .index import ChunkRef, PrefixMatch, StoredChunk, longest_prefix
from .keys import (
    DEFAULT_CHUNK_TOKENS,
    PREFIX_GRANULE,
    Child,
    chunk_key,
    chunk_spans,
    lead_key,
    matched_tokens,
    prefix_digests,
    salted_root,
    store_digest,
)
from .layout import StoreNamespace
from .lookahead import LookAheadPolicy
from .policy import EvictionPolicy, ScorePolicy, make_policy
from .reads import PlannedReads
from .redact import redact
from .reorder import MIN_OBSERVATIONS, ImportanceStats, ReorderReport
from .saving import PendingSave, SaveJob, check_job, chunk_layers, job_nbytes
from .seal import Seal
from .spec import parse_spec
from .staging import Staging
from .tiers.base import Expect, Tier
from .tiers.disk import DiskTier
from .tiers.memory import MemoryTier
from .writer import BackgroundWriter

log = logging.getLogger(__name__)
DEFAULT_QUEUE_BYTES = 1 << 30


@dataclass(frozen=True)
class VerifyReport:
    checked: int
    corrupt: tuple[tuple[str, str, str], ...]  # (tier, key, reason)
    per_tier: dict

    @property
    def clean(self) -> bool:
        return not self.corrupt


@dataclass(frozen=True)
class _Promote:
    key: str
    tier: Tier


@dataclass(frozen=True)
class _Reorder:
    min_observations: int


class TieredStore:
    def __init__(self, tiers: list[Tier], namespace: StoreNamespace | None, chunk_tokens: int,
                 writer_queue_bytes: int, spec_text: str = "", seal: Seal = Seal()) -> None:
        if chunk_tokens <= 0:
            raise ValueError(f"chunk_tokens must be positive, got {chunk_tokens}")
        self.tiers = tiers
        self.namespace = namespace
        self.chunk_tokens = chunk_tokens
        self.spec_text = spec_text
        self.seal = seal
        self.root = store_digest(namespace.digest(), chunk_tokens, seal.key_id()) if namespace else None
        self.memory = next((t for t in tiers if isinstance(t, MemoryTier)), None)
        for t in tiers:
            t.on_evict = self._demote
            t.seal = seal
        self.counters = dict(saves=0, chunks_written=0, chunks_skipped=0, partials_superseded=0, discarded=0,
                             promotions=0, lookup_errors=0)
        self._promoting: set[str] = set()
        self.staging = Staging()  # aligned read buffers, kept for the next restore
        self.writer = BackgroundWriter(self._process, writer_queue_bytes)
        self.importance = ImportanceStats()  # fed by importance-only restores, read by reorder passes
        self.last_reorder = ReorderReport()
        self._reorder_timer: threading.Thread | None = None
        self._closing = threading.Event()

    # --- construction -------------------------------------------------------------------------
    @classmethod
    def open(cls, spec: str, namespace: StoreNamespace | None, chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
             policy: str = "lru", writer_queue_bytes: int = DEFAULT_QUEUE_BYTES,
             fsync: bool = False, pin: bool = False, seal: Seal = Seal()) -> "TieredStore":
        """`pin`: the engine runs on CUDA, so host memory the store reads into (the memory tier,
        staging buffers) is pinned for asynchronous copies to the device. `seal`: the store
        secret, when the servers sharing the store have one (seal.py)."""
        parsed = parse_spec(spec)
        make_policy(policy)  # validate the name before touching any tier
        ns = store_digest(namespace.digest(), chunk_tokens, seal.key_id()) if namespace else None
        tiers: list[Tier] = []
        if parsed.memory:
            tiers.append(MemoryTier(parsed.memory.capacity, make_policy(policy), parsed.memory.emulation, pin=pin))
        if parsed.disk:
            disk = DiskTier(list(parsed.disk.paths), list(parsed.disk.capacities), ns,
                            lambda: make_policy(policy), parsed.disk.emulation, fsync)
            disk.read_ahead = not pin
            tiers.append(disk)
        if parsed.redis:
            from .tiers.redis_tier import RedisTier
            tiers.append(RedisTier(parsed.redis, ns))
        store = cls(tiers, namespace, chunk_tokens, writer_queue_bytes, spec, seal)
        store.staging.pin = pin
        return store

    def __enter__(self) -> "TieredStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _ns(self) -> StoreNamespace:
        if self.namespace is None:
            raise RuntimeError("this store was opened without a namespace (admin mode): "
                               "only stats, verify and clear are available")
        return self.namespace

    def _root(self, salt: str = "", space: str = "") -> str:
        self._ns()  # raises in admin mode
        assert self.root is not None  # set whenever there is a namespace
        return salted_root(self.root, salt, space)

    def _expect(self, key: str, span: tuple[int, int] | None = None) -> Expect:
        """What a chunk read under this store's namespace must be (validate.py); `span`: the
        tokens the caller planned it to hold, when known."""
        ns = self.namespace
        if ns is None:
            return Expect(key)
        return Expect(key, self.root, ns.model_fingerprint, ns, self.chunk_tokens, span)

    def _expect_chunk(self, c: StoredChunk) -> Expect:
        return self._expect(c.key, (c.start, c.end))

    def tier(self, name: str) -> Tier:
        return next(t for t in self.tiers if t.name == name)

    # --- lookup and reads ---------------------------------------------------------------------
    def lookup(self, token_ids: Sequence[int], salt: str = "", space: str = "") -> PrefixMatch:
        """The longest stored prefix of `token_ids` under `salt`, in the exact chains or in `space`."""
        ns = self._ns()
        try:
            return longest_prefix(self._root(salt, space), token_ids, self.chunk_tokens, self.tiers,
                                  ns.layer_reprs, self._size_of, self._prefix_of)
        except Exception as e:  # noqa: BLE001 - tiers turn their own failures into misses; this is the
            # last line: a lookup is a hint, and a failing one must cost a recompute, not a request
            self.counters["lookup_errors"] += 1
            if self.counters["lookup_errors"] == 1:  # the counter (/metrics) tells how often after
                log.warning("store lookup failed (%s: %s); treated as a miss", type(e).__name__, e)
            return PrefixMatch((), 0)

    def _size_of(self, tier_name: str, key: str, tokens: int) -> int:
        known = self.tier(tier_name).size_of(key)
        return known if known is not None else self._ns().bytes_per_token() * tokens  # redis: no extra trip

    def _prefix_of(self, tier_name: str, child: Child, start: int) -> tuple[str, ...] | None:
        """A stored chunk's prefix digests, from its header checked as the chunk at `start`."""
        oc = self.tier(tier_name).open_chunk(self._expect(child.key, (start, start + child.tokens)))
        if oc is None:
            return None
        oc.close()
        return oc.header.prefix

    def read_layers(self, ref_or_key: ChunkRef | str, layers: Iterable[int],
                    parts: Iterable[str] = ("k", "v", "h"), copy: bool = True,
                    tier: str | None = None) -> list[fmt.LayerState] | None:
        """Parts of `layers` of one chunk, in the compute dtype; None if no tier (or not `tier`,
        where named) has it intact.

        copy=False lets tensors alias the memory tier's cached bytes: for readers that never
        modify what they get (the restore executor), it saves a copy per read."""
        return self._read(ref_or_key, list(layers), tuple(parts), copy, only=tier)

    def read_chunk(self, ref_or_key: ChunkRef | str, copy: bool = True) -> list[fmt.LayerState] | None:
        """Every layer of one chunk (one sequential read per tier)."""
        return self._read(ref_or_key, None, ("k", "v", "h"), copy)

    def _read(self, ref_or_key, layers: list[int] | None, parts: tuple[str, ...], copy: bool = True,
              expect: Expect | None = None, only: str | None = None):
        self._ns()
        key = ref_or_key.key if isinstance(ref_or_key, ChunkRef) else ref_or_key
        if expect is None:
            expect = self._expect_chunk(ref_or_key) if isinstance(ref_or_key, ChunkRef) else self._expect(key)
        for t in self.tiers if only is None else [self.tier(only)]:
            data = t.read(expect, layers, parts)
            if data is None:
                continue  # a miss or a corrupt copy (removed): a lower tier may still hold it
            if t is not self.memory and self.memory is not None:
                self._schedule_promotion(key, t)
            want = range(len(data.header.layer_reprs)) if layers is None else layers
            return fmt.decode_layers(data.header, data.segments, want, parts, copy=copy and not t.owned_buffers)
        return None

    def planned_reads(self, chunks: Sequence[StoredChunk]) -> PlannedReads:
        """Reads of exactly `chunks`, each from the tier named on it (a restore plan's contract)."""
        self._ns()
        return PlannedReads(self.tiers, self._expect_chunk, chunks, self.staging)

    def promote(self, chunks: Sequence[StoredChunk]) -> None:
        """Copy chunks a restore read from below the memory tier into it, in the background (after
        the restore, so the copy never competes with it)."""
        score = self.score_policy()
        for c in chunks:
            if self.memory is not None and c.tier != self.memory.name:
                if score is not None:
                    score.access(c.key)  # read from below: counts toward its score all the same
                self._schedule_promotion(c.key, self.tier(c.tier))

    def score_policy(self) -> ScorePolicy | None:
        """The memory tier's score policy (under the engine's look-ahead wrapper), if it runs one."""
        policy: EvictionPolicy | None = self.memory.policy if self.memory is not None else None
        if isinstance(policy, LookAheadPolicy):
            policy = policy.base
        return policy if isinstance(policy, ScorePolicy) else None

    def observe_importance(self, ratios: Mapping[str, float]) -> None:
        """An importance-only restore's share of each chunk's tokens it needed (IMPRESS scores: the
        memory tier, run with policy "score", keeps the chunks whose important part is read most)."""
        score = self.score_policy()
        if score is not None and self.memory is not None:
            with self.memory.lock:  # the policy is the tier's, used under its lock
                for key, ratio in ratios.items():
                    score.observe(key, ratio)

    def observe_kept(self, kept: Mapping[str, torch.Tensor]) -> None:
        """An importance-only restore's kept tokens per chunk ({key: [layers, tokens] bool}): what
        reorder passes order each chunk's rows by."""
        for key, mask in kept.items():
            self.importance.observe(key, mask)

    # --- reordering (IMPRESS §4.4.1; store/reorder.py) -----------------------------------------
    def reorder(self, min_observations: int = MIN_OBSERVATIONS) -> ReorderReport:
        """Rewrite every chunk seen by enough importance restores whose best row order changed."""
        t0 = time.perf_counter()
        report = ReorderReport()
        for key, order in self.importance.due(min_observations):
            n = self.rewrite(key, order)
            if n > 0:
                report.chunks += 1
                report.nbytes += n
            elif n == 0:
                report.unchanged += 1
            else:
                report.missing += 1
        report.seconds = time.perf_counter() - t0
        return report

    def rewrite(self, key: str, order: torch.Tensor) -> int:
        """Store full chunk `key` again with layer l's K/V rows in token order `order[l]`, on every
        tier holding it. -> bytes written; 0 if already in that order; -1 if gone or partial."""
        written, held = 0, False
        packed: fmt.PackedChunk | None = None  # packed once, from the first tier that needs it
        for t in self.tiers:
            oc = t.open_chunk(self._expect(key))  # the header alone
            if oc is None:
                continue
            h = oc.header
            oc.close()
            if h.partial or tuple(order.shape) != (len(h.layer_reprs), h.tokens):
                continue  # a partial chunk is superseded when it fills: nothing to gain
            held = True
            if h.order is not None and torch.equal(h.order, order) or h.order is None and \
                    torch.equal(order, torch.arange(h.tokens).expand_as(order)):
                continue
            if packed is None:
                packed = self._repacked(t, key, order)
                if packed is None:
                    continue
            if t.replace(packed):
                written += packed.nbytes
        return written if held else -1

    def _repacked(self, tier: Tier, key: str, order: torch.Tensor) -> fmt.PackedChunk | None:
        """Chunk `key` as `tier` holds it (whole and verified), packed again with K/V rows in `order`."""
        data = tier.read(self._expect(key), None)
        if data is None:
            return None
        h = data.header
        states = fmt.decode_layers(h, data.segments, range(len(h.layer_reprs)), ("k", "v", "h"))  # token order
        layers = {st.layer: {p: getattr(st, p) for p in st.repr.parts()} for st in states}
        return fmt.pack(self._ns(), self._root(), key, h.parent, h.index, h.start, False, layers, order, self.seal,
                        h.prefix)

    def reorder_every(self, interval_s: float, min_observations: int = MIN_OBSERVATIONS) -> None:
        """Queue a reorder pass on the writer every `interval_s` seconds (0: never), skipped while
        saves are waiting: reordering only ever uses the writer's idle time."""
        if interval_s <= 0 or self._reorder_timer is not None:
            return

        def loop() -> None:
            while not self._closing.wait(interval_s):
                if len(self.importance) and self.writer.idle:
                    self.writer.submit(_Reorder(min_observations), 0)

        self._reorder_timer = threading.Thread(target=loop, name="kvtier-reorder", daemon=True)
        self._reorder_timer.start()

    def prefetch(self, ref: ChunkRef) -> bool:
        """Bring a chunk into the memory tier in the background (look-ahead); True if queued."""
        if self.memory is None or self.memory.contains(ref.key):
            return False
        tier = next((t for t in self.tiers if t is not self.memory and t.contains(ref.key)), None)
        if tier is None or ref.key in self._promoting:
            return False
        self._schedule_promotion(ref.key, tier)
        return True

    def _schedule_promotion(self, key: str, tier: Tier) -> None:
        assert self.memory is not None  # callers promote only into an existing memory tier
        if key in self._promoting or self.memory.contains(key):
            return
        score = self.score_policy()
        if score is not None:  # admission by score: a chunk comes in only if it beats the lowest held
            room = self.memory.used + self._ns().bytes_per_token() * self.chunk_tokens <= self.memory.capacity
            if not score.admit(key, room):
                return
        self._promoting.add(key)
        self.writer.submit(_Promote(key, tier), 0)

    # --- saving -------------------------------------------------------------------------------
    def save(self, token_ids: Sequence[int], start: int, k: torch.Tensor | None,
             v: torch.Tensor | None, h: torch.Tensor | None, salt: str = "", space: str = "") -> None:
        """Hand a host snapshot of tokens [start, len(token_ids)) to the background writer
        (`space`: keyed apart from the exact chains, keys.salted_root)."""
        ns = self._ns()
        job = SaveJob(tuple(int(t) for t in token_ids), int(start), k, v, h, salt, space)
        check_job(ns, job)
        self.counters["saves"] += 1
        self.writer.submit(job, job_nbytes(job))

    def save_pending(self, pending: PendingSave) -> None:
        """Hand a snapshot still in flight from the device to the writer, which waits for it (the
        engine's step never does)."""
        if not 0 <= pending.start < len(pending.token_ids):
            raise ValueError(f"save: start={pending.start} outside the context of {len(pending.token_ids)} tokens")
        self.counters["saves"] += 1
        self.writer.submit(pending, pending.nbytes)

    def _process(self, job) -> None:
        if isinstance(job, PendingSave):
            job = job.job()
            check_job(self._ns(), job)
        if isinstance(job, _Promote):
            self._promote(job)
        elif isinstance(job, _Reorder):
            self.last_reorder = self.reorder(job.min_observations)
        else:
            self._write_job(job)

    def _write_job(self, job: SaveJob) -> None:
        ns, root = self._ns(), self._root(job.salt, job.space)
        for span in chunk_spans(root, job.token_ids, self.chunk_tokens):
            if span.end <= job.start:
                continue
            missing = [t for t in self.tiers if not t.contains(span.key)]
            if not missing:
                continue
            prefix = None
            if span.start < job.start:
                prefix = self._stored_prefix(job.token_ids, span.parent, span.start, job.start)
                if prefix is None:
                    self.counters["chunks_skipped"] += 1
                    continue  # later chunks only need their tokens, so keep going
            layers = chunk_layers(ns, job, span.start, span.end, prefix)
            partial = span.length < self.chunk_tokens
            # The header names the store digest (unsalted: what every reader expects); the salt
            # lives in the key chain (span.parent, span.key).
            packed = fmt.pack(ns, self._root(), span.key, span.parent, span.index, span.start,
                              partial, layers, seal=self.seal,
                              prefix=prefix_digests(span.parent, job.token_ids[span.start:span.end]))
            for t in missing:
                t.put(packed)
            self.counters["chunks_written"] += 1
            self._supersede(job.token_ids, span.parent, span.start, span.length)

    def _stored_prefix(self, token_ids, parent: str, lo: int, hi: int):
        """Stored state of tokens [lo, hi) from a chunk under `parent` that begins with them (a
        partial one, or one a restore reused in part), or None."""
        need = hi - lo
        ids = token_ids[lo:lo + self.chunk_tokens]
        for t in self.tiers:
            for child in sorted(t.children(parent, lead_key(parent, ids)), key=lambda c: c.tokens):
                if child.tokens < need:
                    continue
                whole = child.tokens <= len(ids) and chunk_key(parent, ids[:child.tokens]) == child.key
                if not whole:
                    prefix = self._prefix_of(t.name, child, lo) if child.lead and need >= PREFIX_GRANULE else None
                    if prefix is None or matched_tokens(parent, ids, child, prefix) < need:
                        continue
                expect = self._expect(child.key, (lo, lo + child.tokens))
                states = self._read(child.key, None, ("k", "v", "h"), expect=expect)
                if states is None:
                    continue
                return {s.layer: {p: getattr(s, p)[:need] for p in ("k", "v", "h")
                                  if getattr(s, p) is not None} for s in states}
        return None

    def _supersede(self, token_ids, parent: str, lo: int, length: int) -> None:
        """Delete stored partial chunks that are strict prefixes of the chunk just written."""
        lead = lead_key(parent, token_ids[lo:lo + length])
        for t in self.tiers:
            for child in t.children(parent, lead):
                if child.tokens < length and chunk_key(parent, token_ids[lo:lo + child.tokens]) == child.key:
                    for tt in self.tiers:
                        tt.delete(child.key)
                    self.counters["partials_superseded"] += 1

    def _promote(self, job: _Promote) -> None:
        try:
            if self.memory is None or self.memory.contains(job.key):
                return
            data = job.tier.read(self._expect(job.key), None)
            if data is None or data.whole is None:
                return
            packed = fmt.PackedChunk(data.header, (data.whole.numpy().data,))
            if self.memory.put(packed):
                self.counters["promotions"] += 1
        finally:
            self._promoting.discard(job.key)

    def _demote(self, tier: Tier, key: str) -> None:
        """Called before `tier` evicts `key`: keep one copy in the next tier down."""
        lower = self.tiers[self.tiers.index(tier) + 1:]
        if not lower or any(t.contains(key) for t in lower):
            return
        data = tier.read(self._expect(key), None, verify=True)
        if data is None or data.whole is None:
            return
        packed = fmt.PackedChunk(data.header, (data.whole.numpy().data,))
        for t in lower:
            if t.put(packed):
                return

    def keys_for(self, token_ids: Sequence[int], salt: str = "") -> list[str]:
        """Keys of every chunk (a trailing partial one included) that would hold `token_ids`."""
        return [s.key for s in chunk_spans(self._root(salt), token_ids, self.chunk_tokens)]

    def discard(self, keys: Iterable[str]) -> int:
        """Delete chunks from every tier (retention, not eviction: nothing is demoted). -> chunks removed."""
        n = 0
        for key in keys:
            held = [t for t in self.tiers if t.contains(key)]
            for t in held:
                t.delete(key)
            n += bool(held)
        self.counters["discarded"] += n
        return n

    # --- lifecycle and admin ------------------------------------------------------------------
    def flush(self, timeout: float | None = None) -> bool:
        return self.writer.flush(timeout)

    def close(self) -> None:
        self._closing.set()
        if self._reorder_timer is not None:
            self._reorder_timer.join()
        self.writer.close()
        for t in self.tiers:
            t.close()
            t.on_evict = None  # (a bound method of this store: see BackgroundWriter.close)

    def stats(self) -> dict:
        return dict(spec=redact(self.spec_text), chunk_tokens=self.chunk_tokens,
                    namespace=self.root, store=dict(self.counters), writer=self.writer.stats(),
                    tiers={t.name: t.stats() for t in self.tiers}, last_reorder=vars(self.last_reorder))

    def verify(self) -> VerifyReport:
        """Read every chunk in every tier; remove and report the ones that fail any check."""
        self.flush()
        corrupt: list[tuple[str, str, str]] = []
        per_tier: dict = {}
        checked = 0
        for t in self.tiers:
            n_ok = n_bad = 0
            for key in t.iterate():
                why = t.check(self._expect(key))
                checked += 1
                if why is None:
                    n_ok += 1
                elif why not in ("missing", "unavailable"):
                    n_bad += 1
                    corrupt.append((t.name, key, why))
            per_tier[t.name] = dict(ok=n_ok, corrupt=n_bad)
        return VerifyReport(checked, tuple(corrupt), per_tier)

    def clear(self) -> dict:
        self.flush()
        return {t.name: t.clear() for t in self.tiers}
