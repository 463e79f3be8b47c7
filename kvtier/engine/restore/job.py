"""The surface every restore executor offers the link: prepare off the step loop, report ready,
place layer by layer inside its request's step, finish (or abort). The link never asks which
executor it holds."""

from __future__ import annotations

from typing import Protocol

from kvtier.engine.restore.blend import BlendStats
from kvtier.engine.restore.impress_policy import ImpressStats
from kvtier.engine.restore.layerwise import RestoreStats


class RestoreJob(Protocol):
    start: int  # the first position it writes: a failure recomputes from here
    # What an importance-only restore chose (the planner learns from it); None for exact restores.
    impress: ImpressStats | None

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
