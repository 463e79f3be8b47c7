"""What the link to the store did: counters while it runs, a plain snapshot for Engine.stats()."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class LinkStats:
    """Counters the link's parts update as they work."""

    restores: int = 0  # restores that finished and were placed
    restore_failures: int = 0  # restores that failed (the request was recomputed)
    restored_tokens: int = 0  # prompt tokens restored from the store
    prefetches: int = 0  # chunks the look-ahead copied up into the memory tier
    restore_tokens_charged: int = 0  # restore compute paid out of step budgets, in prefill tokens
    sessions_expired: int = 0  # idle sessions whose state was deleted
    blended_tokens: int = 0  # prompt tokens blended restores loaded from segments computed alone
    blend_recomputed_tokens: int = 0  # prompt tokens blended restores recomputed

    def as_dict(self, saves: int) -> dict[str, int]:
        return dict(asdict(self), saves=saves)


@dataclass(frozen=True)
class LinkReport:
    """A snapshot of the link (plain values, safe to keep)."""

    counters: dict[str, int] = field(default_factory=dict)  # LinkStats and the saver's saves
    reused_by_method: dict[str, int] = field(default_factory=dict)  # restored prompt tokens by restore method
    reused_by_tier: dict[str, int] = field(default_factory=dict)  # restored prompt tokens by store tier
    layout: tuple[str, ...] = ()  # what the store keeps per layer ("kv", "hidden", "none"); () without a store
    stored_bytes_per_token: int = 0  # payload bytes one token's stored state takes (all layers)
    store: dict[str, Any] | None = None  # TieredStore.stats(): per-tier bytes, hits, writer queue
