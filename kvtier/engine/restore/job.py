"""The surface every restore executor offers the link: prepare off the step loop, report ready,
place layer by layer inside its request's step, finish (or abort). The link never asks which
executor it holds."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from kvtier.engine.restore.blend import BlendStats
from kvtier.engine.restore.layerwise import RestoreStats


@dataclass(frozen=True)
class LossyChoice:
    """What a restore that read only some of the stored prefix chose: the planner learns from it."""

    chosen_share: float  # of the stored granules of the parts read by token, the share read
    cheap_share: float  # of the layers, those whose choice needed only the cheap keys (probes that agreed)


class RestoreJob(Protocol):
    start: int  # the first position it writes: a failure recomputes from here
    # Where its request's computed state ends once it is placed, where that is past the plan's
    # history (an importance restore computes the new tokens but the last); None: the history's end.
    placed_to: int | None

    @property
    def chose(self) -> LossyChoice | None:
        """What an importance-only restore chose; None for the others."""
        ...

    @property
    def blended(self) -> BlendStats | None:
        """What a blended restore loaded and recomputed; None for the others."""
        ...

    def prepare(self) -> None:
        """On the restore worker (or inline for an instant restore): open reads, compute what the
        plan computes before the new tokens. Raises RestoreMiss on a failed read."""
        ...

    def ready(self) -> bool:
        """Prepared far enough for its request to rejoin the running set."""
        ...

    @property
    def failed(self) -> bool: ...

    def place(self, layer: int) -> None:
        """Put layer `layer`'s history into the pool, just before the step runs that layer."""
        ...

    def finish(self) -> RestoreStats:
        """Wait for its work to end; raises RestoreMiss if it failed."""
        ...

    def abort(self) -> None: ...
