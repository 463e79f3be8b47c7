"""Engine outputs as OpenAI choices: text, tool calls and logprobs, whole or streamed.

One `ChatChoiceStream` / `CompletionChoiceStream` per sample turns each engine output into the
chunk deltas of its choice; the whole-response builders take a sample's final output. With a
reasoning parser, a chat sample's thinking is split off first (kvtier/serve/reasoning.py) and
tool calls are read from the answer after it, as vLLM does.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvtier.engine.engine import RequestOutput
from kvtier.engine.sampler import TokenLogprobs
from kvtier.serve import responses as r
from kvtier.serve.inputs import ToolSetup
from kvtier.serve.reasoning import ReasoningParser, ThinkSplitter
from kvtier.serve.tools import CALL_OPEN, ToolCall, may_be_tool_call, parse_tool_calls


def reason(out: RequestOutput) -> r.FinishReason:
    # "abort" never gets here: the bridge raises EngineFailed for it, or nobody is listening any more.
    why = out.finish_reason
    assert why in ("stop", "length"), why
    return why


def usage(outs: Sequence[RequestOutput]) -> r.Usage:
    """One prompt, n samples: the prompt counts once, the completions together."""
    first = outs[0]
    n = sum(len(o.output_ids) for o in outs)
    return r.Usage(
        prompt_tokens=first.prompt_tokens,
        completion_tokens=n,
        total_tokens=first.prompt_tokens + n,
        prompt_tokens_details=r.PromptTokensDetails(
            cached_tokens=first.prompt_tokens_reused,
            attended_prefix_tokens=first.restore.prefix_attended if first.restore else None,
            blended_tokens=first.restore.blended_tokens if first.restore else None,
            recomputed_tokens=first.restore.recomputed_tokens if first.restore else None,
        ),
    )


class TokenText:
    """Token ids as logprobs name them: the text of the token alone and its exact bytes (a
    token may hold part of a character: its text then shows U+FFFD, its bytes the truth).
    `as_ids` (vLLM's return_tokens_as_token_ids): the text is "token_id:N", which a client maps
    back to the id without a tokenizer; the bytes stay the token's own."""

    def __init__(self, tokenizer: Any, bytes_of: Callable[[list[int]], bytes] | None, as_ids: bool = False):
        self._tok = tokenizer
        self._as_ids = as_ids
        self._bytes_of = bytes_of
        self._cache: dict[int, tuple[str, list[int] | None]] = {}

    def __call__(self, token: int) -> tuple[str, list[int] | None]:
        got = self._cache.get(token)
        if got is None:
            text = self._tok.decode([token]) if self._tok is not None and not self._as_ids else f"token_id:{token}"
            got = self._cache[token] = (text, list(self._bytes_of([token])) if self._bytes_of else None)
        return got


def chat_logprobs(lps: Sequence[TokenLogprobs], text: TokenText) -> r.ChatLogprobs:
    def top(t: int, lp: float) -> r.TopLogprob:
        s, raw = text(t)
        return r.TopLogprob(token=s, logprob=lp, bytes=raw)

    return r.ChatLogprobs(content=[
        r.ChatTokenLogprob(**top(x.token, x.logprob).model_dump(), top_logprobs=[top(t, lp) for t, lp in x.top])
        for x in lps
    ])


def completion_logprobs(lps: Sequence[TokenLogprobs], text: TokenText, offset: int) -> r.CompletionLogprobs:
    """`offset`: the characters of this choice's text before these tokens."""
    tokens = [text(x.token)[0] for x in lps]
    offsets = []
    for s in tokens:
        offsets.append(offset)
        offset += len(s)
    return r.CompletionLogprobs(
        tokens=tokens, token_logprobs=[x.logprob for x in lps],
        top_logprobs=[{text(t)[0]: lp for t, lp in x.top} for x in lps], text_offset=offsets,
    )


def prompt_logprobs(out: RequestOutput, text: TokenText) -> r.PromptLogprobs | None:
    if out.prompt_logprobs is None:
        return None

    def entry(lp: TokenLogprobs) -> dict[str, r.PromptLogprob]:
        top = {str(t): r.PromptLogprob(logprob=v, rank=i + 1, decoded_token=text(t)[0]) for i, (t, v) in enumerate(lp.top)}
        return {**top, str(lp.token): r.PromptLogprob(logprob=lp.logprob, rank=lp.rank, decoded_token=text(lp.token)[0])}

    return [entry(lp) if lp is not None else None for lp in out.prompt_logprobs]


def _calls_out(calls: Sequence[ToolCall]) -> list[r.ToolCallOut]:
    return [r.ToolCallOut(id=f"call_{uuid.uuid4().hex[:24]}", function=r.FunctionCallOut(name=c.name,
                                                                                         arguments=c.arguments))
            for c in calls]


def read_calls(text: str, tools: ToolSetup | None, parallel: bool) -> tuple[str | None, list[ToolCall]]:
    """The content and the tool calls of a finished sample's text."""
    if tools is None or tools.mode == "none":
        return text, []
    if tools.strict and not text.startswith("<" if tools.family == "hermes" else ("{", "<")):
        return text, []  # the grammar let it answer in text: a call written later was not checked
    content, calls = parse_tool_calls(text, tools.family, tools.names)
    return content, calls[:1] if not parallel else calls


def chat_choice(out: RequestOutput, tools: ToolSetup | None, parallel: bool, text: TokenText,
                echo: str = "", reasoning: ReasoningParser | None = None) -> r.ChatChoice:
    """`echo`: text the answer begins with (the request's echo). `reasoning`: the request's parser."""
    thought, said = reasoning.split(out.text) if reasoning is not None else (None, out.text)
    content, calls = read_calls(said or "", tools, parallel)
    answer = content if calls else said
    if echo:
        answer = echo + (answer or "")
    return r.ChatChoice(
        index=out.index,
        message=r.AssistantMessage(content=answer, reasoning_content=thought, tool_calls=_calls_out(calls) or None),
        finish_reason="tool_calls" if calls else reason(out),
        logprobs=chat_logprobs(out.logprobs, text) if out.logprobs is not None else None,
    )


def completion_choice(out: RequestOutput, text: TokenText, echo: str = "") -> r.CompletionChoice:
    return r.CompletionChoice(
        index=out.index, text=echo + out.text, finish_reason=reason(out),
        logprobs=completion_logprobs(out.logprobs, text, 0) if out.logprobs is not None else None,
        prompt_logprobs=prompt_logprobs(out, text),
    )


def _delta_logprobs(out: RequestOutput) -> list[TokenLogprobs]:
    return out.logprobs[len(out.logprobs) - len(out.delta_ids):] if out.logprobs is not None and out.delta_ids else []


@dataclass
class ChatChoiceStream:
    """One sample's stream. With tools, text from where a tool call may begin is held back until
    the sample ends; a call goes out whole, as one tool_calls delta. With a reasoning parser,
    thinking goes out as reasoning_content as it comes, and only the answer after it is content
    (where tool calls are looked for)."""

    index: int
    tools: ToolSetup | None
    parallel: bool
    text: TokenText
    logprobs: bool
    reasoning: ReasoningParser | None = None
    _all: str = ""  # the answer so far (without the thinking)
    _sent: int = 0  # characters of _all streamed as content
    _lps: list[TokenLogprobs] = field(default_factory=list)  # not yet sent
    _split: ThinkSplitter | None = None

    def __post_init__(self) -> None:
        if self.reasoning is not None:
            self._split = self.reasoning.splitter()

    def deltas(self, out: RequestOutput) -> list[r.ChatChunkChoice]:
        thought, said = self._split_off(out)
        self._all += said
        self._lps += _delta_logprobs(out)
        made = []
        if not out.finished:
            end = self._safe_end()
            if end > self._sent or thought:
                made.append(self._content(self._all[self._sent:max(end, self._sent)], thought))
            return made
        content, calls = read_calls(self._all, self.tools, self.parallel)
        if calls:
            sent = self._all[: self._sent].strip()
            rest = content[len(sent):].strip() if content and content.startswith(sent) else ""
            if rest or self._lps or thought:
                made.append(self._content(rest, thought))
            made.append(r.ChatChunkChoice(index=self.index, delta=r.ChatDelta(tool_calls=[
                r.ToolCallDelta(index=i, id=c.id, type="function", function=c.function)
                for i, c in enumerate(_calls_out(calls))])))
            made.append(r.ChatChunkChoice(index=self.index, delta=r.ChatDelta(), finish_reason="tool_calls"))
            return made
        if len(self._all) > self._sent or self._lps or thought:
            made.append(self._content(self._all[self._sent:], thought))
        made.append(r.ChatChunkChoice(index=self.index, delta=r.ChatDelta(), finish_reason=reason(out)))
        return made

    def _split_off(self, out: RequestOutput) -> tuple[str, str]:
        """(thinking, answer) text this output adds; at the end, what the splitter held back too."""
        if self._split is None:
            return "", out.delta_text
        thought, said = self._split.feed(out.delta_text)
        if out.finished:
            more_thought, more_said = self._split.finish()
            thought, said = thought + more_thought, said + more_said
        return thought, said

    def _safe_end(self) -> int:
        """How much of the text can go out as content: all of it but where a tool call may begin."""
        text, tools = self._all, self.tools
        if tools is None or tools.mode == "none":
            return len(text)
        if tools.family != "hermes":  # a Llama 3 call is the whole message
            return self._sent if may_be_tool_call(text, tools.family) else len(text)
        at = text.find(CALL_OPEN, self._sent)
        if at != -1:
            return at
        for k in range(min(len(CALL_OPEN) - 1, len(text)), 0, -1):  # a tail that may become the tag
            if CALL_OPEN.startswith(text[-k:]):
                return len(text) - k
        return len(text)

    def _content(self, piece: str, thought: str = "") -> r.ChatChunkChoice:
        """A delta of answer text `piece` (and thinking `thought`), with the logprobs not sent yet."""
        self._sent += len(piece)
        lps, self._lps = self._lps, []
        delta = r.ChatDelta(content=piece if piece or not thought else None, reasoning_content=thought or None)
        return r.ChatChunkChoice(index=self.index, delta=delta,
                                 logprobs=chat_logprobs(lps, self.text) if self.logprobs else None)


@dataclass
class CompletionChoiceStream:
    index: int
    text: TokenText
    logprobs: bool
    _offset: int = 0

    def deltas(self, out: RequestOutput) -> list[r.CompletionChoice]:
        if not (out.delta_text or out.finished or out.delta_ids):
            return []
        lps = completion_logprobs(_delta_logprobs(out), self.text, self._offset) if self.logprobs else None
        self._offset += len(out.delta_text)
        return [r.CompletionChoice(index=self.index, text=out.delta_text,
                                   finish_reason=reason(out) if out.finished else None, logprobs=lps)]
