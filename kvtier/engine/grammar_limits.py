"""Bounds a grammar, regex or JSON schema must stay within before the grammar engine sees it.

The grammar engine (llguidance) compiles recursively: a chain of a few thousand rules or `$ref`s
overflows a thread's stack and kills the process, and a large repetition count (`a{99999999}`)
makes one token mask cost seconds on the step thread. Each spec is measured here in one linear,
non-recursive pass: its size, its rules (Lark and GBNF rules, JSON Schema subschemas), its depth
(bracket nesting, and the longest chain of rule or `$ref` references), and its repetition counts
(the product of nested counts). Past a limit it is refused with the limit's name and the option
that sets it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from kvtier.engine.request import GrammarSpec


class GrammarError(ValueError):
    """A schema, regex or grammar the grammar engine cannot or may not compile."""


class GrammarLimitError(GrammarError):
    """A spec past one of the grammar limits (the message names the limit and its option)."""


@dataclass(frozen=True)
class GrammarLimits:
    # A JSON schema of a few hundred properties or a grammar of a few hundred rules is a few tens
    # of KB; tool definitions are embedded in the grammar that forces a call.
    max_bytes: int = 128 << 10
    max_rules: int = 2000  # Lark/GBNF rules and terminals, or JSON Schema subschemas
    max_depth: int = 256  # bracket nesting, and the longest chain of rule or $ref references
    max_repeat: int = 10_000  # a repetition count, and the product of nested ones
    timeout_s: float = 10.0  # compile, matcher and first mask, on the grammar thread

    def __post_init__(self) -> None:
        for name in ("max_bytes", "max_rules", "max_depth", "max_repeat"):
            if getattr(self, name) < 1:
                raise ValueError(f"grammar limit {name} must be >= 1, got {getattr(self, name)}")
        if not self.timeout_s > 0:
            raise ValueError(f"grammar limit timeout_s must be > 0, got {self.timeout_s}")


# The server's flag for each limit, named in a refusal so an operator knows what to raise.
FLAGS = {"max_bytes": "--max-grammar-bytes", "max_rules": "--max-grammar-rules",
         "max_depth": "--max-grammar-depth", "max_repeat": "--max-grammar-repeat"}


def check(spec: GrammarSpec, limits: GrammarLimits) -> None:
    """Raise GrammarLimitError if `spec` is past a limit; O(len(spec.text)), no recursion."""
    size = len(spec.text.encode("utf-8", "surrogatepass"))
    _bound(size, limits, "max_bytes", f"is {size:,} bytes")
    if spec.kind == "regex":
        _check_regex(spec.text, limits)
    elif spec.kind == "json_schema":
        _check_schema_text(spec.text, limits)
    elif spec.kind in ("lark", "gbnf"):
        _check_grammar(spec.text, limits, gbnf=spec.kind == "gbnf")


def _bound(value: int, limits: GrammarLimits, name: str, what: str) -> None:
    limit = getattr(limits, name)
    if value > limit:
        raise GrammarLimitError(f"the grammar {what}, over the limit of {limit:,} ({FLAGS[name]})")


# ----- regular expressions --------------------------------------------------------------------

# Counts as the grammar engine reads them: spaces and a sign allowed, `{,n}` too.
_QUANT = re.compile(r"\{\s*[+-]?(\d*)\s*(?:,\s*[+-]?(\d*)\s*)?\}")
_BRACED_ESCAPE = re.compile(r"\\[xuUpPN]\{[^}]*\}")  # \x{1F600}, \p{L}: one character, not a count


def _count(m: re.Match[str]) -> int | None:
    """The largest count a quantifier match names (None: `{}`, not a quantifier); a count of
    more than 9 digits is taken as 10^digits, so int() never parses a huge string."""
    digits = [g for g in m.groups() if g]
    return max((int(d) if len(d) <= 9 else 10 ** min(len(d), 12) for d in digits), default=None)


def _check_regex(text: str, limits: GrammarLimits) -> None:
    """Group depth and the product of nested repetition counts (`(a{1000}){1000}` is 10^6)."""
    # Each open group: the product of the counts of the groups around it, and the largest
    # product reached inside it (what a count after its `)` multiplies).
    outer: list[int] = []
    inner: list[int] = []
    scale, last, i, n = 1, 1, 0, len(text)  # last: the product of the atom a quantifier would repeat
    while i < n:
        c = text[i]
        if c == "\\":
            m = _BRACED_ESCAPE.match(text, i)
            i, last = (m.end() if m else i + 2), scale
            continue
        if c == "[":
            i, last = _class_end(text, i), scale
            continue
        if c == "(":
            outer.append(scale)
            inner.append(scale)
            _bound(len(outer), limits, "max_depth", f"nests groups {len(outer)} deep")
        elif c == ")" and outer:
            scale = outer.pop()
            last = inner.pop()
            if inner:
                inner[-1] = max(inner[-1], last)
        elif c == "{" and (m := _QUANT.match(text, i)) and (count := _count(m)) is not None:
            last = _repeat(last, count, limits)  # a second quantifier repeats the first's product
            if inner:
                inner[-1] = max(inner[-1], last)
            i = m.end()
            continue
        else:
            last = scale
            if inner:
                inner[-1] = max(inner[-1], scale)
        i += 1


def _repeat(product: int, count: int, limits: GrammarLimits) -> int:
    _bound(count, limits, "max_repeat", f"repeats {count:,} times")
    total = product * count
    _bound(total, limits, "max_repeat", f"repeats {total:,} times (nested counts multiply)")
    return total


def _class_end(text: str, i: int) -> int:
    """The index past the character class starting at text[i] == '['."""
    j = i + 1
    if j < len(text) and text[j] == "^":
        j += 1
    if j < len(text) and text[j] == "]":  # a leading ] is a literal
        j += 1
    while j < len(text) and text[j] != "]":
        j += 2 if text[j] == "\\" else 1
    return j + 1


# ----- JSON schemas ---------------------------------------------------------------------------


def _check_schema_text(text: str, limits: GrammarLimits) -> None:
    depth = _bracket_depth(text)
    _bound(depth, limits, "max_depth", f"nests {depth} deep")
    try:
        schema = json.loads(text)
    except ValueError:
        return  # the grammar engine names what is wrong with it
    _check_schema(schema, limits)


def _bracket_depth(text: str) -> int:
    """The deepest nesting of JSON brackets, strings skipped (before json.loads recurses)."""
    depth = deepest = 0
    in_string = escaped = False
    for c in text:
        if in_string:
            if escaped:
                escaped = False
            elif c == "\\":
                escaped = True
            elif c == '"':
                in_string = False
        elif c == '"':
            in_string = True
        elif c in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif c in "]}":
            depth -= 1
    return deepest


def _check_schema(schema: Any, limits: GrammarLimits) -> None:
    """Subschemas counted, regexes checked, and the `$ref` chains measured: a definition's depth
    is its own nesting plus the deepest definition it refers to."""
    nodes = 0
    local: dict[str, int] = {}  # "#/$defs/x" (and "#" for the root) -> its nesting depth
    refs: dict[str, set[str]] = {}
    for pointer, node, depth in _walk_schema(schema):
        nodes += 1
        _bound(nodes, limits, "max_rules", f"has over {limits.max_rules:,} subschemas")
        local[pointer] = max(local.get(pointer, 0), depth)
        ref = node.get("$ref")
        if isinstance(ref, str):
            refs.setdefault(pointer, set()).add(ref)
        for key in ("pattern",):
            if isinstance(node.get(key), str):
                _check_regex(node[key], limits)
        for key in node.get("patternProperties") or {}:
            _check_regex(str(key), limits)
    chain = _deepest_chain(local, refs)
    _bound(chain, limits, "max_depth", f"nests {chain} deep through its $refs")


def _walk_schema(schema: Any) -> Iterator[tuple[str, dict[str, Any], int]]:
    """(the definition it belongs to, subschema, depth inside that definition) for every dict."""
    stack: list[tuple[str, Any, int]] = [("#", schema, 1)]
    while stack:
        pointer, node, depth = stack.pop()
        if isinstance(node, list):
            stack.extend((pointer, v, depth) for v in node)
            continue
        if not isinstance(node, dict):
            continue
        yield pointer, node, depth
        for key, value in node.items():
            if key in ("$defs", "definitions") and isinstance(value, dict) and pointer == "#" and depth == 1:
                stack.extend((f"#/{key}/{name}", sub, 1) for name, sub in value.items())
            elif isinstance(value, (dict, list)) and key not in ("enum", "const", "default", "examples"):
                stack.append((pointer, value, depth + 1))


# ----- Lark and GBNF grammars -----------------------------------------------------------------

# A rule's header: its name, then template parameters, attributes or a priority, then `:`.
_LARK_RULE = re.compile(r"^[ \t]*[?!]?([\w-]+)(?:\{[^}\n]*\})?(?:\[[^\]\n]*\])?(?:\.[+-]?\d+)?[ \t]*(?:::_)?:(?!:)",
                        re.M)
_GBNF_RULE = re.compile(r"^[ \t]*([\w-]+)[ \t]*::=", re.M)
_NAME = re.compile(r"[\w-]+")
_TILDE = re.compile(r"~\s*[+-]?(\d+)(?:\s*\.\.\s*[+-]?(\d+))?")


def _check_grammar(text: str, limits: GrammarLimits, gbnf: bool) -> None:
    """Rules counted, bracket nesting and repetition products bounded, regex terminals checked,
    embedded JSON schemas (`%json {...}`) checked as schemas, and the rule-reference chain measured."""
    text = text.replace("\r\n", "\n").replace("\r", "\n")  # a lone CR ends a line for the grammar engine
    starts = [(m.start(), m.end(), m.group(1)) for m in (_GBNF_RULE if gbnf else _LARK_RULE).finditer(text)]
    _bound(len(starts), limits, "max_rules", f"has {len(starts):,} rules")
    if not starts and text.strip():
        raise GrammarLimitError("the grammar has no rule this server can measure (a line `name: ...` for Lark, "
                                "`name ::= ...` for GBNF)")
    names = {name for _, _, name in starts}
    refs: dict[str, set[str]] = {}
    # Everything is scanned, the text before the first header too; each body's names are its refs.
    bodies = [(0, starts[0][0], "")] + [(body_start, starts[k + 1][0] if k + 1 < len(starts) else len(text), name)
                                         for k, (_, body_start, name) in enumerate(starts)]
    for body_start, body_end, name in bodies:
        used = refs.setdefault(name, set())
        for word in _scan_body(text, body_start, body_end, limits, gbnf):
            if word in names:
                used.add(word)
    refs.pop("", None)
    chain = _deepest_chain(dict.fromkeys(names, 1), refs)
    _bound(chain, limits, "max_depth", f"chains {chain} rules deep")


def _scan_body(text: str, i: int, end: int, limits: GrammarLimits, gbnf: bool) -> Iterator[str]:
    """The names a rule's body refers to, checking its nesting and repetitions on the way."""
    scales = [1]  # the product of the counts around each open group
    inner = [1]  # the largest product inside each open group
    last = 1
    while i < end:
        c = text[i]
        if c in " \t\r\n|":
            i += 1
        elif c == "#" or text.startswith("//", i):  # both grammars' line comments
            i = _line_end(text, i, end)
        elif c == '"':
            i, last = _string_end(text, i, end), scales[-1]
            inner[-1] = max(inner[-1], last)
        elif c == "[" and gbnf:
            i, last = _class_end(text, i), scales[-1]
        elif c == "/" and not gbnf:
            j = _regex_end(text, i, end)
            _check_regex(text[i + 1:j - 1], limits)
            i, last = j, scales[-1]
        elif c == "%" and text.startswith("%json", i):
            i = _json_block(text, i + 5, end, limits)
            last = scales[-1]
        elif c in "([":
            scales.append(scales[-1])
            inner.append(scales[-1])
            _bound(len(scales) - 1, limits, "max_depth", f"nests groups {len(scales) - 1} deep")
            i += 1
        elif c in ")]":
            if len(scales) > 1:
                scales.pop()
                last = inner.pop()
                inner[-1] = max(inner[-1], last)
            i += 1
        elif ((c == "{" and (m := _QUANT.match(text, i))) or (c == "~" and (m := _TILDE.match(text, i)))) \
                and (count := _count(m)) is not None:
            last = _repeat(last, count, limits)  # a second quantifier repeats the first's product
            inner[-1] = max(inner[-1], last)
            i = m.end()
        elif m := _NAME.match(text, i):
            yield m.group(0)
            i, last = m.end(), scales[-1]
        else:
            i += 1


def _line_end(text: str, i: int, end: int) -> int:
    j = text.find("\n", i, end)
    return end if j < 0 else j + 1


def _string_end(text: str, i: int, end: int) -> int:
    j = i + 1
    while j < end and text[j] != '"':
        j += 2 if text[j] == "\\" else 1
    return j + 1


def _regex_end(text: str, i: int, end: int) -> int:
    j = i + 1
    while j < end and text[j] not in "/\n":
        if text[j] == "\\":
            j += 2
        elif text[j] == "[":
            j = _class_end(text, j)
        else:
            j += 1
    return j + 1


def _json_block(text: str, i: int, end: int, limits: GrammarLimits) -> int:
    """Check the JSON schema of a `%json {...}` rule as a schema; the index past it."""
    start = text.find("{", i, end)
    if start < 0:
        return i
    depth, j, in_string, escaped = 0, start, False, False
    while j < end:
        c = text[j]
        if in_string:
            escaped, in_string = (False, True) if escaped else (c == "\\", c != '"')
        elif c == '"':
            in_string = True
        elif c == "{":
            depth += 1
            _bound(depth, limits, "max_depth", f"nests {depth} deep")
        elif c == "}":
            depth -= 1
            if depth == 0:
                _check_schema_text(text[start:j + 1], limits)
                return j + 1
        j += 1
    return end


# ----- reference chains -----------------------------------------------------------------------


def _deepest_chain(weight: Mapping[str, int], refs: Mapping[str, Iterable[str]]) -> int:
    """The heaviest path through the reference graph, a cycle's members counted once each (an
    upper bound on how deep a recursive compile of it goes). Iterative: Tarjan's strongly connected
    components, whose order is a reverse topological order of the condensed graph."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    component: dict[str, int] = {}
    heaviest: list[int] = []  # per component, in the order found (sinks first)
    for root in weight:
        if root in index:
            continue
        work: list[tuple[str, Iterator[str]]] = [(root, iter(refs.get(root, ())))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in weight:
                    continue
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(refs.get(child, ()))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                members = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component[member] = len(heaviest)
                    members.append(member)
                    if member == node:
                        break
                below = max((heaviest[component[c]] for m in members for c in refs.get(m, ())
                             if c in component and component[c] != len(heaviest)), default=0)
                heaviest.append(sum(weight[m] for m in members) + below)
    return max(heaviest, default=0)
