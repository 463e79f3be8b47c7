"""The Engine facade: requests in, tokens out. Each step is schedule -> execute -> update."""

from __future__ import annotations

import itertools
import queue
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from kvtier.engine.block_pool import BlockPool, block_hashes
from kvtier.engine.config import EngineConfig
from kvtier.engine.detokenizer import Detokenizer
from kvtier.engine.request import Request, RequestStatus, SamplingParams
from kvtier.engine.runner import ModelRunner, RunItem
from kvtier.engine.sampler import make_generator, sample
from kvtier.engine.scheduler import Scheduler, SchedulerOutput
from kvtier.engine.config import ReuseConfig
from kvtier.engine.statecache import StateCache
from kvtier.models.loading import LoadedModel, default_home, load_model
from kvtier.restore.profile import HardwareProfile
from kvtier.restore.truncation import TruncationConfig, kept_positions


class PromptError(ValueError):
    """A prompt the engine cannot run (empty, too long, bad token ids, no tokenizer)."""


_FINISH_REASON = {
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
    finish_reason: str | None
    queue_time: float | None
    ttft: float | None
    mean_tbt: float | None
    prompt_tokens_reused: int
    prompt_tokens_computed: int
    reused_by_tier: dict[str, int] = field(default_factory=dict)
    restore_method: str | None = None


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


@dataclass
class _Live:
    """Per-request state the engine keeps beside the scheduler's Request."""

    req: Request
    detok: Detokenizer
    generator: torch.Generator | None
    on_output: Callable[[RequestOutput], None] | None
    delta_text: str = ""
    delta_ids: list[int] = field(default_factory=list)


class Engine:
    def __init__(self, model: LoadedModel, config: EngineConfig | None = None, store: str | None = None,
                 reuse: ReuseConfig | None = None, profile: HardwareProfile | None = None, home: Path | None = None,
                 truncation: TruncationConfig | None = None):
        """`store` is a tier spec (e.g. "memory:2GB,disk:/data:100GB"); with it every request's state
        is saved and restored across requests. `profile` defaults to the measured one for this machine."""
        self.model = model
        self.truncation = truncation  # None: a prompt over the context window is an error
        self.config = config = config or EngineConfig()
        cfg = model.config
        self.max_model_len = min(config.max_model_len or cfg.max_position_embeddings, cfg.max_position_embeddings)
        num_blocks = config.kv_cache_bytes // ModelRunner.bytes_per_block(model.module, config.block_size)
        blocks_per_seq = -(-self.max_model_len // config.block_size)
        if num_blocks < blocks_per_seq:
            raise ValueError(
                f"kv_cache_bytes={config.kv_cache_bytes} holds {num_blocks} blocks but one full-length sequence "
                f"needs {blocks_per_seq}; raise the KV budget or lower max_model_len"
            )
        self.pool = BlockPool(num_blocks, config.block_size)
        self.runner = ModelRunner(model.module, num_blocks, config.block_size, self.max_model_len)
        self.state: StateCache | None = None
        if store:
            from kvtier.restore.profile import load_or_measure

            profile = profile or load_or_measure(model, home or default_home(), store)
            self.state = StateCache(model, self.runner, store, profile, reuse or ReuseConfig())
        self.scheduler = Scheduler(self.pool, config.max_batched_tokens, config.max_num_seqs, self.state)
        self.eos_ids = set(cfg.eos_token_ids)
        tok = model.tokenizer
        if tok is not None and tok.eos_token_id is not None:
            self.eos_ids.add(tok.eos_token_id)
        self._live: dict[str, _Live] = {}
        # Optional session ids (reuse itself is content-addressed): per-session totals.
        self.session_stats: dict[str, dict[str, int]] = {}
        self._inbox: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()  # thread-safe entry point
        self._ids = itertools.count()
        self._steps = 0

    @classmethod
    def from_model(cls, name: str, dtype: str | None = "auto", **config: Any) -> "Engine":
        return cls(load_model(name, dtype=dtype), EngineConfig(**config))

    # ----- requests -------------------------------------------------------------------------
    def encode(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.model.tokenizer is None:
                raise PromptError(f"model {self.model.name} has no tokenizer; pass token ids")
            return list(self.model.tokenizer.encode(prompt, add_special_tokens=False))
        return [int(t) for t in prompt]

    def encode_chat(self, messages: Sequence[dict[str, str]]) -> list[int]:
        tok = self.model.tokenizer
        if tok is None or not getattr(tok, "chat_template", None):
            raise PromptError(f"model {self.model.name} has no chat template")
        if not messages:
            raise PromptError("messages must not be empty")
        ids = tok.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=True)
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)

    def validate(self, ids: Sequence[int]) -> None:
        if not ids:
            raise PromptError("the prompt is empty")
        if len(ids) >= self.max_model_len:
            raise PromptError(
                f"the prompt has {len(ids)} tokens but the context window is {self.max_model_len} "
                "(prompt plus at least one generated token); shorten the prompt"
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
    ) -> str:
        """Queue a request (safe from any thread); it joins the batch at the next step."""
        ids = self.encode(prompt)
        params = params or SamplingParams()
        source, kept = None, None
        if self.truncation is not None and len(ids) >= self.max_model_len and ids:
            # Leave room to generate: at most max_tokens, at most half the window.
            limit = self.max_model_len - min(params.max_tokens, self.max_model_len // 2)
            source, kept = ids, kept_positions(len(ids), limit, self.truncation)
            ids = [ids[i] for i in kept]
        self.validate(ids)
        rid = request_id or f"req-{next(self._ids)}"
        req = Request(rid, ids, params, session_id=session_id, source_ids=source, kept=kept)
        self._inbox.put(("add", (req, on_output)))
        return rid

    def abort(self, request_id: str) -> None:
        self._inbox.put(("abort", request_id))

    def has_work(self) -> bool:
        return self.scheduler.has_work() or not self._inbox.empty()

    # ----- the step loop --------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        self._steps += 1
        outputs = self._drain_inbox()
        if self.state is not None:
            outputs += self._collect_restores()
            self.state.look_ahead(list(itertools.islice(self.scheduler.waiting, 32)))
            self.state.expire_sessions()
        plan = self.scheduler.schedule()
        if plan.chunks:
            capture = None
            if self.state is not None and self.state.config.save:
                capture = self.state.capture_for([self._live[c.request_id].req for c in plan.chunks])
            logits = self.runner.execute(self._run_items(plan), capture)
            outputs += self._update(plan, logits)
        elif self.scheduler.restoring and self.state is not None and self._inbox.empty():
            self.state.wait_any(0.005)  # only restores in flight: sleep until one ends (or a new request may be in)
        return outputs

    def _collect_restores(self) -> list[RequestOutput]:
        outs = []
        for req, ok, tokens, aborted in self.state.poll():
            if aborted:
                self.scheduler.finish(req, RequestStatus.FINISHED_ABORTED)
                outs.append(self._emit(self._live[req.request_id]))
            else:
                self.scheduler.restored(req, ok, tokens)
        return outs

    def stats(self) -> EngineStats:
        st = self.state
        return EngineStats(
            steps=self._steps, preemptions=self.scheduler.num_preemptions, prefix_cache_hits=self.pool.hits,
            counters=dict(st.counters) if st else {}, reused_by_method=dict(st.reused_by_method) if st else {},
            reused_by_tier=dict(st.tier_tokens) if st else {},
            layout=tuple(r.value for r in st.layout) if st else (),
            stored_bytes_per_token=st.store.namespace.bytes_per_token() if st else 0,
            store=st.store.stats() if st else None)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every save handed to the store so far is written. False on timeout."""
        return self.state.store.flush(timeout) if self.state is not None else True

    def close(self) -> None:
        """Drain pending saves and stop the restore thread."""
        if self.state is not None:
            self.state.close()

    def _drain_inbox(self) -> list[RequestOutput]:
        outs = []
        while not self._inbox.empty():
            kind, arg = self._inbox.get()
            if kind == "add":
                req, cb = arg
                detok = Detokenizer(self.model.tokenizer, req.params.stop)
                self._live[req.request_id] = _Live(req, detok, make_generator(req.params), cb)
                if not self.config.enable_prefix_cache:
                    req.block_hashes = []
                if self.state is not None:
                    self.state.session_arrived(req)
                self.scheduler.add(req)
            elif (live := self._live.get(arg)) is not None:
                if self.state is not None and self.state.abort(arg):
                    continue  # its restore is writing into its blocks: finish once that is done
                self.scheduler.finish(live.req, RequestStatus.FINISHED_ABORTED)
                if self.state is not None:
                    self.state.drop(arg)
                outs.append(self._emit(live))
        return outs

    def _run_items(self, plan: SchedulerOutput) -> list[RunItem]:
        items = []
        for c in plan.chunks:
            req = self._live[c.request_id].req
            ids = req.all_ids[c.start : c.end]
            items.append(RunItem(ids, c.start, req.block_ids, want_logits=c.end == req.num_tokens))
        return items

    def _update(self, plan: SchedulerOutput, logits: torch.Tensor) -> list[RequestOutput]:
        outs = []
        row = 0
        now = time.perf_counter()
        for c in plan.chunks:
            live = self._live[c.request_id]
            req = live.req
            req.num_computed = c.end
            self._publish_blocks(req)
            if c.end != req.num_tokens:
                if self.state is not None:
                    self.state.after_step(req, finished=False)
                continue  # a prefill chunk that is not the last one
            token = sample(logits[row], req.params, live.generator)
            row += 1
            if req.metrics.first_token is None:
                req.metrics.first_token = now
                req.metrics.prompt_tokens_computed = len(req.prompt_ids) - req.metrics.prompt_tokens_reused
            req.metrics.last_token = now
            req.status = RequestStatus.DECODE
            req.output_ids.append(token)
            live.delta_ids.append(token)
            status = self._check_stop(live, token)
            if self.state is not None:
                self.state.after_step(req, finished=status is not None)
            if status is not None:
                self.scheduler.finish(req, status)
                live.delta_text += live.detok.flush()
            outs.append(self._emit(live))
        return outs

    def _publish_blocks(self, req: Request) -> None:
        if not self.config.enable_prefix_cache:
            return
        bs = self.pool.block_size
        req.block_hashes = block_hashes(req.all_ids[: req.num_computed], bs, req.block_hashes)
        for i, h in enumerate(req.block_hashes[: req.num_computed // bs]):
            self.pool.register(req.block_ids[i], h)

    def _check_stop(self, live: _Live, token: int) -> RequestStatus | None:
        req = live.req
        if token in self.eos_ids and not req.params.ignore_eos:
            return RequestStatus.FINISHED_STOPPED
        live.delta_text += live.detok.add(token)
        if live.detok.stopped:
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
        )
        live.delta_text, live.delta_ids = "", []
        if out.finished:
            del self._live[req.request_id]
            if self.state is not None:
                self.state.session_finished(req)
            if req.session_id is not None:
                st = self.session_stats.setdefault(req.session_id, dict(
                    requests=0, prompt_tokens=0, prompt_tokens_reused=0, output_tokens=0))
                st["requests"] += 1
                st["prompt_tokens"] += out.prompt_tokens
                st["prompt_tokens_reused"] += out.prompt_tokens_reused
                st["output_tokens"] += len(out.output_ids)
        if live.on_output is not None:
            live.on_output(out)
        return out

    # ----- convenience API ------------------------------------------------------------------
    def generate(
        self, prompts: str | Sequence[int] | Sequence[str | Sequence[int]], params: SamplingParams | None = None
    ) -> list[RequestOutput]:
        """Run a batch of prompts to completion (continuous batching); outputs in prompt order."""
        single = isinstance(prompts, str) or (len(prompts) > 0 and isinstance(prompts[0], int))
        batch = [prompts] if single else list(prompts)
        ids = [self.add_request(p, params) for p in batch]
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
