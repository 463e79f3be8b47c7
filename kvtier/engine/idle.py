"""Work an engine does while it has nothing to serve, a slice at a time.

A first start lacks measurements that take minutes on a small CPU: the full checks of the linears'
larger row plans, and the machine profile the restore planner predicts with. The server answers at
once without them (on quick plans and an estimate) and measures them here, between requests: the
engine's thread runs one slice (one timed kernel call or step) when no request is in flight, so a
request arriving waits for one slice at most, and the result is adopted when complete.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)


@dataclass
class IdleTask:
    name: str  # what /health and the logs call it
    slices: Generator[None, None, Any]
    done: Callable[[Any], None]  # called on the engine's thread with the measurement's result


class IdleWork:
    """Tasks offered by the sources a call passes (each returns a task when it has one, else None),
    run one slice per call; a task that raises is logged and dropped (the engine keeps serving
    without it). The sources are passed per call, not held: bound methods of the engine kept here
    would make a reference cycle, and a closed engine must be freed without the collector."""

    def __init__(self) -> None:
        self._task: IdleTask | None = None

    @property
    def running(self) -> str | None:
        return self._task.name if self._task is not None else None

    def run_slice(self, sources: Sequence[Callable[[], IdleTask | None]]) -> bool:
        """One slice of the current task (or the next one offered); False when there is none."""
        if self._task is None:
            self._task = next((t for src in sources if (t := src()) is not None), None)
            if self._task is None:
                return False
            log.info("measuring %s while idle", self._task.name)
        task = self._task
        try:
            next(task.slices)
        except StopIteration as finished:
            self._task = None
            task.done(finished.value)
        except Exception:
            self._task = None
            log.exception("measuring %s while idle failed; serving without it", task.name)
        return True

    def close(self) -> None:
        if self._task is not None:
            self._task.slices.close()  # its finally blocks (scratch stores) run now
            self._task = None
