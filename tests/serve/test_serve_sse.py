"""An event's JSON never carries a character that line-splitting SSE readers (httpx's aiter_lines,
str.splitlines) take for a line break, whatever text the model generated."""

from __future__ import annotations

import json

from pydantic import BaseModel

from kvtier.serve.sse import event

TEXT = "a\u2028b\x85c\u2029d\x1ee\u00e9\n"


class Delta(BaseModel):
    content: str


def test_event_json_survives_splitlines_readers():
    for payload in (Delta(content=TEXT), {"content": TEXT}):
        raw = event(payload).decode()
        lines = raw.splitlines()
        assert lines == [raw[:-2], ""]  # one data line, then the blank line that ends the event
        assert json.loads(lines[0].removeprefix("data: "))["content"] == TEXT
