"""A line every few seconds for a long step, where no progress bar shows (no terminal: a log file,
a service manager): a first start is never silent while it reads or converts a model."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TextIO


@contextmanager
def heartbeat(what: str, every: float = 5.0, out: TextIO | None = None) -> Iterator[None]:
    """Print `what` now, then `what: still at it (N s)` every `every` seconds until the block ends."""
    stream = out or sys.stderr
    print(f"{what} ...", file=stream, flush=True)
    done = threading.Event()
    start = time.monotonic()

    def beat() -> None:
        while not done.wait(every):
            print(f"{what}: still at it ({time.monotonic() - start:.0f} s)", file=stream, flush=True)

    thread = threading.Thread(target=beat, name="kvtier-heartbeat", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()
