"""kvtier: an LLM inference engine with a tiered store that keeps and restores the state of every context.

    from kvtier import LLM, SamplingParams          # the short way (kvtier/llm.py)
    from kvtier import Engine, load_model           # the engine itself

Names are imported on first use, so `import kvtier` stays light (the CLI's `--help` does not load torch).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvtier.cli.engine_args import EngineOptions
    from kvtier.engine.config import EngineConfig, ReuseConfig
    from kvtier.engine.engine import Engine, RequestOutput
    from kvtier.engine.factory import build_engine
    from kvtier.engine.request import GrammarSpec, SamplingParams
    from kvtier.llm import LLM
    from kvtier.models.loading import load_model

_WHERE = {
    "LLM": "kvtier.llm", "Engine": "kvtier.engine.engine", "RequestOutput": "kvtier.engine.engine",
    "SamplingParams": "kvtier.engine.request", "GrammarSpec": "kvtier.engine.request",
    "EngineConfig": "kvtier.engine.config", "ReuseConfig": "kvtier.engine.config",
    "EngineOptions": "kvtier.cli.engine_args", "build_engine": "kvtier.engine.factory",
    "load_model": "kvtier.models.loading",
}
__all__ = ["LLM", "Engine", "EngineConfig", "EngineOptions", "GrammarSpec", "RequestOutput", "ReuseConfig",
           "SamplingParams", "build_engine", "load_model"]


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'kvtier' has no attribute {name!r}")
    return getattr(importlib.import_module(_WHERE[name]), name)
