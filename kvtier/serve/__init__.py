"""The OpenAI-compatible HTTP server over the engine (`kvtier serve`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvtier.serve.app import create_app
    from kvtier.serve.config import ServeConfig

__all__ = ["ServeConfig", "create_app"]


def __getattr__(name: str) -> Any:
    """Imported on first use: `kvtier serve --help` (which reads serve.config) need not load FastAPI."""
    if name == "create_app":
        from kvtier.serve.app import create_app
        return create_app
    if name == "ServeConfig":
        from kvtier.serve.config import ServeConfig
        return ServeConfig
    raise AttributeError(f"module 'kvtier.serve' has no attribute {name!r}")
