"""Structured output: a grammar engine's token masks keep a sequence inside a JSON schema, regex or grammar.

The grammar engine is llguidance (the one vLLM, SGLang and llama.cpp ship): abi3 CPU wheels with
no torch or compiler dependency, JSON Schema, regex and Lark (with JSON schemas inside a grammar,
which tool calls need), and a mask per step in tens of microseconds with no per-grammar compile
ahead of time. A spec is bounded first (grammar_limits.py), then compiled on a grammar thread
(grammar_threads.py), never the event loop's or the step's; a `Constraint` (one sequence's matcher)
is a copy of the ready matcher kept per spec.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections import OrderedDict
from concurrent.futures import Future, InvalidStateError
from typing import Any

import llguidance
import torch

from kvtier.engine.grammar_limits import GrammarError, GrammarLimits, check
from kvtier.engine.grammar_threads import grammar_threads
from kvtier.engine.request import GrammarSpec

# llguidance's torch and transformers helpers are imported when the grammar tokenizer is built
# (`Grammars.tokenizer`), on the thread that builds it: `llguidance.torch` defines a
# torch.compile'd function, which costs seconds of a process's start on a small CPU, and a library
# or CLI process that never constrains a request never pays it. A server builds the grammar
# tokenizer as it starts (serve/app.py), before any request is read.

# Compact JSON: what a schema-following model emits; a free-whitespace grammar lets a small model
# pad with newlines until max_tokens.
_JSON_OPTIONS: Any = {"whitespace_flexible": False}  # llguidance's JsonCompileOptions


# Per HF tokenizer: its grammar tokenizers by vocabulary size, and the lock their builds take (one
# model's build never waits for another's).
_SHARED: weakref.WeakKeyDictionary[Any, tuple[dict[int, llguidance.LLTokenizer], threading.Lock]] = \
    weakref.WeakKeyDictionary()
_SHARED_LOCK = threading.Lock()


def _shared_tokenizer(hf: Any, vocab: int) -> llguidance.LLTokenizer:
    """The grammar tokenizer of an HF tokenizer, built once per process (its trie takes a third of
    a second for a 49K vocabulary and holds the GIL meanwhile; engines of one model share it)."""
    with _SHARED_LOCK:
        built, lock = _SHARED.setdefault(hf, ({}, threading.Lock()))
    with lock:
        if vocab not in built:
            import llguidance.hf
            import llguidance.torch  # noqa: F401 - for Constraint.fill_mask, here rather than on the step thread

            built[vocab] = llguidance.hf.from_tokenizer(hf, n_vocab=vocab)
        return built[vocab]


class Constraint:
    """One sequence's place in its grammar: which tokens may come next, and whether it is complete."""

    def __init__(self, matcher: llguidance.LLMatcher):
        self._m = matcher

    def fill_mask(self, bitmask: torch.Tensor, row: int) -> None:
        """bitmask: [rows, ceil(vocab / 32)] int32 on the host; bit t of row `row` set = token t allowed."""
        import llguidance.torch  # imported already by `Grammars.tokenizer`, which made this matcher

        llguidance.torch.fill_next_token_bitmask(self._m, bitmask, row)

    def accept(self, token: int) -> None:
        self._m.consume_token(token)

    @property
    def done(self) -> bool:
        """The grammar is complete: nothing more may be generated."""
        return bool(self._m.is_stopped())

    @property
    def error(self) -> str | None:
        """Why the matcher failed mid-sequence (a grammar too large for its limits), or None."""
        return str(self._m.get_error()) if self._m.is_error() else None

    def fork(self) -> Constraint:
        """An independent copy at the same place (the other samples of an n > 1 request)."""
        return Constraint(self._m.deep_copy())


class Grammars:
    """Grammar compilation for one tokenizer (thread-safe; the tokenizer's trie is built on first use).

    Every spec is checked against `limits` before the grammar engine sees it, then compiled, made
    into a matcher and asked for its first mask on a grammar thread with a large stack (`build`);
    a ready matcher is kept per spec, its total bounded by `cache_bytes`, and each request gets a
    copy."""

    def __init__(self, tokenizer: Any, vocab_size: int, limits: GrammarLimits | None = None,
                 cache_bytes: int = 64 << 20):
        self._hf = tokenizer
        self._vocab = vocab_size
        self.limits = limits or GrammarLimits()
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._failed: str | None = None  # why the grammar tokenizer cannot be built: said, never retried
        self._building: Future[llguidance.LLTokenizer] | None = None
        self._build_lock = threading.Lock()  # held through the build (seconds): never on the event loop
        self._lock = threading.Lock()  # held briefly: the ready matchers, the build's future
        self._ready: OrderedDict[GrammarSpec, tuple[Constraint, int]] = OrderedDict()
        self._ready_bytes = 0
        self._cache_bytes = cache_bytes

    @property
    def available(self) -> bool:
        """Whether grammars can be compiled at all (the model has a tokenizer)."""
        return self._hf is not None

    @property
    def built(self) -> bool:
        """Whether the grammar tokenizer is built (no request waits for it)."""
        return self._tokenizer is not None

    @property
    def tokenizer(self) -> llguidance.LLTokenizer:
        """The model's grammar tokenizer, built here if it is not yet (raises GrammarError if the
        grammar engine cannot read the model's tokenizer, at once after the first failure)."""
        with self._build_lock:  # its token trie is costly to build: once per model
            if self._tokenizer is None:
                # A new error each time: one raised again and again would grow its traceback
                # with every raiser's frames, and keep them.
                if self._failed is not None:
                    raise GrammarError(self._failed)
                if self._hf is None:
                    raise GrammarError("structured output needs the model's tokenizer")
                try:
                    self._tokenizer = _shared_tokenizer(self._hf, self._vocab)
                except Exception as e:  # llguidance refuses some tokenizers (slow ones: a ValueError)
                    self._failed = f"structured output is unavailable: the grammar engine cannot read this model's tokenizer ({e})"
                    raise GrammarError(self._failed) from e
            return self._tokenizer

    def ready(self) -> Future[llguidance.LLTokenizer]:
        """The model's grammar tokenizer, built on a grammar thread if it is not yet: a per-model
        cost, which callers wait for before a grammar's deadline starts. Every caller waits for
        the one build (raising GrammarError if it fails), through a future of its own: a caller
        that cancels its wait (a client gone) never cancels the build for the others."""
        mine: Future[llguidance.LLTokenizer] = Future()
        if self._tokenizer is not None:  # no thread to wait behind
            mine.set_result(self._tokenizer)
            return mine
        with self._lock:  # not the build's lock: the event loop calls this
            if self._building is None:
                self._building = grammar_threads().submit(lambda: self.tokenizer)
            building = self._building

        def settle(done: Future[llguidance.LLTokenizer]) -> None:
            with contextlib.suppress(InvalidStateError):  # its caller cancelled it
                if done.cancelled():  # nothing cancels the build; were it cancelled, no wait hangs
                    mine.cancel()
                elif (error := done.exception()) is not None:
                    # each waiter an error of its own (see `tokenizer`)
                    mine.set_exception(GrammarError(str(error)) if isinstance(error, GrammarError) else error)
                else:
                    mine.set_result(done.result())

        building.add_done_callback(settle)
        return mine

    def build(self, spec: GrammarSpec) -> Future[Constraint]:
        """A constraint for `spec` at its start, made on a grammar thread (raises GrammarError
        through the future). Wait on it with a deadline of `limits.timeout_s`."""
        return grammar_threads().submit(self._constraint_here, spec)

    def constraint(self, spec: GrammarSpec) -> Constraint:
        """`build`, waited for (raises GrammarError, also past the deadline)."""
        try:
            self.ready().result()  # the tokenizer is the model's cost, not this grammar's
            return self.build(spec).result(timeout=self.limits.timeout_s)
        except TimeoutError:
            raise GrammarError(too_slow(self.limits)) from None

    def _constraint_here(self, spec: GrammarSpec) -> Constraint:
        with self._lock:
            kept = self._ready.get(spec)
            if kept is not None:
                self._ready.move_to_end(spec)
                return kept[0].fork()
        check(spec, self.limits)
        grammar = _compile(spec, self.tokenizer)
        matcher = llguidance.LLMatcher(self.tokenizer, grammar, limits=_PARSER_LIMITS)
        if not matcher.is_error():  # the first mask: where a grammar too large for its limits fails
            Constraint(matcher).fill_mask(allocate_bitmask(1, self._vocab), 0)
        if matcher.is_error():
            raise GrammarError(f"cannot compile the {spec.kind}: {matcher.get_error()}")
        ready = Constraint(matcher)
        self._keep(spec, ready, len(spec.text) + len(grammar) + _MATCHER_BYTES)
        return ready.fork()

    def _keep(self, spec: GrammarSpec, ready: Constraint, size: int) -> None:
        with self._lock:
            if spec in self._ready or size > self._cache_bytes:
                return
            self._ready[spec] = (ready, size)
            self._ready_bytes += size
            while self._ready_bytes > self._cache_bytes:
                _, (_, gone) = self._ready.popitem(last=False)
                self._ready_bytes -= gone


def too_slow(limits: GrammarLimits) -> str:
    return (f"the grammar took longer than {limits.timeout_s:g} s to compile (--grammar-timeout); "
            "simplify it")


# A ready matcher's own memory (its lexer and parser tables) is not exposed; this is the allowance
# the cache counts for it besides the texts.
_MATCHER_BYTES = 256 << 10

# llguidance's own per-step limits keep their defaults (lexer fuel and Earley items a mask may
# spend): they end a grammar the checks of grammar_limits.py let through but that grows too large
# mid-sequence. Its errors leave out the parser's state and the grammar's text: they reach clients.
_PARSER_LIMITS = llguidance.LLParserLimits(verbose_errors=False)


def _compile(spec: GrammarSpec, tokenizer: llguidance.LLTokenizer) -> str:
    try:
        if spec.kind == "json_object":
            grammar = llguidance.LLMatcher.grammar_from_json_schema('{"type": "object"}', defaults=_JSON_OPTIONS)
        elif spec.kind == "json_schema":
            grammar = llguidance.LLMatcher.grammar_from_json_schema(spec.text, defaults=_JSON_OPTIONS)
        elif spec.kind == "regex":
            grammar = llguidance.LLMatcher.grammar_from_regex(spec.text)
        elif spec.kind == "gbnf":  # llama.cpp's grammar format
            grammar = llguidance.LLMatcher.grammar_from_lark(_gbnf_to_lark(spec.text))
        else:
            grammar = llguidance.LLMatcher.grammar_from_lark(spec.text)
    except (ValueError, TypeError) as e:
        raise GrammarError(f"cannot compile the {spec.kind}: {e}") from e
    error = llguidance.LLMatcher.validate_grammar(grammar, tokenizer, limits=_PARSER_LIMITS)
    if error:
        raise GrammarError(f"cannot compile the {spec.kind}: {error}")
    return grammar


def _gbnf_to_lark(text: str) -> str:
    from llguidance.gbnf_to_lark import gbnf_to_lark

    try:
        return gbnf_to_lark(text)
    except Exception as e:  # the converter raises a bare Exception for an unknown rule
        raise GrammarError(f"cannot convert the GBNF grammar: {e}") from e


def allocate_bitmask(rows: int, vocab_size: int) -> torch.Tensor:
    """[rows, ceil(vocab / 32)] int32, every token allowed (rows without a constraint stay so)."""
    return torch.full((rows, (vocab_size + 31) // 32), -1, dtype=torch.int32)


def apply_bitmask(x: torch.Tensor, bitmask: torch.Tensor) -> None:
    """In place on x [rows, vocab]: tokens whose bit is clear go to -inf. Plain tensor ops (llguidance's
    own helper is torch.compile'd: seconds of compile on the step thread, and no compiler, no step)."""
    rows, vocab = x.shape
    shifts = torch.arange(32, device=x.device, dtype=torch.int32)
    bits = (bitmask.to(x.device, non_blocking=True)[:, :, None] >> shifts) & 1  # [rows, words, 32]
    x.masked_fill_(bits.reshape(rows, -1)[:, :vocab] == 0, float("-inf"))
