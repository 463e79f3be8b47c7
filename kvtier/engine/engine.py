"""The Engine facade: requests in, tokens out. Each step is schedule -> execute -> update.

Output assembly (each step's logits rows, sampling, prompt logprobs, n > 1 samples, stop checks
and RequestOutputs) is assembly.py's; the facade wires the rooms and runs the loop.
"""

from __future__ import annotations

import functools
import itertools
import logging
import queue
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any, cast

import torch

from kvtier import paths
from kvtier.device import resolve_device
from kvtier.engine import budget, prompts
from kvtier.engine import documents as documents_
from kvtier.engine.assembly import FinishReason, Outputs, RequestOutput, SampleRows, StepHooks, sample_id
from kvtier.engine.block_pool import BlockPool
from kvtier.engine.calibrate import fronts as front_costs
from kvtier.engine.calibrate.hardware import estimate, load_profile, measure_slices, profile_path, save_profile
from kvtier.engine.calibrate.probes import ProbeCalibration
from kvtier.engine.config import EngineConfig, ReuseConfig
from kvtier.engine.corpus import Corpus, Finder
from kvtier.engine.idle import IdleTask, IdleWork
from kvtier.engine.link.store_link import NullStateLink, StateLink, open_store_link
from kvtier.engine.partial import Fronts, FullCaching, PartialCaching
from kvtier.engine.placement import AnyBlocks, KeepRuns, Placement
from kvtier.engine.prompts import PromptError
from kvtier.engine.request import Request, SamplingParams, check_priority
from kvtier.engine.runner.backends.static import StaticDecode
from kvtier.engine.runner.model_runner import ModelRunner, RunItem
from kvtier.engine.sampler import sample_batch
from kvtier.engine.scheduler import Scheduler
from kvtier.engine.scheduler_api import SchedulerOutput
from kvtier.engine.snapshot import EngineStats
from kvtier.engine.structured import Constraint, Grammars
from kvtier.models import exact_matmul, invariant
from kvtier.models.attention import exact_cpu
from kvtier.models.exact_attention import KEY_BLOCK, PIECE
from kvtier.models.kernels import Kernels
from kvtier.models.loading import LoadedModel
from kvtier.planning.blend import BlendOptions
from kvtier.planning.costs import HardwareProfile
from kvtier.planning.truncation import TruncationConfig

__all__ = ["Engine", "EngineStats", "FinishReason", "PromptError", "RequestOutput", "sample_id"]

log = logging.getLogger(__name__)


def _with_given(logits: torch.Tensor | None, items: Sequence[RunItem],
                given: Sequence[torch.Tensor | None]) -> torch.Tensor:
    """The step's logits rows in chunk order: the runner's for the computed `items` (`logits`,
    [rows, vocab]: every token of an all_logits item, else the last of a want_logits one) and
    each given chunk's [1, vocab] where `given` has it."""
    rows, at, computed = [], 0, iter(items)
    for g in given:
        if g is not None:
            rows.append(g)
            continue
        it = next(computed)
        n = len(it.token_ids) if it.all_logits else int(it.want_logits)
        if n:
            assert logits is not None
            rows.append(logits[at : at + n])
            at += n
    return torch.cat(rows)


class Engine:
    def __init__(self, model: LoadedModel, config: EngineConfig | None = None, store: str | None = None,
                 reuse: ReuseConfig | None = None, profile: HardwareProfile | None = None,
                 truncation: TruncationConfig | None = None, probes: ProbeCalibration | None = None,
                 sample_rows: SampleRows = sample_batch):
        """`store` is a tier spec (e.g. "memory:2GB,disk:/data:100GB"); with it every request's state
        is saved and restored across requests. Nothing is timed here: what the machine measures
        (`profile`, the importance restore's `probes`, partial caching's `PartialConfig.cost`)
        defaults to what was measured and cached before, else a documented estimate;
        `kvtier.engine.factory.make_engine` measures what is missing first. `sample_rows`: how a
        step's rows are sampled (the batched sampler; a benchmark passes its baseline)."""
        self.model = model
        self.truncation = truncation  # None: a prompt over the context window is an error
        self.config = config = config or EngineConfig()
        # The kernels are the model's state (models/kernels.py): an engine runs it with its config's.
        model.module.set_kernels(Kernels(config.exact, config.bf16_attention))
        cfg = model.config
        self.device = model.module.lm_head.weight.device
        if config.device is not None and resolve_device(config.device) != self.device:
            raise ValueError(f"EngineConfig.device is {config.device} but the model is on {self.device}; "
                             f"load it with load_model(..., device={config.device!r})")
        self.max_model_len = min(config.max_model_len or cfg.max_position_embeddings, cfg.max_position_embeddings)
        if config.max_model_len and config.max_model_len > cfg.max_position_embeddings:  # the CLI refuses it
            log.warning("max_model_len=%d is past %s's context window: using %d", config.max_model_len, model.name,
                        cfg.max_position_embeddings)
        self.budget = budget.choose(config, cfg, model.module.dtype, self.device, self.max_model_len)
        self.pool, self.runner = self._pool_and_runner(self._num_blocks())
        self.link: StateLink = NullStateLink()
        # Where the restore planner's machine profile came from: "given" (measured by the factory,
        # or the caller's), "saved" (`kvtier profile`'s), "estimate", "measured" (while idle,
        # replacing the estimate), or None without a store.
        self.profile_source: str | None = None
        self._store_spec = store
        # Blending marked documents: the options requests blend with, None where it is off.
        self.blend = (reuse or ReuseConfig()).blend
        # Documents found in prompts that mark none (engine/corpus.py): `--blend-corpus`'s, precompiled ones.
        self.corpus = Corpus()
        if store:
            self.link = self._open_link(store, reuse or ReuseConfig(), profile, probes)
            if self.blend is not None and "none" in self.link.report(with_store=False).layout:
                self.link.close()
                raise ValueError("blending loads K/V or hidden states in every layer, and this store keeps none for "
                                 "some: use --restore-method kv (or a layout without none)")
        # Drain saves and stop the store's threads when the engine is dropped or the interpreter
        # exits without close(): a thread still in torch code at shutdown aborts the process.
        self._closer = weakref.finalize(self, self.link.close)
        self.partial: Fronts = self._fronts()
        self.scheduler = Scheduler(self.pool, self.budget.max_batched_tokens, config.max_num_seqs, self.link.scheduler_side,
                                   prefix_cache=config.enable_prefix_cache, feeds=self.partial,
                                   defer_instant=self.runner.transfer.is_async)
        tok = model.tokenizer
        eos = set(cfg.eos_token_ids) | ({tok.eos_token_id} if tok is not None and tok.eos_token_id is not None else set())
        self.grammars = Grammars(tok, cfg.vocab_size)
        hooks = StepHooks(self.link.step_side, self.runner.copy_block, self.partial.forget)
        self.outputs = Outputs(self.scheduler, hooks, eos, self.max_model_len, tok, self.device, sample_rows)
        self._inbox: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()  # thread-safe entry point
        self._ids = itertools.count()
        self._steps = 0
        self.idle = IdleWork()
        self._profile_offered = False

    def _pool_and_runner(self, num_blocks: int) -> tuple[BlockPool, ModelRunner]:
        config, cfg = self.config, self.model.config
        # Exact CPU attention reads a decode's whole key blocks in place only while its blocks are
        # consecutive: each new run leaves one key block of growth to the run before it.
        kernels = self.model.module.kernels
        exact = exact_cpu(self.device, kernels)
        placement: Placement = AnyBlocks() if self.device.type != "cpu" else \
            KeepRuns(config.block_size, reach=PIECE if exact else 0, headroom=KEY_BLOCK if exact else 0)
        pool = BlockPool(num_blocks, config.block_size, placement)
        if exact:
            log.info("exact attention: %s", exact_matmul.why(self.model.dtype, cfg.num_heads, cfg.num_kv_heads,
                                                            cfg.head_dim, kernels.bf16_attention))
        max_seqs, window = config.max_num_seqs, self.max_model_len
        runner = ModelRunner(
            self.model.module, num_blocks, config.block_size, window, staging_bytes=self.budget.staging_bytes,
            # The pool, not the engine: the runner holds no reference back to the engine.
            clearable=lambda run, slots: not run.placed_ahead and
            pool.clearable(run.block_ids, slots.start, slots.stop, not run.off_thread),
            decoder=(lambda r: StaticDecode(r, max_seqs, window)) if self.budget.static_decode else None)
        decoder = runner.decoder
        log.info("KV pool %.2f GiB (%s): %d blocks of %d tokens; %d tokens per step; decode %s",
                 self.budget.kv_cache_bytes / (1 << 30), self.budget.source, num_blocks, config.block_size,
                 self.budget.max_batched_tokens, "dynamic" if decoder is None
                 else "through CUDA graphs" if decoder.graphs_on else "through static buffers")
        return pool, runner

    def _open_link(self, store: str, reuse: ReuseConfig, profile: HardwareProfile | None,
                   probes: ProbeCalibration | None) -> StateLink:
        if profile is None:
            profile, self.profile_source = self._saved_profile()
        else:
            self.profile_source = "given"
        return open_store_link(self.model, self.runner, store, reuse, profile, self.budget.max_batched_tokens, probes)

    def _fronts(self) -> Fronts:
        if self.config.partial is None:
            return FullCaching()
        cost = self.config.partial.cost or front_costs.cached_or_estimate(self.model)
        return PartialCaching(self.config.partial, self.runner, cost)

    def _num_blocks(self) -> int:
        cfg, kv_bytes = self.config, self.budget.kv_cache_bytes
        num_blocks = kv_bytes // ModelRunner.bytes_per_block(self.model.module, cfg.block_size)
        blocks_per_seq = -(-self.max_model_len // cfg.block_size)
        if num_blocks < blocks_per_seq:
            raise ValueError(
                f"kv_cache_bytes={kv_bytes} ({self.budget.source}) holds {num_blocks} blocks but one full-length sequence "
                f"needs {blocks_per_seq}; raise the KV budget or lower max_model_len"
            )
        return num_blocks

    def _saved_profile(self) -> tuple[HardwareProfile, str]:
        """The profile `kvtier profile` (or the factory) saved for this model, else an estimate."""
        profile = load_profile(self.model, paths.home())
        if profile is not None:
            return profile, "saved"
        log.warning("no measured hardware profile for %s on this machine: restores are planned on an estimate "
                    "(every method stays exact) until it is measured%s; `kvtier profile --model %s` measures it at "
                    "once (minutes on a small CPU)", self.model.name,
                    " while no request is in flight" if self.config.measure_when_idle else "", self.model.name)
        return estimate(self.model), "estimate"

    # ----- measured while idle (engine/idle.py) ---------------------------------------------
    def idle_slice(self) -> bool:
        """One slice of what this start did not measure; False when there is nothing to measure."""
        return self.idle.run_slice((self._offer_plans, self._offer_profile))

    def _offer_plans(self) -> IdleTask | None:
        if not self.config.measure_when_idle or not invariant.has_pending():
            return None
        return IdleTask("the linears' larger row plans", invariant.refine(), lambda _: None)

    def _offer_profile(self) -> IdleTask | None:
        if not self.config.measure_when_idle or self.profile_source != "estimate" or self._profile_offered:
            return None
        self._profile_offered = True  # once: a failed measurement is not retried every idle moment
        return IdleTask("this machine's profile", measure_slices(self.model, self._store_spec), self._adopt_profile)

    def _adopt_profile(self, profile: HardwareProfile) -> None:
        """Plan restores on `profile` from now on, and keep it for the next start. What the store
        keeps per layer was chosen at the start and stays for this process."""
        save_profile(profile, profile_path(paths.home(), self.model))
        self.link.adopt_profile(profile)
        self.profile_source = "measured"
        log.info("this machine's profile is measured; restores are planned on it (saved for the next start)")

    # ----- requests -------------------------------------------------------------------------
    def encode(self, prompt: str | Sequence[int], add_special_tokens: bool = False) -> list[int]:
        return prompts.encode(self.model, prompt, add_special_tokens)

    def encode_chat(self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True,
                    tools: list[dict[str, Any]] | None = None) -> list[int]:
        return prompts.encode_chat(self.model, messages, add_generation_prompt, tools)

    def validate(self, ids: Sequence[int]) -> None:
        prompts.validate(ids, self.max_model_len, self.model.config.vocab_size)

    @functools.cached_property
    def _longest_token_chars(self) -> int | None:
        return prompts.longest_token_chars(self.model.tokenizer)

    def finder(self, blend: bool | BlendOptions | None, cache_salt: str | None) -> Finder | None:
        """What finds the corpus's documents in a request's unmarked prompt: None where the request
        does not blend (`blend` False, or None where the engine does not) or nothing is known."""
        if blend is False or (blend is None and self.blend is None) or not len(self.corpus):
            return None
        longest = self._longest_token_chars
        return self.corpus.finder(cache_salt or "", max_ids=self.max_model_len,
                                  max_chars=None if longest is None else self.max_model_len * longest)

    def add_request(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        on_output: Callable[[RequestOutput], None] | None = None,
        session_id: str | None = None,
        cache_salt: str | None = None,
        constraint: Constraint | None = None,
        *,
        priority: int = 0,
        cache_prompt: bool = True,
        documents: Sequence[str | Sequence[int]] | None = None,
        segments: Sequence[tuple[int, int]] = (),
        blend: bool | BlendOptions | None = None,
    ) -> str:
        """Queue a request (safe from any thread); it joins the batch at the next step.
        `cache_salt`: only requests with the same salt share cached or stored state.
        `constraint`: params.structured's, made already (`grammars.build`); else made here, on a
        grammar thread while the caller waits, never on the step's.
        `priority` (vLLM's): waiting requests are admitted lowest value first, equal ones in
        arrival order; running requests are not preempted for it.
        `cache_prompt` (llama-server's): False neither reuses cached or stored state nor leaves
        any (same answer, computed in full).
        `documents` (texts or ids in prompt order) or `segments` (spans of its ids) mark what a
        blended restore may load; `blend`: None as the engine allows (`ReuseConfig.blend`), False
        never, True or BlendOptions asks to (an error where blending is off). docs/blend.md."""
        priority = check_priority(priority)
        ids, spans = documents_.mark(self.encode, prompt, documents, segments, self.finder(blend, cache_salt))
        options = documents_.blend_options(blend, self.blend, self._store_spec is not None, spans)
        params = params or SamplingParams()
        params.check_vocab(self.model.config.vocab_size)
        if constraint is None and params.structured is not None:
            constraint = self.grammars.constraint(params.structured)
        ids, source, kept = prompts.truncate(ids, params.max_tokens, self.max_model_len, self.truncation)
        self.validate(ids)
        if request_id is not None and "#" in request_id:
            raise PromptError("a request id may not contain '#': it names the samples of an n > 1 request")
        rid = request_id or f"req-{next(self._ids)}"
        req = Request(rid, ids, params, session_id=session_id, cache_salt=cache_salt or "", priority=priority,
                      cache_prompt=bool(cache_prompt), source_ids=source, kept=kept,
                      segments=spans if kept is None and options else (), blend=options if kept is None else None)
        self._inbox.put(("add", (req, on_output, constraint)))
        return rid

    def precompile(self, documents: Sequence[str | Sequence[int]], cache_salt: str | None = None) -> tuple[int, int]:
        """Store each document's state computed alone, for blended requests (safe from any thread) -> (found, computed).
        The documents join the corpus: a later prompt of the same cache partition that marks none is
        searched for them."""
        documents = documents_.given(documents)
        docs = [self.encode(d) for d in documents]
        for d in docs:
            self.validate(d)
        counts = self.link.precompile(docs, cache_salt or "")
        self.corpus.add(zip([d if isinstance(d, str) else None for d in documents], docs), cache_salt or "")
        return counts

    def abort(self, request_id: str) -> None:
        self._inbox.put(("abort", request_id))

    def has_work(self) -> bool:
        return self.scheduler.has_work() or not self._inbox.empty()

    # ----- the step loop --------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """schedule -> execute -> update: one forward over every scheduled run."""
        self._steps += 1
        t = time.perf_counter()
        outputs = self._drain_inbox()
        out = self.scheduler.schedule()
        if not out.chunks and self.scheduler.restoring and self._inbox.empty():
            self.link.idle_wait(0.005)  # only restores in flight: sleep until one may be ready
        logits, void = self._execute(out)
        outputs += [self.outputs.emit(rid) for rid in out.aborted] + self.outputs.update(out, logits, void)
        self.partial.observe(time.perf_counter() - t)
        return outputs

    def _execute(self, out: SchedulerOutput) -> tuple[torch.Tensor | None, dict[str, int]]:
        """One forward of every scheduled run (and the decodes' front runs); restores attached to
        it are placed layer by layer. -> (logits, {request: restart position} for those whose
        restore failed mid-step)."""
        if not out.chunks:
            return None, {}
        link = self.link.step_side
        reqs = [self.outputs.request(c.request_id) for c in out.chunks]
        # A restore attached to the step may have computed a request's one token already (a blend
        # folds the prompt's last token into its passes): its logits join the step's as they are.
        every = [self.outputs.all_logits(c) for c in out.chunks]  # each token's logits (prompt logprobs)
        given = [link.given_logits(c.request_id, c.start) if c.end == c.start + 1 == r.num_tokens and not e else None
                 for r, c, e in zip(reqs, out.chunks, every)]
        computed = [(r, c, e) for r, c, e, g in zip(reqs, out.chunks, every, given) if g is None]
        items = [RunItem(r.all_ids[c.start : c.end], c.start, r.block_ids, want_logits=c.end == r.num_tokens,
                         all_logits=e, unslotted=r.unslotted, context_feed=r.fed)
                 for r, c, e in computed]
        ids = [c.request_id for c in out.chunks]
        logits = None
        if items:
            creqs = [r for r, _, _ in computed]
            fronts = self.partial.step_fronts(items, creqs)
            logits = self.runner.execute(items + list(fronts.runs), link.capture_for(creqs),
                                         before_layer=link.restore_hook([c.request_id for _, c, _ in computed]),
                                         feed=fronts.feed)
        if len(items) < len(given):
            logits = _with_given(logits, items, given)
        return logits, link.after_execute(ids)

    def stats(self, with_store: bool = True) -> EngineStats:
        """What the engine did so far and where it stands; `with_store=False` skips the store's
        own statistics (a remote tier's may take a round trip)."""
        st, sched, pool = self.link.report(with_store), self.scheduler, self.pool
        return EngineStats(steps=self._steps, preemptions=sched.num_preemptions,
                           prefix_cache_hits=pool.hits, counters=st.counters,
                           reused_by_method=st.reused_by_method, reused_by_tier=st.reused_by_tier,
                           layout=st.layout, stored_bytes_per_token=st.stored_bytes_per_token,
                           store=st.store, partial=self.partial.summary(), running=len(sched.running),
                           waiting=len(sched.waiting), restoring=len(sched.restoring),
                           kv_blocks_total=pool.num_blocks, kv_blocks_free=pool.num_free,
                           block_size=pool.block_size, prefix_cache_queries=pool.queries,
                           tiers=tuple(t.name for t in getattr(self.store, "tiers", ()) or ()))

    @property
    def eos_ids(self) -> set[int]:
        """The model's EOS ids: sampling one stops a request (unless it ignores EOS)."""
        return self.outputs.eos_ids

    @eos_ids.setter
    def eos_ids(self, ids: set[int]) -> None:
        self.outputs.eos_ids = set(ids)

    @property
    def store(self) -> Any:
        """The engine's TieredStore (None without one): its own statistics and admin calls."""
        return self.link.store

    def reset_prefix_cache(self) -> int:
        """Forget the device prefix cache's blocks no request holds (a benchmark's rows each start
        from the same device state); call it from the thread that steps. -> blocks forgotten."""
        return self.pool.forget_free()

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every save handed to the store so far is written. False on timeout."""
        return self.link.flush(timeout)

    def close(self) -> None:
        """Drain pending saves and stop the restore and writer threads (once; later calls do nothing)."""
        self.idle.close()
        self._closer()

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _drain_inbox(self) -> list[RequestOutput]:
        outs = []
        while not self._inbox.empty():
            kind, arg = self._inbox.get()
            if kind == "add":
                self.outputs.admit(*arg)
            else:
                outs += self.outputs.abort(arg)
        return outs

    # ----- convenience API ------------------------------------------------------------------
    def generate(
        self, prompts: str | Sequence[int] | Sequence[str | Sequence[int]], params: SamplingParams | None = None,
        priority: Sequence[int] | None = None, cache_prompt: bool = True,
        documents: Sequence[Sequence[str | Sequence[int]] | None] | None = None, blend: bool | BlendOptions | None = None,
    ) -> list[RequestOutput]:
        """Run a batch of prompts to completion (continuous batching); outputs in prompt order,
        with SamplingParams(n > 1) each prompt's n samples in index order. `priority`: one per
        prompt (vLLM's), the order in which they are admitted; `cache_prompt`: see add_request;
        `documents`: one list (or None) per prompt, and `blend`, see add_request."""
        single = isinstance(prompts, str) or (len(prompts) > 0 and isinstance(prompts[0], int))
        # `single` tells a lone prompt from a batch; mypy cannot narrow the union on prompts[0].
        batch = cast("list[str | Sequence[int]]", [prompts] if single else list(prompts))
        for name, per in (("priority", priority), ("documents", documents)):
            if per is not None and len(per) != len(batch):
                raise ValueError(f"{name} has {len(per)} values for {len(batch)} prompts")
        # Checked before any is queued: a bad value must not leave the others running unread.
        order = [check_priority(p) for p in priority] if priority is not None else [0] * len(batch)
        n = (params or SamplingParams()).n
        docs = documents if documents is not None else [None] * len(batch)
        ids = [sample_id(rid, i) for p, pri, d in zip(batch, order, docs)
               for rid in [self.add_request(p, params, priority=pri, cache_prompt=cache_prompt, documents=d, blend=blend)]
               for i in range(n)]
        final: dict[str, RequestOutput] = {}
        while len(final) < len(ids):
            for out in self.step():
                if out.finished:
                    final[out.request_id] = out
        return [final[i] for i in ids]

    def stream(self, prompt: str | Sequence[int], params: SamplingParams | None = None) -> Iterator[RequestOutput]:
        """Yield an output (with delta_text / delta_ids) each time the request makes progress."""
        rid = self.add_request(prompt, params)
        while True:
            for out in self.step():
                if out.request_id == rid:
                    yield out
                    if out.finished:
                        return

    def chat(self, messages: Sequence[dict[str, str]], params: SamplingParams | None = None) -> RequestOutput:
        return self.generate([self.encode_chat(messages)], params)[0]

