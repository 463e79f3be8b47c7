"""Server-sent events: `data: <json>\\n\\n` per chunk, then `data: [DONE]`, as OpenAI streams.

Headers go out before the first token, so a failure mid-stream cannot change the status code;
it is reported as an `{"error": ...}` event before `[DONE]` (what vLLM and OpenAI clients expect).
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Callable

from pydantic import BaseModel
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from kvtier.engine.engine import RequestOutput
from kvtier.serve.bridge import EngineFailed, Generation, GrammarFailed
from kvtier.serve.errors import error_body

log = logging.getLogger("kvtier.serve")

DONE = b"data: [DONE]\n\n"

# How OpenAPI 3.2 describes an event of a text/event-stream body (the same shape FastAPI uses).
SSE_EVENT_SCHEMA = {
    "type": "object",
    "properties": {
        "data": {"type": "string"},
        "event": {"type": "string"},
        "id": {"type": "string"},
        "retry": {"type": "integer", "minimum": 0},
    },
}


# Characters Python's str.splitlines() (and so httpx's aiter_lines and many hand-written SSE readers)
# treats as line breaks although SSE and JSON do not: a model that generates one would cut the
# event in two for such clients. JSON's \u escapes keep the text identical.
_LINE_BREAKS_JSON_KEEPS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def event(payload: BaseModel | dict) -> bytes:
    data = payload.model_dump_json() if isinstance(payload, BaseModel) else json.dumps(payload)
    return b"data: " + data.translate(_LINE_BREAKS_JSON_KEEPS).encode() + b"\n\n"


class GenerationStream(StreamingResponse):
    """A streaming response that aborts its generation however the response ends.

    Starlette cancels the body iterator when the client disconnects; an iterator cancelled
    before it ever started (or parked at a `yield` during a blocked send) would not run its own
    cleanup, so the abort is tied to the response instead.
    """

    def __init__(self, gen: Generation, body: AsyncIterator[bytes]) -> None:
        super().__init__(body, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self.generation = gen

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.generation.cancel()  # no-op when it finished


async def stream_events(
    gen: Generation,
    first: list[BaseModel],
    on_output: Callable[[RequestOutput], list[BaseModel]],
) -> AsyncIterator[bytes]:
    """Yield `first`, then the chunks `on_output` makes of each engine output, then [DONE]."""
    for chunk in first:
        yield event(chunk)
    try:
        async for out in gen:
            for chunk in on_output(out):
                yield event(chunk)
    except GrammarFailed as e:
        yield event(error_body(str(e), "invalid_request_error", None, "grammar_failed"))
    except EngineFailed as e:
        yield event(error_body(str(e), "server_error", None, "engine_error"))
    yield DONE
