"""The Engine facade: requests in, tokens out. Each step is schedule -> execute -> update."""

from __future__ import annotations

import itertools
import logging
import queue
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, cast

import torch

from kvtier import paths
from kvtier.device import resolve_device
from kvtier.engine import budget
from kvtier.engine.block_pool import BlockPool
from kvtier.engine.calibrate import fronts as front_costs
from kvtier.engine.calibrate.hardware import estimate, load_profile, measure_slices, profile_path, save_profile
from kvtier.engine.calibrate.probes import ProbeCalibration
from kvtier.engine.config import EngineConfig, ReuseConfig
from kvtier.engine.detokenizer import Detokenizer
from kvtier.engine.idle import IdleTask, IdleWork
from kvtier.engine.link.store_link import NullStateLink, StateLink, open_store_link
from kvtier.engine.partial import Fronts, FullCaching, PartialCaching
from kvtier.engine.penalties import Seen
from kvtier.engine.request import Request, RequestMetrics, RequestStatus, RestoreReport, SamplingParams, check_priority
from kvtier.engine.runner.model_runner import ModelRunner, RunItem
from kvtier.engine.runner.static_decode import StaticDecode
from kvtier.engine.sampler import Row, Sampled, TokenLogprobs, make_generator, sample_batch, score
from kvtier.engine.scheduler import Scheduler
from kvtier.engine.scheduler_api import SchedulerOutput
from kvtier.engine.structured import Constraint, Grammars
from kvtier.models import exact_matmul, invariant
from kvtier.models.attention import exact_cpu
from kvtier.models.exact_attention import KEY_BLOCK, PIECE
from kvtier.models.loading import LoadedModel
from kvtier.planning.costs import HardwareProfile
from kvtier.planning.truncation import TruncationConfig, kept_positions

log = logging.getLogger(__name__)


class PromptError(ValueError):
    """A prompt the engine cannot run (empty, too long, bad token ids, no tokenizer)."""


FinishReason = Literal["stop", "length", "abort"]

_SCORE_ROWS = 256  # prompt rows scored per call: each call copies [rows, vocab] a few times

_FINISH_REASON: dict[RequestStatus, FinishReason] = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


@dataclass
class RequestOutput:
    request_id: str
    prompt_tokens: int
    output_ids: list[int]
    text: str
    delta_text: str
    delta_ids: list[int]
    finished: bool
    finish_reason: FinishReason | None
    queue_time: float | None
    ttft: float | None
    mean_tbt: float | None
    prompt_tokens_reused: int
    prompt_tokens_computed: int
    reused_by_tier: dict[str, int] = field(default_factory=dict)
    restore_method: str | None = None
    restore: RestoreReport | None = None  # what the restore from the store did and was predicted to take
    first_logits: torch.Tensor | None = None  # [vocab] on the host, with SamplingParams(first_logits=True)
    index: int = 0  # which of the request's n samples (each has its own request_id: `<id>#<index>`)
    logprobs: list[TokenLogprobs] | None = None  # with SamplingParams(logprobs=k): one per output token
    # With SamplingParams(prompt_logprobs=k): one per prompt token, None for the first (nothing before it).
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    # Why the engine ended the request itself (finish_reason "abort"): its grammar could not go on.
    error: str | None = None


@dataclass(frozen=True)
class EngineStats:
    """A snapshot of what the engine did so far (plain values, safe to keep)."""

    steps: int
    preemptions: int
    prefix_cache_hits: int  # full blocks found in the device prefix cache
    counters: dict[str, int]  # restores, restore_failures, restored_tokens, saves, prefetches, ...
    reused_by_method: dict[str, int]  # restored prompt tokens by restore method
    reused_by_tier: dict[str, int]  # restored prompt tokens by the store tier they were read from
    layout: tuple[str, ...] = ()  # what the store keeps per layer ("kv", "hidden", "none"); () without a store
    stored_bytes_per_token: int = 0  # payload bytes one token's stored state takes (all layers)
    store: dict[str, Any] | None = None  # TieredStore.stats(): per-tier bytes, hits, writer queue
    partial: dict[str, float] | None = None  # partial token-wise caching's totals and latest step; None when off


@dataclass
class _Live:
    """Per-request state the engine keeps beside the scheduler's Request."""

    req: Request
    detok: Detokenizer
    generator: torch.Generator | None
    on_output: Callable[[RequestOutput], None] | None
    constraint: Constraint | None = None
    index: int = 0
    forks: int = 0  # samples still to start from this one's prefill (n - 1 until its first token)
    logprobs: list[TokenLogprobs] | None = None
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    seen: Seen | None = None  # penalties: the tokens it has seen, kept across steps
    group: str = ""  # n > 1: the request's own id (its samples' key in Engine._samples)
    delta_text: str = ""
    delta_ids: list[int] = field(default_factory=list)
    first_logits: torch.Tensor | None = None
    error: str | None = None  # why the engine ended it (RequestOutput.error)


def _scores_prompt(live: _Live, start: int) -> bool:
    """Whether a run from `start` needs the logits of every token: its request asked for prompt
    logprobs, some are not scored yet, and the run predicts prompt tokens."""
    scored = live.prompt_logprobs
    return scored is not None and len(scored) < len(live.req.prompt_ids) and start < len(live.req.prompt_ids) - 1


def sample_id(request_id: str, index: int) -> str:
    """The request id of sample `index` of an n > 1 request (sample 0 is the request itself)."""
    return f"{request_id}#{index}" if index else request_id


class Engine:
    def __init__(self, model: LoadedModel, config: EngineConfig | None = None, store: str | None = None,
                 reuse: ReuseConfig | None = None, profile: HardwareProfile | None = None,
                 truncation: TruncationConfig | None = None, probes: ProbeCalibration | None = None):
        """`store` is a tier spec (e.g. "memory:2GB,disk:/data:100GB"); with it every request's state
        is saved and restored across requests. Nothing is timed here: what the machine measures
        (`profile`, the importance restore's `probes`, partial caching's `PartialConfig.cost`)
        defaults to what was measured and cached before, else a documented estimate;
        `kvtier.engine.factory.make_engine` measures what is missing first."""
        self.model = model
        invariant.set_exact((config or EngineConfig()).exact)
        if config is not None and config.bf16_attention is not None:
            exact_matmul.set_mode(config.bf16_attention)
        self.truncation = truncation  # None: a prompt over the context window is an error
        self.config = config = config or EngineConfig()
        cfg = model.config
        self.device = model.module.lm_head.weight.device
        if config.device is not None and resolve_device(config.device) != self.device:
            raise ValueError(f"EngineConfig.device is {config.device} but the model is on {self.device}; "
                             f"load it with load_model(..., device={config.device!r})")
        self.max_model_len = min(config.max_model_len or cfg.max_position_embeddings, cfg.max_position_embeddings)
        self.budget = budget.choose(config, cfg, model.module.dtype, self.device, self.max_model_len)
        num_blocks = self._num_blocks()
        # Exact CPU attention reads a decode's whole key blocks in place only while its blocks are
        # consecutive: each new run leaves one key block of growth to the run before it.
        self.pool = BlockPool(num_blocks, config.block_size, keep_runs=self.device.type == "cpu",
                              reach=PIECE if exact_cpu(self.device) else 0,
                              headroom=KEY_BLOCK if exact_cpu(self.device) else 0)
        if exact_cpu(self.device):
            log.info("exact attention: %s", exact_matmul.why(model.dtype, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim))
        self.runner = ModelRunner(model.module, num_blocks, config.block_size, self.max_model_len)
        self.runner.staging_bytes = self.budget.staging_bytes
        pool = self.pool  # not self: the runner holds no reference back to the engine
        self.runner.clearable = lambda run, slots: pool.clearable(run.block_ids, slots.start, slots.stop, not run.off_thread)
        if self.budget.static_decode:
            self.runner.decoder = StaticDecode(self.runner, config.max_num_seqs, self.max_model_len)
        decoder = self.runner.decoder
        log.info("KV pool %.2f GiB (%s): %d blocks of %d tokens; %d tokens per step; decode %s",
                 self.budget.kv_cache_bytes / (1 << 30), self.budget.source, num_blocks, config.block_size,
                 self.budget.max_batched_tokens, "dynamic" if decoder is None
                 else "through CUDA graphs" if decoder.graphs_on else "through static buffers")
        self.link: StateLink = NullStateLink()
        # Where the restore planner's machine profile came from: "given" (measured by the factory,
        # or the caller's), "saved" (`kvtier profile`'s), "estimate", "measured" (while idle,
        # replacing the estimate), or None without a store.
        self.profile_source: str | None = None
        self._store_spec = store
        if store:
            if profile is None:
                profile, self.profile_source = self._saved_profile()
            else:
                self.profile_source = "given"
            self.link = open_store_link(model, self.runner, store, reuse or ReuseConfig(),
                                        profile, self.budget.max_batched_tokens, probes)
        # Drain saves and stop the store's threads when the engine is dropped or the interpreter
        # exits without close(): a thread still in torch code at shutdown aborts the process.
        self._closer = weakref.finalize(self, self.link.close)
        self.partial: Fronts = FullCaching()
        if config.partial is not None:
            cost = config.partial.cost or front_costs.cached_or_estimate(model)
            self.partial = PartialCaching(config.partial, self.runner, cost)
        self.scheduler = Scheduler(self.pool, self.budget.max_batched_tokens, config.max_num_seqs, self.link.scheduler_side,
                                   prefix_cache=config.enable_prefix_cache, fronts=self.partial,
                                   defer_instant=self.runner.transfer.is_async)
        self.eos_ids = set(cfg.eos_token_ids)
        tok = model.tokenizer
        if tok is not None and tok.eos_token_id is not None:
            self.eos_ids.add(tok.eos_token_id)
        self._live: dict[str, _Live] = {}
        self._samples: dict[str, set[str]] = {}  # n > 1: a request's id -> its samples still running
        self.grammars = Grammars(tok, cfg.vocab_size)
        self._inbox: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()  # thread-safe entry point
        self._ids = itertools.count()
        self._steps = 0
        self.idle = IdleWork([self._offer_plans, self._offer_profile])
        self._profile_offered = False

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
        if isinstance(prompt, str):
            if self.model.tokenizer is None:
                raise PromptError(f"model {self.model.name} has no tokenizer; pass token ids")
            return list(self.model.tokenizer.encode(prompt, add_special_tokens=add_special_tokens))
        return [int(t) for t in prompt]

    def encode_chat(self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True,
                    tools: list[dict[str, Any]] | None = None) -> list[int]:
        tok = self.model.tokenizer
        if tok is None or not getattr(tok, "chat_template", None):
            raise PromptError(f"model {self.model.name} has no chat template")
        if not messages:
            raise PromptError("messages must not be empty")
        ids = tok.apply_chat_template(list(messages), add_generation_prompt=add_generation_prompt, tokenize=True,
                                      tools=tools)
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)

    def validate(self, ids: Sequence[int]) -> None:
        if not ids:
            raise PromptError("the prompt is empty")
        if len(ids) > self.max_model_len:  # a prompt that fills the window still yields one token
            raise PromptError(
                f"the prompt has {len(ids)} tokens but the context window is {self.max_model_len}; "
                "shorten the prompt"
            )
        vocab = self.model.config.vocab_size
        if min(ids) < 0 or max(ids) >= vocab:
            raise PromptError(f"token ids must be in [0, {vocab})")

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
    ) -> str:
        """Queue a request (safe from any thread); it joins the batch at the next step.
        `cache_salt`: only requests with the same salt share cached or stored state.
        `constraint`: params.structured's, made already (`grammars.build`); else made here, on a
        grammar thread while the caller waits, never on the step's.
        `priority` (vLLM's): waiting requests are admitted lowest value first, equal ones in
        arrival order; running requests are not preempted for it.
        `cache_prompt` (llama-server's): False neither reuses cached or stored state nor leaves
        any (same answer, computed in full)."""
        priority = check_priority(priority)
        ids = self.encode(prompt)
        params = params or SamplingParams()
        params.check_vocab(self.model.config.vocab_size)
        if constraint is None and params.structured is not None:
            constraint = self.grammars.constraint(params.structured)
        source, kept = None, None
        if self.truncation is not None and len(ids) >= self.max_model_len:
            # Leave room to generate: at most max_tokens, at most half the window.
            limit = self.max_model_len - min(params.max_tokens, self.max_model_len // 2)
            source, kept = ids, kept_positions(len(ids), limit, self.truncation)
            ids = [ids[i] for i in kept]
        self.validate(ids)
        if request_id is not None and "#" in request_id:
            raise PromptError("a request id may not contain '#': it names the samples of an n > 1 request")
        rid = request_id or f"req-{next(self._ids)}"
        req = Request(rid, ids, params, session_id=session_id, cache_salt=cache_salt or "", priority=priority,
                      cache_prompt=bool(cache_prompt), source_ids=source, kept=kept)
        self._inbox.put(("add", (req, on_output, constraint)))
        return rid

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
        outputs += [self._emit(self._live[rid]) for rid in out.aborted] + self._update(out, logits, void)
        self.partial.observe(time.perf_counter() - t)
        return outputs

    def _execute(self, out: SchedulerOutput) -> tuple[torch.Tensor | None, dict[str, int]]:
        """One forward of every scheduled run (and the decodes' front runs); restores attached to
        it are placed layer by layer. -> (logits, {request: restart position} for those whose
        restore failed mid-step)."""
        if not out.chunks:
            return None, {}
        reqs = [self._live[c.request_id].req for c in out.chunks]
        items = [RunItem(r.all_ids[c.start : c.end], c.start, r.block_ids, want_logits=c.end == r.num_tokens,
                         all_logits=_scores_prompt(self._live[c.request_id], c.start), dropped=r.dropped,
                         front=r.front)
                 for r, c in zip(reqs, out.chunks)]
        ids = [c.request_id for c in out.chunks]
        fronts = self.partial.step_fronts(items, reqs)
        link = self.link.step_side
        logits = self.runner.execute(items + list(fronts.runs), link.capture_for(reqs),
                                     before_layer=link.restore_hook(ids), fed=fronts.feed)
        return logits, link.after_execute(ids)

    def _update(self, out: SchedulerOutput, logits: torch.Tensor | None, void: dict[str, int]) -> list[RequestOutput]:
        outs = []
        sampling = {r.request_id for r in self.scheduler.postprocess(out, void)}
        rows: dict[str, int] = {}  # request -> the logits row it samples from
        scored: list[tuple[_Live, int, int]] = []  # prompt logprobs: (request, logits row, token index)
        row = 0
        for c in out.chunks:  # the runner's rows, in run order (see RunItem.all_logits)
            live = self._live[c.request_id]
            req = live.req
            if _scores_prompt(live, c.start):
                assert live.prompt_logprobs is not None
                if c.request_id not in void:  # row r predicts token p + 1; a recompute skips scored ones
                    first = max(c.start, len(live.prompt_logprobs) - 1)
                    scored += [(live, row + p - c.start, p + 1) for p in range(first, min(c.end, len(req.prompt_ids) - 1))]
                row += c.end - c.start
                if c.end == req.num_tokens:
                    rows[c.request_id] = row - 1
            elif c.end == req.num_tokens:
                rows[c.request_id] = row  # this run's logits row, used or not
                row += 1
        if scored and logits is not None:
            self._score_prompts(logits, scored)
        picked = [c.request_id for c in out.chunks if c.request_id in sampling and c.request_id not in void]
        # n > 1: the other samples start from this prefill; their first tokens come from its row.
        draws = [(rid, rows[rid]) for rid in picked]
        for rid in picked:
            draws += [(child, rows[rid]) for child in self._fork(self._live[rid])]
        self.link.step_side.before_sample([self._live[c.request_id].req for c in out.chunks if c.request_id not in void])
        drawn = self._sample(logits, draws)
        now = time.perf_counter()  # after the step's one device sync: the tokens exist now
        for c in out.chunks:
            live = self._live[c.request_id]
            req = live.req
            if c.request_id in void:
                self.scheduler.void(req, void[c.request_id])  # its step computed on garbage: not sampled
                continue
            if c.request_id not in sampling:
                self.link.step_side.after_step(req, finished=False)
                continue  # a prefill chunk that is not the last one
            if live.req.params.first_logits and req.metrics.first_token is None and logits is not None:
                live.first_logits = logits[rows[c.request_id]].to("cpu", copy=True)
            outs.append(self._accept(live, drawn[c.request_id], now))
        outs += [self._accept(self._live[rid], drawn[rid], now) for rid, _ in draws if rid not in rows]
        return outs

    def _sample(self, logits: torch.Tensor | None, draws: list[tuple[str, int]]) -> dict[str, Sampled]:
        """Every draw (request, logits row) in one batched call: one device sync per step."""
        if not draws or logits is None:
            return {}
        batch = []
        for rid, _ in draws:
            live = self._live[rid]
            if live.req.params.penalized and live.seen is None:
                live.seen = Seen(live.req.prompt_ids, live.req.output_ids, logits.device)
            batch.append(Row(live.req.params, live.generator, live.req.prompt_ids, live.req.output_ids,
                             live.constraint, live.seen))
        rows = [row for _, row in draws]
        if rows != list(range(logits.shape[0])):  # a plain decode step samples every row, in order
            # From pinned memory without blocking: the sampled ids stay the step's one device sync.
            at = torch.tensor(rows, pin_memory=logits.is_cuda).to(logits.device, non_blocking=True)
            logits = logits.index_select(0, at)  # [draws, vocab]
        got = sample_batch(logits, batch, self.eos_ids)
        return {rid: g for (rid, _), g in zip(draws, got)}

    def _score_prompts(self, logits: torch.Tensor, scored: list[tuple[_Live, int, int]]) -> None:
        """Prompt logprobs of this step's prompt rows, in one call (one more transfer, only in
        steps that compute prompt tokens of such requests)."""
        for s in range(0, len(scored), _SCORE_ROWS):  # bounded copies of [rows, vocab]
            part = scored[s : s + _SCORE_ROWS]
            at = torch.tensor([r for _, r, _ in part], device=logits.device)
            targets = torch.tensor([lv.req.prompt_ids[i] for lv, _, i in part], device=logits.device)
            wants = [lv.req.params.prompt_logprobs for lv, _, _ in part]
            for (live, _, _), lp in zip(part, score(logits.index_select(0, at), targets, wants, rank=True)):
                assert live.prompt_logprobs is not None
                live.prompt_logprobs.append(lp)

    def _accept(self, live: _Live, sampled: Sampled, now: float) -> RequestOutput:
        """Append a sampled token to its request, stop it if it should, and emit its output."""
        req, token = live.req, sampled.token
        if req.metrics.first_token is None:
            req.metrics.first_token = now
            req.metrics.prompt_tokens_computed = len(req.prompt_ids) - req.metrics.prompt_tokens_reused
        req.metrics.last_token = now
        req.append_output(token)
        live.delta_ids.append(token)
        if live.logprobs is not None and sampled.logprobs is not None:
            live.logprobs.append(sampled.logprobs)
        if live.constraint is not None:
            live.constraint.accept(token)
        if live.seen is not None:
            live.seen.add(token)
        status = self._check_stop(live, token)
        if live.constraint is not None and (error := live.constraint.error) is not None:
            # Never a "stop": the output would look complete and not follow its grammar.
            log.warning("request %s: the grammar engine failed (%s); ending the request", req.request_id, error)
            live.error = f"the grammar engine could not go on: {error}"
            status = RequestStatus.FINISHED_ABORTED
        self.link.step_side.after_step(req, finished=status is not None)
        if status is not None:
            self.scheduler.finish(req, status)
            live.delta_text += live.detok.flush()
        return self._emit(live)

    def _fork(self, parent: _Live) -> list[str]:
        """Start the other samples of an n > 1 request from `parent`'s just-computed prompt ->
        the ids of those that share it now (the rest, when no block is free, wait and prefill)."""
        now, n, parent.forks = [], parent.forks, 0
        req = parent.req
        for i in range(1, n + 1):
            child = Request(sample_id(req.request_id, i), list(req.prompt_ids), req.params,
                            session_id=req.session_id, cache_salt=req.cache_salt, priority=req.priority,
                            cache_prompt=req.cache_prompt, source_ids=req.source_ids, kept=req.kept,
                            metrics=RequestMetrics(arrival=req.metrics.arrival,
                                                   first_scheduled=req.metrics.first_scheduled))
            self._live[child.request_id] = _Live(
                child, Detokenizer(self.model.tokenizer, req.params.stop), make_generator(req.params, self.device, i),
                parent.on_output, parent.constraint.fork() if parent.constraint is not None else None, index=i,
                logprobs=[] if req.params.logprobs is not None else None,
                prompt_logprobs=list(parent.prompt_logprobs) if parent.prompt_logprobs is not None else None,
                group=req.request_id)
            self._samples.setdefault(req.request_id, {req.request_id}).add(child.request_id)
            copy = self.scheduler.fork(req, child)
            if copy is None:
                self.scheduler.add(child)
                continue
            if copy[2]:
                self.runner.copy_block(*copy)
            now.append(child.request_id)
        return now

    def stats(self, with_store: bool = True) -> EngineStats:
        """What the engine did so far; `with_store=False` skips the store's own statistics (a
        remote tier's may take a round trip)."""
        st = self.link.report(with_store)
        return EngineStats(steps=self._steps, preemptions=self.scheduler.num_preemptions,
                           prefix_cache_hits=self.pool.hits, counters=st.counters,
                           reused_by_method=st.reused_by_method, reused_by_tier=st.reused_by_tier,
                           layout=st.layout, stored_bytes_per_token=st.stored_bytes_per_token,
                           store=st.store, partial=self.partial.summary())

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every save handed to the store so far is written. False on timeout."""
        return self.link.flush(timeout)

    def close(self) -> None:
        """Drain pending saves and stop the restore and writer threads (once; later calls do nothing)."""
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
                req, cb, constraint = arg
                p = req.params
                detok = Detokenizer(self.model.tokenizer, p.stop)
                self._live[req.request_id] = _Live(req, detok, make_generator(p, self.device), cb, constraint,
                                                   forks=p.n - 1, logprobs=[] if p.logprobs is not None else None,
                                                   prompt_logprobs=[None] if p.prompt_logprobs is not None else None,
                                                   group=req.request_id)
                self.scheduler.add(req)
                continue
            for rid in sorted(self._samples.pop(arg, set()) | {arg}):  # an n > 1 request's samples end together
                if (live := self._live.get(rid)) is not None and self.scheduler.abort(live.req):
                    # (else its restore is writing into its blocks: it ends once that is done)
                    outs.append(self._emit(live))
        return outs

    def _check_stop(self, live: _Live, token: int) -> RequestStatus | None:
        req = live.req
        if (token in self.eos_ids and not req.params.ignore_eos) or token in req.params.stop_token_ids:
            return RequestStatus.FINISHED_STOPPED
        # Stop strings count from min_tokens on, as vLLM checks them.
        live.delta_text += live.detok.add(token, check_stop=len(req.output_ids) > req.params.min_tokens)
        if live.detok.stopped or (live.constraint is not None and live.constraint.done):
            return RequestStatus.FINISHED_STOPPED
        if len(req.output_ids) >= req.params.max_tokens or req.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def _emit(self, live: _Live) -> RequestOutput:
        req, m = live.req, live.req.metrics
        out = RequestOutput(
            request_id=req.request_id,
            prompt_tokens=len(req.prompt_ids),
            output_ids=list(req.output_ids),
            text=live.detok.text,
            delta_text=live.delta_text,
            delta_ids=live.delta_ids,
            finished=req.status.finished,
            finish_reason=_FINISH_REASON.get(req.status),
            queue_time=m.queue_time,
            ttft=m.ttft,
            mean_tbt=m.mean_tbt(len(req.output_ids)),
            prompt_tokens_reused=m.prompt_tokens_reused,
            prompt_tokens_computed=m.prompt_tokens_computed,
            reused_by_tier=dict(m.reused_by_tier),
            restore_method=m.restore_method,
            restore=m.restore,
            first_logits=live.first_logits,
            index=live.index,
            logprobs=list(live.logprobs) if live.logprobs is not None else None,
            prompt_logprobs=list(live.prompt_logprobs) if live.prompt_logprobs is not None else None,
            error=live.error if req.status.finished else None,
        )
        live.delta_text, live.delta_ids = "", []
        if out.finished:
            del self._live[req.request_id]
            if (samples := self._samples.get(live.group)) is not None:
                samples.discard(req.request_id)
                if not samples:
                    del self._samples[live.group]
            self.partial.forget(req.request_id)
        if live.on_output is not None:
            live.on_output(out)
        return out

    # ----- convenience API ------------------------------------------------------------------
    def generate(
        self, prompts: str | Sequence[int] | Sequence[str | Sequence[int]], params: SamplingParams | None = None,
        priority: Sequence[int] | None = None, cache_prompt: bool = True,
    ) -> list[RequestOutput]:
        """Run a batch of prompts to completion (continuous batching); outputs in prompt order,
        with SamplingParams(n > 1) each prompt's n samples in index order. `priority`: one per
        prompt (vLLM's), the order in which they are admitted; `cache_prompt`: see add_request."""
        single = isinstance(prompts, str) or (len(prompts) > 0 and isinstance(prompts[0], int))
        # `single` tells a lone prompt from a batch; mypy cannot narrow the union on prompts[0].
        batch = cast("list[str | Sequence[int]]", [prompts] if single else list(prompts))
        if priority is not None and len(priority) != len(batch):
            raise ValueError(f"priority has {len(priority)} values for {len(batch)} prompts")
        # Checked before any is queued: a bad value must not leave the others running unread.
        order = [check_priority(p) for p in priority] if priority is not None else [0] * len(batch)
        n = (params or SamplingParams()).n
        ids = [sample_id(rid, i) for p, pri in zip(batch, order)
               for rid in [self.add_request(p, params, priority=pri, cache_prompt=cache_prompt)] for i in range(n)]
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
