"""The lifecycle of a restore that does all its work in `prepare`, on the restore worker, and
places every layer there (the blended and the importance-only restores): ready once prepared,
nothing to place layer by layer, and any failure a miss (the request recomputes, never a step
over half-written slots)."""

from __future__ import annotations

import abc
import logging
import threading
import time

import torch

from kvtier.engine.restore.layerwise import RestoreMiss, RestoreStats
from kvtier.engine.runner.model_runner import ModelRunner

log = logging.getLogger(__name__)


class PreparedRestore(abc.ABC):
    placed_to: int | None = None  # (RestoreJob)
    # Failures of what was read (a miss); anything else is also a miss, but logged as a fault.
    misses: tuple[type[BaseException], ...] = (RestoreMiss, OSError, ValueError)

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.stats = RestoreStats()
        self._prepared = threading.Event()
        self._error: str | None = None

    @abc.abstractmethod
    def _work(self) -> None:
        """Read, compute and place every layer of the request's slots."""

    def _cleanup(self) -> None:
        """After the work, whether it failed or not (close what it opened)."""

    # ----- RestoreJob -------------------------------------------------------------------------
    def prepare(self) -> None:
        t0 = time.perf_counter()
        try:
            if self._error is not None:
                raise RestoreMiss(self._error)
            with torch.inference_mode():
                self._work()
            self.runner.transfer.sync_compute()  # done means written
        except Exception as e:
            if not isinstance(e, self.misses):
                log.exception("%s failed", type(self).__name__)
            self._error = str(e) or type(e).__name__
            raise RestoreMiss(self._error) from e
        finally:
            self._cleanup()
            self.stats.seconds = time.perf_counter() - t0
            self._prepared.set()

    def ready(self) -> bool:
        return self._prepared.is_set()

    @property
    def failed(self) -> bool:
        return self._error is not None

    def place(self, layer: int) -> None:
        """Everything was placed while preparing: nothing to do layer by layer."""

    def finish(self) -> RestoreStats:
        self._prepared.wait()
        if self._error is not None:
            raise RestoreMiss(self._error)
        return self.stats

    def abort(self) -> None:
        self._error = self._error or "aborted"
