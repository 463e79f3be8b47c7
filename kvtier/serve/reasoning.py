"""A reasoning model's thinking, split from its answer (`--reasoning-parser`, vLLM's option).

Reasoning models write their thinking between `<think>` and `</think>`, then the answer. With a
parser, a chat completion returns the two apart: the message's `reasoning_content` and `content`,
and streamed, deltas that carry `reasoning_content` for the thinking and `content` after it. The
tags must reach the text: Qwen3's and DeepSeek-R1's tokenizers have them as ordinary added tokens
(a special token would be dropped by decoding, as every special token is).

Where the output begins decides how it is read:

- inside a think block (the chat template opened it: DeepSeek-R1's and the thinking-only Qwen3
  templates end the prompt with `<think>\\n`): everything up to `</think>` is thinking, all of it
  when `</think>` never comes (the output was cut short); a `<think>` the model writes anyway,
  first thing, is dropped;
- outside: a think block is one the output opens itself, first thing (after whitespace); output
  that does not open one is all answer, a later `<think>` included (Qwen3 with
  `enable_thinking: false`, whose template closes an empty block in the prompt).

qwen3 begins outside unless the prompt ends with an open `<think>`; deepseek_r1 begins inside
unless the prompt ends with a closed block. A request whose output a grammar shapes from its first
token (a JSON schema, regex, grammar or forced tool call) begins outside: what the grammar made is
the answer, unless it let the output open a think block of its own.

    parser = PARSERS["qwen3"].for_request(prompt_tail, constrained=False)
    parser.split("<think>abc</think>answer")     # ("abc", "answer")
    parser.split("answer")                       # (None, "answer")
    s = parser.splitter()                        # streamed: the same split, delta by delta
    s.feed("<thi"), s.feed("nk>ab"), s.finish()  # ("", ""), ("ab", ""), ("", "")
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal

START, END = "<think>", "</think>"
# Prompt tokens decoded to see how the template left the assistant's turn: enough for the
# assistant header and a tag spelt in several tokens.
_TAIL_TOKENS = 16


@dataclass(frozen=True)
class ReasoningParser:
    name: str
    inside: bool = False  # the output begins inside a think block
    start: str = START
    end: str = END

    def for_request(self, prompt_tail: str, constrained: bool = False) -> ReasoningParser:
        """This parser for one request, given the end of its rendered prompt."""
        tail = prompt_tail.rstrip()
        if constrained or tail.endswith(self.end):
            return replace(self, inside=False)
        if tail.endswith(self.start):
            return replace(self, inside=True)
        return self

    def split(self, text: str) -> tuple[str | None, str | None]:
        """(reasoning, content) of a whole output: reasoning is None when the output has no think
        block, content None when nothing follows one. What `splitter` streams, joined."""
        s = self.splitter()
        thought, answer = s.feed(text)
        more_thought, more_answer = s.finish()
        thought, answer = thought + more_thought, answer + more_answer
        if not s.thought:
            return None, answer
        return thought, answer or None

    def splitter(self) -> ThinkSplitter:
        return ThinkSplitter(self)


@dataclass
class ThinkSplitter:
    """One output's split, as its text arrives: each `feed` returns the (reasoning, content) text it
    releases. Text that may still become a tag (`</thi` at the end of a delta) is held back until
    the next delta says, or `finish` releases it."""

    parser: ReasoningParser
    state: Literal["begin", "thinking", "answer"] = "begin"
    thought: bool = False  # the output has a think block (it began in one, or opened one)
    _held: str = ""

    def feed(self, delta: str) -> tuple[str, str]:
        text, self._held = self._held + delta, ""
        p = self.parser
        if self.state == "begin":
            head = text.lstrip()
            if head.startswith(p.start):
                text, self.state = head[len(p.start):], "thinking"
            elif p.start.startswith(head):  # only whitespace, or a start tag in the making
                self._held = text
                return "", ""
            else:
                self.state = "thinking" if p.inside else "answer"
            self.thought = self.state == "thinking"
        if self.state == "answer":
            return "", text
        at = text.find(p.end)
        if at == -1:
            keep = _partial_tag(text, p.end)
            self._held = text[len(text) - keep:]
            return text[: len(text) - keep], ""
        self.state = "answer"
        return text[:at], text[at + len(p.end):]

    def finish(self) -> tuple[str, str]:
        """The held-back text, at the end of the output."""
        held, self._held = self._held, ""
        if self.state == "begin":
            self.state = "thinking" if self.parser.inside else "answer"
            self.thought = self.parser.inside
        return (held, "") if self.state == "thinking" else ("", held)


def _partial_tag(text: str, tag: str) -> int:
    """The length of the longest end of `text` that begins `tag` (shorter than the tag)."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


PARSERS: dict[str, ReasoningParser] = {
    # Qwen3 writes <think> itself (its template opens no block; enable_thinking false closes an
    # empty one in the prompt).
    "qwen3": ReasoningParser("qwen3"),
    # DeepSeek-R1 (and QwQ): the template opens the block, so the output may hold only </think>.
    "deepseek_r1": ReasoningParser("deepseek_r1", inside=True),
}
PARSER_NAMES = tuple(PARSERS)


def request_parser(name: str | None, tokenizer: Any, prompt_ids: Sequence[int],
                   constrained: bool) -> ReasoningParser | None:
    """The parser `name` for one chat request (None: no parser), read against its prompt's end."""
    if name is None:
        return None
    tail = ""
    if tokenizer is not None and prompt_ids:
        # Special tokens kept: the tags are looked for whatever the tokenizer marks them.
        tail = str(tokenizer.decode(list(prompt_ids[-_TAIL_TOKENS:]), skip_special_tokens=False))
    return PARSERS[name].for_request(tail, constrained)
