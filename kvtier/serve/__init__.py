"""The OpenAI-compatible HTTP server over the engine (`kvtier serve`)."""

from kvtier.serve.app import create_app
from kvtier.serve.config import ServeConfig

__all__ = ["ServeConfig", "create_app"]
