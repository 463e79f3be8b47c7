"""The process's garbage-collected heap: leaving what start-up made out of later collections."""

from __future__ import annotations

import gc


def freeze_startup_heap() -> None:
    """Collect once, then leave every object start-up made (the model, torch's and transformers'
    modules: hundreds of thousands for smollm2) out of later collections. A full collection over
    them is a noticeable pause on a small CPU, and one falls due now and then: a step, or a
    benchmark's timed restore, would stall that long. vLLM's engine core does the same after its start-up. Only
    in a process kvtier owns (the server, a benchmark): a library caller's objects are not ours
    to make immortal. `gc.unfreeze()` hands them back to the collector."""
    gc.collect()
    gc.freeze()
