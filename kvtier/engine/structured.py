"""Structured output: a grammar engine's token masks keep a sequence inside a JSON schema, regex or grammar.

The grammar engine is llguidance (the one vLLM, SGLang and llama.cpp ship): abi3 CPU wheels with
no torch or compiler dependency, JSON Schema, regex and Lark (with JSON schemas inside a grammar,
which tool calls need), and a mask per step in tens of microseconds with no per-grammar compile
ahead of time. Compiling a spec to the engine's grammar text is cached per spec; a `Constraint`
(one sequence's matcher) is made by the caller's thread (`Grammars.constraint`), never the step's.
"""

from __future__ import annotations

import functools
import threading
from typing import Any

import llguidance
import torch

from kvtier.engine.request import GrammarSpec

# llguidance's torch and transformers helpers are imported on first use, on the caller's thread
# (`Grammars.tokenizer`): `llguidance.torch` defines a torch.compile'd function, which costs 1.5-4 s
# of every process's start on a 2-core CPU, and most processes never constrain a request.

# Compact JSON: what a schema-following model emits; a free-whitespace grammar lets a small model
# pad with newlines until max_tokens.
_JSON_OPTIONS: Any = {"whitespace_flexible": False}  # llguidance's JsonCompileOptions


class GrammarError(ValueError):
    """A schema, regex or grammar the grammar engine cannot compile."""


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
    """Grammar compilation for one tokenizer, cached per spec (thread-safe; built on first use)."""

    def __init__(self, tokenizer: Any, vocab_size: int):
        self._hf = tokenizer
        self._vocab = vocab_size
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._lock = threading.Lock()

    @property
    def tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:  # its token trie takes ~0.3 s to build: once per model
            if self._tokenizer is None:
                if self._hf is None:
                    raise GrammarError("structured output needs the model's tokenizer")
                import llguidance.hf
                import llguidance.torch  # noqa: F401 - for Constraint.fill_mask, here rather than on the step thread

                self._tokenizer = llguidance.hf.from_tokenizer(self._hf, n_vocab=self._vocab)
            return self._tokenizer

    def compile(self, spec: GrammarSpec) -> str:
        """The engine's grammar for `spec`, checked against this tokenizer (raises GrammarError)."""
        return _compile(spec, self.tokenizer)

    def constraint(self, spec: GrammarSpec) -> Constraint:
        matcher = llguidance.LLMatcher(self.tokenizer, self.compile(spec))
        if matcher.is_error():
            raise GrammarError(matcher.get_error())
        return Constraint(matcher)


@functools.lru_cache(maxsize=256)
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
    error = llguidance.LLMatcher.validate_grammar(grammar, tokenizer)
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
