"""From the engine thread to asyncio: one handle per request, an async iterator of its outputs.

The engine calls `on_output` on its own thread; the handle stamps the time there (so latency
metrics do not include event-loop lag) and hands the output to the request's event loop. A
handle whose consumer goes away (client disconnect, cancellation) aborts its request, which makes
the engine free the request's KV blocks.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Sequence

from starlette.requests import Request

from kvtier.engine.background import BackgroundEngine
from kvtier.engine.engine import RequestOutput
from kvtier.engine.request import SamplingParams
from kvtier.engine.structured import Constraint
from kvtier.planning.blend import BlendOptions
from kvtier.serve.metrics import ServerMetrics


class ClientGone(Exception):
    """The client disconnected before its response was ready."""


class EngineFailed(Exception):
    """The engine ended the request without the client asking (a failed engine step)."""


class GrammarFailed(EngineFailed):
    """The engine ended the request because its grammar could not go on (the request's own doing)."""


class Generation:
    """One submitted request (all n of its samples). Iterate it (once) for its outputs;
    `cancel()` is idempotent."""

    def __init__(
        self,
        background: BackgroundEngine,
        ids: Sequence[int],
        params: SamplingParams,
        request_id: str,
        *,
        endpoint: str,
        metrics: ServerMetrics,
        session_id: str | None = None,
        cache_salt: str | None = None,
        received: float | None = None,
        on_done: Callable[[], None] | None = None,
        constraint: Constraint | None = None,
        priority: int = 0,
        cache_prompt: bool = True,
        segments: Sequence[tuple[int, int]] = (),
        blend: bool | BlendOptions | None = None,
    ) -> None:
        self.background = background
        self.request_id = request_id
        self.endpoint = endpoint
        self.metrics = metrics
        # TTFT is measured from here: when the handler got the request, before tokenization.
        self.received = received if received is not None else time.perf_counter()
        self.finished = False
        self.n = params.n
        self.finals: dict[int, RequestOutput] = {}  # sample index -> its last output
        self._queue: asyncio.Queue[tuple[RequestOutput, float]] = asyncio.Queue()
        self._loop = asyncio.get_running_loop()
        self._last_token_at: dict[int, float] = {}  # per sample
        self._cancelled = False
        self._on_done = on_done  # called once, when the request finishes or is cancelled
        # Validation already happened in the handler; this can still raise PromptError/SamplingError.
        background.submit(
            list(ids), params, self._on_output, request_id=request_id, session_id=session_id, cache_salt=cache_salt,
            constraint=constraint, priority=priority, cache_prompt=cache_prompt, segments=segments, blend=blend,
        )

    # ----- engine thread --------------------------------------------------------------------
    def _on_output(self, out: RequestOutput) -> None:
        stamp = time.perf_counter()
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, (out, stamp))
        except RuntimeError:
            # The event loop is closed (server shutting down). Raising here would fail the
            # engine step and with it every other request in the batch.
            pass

    # ----- event loop -----------------------------------------------------------------------
    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        try:
            while True:
                out, stamp = await self._queue.get()
                self._observe(out, stamp)
                if out.finished:
                    self.finals[out.index] = out
                    # An abort ends every sample (the engine aborts them together).
                    if len(self.finals) == self.n or out.finish_reason == "abort":
                        self.finished = True
                        self._done()
                        self._count_finish(out, stamp)
                    if out.finish_reason == "abort" and not self._cancelled:
                        if out.error is not None:
                            raise GrammarFailed(f"{out.error}; simplify the grammar")
                        raise EngineFailed("the engine failed while running this request")
                yield out
                if self.finished:
                    return
        finally:
            if not self.finished:
                self.cancel()

    def cancel(self) -> None:
        """Abort the request in the engine (frees its blocks); safe to call more than once."""
        if self._cancelled or self.finished:
            return
        self._cancelled = True
        self.background.abort(self.request_id)
        self._done()
        self.metrics.count_finish(self.endpoint, "abort")  # vLLM's reason for a request the client ended

    def _done(self) -> None:
        if self._on_done is not None:
            done, self._on_done = self._on_done, None
            done()

    async def result(self, request: Request | None = None) -> list[RequestOutput]:
        """The finished outputs, one per sample in index order. With `request`, a client
        disconnect aborts it (raises ClientGone)."""
        watcher = asyncio.ensure_future(wait_for_disconnect(request)) if request is not None else None
        collector = asyncio.ensure_future(self._drain())
        try:
            waiting = {collector} | ({watcher} if watcher else set())
            done, _ = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
            if collector in done:
                return collector.result()
            raise ClientGone(self.request_id)
        finally:
            for task in (watcher, collector):
                if task is not None and not task.done():
                    task.cancel()
            if not self.finished:
                self.cancel()

    async def _drain(self) -> list[RequestOutput]:
        async for _ in self:
            pass
        return [self.finals[i] for i in sorted(self.finals)]

    def _observe(self, out: RequestOutput, stamp: float) -> None:
        if not out.delta_ids:
            return
        last = self._last_token_at.get(out.index)
        if last is None and not self._last_token_at:  # the request's first token, whichever sample drew it
            self.metrics.first_token(self.endpoint, stamp - self.received, out.prompt_tokens)
        gap = None if last is None else (stamp - last) / len(out.delta_ids)
        self.metrics.generated(self.endpoint, len(out.delta_ids), gap)
        self._last_token_at[out.index] = stamp

    def _count_finish(self, out: RequestOutput, stamp: float) -> None:
        if out.finish_reason == "abort":
            if not self._cancelled:
                self.metrics.count_finish(self.endpoint, "error")
            return
        self.metrics.count_finish(self.endpoint, out.finish_reason or "stop")
        # The prompt and its reuse once (sample 0 computed or restored it; the others forked from
        # it), the generated tokens of every sample.
        first = self.finals.get(0, out)
        generated = sum(len(o.output_ids) for o in self.finals.values())
        self.metrics.observe_finished(self.endpoint, first, stamp - self.received, generated)


async def wait_for_disconnect(request: Request) -> None:
    """Return when the client closes the connection (the body has already been read)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
