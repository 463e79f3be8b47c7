"""What a step is made of: the runs the engine hands the runner (`RunItem`), where context comes
from when it is not in the pool (`ContextFeed`), slot math, and the step's common metadata
(`StepBatch`), built once on the host, uploaded in one copy and shared by every layer. What only one
attention backend needs sits in that backend's own record (`StepBatch.decodes`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

import numpy as np
import torch

# capture(layer, offsets, h [tokens, hidden], k [tokens, kv_heads, hd] rotated, v [tokens, kv_heads, hd]):
# once per layer for the whole step; run i is rows offsets[i]:offsets[i+1].
CaptureFn = Callable[[int, tuple[int, ...], torch.Tensor, torch.Tensor, torch.Tensor], None]


@dataclass(frozen=True)
class RunItem:
    """One request's run of tokens in a step: positions [start, start + len(token_ids))."""

    token_ids: Sequence[int]
    start: int
    block_ids: Sequence[int]
    want_logits: bool
    # Logits of every token of the run, not just the last (prompt logprobs); they come first among
    # its rows, the last token's (when want_logits) among them.
    all_logits: bool = False
    # Positions [0, unslotted) have no pool slot: position p sits in slot p - unslotted, and RoPE
    # still rotates at p. Unless fed (below), the run does not attend to them.
    unslotted: int = 0
    # Of those, positions [0, context_feed) are attended all the same (a decoding run only): their
    # K/V come from a feeding run of the step or from the step's `ContextFeed`, not from the pool.
    # A multiple of the block size, at most `unslotted`.
    context_feed: int = 0
    # A feeding run: positions [0, n) of decoding run `feeds`, computed from its ids. Its K/V serve
    # that run's fed context in this step only: never written to the pool nor captured.
    feeds: int | None = None
    # Run off the scheduler's thread (a restore computing layers on its worker): past its context
    # only its own slots may be zeroed for an in-place read, never a clean block, which the
    # scheduler may meanwhile hand to a request whose step writes it. Nor does it batch as a decode
    # or go through the static decoder: both read through buffers the step thread reuses.
    off_thread: bool = False
    # Its request's slots past the run already hold state placed for later positions (a blended
    # restore lays loaded rows out before computing the runs between them): never zeroed for an
    # in-place read.
    placed_ahead: bool = False

    @property
    def slot_start(self) -> int:
        return self.start - self.unslotted


@dataclass(frozen=True)
class ContextFeed:
    """Where a step's decoding runs' fed context comes from, layer by layer: layers below
    `boundary` from feeding runs computed in the batch (they leave it there: a layer's compute
    needs every layer before it), layers from `boundary` on from `kv(layer)` (K rotated at its
    positions and V, [sum of fed positions, kv_heads, hd], back to back in decoding-run order)."""

    boundary: int
    kv: Callable[[int], tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class SlotRun:
    """Positions [pos, pos + length) of a request sit in consecutive pool slots from `slot`."""

    pos: int
    slot: int
    length: int


def slot_array(block_ids: Sequence[int], start: int, end: int, block_size: int) -> np.ndarray:
    """int64 pool slot of every position in [start, end) for a request owning `block_ids`."""
    pos = np.arange(start, end, dtype=np.int64)
    table = np.asarray(block_ids, dtype=np.int64)
    return table[pos // block_size] * block_size + pos % block_size


def slot_runs(block_ids: Sequence[int], start: int, end: int, block_size: int) -> list[SlotRun]:
    """[start, end) cut where the request's blocks stop being consecutive in the pool."""
    runs = []
    pos = start
    while pos < end:
        b = pos // block_size
        last = b
        while (last + 1) * block_size < end and block_ids[last + 1] == block_ids[last] + 1:
            last += 1
        stop = min(end, (last + 1) * block_size)
        runs.append(SlotRun(pos, block_ids[b] * block_size + pos % block_size, stop - pos))
        pos = stop
    return runs


@dataclass(frozen=True)
class RunRead:
    """How a run attended on its own (not in the decode batch) reads its context."""

    # A slot range (consecutive blocks: a view of the pool, no copy), a slot index tensor
    # (gathered), or None (a fresh run attends to itself).
    ctx: range | torch.Tensor | None
    # K and V buffers [rows, kv_heads, hd] each layer writes the context into, where the backend's
    # kernel cannot read it as it lies; None elsewhere.
    pad: tuple[torch.Tensor, torch.Tensor] | None = None
    # Pool slots past the context that each layer zeroes, so that `ctx` (extended over them) is
    # read in place; None elsewhere.
    tail: range | None = None


class Uploads:
    """A step's host index tensors (int64), uploaded to the pool's device in one copy."""

    def __init__(self) -> None:
        self._host: list[torch.Tensor] = []
        self._dev: list[torch.Tensor] = []

    def add(self, t: torch.Tensor) -> int:
        """Queue a host tensor; after `send` its device copy is `self[index]` (flat)."""
        self._host.append(t.reshape(-1))
        return len(self._host) - 1

    def maybe(self, t: torch.Tensor | None) -> int | None:
        return None if t is None else self.add(t)

    def send(self, upload: Callable[[torch.Tensor], torch.Tensor]) -> None:
        sizes = [t.numel() for t in self._host]
        self._dev = list(upload(torch.cat(self._host)).split(sizes))

    def __getitem__(self, index: int) -> torch.Tensor:
        return self._dev[index]

    def get(self, index: int | None) -> torch.Tensor | None:
        return None if index is None else self._dev[index]


def logit_rows(items: Sequence[RunItem], offsets: Sequence[int]) -> torch.Tensor:
    """[rows wanting logits]: each run's last token where it wants logits, every token of all_logits runs."""
    rows = [r for i, it in enumerate(items) for r in (range(offsets[i], offsets[i + 1]) if it.all_logits
                                                       else [offsets[i + 1] - 1] if it.want_logits else [])]
    return torch.tensor(rows, dtype=torch.long)


def feeding_rows(items: Sequence[RunItem], offsets: Sequence[int],
                 decodes: Sequence[int]) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The step rows computing the decodes' fed context, back to back in decode order (None: no
    feeding run), and the rows whose K/V enter the pool (None: every row; a feeding run's never do)."""
    feeder = {it.feeds: j for j, it in enumerate(items) if it.feeds is not None}
    if not feeder:
        return None, None
    src = [torch.arange(offsets[feeder[i]], offsets[feeder[i]] + items[i].context_feed)
           for i in decodes if items[i].context_feed and i in feeder]
    writes = torch.cat([torch.arange(offsets[j], offsets[j + 1]) for j, it in enumerate(items) if it.feeds is None])
    return (torch.cat(src) if src else None), writes


D = TypeVar("D")


@dataclass(frozen=True)
class StepBatch(Generic[D]):
    """A step's metadata, common to every attention backend (on the model's device)."""

    items: tuple[RunItem, ...]
    ids: torch.Tensor  # [tokens]
    offsets: tuple[int, ...]  # run i is rows offsets[i]:offsets[i+1]
    new_slots: torch.Tensor  # [rows entering the pool] pool slot of each
    write_rows: torch.Tensor | None  # [rows entering the pool] step rows (None: every row; feeding runs' never enter)
    cos: torch.Tensor  # [tokens, 1, head_dim/2] RoPE half tables
    sin: torch.Tensor
    last_rows: torch.Tensor  # [rows wanting logits]: each run's last token, every token of all_logits runs
    reads: tuple[RunRead, ...]  # per run (ctx None for the batched decodes)
    # Single-token runs with history (decodes) attend in one batch: their run indices, their rows,
    # the step rows computing their fed context (None: the step's ContextFeed, or nothing fed),
    # and the backend's own layout of their contexts (None without decodes).
    decode_rows: tuple[int, ...]
    decode_q: torch.Tensor | None  # [decodes]
    feed_src: torch.Tensor | None  # [sum of fed positions computed by feeding runs]
    decodes: D | None
