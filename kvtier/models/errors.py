"""The one error every model source raises (kept apart so hub.py and gguf.py need not import loading.py)."""

from __future__ import annotations


class ModelLoadError(RuntimeError):
    """A model cannot be found, fetched or read; the message is one line saying what to do."""
