"""The scheduler's vocabulary: the records it hands out and takes in, and the two protocols it
calls while it schedules (its store side and the feed policy), each with a null implementation.

Plain values only. No torch.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from kvtier.engine.request import Request
from kvtier.planning.blend import BlendPlan
from kvtier.planning.plan import Plan


@dataclass(frozen=True)
class ScheduledChunk:
    request_id: str
    start: int  # first position computed this step
    num_tokens: int

    @property
    def end(self) -> int:
        return self.start + self.num_tokens


@dataclass(frozen=True)
class RestoreOrder:
    """What a restore is to do, fixed when the store side offers it: the plan, and for a truncated
    context the stored position each restored position takes. The scheduler carries it untouched."""

    plan: Plan
    source: tuple[int, ...] | None = None  # truncated context: the stored token each restored position takes
    tier_tokens: Mapping[str, int] = field(default_factory=dict)  # restored tokens by the tier they are read from
    blend: BlendPlan | None = None  # a blended restore's layout (plan.method is BLEND)


@dataclass(frozen=True)
class StoreOffer:
    """What the store side offers for a request: restore [keep, target) by `order`, keeping the
    device's [0, keep); `compute_tokens` is the plan's compute before the new tokens can start."""

    target: int  # 0: nothing worth restoring (or the plan is to recompute)
    keep: int
    order: RestoreOrder | None = None
    compute_tokens: int = 0
    # Instant: prepared on the step's thread just before its step, which runs the new tokens and
    # places the restore inside it (views of memory with no compute before the new tokens, or a
    # blend whose recompute fits a compute chunk).
    instant: bool = False
    attach_tokens: int = 0  # placement beside the new tokens, in prefill tokens (instant only)
    lossy: bool = False  # an importance-only or blended restore: the request's state becomes approximate
    exact_upto: int = 0  # a lossy restore: the positions [0, exact_upto) whose state stays exact
    dropped: int = 0  # prefix tokens the restore leaves out of the pool (importance-only)

    @property
    def unslotted(self) -> int:
        """Positions the restored request holds no pool slot for (`Request.unslotted`)."""
        return self.dropped


@dataclass(frozen=True)
class RestoreTicket:
    """Restore [start, target) of a request into its blocks by `order`; its new tokens wait until
    the restore is ready. `debt`: compute tokens not yet paid out of a step's budget."""

    request_id: str
    start: int  # device-cached positions before this are kept and never written
    target: int
    order: RestoreOrder
    debt: int = 0
    instant: bool = False  # its new tokens are in the same step's chunks


@dataclass(frozen=True)
class RestoreDone:
    """A restore left the RESTORING phase: ready (tokens will be in the pool once its step runs)
    or failed (tokens None: the request prefills from its device part)."""

    request_id: str
    tokens: int | None
    tier_tokens: Mapping[str, int]
    attach_tokens: int
    aborted: bool


@dataclass(frozen=True)
class SchedulerOutput:
    chunks: tuple[ScheduledChunk, ...]
    restores: tuple[RestoreTicket, ...] = ()  # issued this step (already started by the store side)
    preempted: tuple[str, ...] = ()
    aborted: tuple[str, ...] = ()  # finished this step: their abort waited for a restore to stop


@dataclass(frozen=True)
class FeedPlan:
    """One step's feed policy decision: at most `cap` running sequences, and for each decoding
    request the leading positions (whole blocks) fed from outside the pool, at least."""

    cap: int
    fed: dict[str, int] = field(default_factory=dict)
    # Fed tokens recomputed this step (not read back): their compute shares the step's token
    # budget, after the decodes and before any prefill (else TTFT would pay for them).
    recompute_tokens: int = 0


class FeedPolicy(Protocol):
    """Decides the batch cap and which leading positions of each decode leave the pool, their
    K/V fed back into every step instead (partial token-wise caching, engine/partial.py)."""

    def plan(self, decoding: Sequence[Request], waiting: Sequence[Request], capacity_blocks: int) -> FeedPlan: ...

    def release(self, req: Request, upto: int) -> None:
        """Positions [req.fed, upto) leave the pool (their blocks are released right after):
        keep them elsewhere if the policy feeds them from there."""
        ...


class NoFeeds:
    """No feed policy: every running request keeps all its KV."""

    def plan(self, decoding: Sequence[Request], waiting: Sequence[Request], capacity_blocks: int) -> FeedPlan:
        return FeedPlan(cap=1 << 30)

    def release(self, req: Request, upto: int) -> None:
        raise AssertionError("nothing is fed without a feed policy")


class StoreSide(Protocol):
    """The scheduler's half of the link to the store (vLLM's scheduler-side KV connector): offers,
    restore compute, starting restores and hearing back from them, look-ahead."""

    def begin_step(self) -> Sequence[RestoreDone]:
        """Restores that left the RESTORING phase since the last step."""
        ...

    def offer(self, req: Request) -> StoreOffer: ...

    def charge(self, budget: int) -> int:
        """Take up to `budget` tokens of this step for the compute of restores still preparing."""
        ...

    def start(self, req: Request, ticket: RestoreTicket) -> None:
        """Begin a restore into the blocks the scheduler just gave `req`."""
        ...

    def abort(self, request_id: str) -> bool:
        """Stop any restore into a request's blocks before they are released. -> True if one is
        still writing (the request finishes once `begin_step` reports it)."""
        ...

    def end_step(self, waiting: Sequence[Request]) -> None:
        """What is still queued after this step's admissions (the look-ahead's window)."""
        ...

    def arrived(self, req: Request) -> None: ...

    def finished(self, req: Request) -> None:
        """A request ended (any reason); its blocks are about to be released."""
        ...


class NoStore:
    """No store: nothing is offered, restored or looked ahead at."""

    def begin_step(self) -> Sequence[RestoreDone]:
        return ()

    def offer(self, req: Request) -> StoreOffer:
        return StoreOffer(0, req.num_computed)

    def charge(self, budget: int) -> int:
        return 0

    def start(self, req: Request, ticket: RestoreTicket) -> None:
        raise AssertionError("no restore is offered without a store")

    def abort(self, request_id: str) -> bool:
        return False

    def end_step(self, waiting: Sequence[Request]) -> None:
        pass

    def arrived(self, req: Request) -> None:
        pass

    def finished(self, req: Request) -> None:
        pass
