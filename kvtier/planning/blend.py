"""Blended restores (non-prefix reuse: CacheBlend, EPIC/LegoLink) as plain values.

A prompt is laid out as [exact prefix][blended region], the region ending one token before the
prompt's last (the request's own step computes that one and samples). Inside the region, marked
documents ("segments") whose state was computed alone are loaded at their new positions (K rotated
by the difference), and the rest is recomputed against every key before it with the exact causal
mask: the tokens no segment covers, and the tokens the mode picks:

- `legolink` (the default): the first `link_tokens` of every segment, whose state computed alone
  carries an attention sink of its own; static, so the plan is a function of the layout alone.
- `cacheblend`: the share `ratio` of loaded tokens whose K at layer `check_layer`, computed afresh,
  deviates most from the loaded K (ties by position); the layers up to it are computed for every
  token. With `score` "weighted" (the default) each token's deviation is weighed by the attention
  the prompt's last rows (the question after the last document) pay it in the layers past the
  check, over the loaded state: a deviation the question never reads costs nothing. The executor
  picks them (they depend on values); the plan names the static part only.
- `naive`: nothing but the uncovered tokens (the floor a benchmark shows).

With `link_tokens` at least a segment's length every token is recomputed, and the result is an
exact prefill's, bit for bit. Blended state is approximate: it never enters an exact key.
Torch-free.
"""

from __future__ import annotations

import enum
import functools
import operator
from array import array
from collections.abc import Sequence
from dataclasses import dataclass

# Segments shorter than this are recomputed, not loaded: a few rows gain nothing over their compute.
MIN_SEGMENT_TOKENS = 8
MAX_LINK_TOKENS = 1 << 20


class BlendMode(str, enum.Enum):
    LEGOLINK = "legolink"
    CACHEBLEND = "cacheblend"
    NAIVE = "naive"


class BlendScore(str, enum.Enum):
    WEIGHTED = "weighted"  # K deviation x the attention the prompt's last rows pay the token
    DEVIATION = "deviation"  # K deviation alone (the CacheBlend paper's)


@dataclass(frozen=True)
class BlendOptions:
    """How one request blends (the engine's defaults, or a request's own)."""

    mode: BlendMode | str = BlendMode.LEGOLINK
    # legolink: leading tokens of each segment recomputed; the default is the largest that keeps a
    # 10-passage RAG prompt within 3% recomputed (docs/blend.md, "Results").
    link_tokens: int = 8
    ratio: float = 0.15  # cacheblend: share of the loaded tokens recomputed
    check_layer: int = 2  # cacheblend: the layer whose K deviation picks them (docs/blend.md, "Results")
    score: BlendScore | str = BlendScore.WEIGHTED  # cacheblend: the deviation alone or weighed by attention

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "mode", BlendMode(self.mode))
        except ValueError:
            raise ValueError(f"blend mode {self.mode!r}: use one of {', '.join(m.value for m in BlendMode)}") from None
        if isinstance(self.link_tokens, bool) or not isinstance(self.link_tokens, int) or \
                not 0 <= self.link_tokens <= MAX_LINK_TOKENS:
            raise ValueError(f"blend link_tokens must be an integer in [0, {MAX_LINK_TOKENS}], got {self.link_tokens!r}")
        if isinstance(self.ratio, bool) or not isinstance(self.ratio, (int, float)) or not 0.0 <= self.ratio <= 1.0:
            raise ValueError(f"blend ratio must be in [0, 1], got {self.ratio!r}")
        try:
            object.__setattr__(self, "score", BlendScore(self.score))
        except ValueError:
            raise ValueError(f"blend score {self.score!r}: use one of {', '.join(s.value for s in BlendScore)}") from None
        if isinstance(self.check_layer, bool) or not isinstance(self.check_layer, int) or self.check_layer < 0:
            raise ValueError(f"blend check_layer must be a non-negative integer, got {self.check_layer!r}")

    def describe(self) -> str:
        mode = BlendMode(self.mode)
        if mode is BlendMode.LEGOLINK:
            return f"legolink k={self.link_tokens}"
        if mode is BlendMode.CACHEBLEND:
            return f"cacheblend r={self.ratio:g} at layer {self.check_layer}, {BlendScore(self.score).value}"
        return "naive"


@dataclass(frozen=True)
class PlacedSegment:
    """A segment (`tokens`, its state computed alone) at prompt positions [position, position +
    len(tokens)); rows [first, last) of it lie in the blended region."""

    tokens: tuple[int, ...]
    position: int
    first: int
    last: int

    @property
    def end(self) -> int:
        return self.position + len(self.tokens)


@dataclass(frozen=True)
class BlendPlan:
    """[start, exact_end) come from the exact chain (Plan.chunks), [exact_end, end) are blended:
    `runs` recomputed, the segments' other rows loaded. `end` is the prompt's last token."""

    start: int
    exact_end: int
    end: int
    segments: tuple[PlacedSegment, ...]
    runs: tuple[tuple[int, int], ...]  # [a, b) recomputed, sorted, disjoint, not adjacent
    options: BlendOptions

    @property
    def recomputed_tokens(self) -> int:
        """Static recompute only; cacheblend's chosen tokens come on top."""
        return sum(b - a for a, b in self.runs)

    @functools.cached_property
    def loaded(self) -> tuple[tuple[int, int], ...]:
        """Segment rows [a, b) (prompt positions) loaded rather than recomputed."""
        return tuple(subtract([(s.position + s.first, s.position + s.last) for s in self.segments], self.runs))

    @property
    def blended_tokens(self) -> int:
        return sum(b - a for a, b in self.loaded)

    def lead(self, runs: Sequence[tuple[int, int]] | None = None) -> tuple[int, int] | None:
        """The recomputed run of `runs` (default: the plan's; a restore's may add CacheBlend's
        chosen rows, never remove one) that continues the exact prefix, None where the first row
        past it is loaded: computed over exact keys only, with the step's kernels, it is exact
        state."""
        runs = self.runs if runs is None else runs
        return runs[0] if runs and runs[0][0] == max(self.start, self.exact_end) else None

    @property
    def exact_upto(self) -> int:
        """Positions [0, exact_upto) hold exact state: the exact prefix and the plan's lead (a
        restore's lead is at least as long)."""
        lead = self.lead()
        return lead[1] if lead else max(self.start, self.exact_end)


def merged(spans: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    """Sorted union of [a, b) spans, adjacent ones joined."""
    out: list[tuple[int, int]] = []
    for a, b in sorted(s for s in spans if s[0] < s[1]):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def subtract(spans: Sequence[tuple[int, int]], cut: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    """The positions of `spans` outside `cut` (both sorted and disjoint), as sorted spans; one
    merge over both lists."""
    out = []
    j = 0
    for a, b in spans:
        while j < len(cut) and cut[j][1] <= a:
            j += 1
        pos, i = a, j
        while i < len(cut) and cut[i][0] < b:
            c, d = cut[i]
            if c > pos:
                out.append((pos, c))
            pos = max(pos, d)
            i += 1
        if pos < b:
            out.append((pos, b))
    return out


def pieces(runs: Sequence[tuple[int, int]], rows: int) -> list[list[tuple[int, int]]]:
    """`runs` (sorted) cut into groups of at most `rows` positions each, in order; a long run is split."""
    groups: list[list[tuple[int, int]]] = [[]]
    left = rows
    for a, b in runs:
        while a < b:
            if left == 0:
                groups.append([])
                left = rows
            e = min(b, a + left)
            groups[-1].append((a, e))
            left -= e - a
            a = e
    return [g for g in groups if g]


def integer(x: object) -> int:
    """`x` where it is an integer (Python's, numpy's, torch's), never a bool or a float; else a TypeError."""
    if isinstance(x, bool) or type(x).__name__ == "bool_":
        raise TypeError("a bool is not an integer here")
    return operator.index(x)  # type: ignore[arg-type]


def check_segments(segments: Sequence[tuple[int, int]], n_tokens: int) -> tuple[tuple[int, int], ...]:
    """Segment spans [a, b) of a prompt of `n_tokens`: sorted, disjoint, non-empty, inside it."""
    pairs = []
    for s in segments:
        try:
            a, b = s
            pairs.append((integer(a), integer(b)))
        except (TypeError, ValueError):
            raise ValueError("segments must be (start, end) pairs of integer token positions") from None
    out = tuple(pairs)
    prev = 0
    for a, b in out:
        if not prev <= a < b <= n_tokens:
            raise ValueError(f"segment [{a}, {b}) must lie in the prompt's {n_tokens} tokens, after the one "
                             "before it, and hold at least one token")
        prev = b
    return out


def plan_blend(prompt: Sequence[int], segments: Sequence[tuple[int, int]], start: int, exact_end: int,
               options: BlendOptions) -> BlendPlan | None:
    """The blend of `prompt` past its exact prefix [0, max(start, exact_end)): None when no segment
    of at least MIN_SEGMENT_TOKENS rows lies in what is left (nothing to load: prefill instead)."""
    end = len(prompt) - 1
    lo = max(start, exact_end)
    placed = []
    for a, b in segments:
        first, last = max(lo, a) - a, min(end, b) - a
        if last - first >= MIN_SEGMENT_TOKENS:
            placed.append(PlacedSegment(tuple(prompt[a:b]), a, first, last))
    if not placed:
        return None
    covered = [(s.position + s.first, s.position + s.last) for s in placed]
    runs = subtract([(lo, end)], covered)
    mode = BlendMode(options.mode)
    if mode is BlendMode.LEGOLINK:
        # Rows [0, k) of each segment, those of them past the exact prefix.
        runs += [(s.position + s.first, s.position + min(options.link_tokens, s.last)) for s in placed]
    return BlendPlan(start, exact_end, end, tuple(placed), tuple(merged(runs)), options)


def find_segments(prompt: Sequence[int], documents: Sequence[Sequence[int]]) -> list[tuple[int, int] | None]:
    """Where each document's tokens occur in the prompt, in order, each after the one before
    (None: not found there). A byte search (linear in practice), not a scan of every offset: a
    hostile prompt of one repeated token must not cost len(prompt) x len(document) comparisons."""
    hay = array("q", prompt).tobytes()
    width = array("q").itemsize
    out: list[tuple[int, int] | None] = []
    at = 0
    for doc in documents:
        needle = array("q", doc).tobytes()
        found = None
        pos = hay.find(needle, at * width) if needle else -1
        while pos >= 0 and pos % width:  # a match across two ids' bytes: look on from the next id
            pos = hay.find(needle, pos + width - pos % width)
        if pos >= 0:
            found = (pos // width, pos // width + len(doc))
            at = found[1]
        out.append(found)
    return out
