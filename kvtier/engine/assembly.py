"""Output assembly: a step's logits become sampled tokens, prompt logprobs, n > 1 samples and
one `RequestOutput` per request that made progress.

The facade (engine.py) schedules and executes; `Outputs` keeps what the engine holds per request
beside the scheduler's `Request` (detokenizer, generator, grammar, logprobs, its n > 1 group) and
does the step's update: which logits row each request samples from, the prompt rows it scores,
the samples an n > 1 request forks from its prefill, the stop checks, and the outputs.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import torch

from kvtier.engine.detokenizer import Detokenizer
from kvtier.engine.penalties import Seen
from kvtier.engine.request import Request, RequestMetrics, RequestStatus, RestoreReport
from kvtier.engine.sampler import Row, Sampled, TokenLogprobs, make_generator, sample_batch, score
from kvtier.engine.scheduler import Scheduler
from kvtier.engine.scheduler_api import ScheduledChunk, SchedulerOutput
from kvtier.engine.structured import Constraint

log = logging.getLogger(__name__)

FinishReason = Literal["stop", "length", "abort"]

_SCORE_ROWS = 256  # prompt rows scored per call: each call copies [rows, vocab] a few times

_FINISH_REASON: dict[RequestStatus, FinishReason] = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}

# Samples a step's rows: (logits [rows, vocab], one Row each, the model's EOS ids) -> one Sampled each.
SampleRows = Callable[[torch.Tensor, Sequence[Row], Collection[int]], list[Sampled]]


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


@dataclass
class Live:
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
    group: str = ""  # n > 1: the request's own id (its samples' key in Outputs.samples)
    delta_text: str = ""
    delta_ids: list[int] = field(default_factory=list)
    first_logits: torch.Tensor | None = None
    error: str | None = None  # why the engine ended it (RequestOutput.error)

    def scores_prompt(self, start: int) -> bool:
        """Whether a run from `start` needs the logits of every token: the request asked for prompt
        logprobs, some are not scored yet, and the run predicts prompt tokens."""
        scored, n = self.prompt_logprobs, len(self.req.prompt_ids)
        return scored is not None and len(scored) < n and start < n - 1


def sample_id(request_id: str, index: int) -> str:
    """The request id of sample `index` of an n > 1 request (sample 0 is the request itself)."""
    return f"{request_id}#{index}" if index else request_id


class StepEvents(Protocol):
    """The part of the store's step side (link/store_link.py `StepSide`) the update calls."""

    def before_sample(self, reqs: Sequence[Request]) -> None: ...

    def after_step(self, req: Request, finished: bool) -> None: ...


@dataclass(frozen=True)
class StepHooks:
    """What the update tells the rest of the engine: the store's step side, a block copy for a
    forked sample's partial last block (src, dst, tokens), and that a request ended."""

    step_side: StepEvents
    copy_block: Callable[[int, int, int], None]
    forget: Callable[[str], None]


class Outputs:
    """Every live request's state, and each step's update of it (see the module docstring)."""

    def __init__(self, scheduler: Scheduler, hooks: StepHooks, eos_ids: set[int], max_model_len: int,
                 tokenizer: Any, device: torch.device, sample_rows: SampleRows = sample_batch) -> None:
        self.scheduler, self.hooks = scheduler, hooks
        # What ends a request besides its own params: the model's EOS ids and its context window.
        self.eos_ids, self.max_model_len = eos_ids, max_model_len
        self.tokenizer, self.device, self.sample_rows = tokenizer, device, sample_rows
        self.live: dict[str, Live] = {}
        self.samples: dict[str, set[str]] = {}  # n > 1: a request's id -> its samples still running

    # ----- requests in and out --------------------------------------------------------------
    def admit(self, req: Request, on_output: Callable[[RequestOutput], None] | None,
              constraint: Constraint | None) -> None:
        """A new request: its state here, then the scheduler's queue."""
        p = req.params
        self.live[req.request_id] = Live(req, Detokenizer(self.tokenizer, p.stop), make_generator(p, self.device),
                                         on_output, constraint, forks=p.n - 1,
                                         logprobs=[] if p.logprobs is not None else None,
                                         prompt_logprobs=[None] if p.prompt_logprobs is not None else None,
                                         group=req.request_id)
        self.scheduler.add(req)

    def abort(self, request_id: str) -> list[RequestOutput]:
        """End a request and its n > 1 samples together -> the outputs of those that ended now
        (one whose restore is still writing into its blocks ends once that is done)."""
        outs = []
        for rid in sorted(self.samples.pop(request_id, set()) | {request_id}):
            if (live := self.live.get(rid)) is not None and self.scheduler.abort(live.req):
                outs.append(self.emit(rid))
        return outs

    def request(self, request_id: str) -> Request:
        return self.live[request_id].req

    def all_logits(self, chunk: ScheduledChunk) -> bool:
        """Whether the chunk's run needs every token's logits (prompt logprobs; RunItem.all_logits)."""
        return self.live[chunk.request_id].scores_prompt(chunk.start)

    # ----- one step's update ----------------------------------------------------------------
    def update(self, out: SchedulerOutput, logits: torch.Tensor | None, void: dict[str, int]) -> list[RequestOutput]:
        """The scheduler's bookkeeping, then each sampling request's token and output. `void`:
        requests whose step computed on garbage (a restore failed mid-step) and restart there."""
        sampling = {r.request_id for r in self.scheduler.postprocess(out, void)}
        rows, scored = self._rows(out, void)
        if scored and logits is not None:
            self._score_prompts(logits, scored)
        picked = [c.request_id for c in out.chunks if c.request_id in sampling and c.request_id not in void]
        # n > 1: the other samples start from this prefill; their first tokens come from its row.
        draws = [(rid, rows[rid]) for rid in picked]
        for rid in picked:
            draws += [(child, rows[rid]) for child in self._fork(self.live[rid])]
        self.hooks.step_side.before_sample([self.live[c.request_id].req for c in out.chunks
                                            if c.request_id not in void])
        drawn = self._sample(logits, draws)
        return self._accept_all(out, logits, void, sampling, rows, drawn, draws)

    def _rows(self, out: SchedulerOutput, void: dict[str, int]) -> tuple[dict[str, int], list[tuple[Live, int, int]]]:
        """The runner's logits rows, in run order (see RunItem.all_logits) -> ({request: the row it
        samples from}, prompt logprobs to score: (request, logits row, token index))."""
        rows: dict[str, int] = {}
        scored: list[tuple[Live, int, int]] = []
        row = 0
        for c in out.chunks:
            live = self.live[c.request_id]
            req = live.req
            if live.scores_prompt(c.start):
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
        return rows, scored

    def _accept_all(self, out: SchedulerOutput, logits: torch.Tensor | None, void: dict[str, int],
                    sampling: set[str], rows: dict[str, int], drawn: dict[str, Sampled],
                    draws: list[tuple[str, int]]) -> list[RequestOutput]:
        outs = []
        now = time.perf_counter()  # after the step's one device sync: the tokens exist now
        for c in out.chunks:
            live = self.live[c.request_id]
            req = live.req
            if c.request_id in void:
                self.scheduler.void(req, void[c.request_id])  # its step computed on garbage: not sampled
                continue
            if c.request_id not in sampling:
                self.hooks.step_side.after_step(req, finished=False)
                continue  # a prefill chunk that is not the last one
            if req.params.first_logits and req.metrics.first_token is None and logits is not None:
                live.first_logits = logits[rows[c.request_id]].to("cpu", copy=True)
            outs.append(self._accept(live, drawn[c.request_id], now))
        outs += [self._accept(self.live[rid], drawn[rid], now) for rid, _ in draws if rid not in rows]
        return outs

    def _sample(self, logits: torch.Tensor | None, draws: list[tuple[str, int]]) -> dict[str, Sampled]:
        """Every draw (request, logits row) in one batched call: one device sync per step."""
        if not draws or logits is None:
            return {}
        batch = []
        for rid, _ in draws:
            live = self.live[rid]
            if live.req.params.penalized and live.seen is None:
                live.seen = Seen(live.req.prompt_ids, live.req.output_ids, logits.device)
            batch.append(Row(live.req.params, live.generator, live.req.prompt_ids, live.req.output_ids,
                             live.constraint, live.seen))
        rows = [row for _, row in draws]
        if rows != list(range(logits.shape[0])):  # a plain decode step samples every row, in order
            # From pinned memory without blocking: the sampled ids stay the step's one device sync.
            at = torch.tensor(rows, pin_memory=logits.is_cuda).to(logits.device, non_blocking=True)
            logits = logits.index_select(0, at)  # [draws, vocab]
        got = self.sample_rows(logits, batch, self.eos_ids)
        return {rid: g for (rid, _), g in zip(draws, got)}

    def _score_prompts(self, logits: torch.Tensor, scored: list[tuple[Live, int, int]]) -> None:
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

    def _accept(self, live: Live, sampled: Sampled, now: float) -> RequestOutput:
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
        self.hooks.step_side.after_step(req, finished=status is not None)
        if status is not None:
            self.scheduler.finish(req, status)
            live.delta_text += live.detok.flush()
        return self.emit(req.request_id)

    def _check_stop(self, live: Live, token: int) -> RequestStatus | None:
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

    def _fork(self, parent: Live) -> list[str]:
        """Start the other samples of an n > 1 request from `parent`'s just-computed prompt ->
        the ids of those that share it now (the rest, when no block is free, wait and prefill)."""
        now, n, parent.forks = [], parent.forks, 0
        req = parent.req
        for i in range(1, n + 1):
            child = Request(sample_id(req.request_id, i), list(req.prompt_ids), req.params,
                            session_id=req.session_id, cache_salt=req.cache_salt, priority=req.priority,
                            cache_prompt=req.cache_prompt, source_ids=req.source_ids, kept=req.kept,
                            segments=req.segments, blend=req.blend,  # a blended parent's samples blend alike
                            metrics=RequestMetrics(arrival=req.metrics.arrival,
                                                   first_scheduled=req.metrics.first_scheduled))
            self.live[child.request_id] = Live(
                child, Detokenizer(self.tokenizer, req.params.stop), make_generator(req.params, self.device, i),
                parent.on_output, parent.constraint.fork() if parent.constraint is not None else None, index=i,
                logprobs=[] if req.params.logprobs is not None else None,
                prompt_logprobs=list(parent.prompt_logprobs) if parent.prompt_logprobs is not None else None,
                group=req.request_id)
            self.samples.setdefault(req.request_id, {req.request_id}).add(child.request_id)
            copy = self.scheduler.fork(req, child)
            if copy is None:
                self.scheduler.add(child)
                continue
            if copy[2]:
                self.hooks.copy_block(*copy)
            now.append(child.request_id)
        return now

    def emit(self, request_id: str) -> RequestOutput:
        """The request's output now (its deltas since the last one); a finished request is forgotten."""
        live = self.live[request_id]
        out = _output(live)
        live.delta_text, live.delta_ids = "", []
        if out.finished:
            del self.live[request_id]
            if (samples := self.samples.get(live.group)) is not None:
                samples.discard(request_id)
                if not samples:
                    del self.samples[live.group]
            self.hooks.forget(request_id)
        if live.on_output is not None:
            live.on_output(out)
        return out


def _output(live: Live) -> RequestOutput:
    req, m = live.req, live.req.metrics
    return RequestOutput(
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
