"""A transfer back end that records what the host issues, for tests on a CPU-only machine.

It behaves as `LazyTransfer` (copies deliver garbage until waited on) and logs every host-issued
operation a CUDA back end would send to the driver: one `h2d` per batched staging submission (with
the bytes of each DMA run in it), one per legacy host-to-device copy, one `scatter` per placement
kernel, one `d2h` per device-to-host copy. A wait on a device-to-host (save) copy by the thread
that built it (the one running engine steps) raises: saving must never stall a step.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvtier.engine.runner.transfer import DONE, EqualRuns, Handle, LazyTransfer, span_runs


@dataclass(frozen=True)
class Op:
    kind: str  # "h2d", "scatter" or "d2h"
    runs: tuple[int, ...]  # bytes of each DMA run (a scatter: the bytes it writes)


class StepWaitedOnSave(AssertionError):
    pass


class RecordingTransfer(LazyTransfer):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[Op] = []
        self.stages: set[int] = set()  # every staging buffer (ring slot) a restore copied into
        self.equal_runs = 0  # runs handed over as arrays (EqualRuns), not a view each
        self.uploads: list[int] = []  # the runs of each upload_runs (and upload_views) submission
        self.step_thread = threading.current_thread()
        self._saves: dict[int, Handle] = {}  # id -> handle of every device-to-host copy

    def of(self, kind: str) -> list[Op]:
        return [o for o in self.ops if o.kind == kind]

    def to_stage(self, stage: torch.Tensor, runs: Sequence[tuple[int, torch.Tensor]],
                 equal: EqualRuns | None = None) -> Handle:
        sizes = tuple(r.numel() for _, r in runs) + ((equal.nbytes,) * len(equal) if equal is not None else ())
        if sizes:
            self.ops.append(Op("h2d", sizes))
            self.stages.add(stage.data_ptr())
        self.equal_runs += len(equal) if equal is not None else 0
        return super().to_stage(stage, runs, equal)

    def to_device(self, dst: Sequence[torch.Tensor], src: Sequence[torch.Tensor]) -> Handle:
        # The CUDA back end's general path: one DMA per host buffer's span, one scatter per source.
        self.ops += [Op("h2d", (r.numel(),)) for _, r in span_runs(src)[0]] + [Op("scatter", (s.nbytes,)) for s in src]
        return super().to_device(dst, src)

    def upload_views(self, src: Sequence[torch.Tensor]) -> tuple[list[torch.Tensor], Handle]:
        # As the CUDA back end: the spans under the views copied into a stage, the views made on it.
        return self.packed_upload(src)

    def upload_runs(self, runs: Sequence[tuple[int, torch.Tensor]], nbytes: int) -> tuple[torch.Tensor, Handle]:
        self.uploads.append(len(runs))
        return super().upload_runs(runs, nbytes)

    def scatter(self, dst: torch.Tensor, index: torch.Tensor, src: torch.Tensor) -> None:
        self.ops.append(Op("scatter", (src.nbytes,)))
        super().scatter(dst, index, src)

    def to_host(self, src: Sequence[torch.Tensor]) -> tuple[list[torch.Tensor], Handle]:
        out, handle = super().to_host(src)
        self.ops += [Op("d2h", (s.nbytes,)) for s in src]
        if handle is not DONE:
            self._saves[id(handle)] = handle
        return out, handle

    def sync(self, handle: Handle) -> None:
        if self._saves.get(id(handle)) is handle and threading.current_thread() is self.step_thread:
            raise StepWaitedOnSave("the step thread waited on a device-to-host (save) copy")
        super().sync(handle)
