"""Where kvtier keeps its files: read KVTIER_HOME once, here, at the edge."""

from __future__ import annotations

import os
from pathlib import Path


def home() -> Path:
    """KVTIER_HOME, default ~/.cache/kvtier: converted models, hardware profiles, the default disk tier."""
    return Path(os.environ.get("KVTIER_HOME") or Path.home() / ".cache" / "kvtier")
