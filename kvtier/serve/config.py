"""Server settings: one validated dataclass, filled from the command line or by tests."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from kvtier.serve.tenants import DEFAULT_TENANT, check_tenant_name

DEFAULT_MAX_BODY_BYTES = 4 << 20  # far above any prompt that fits a context window, far below a memory problem


@dataclass(frozen=True)
class ServeConfig:
    served_model_name: str | None = None  # default: the engine's model name
    # One key for the tenant "default" (--api-key), or several: {key: tenant} (--api-keys FILE).
    # With either, every path but /health needs `Authorization: Bearer <key>`. Kept out of repr
    # so a logged config or a traceback never shows a key.
    api_key: str | None = field(default=None, repr=False)
    api_keys: Mapping[str, str] = field(default_factory=dict, repr=False)
    # Leave /metrics open (for Prometheus scrapers without the key) while keys are required.
    metrics_public: bool = False
    # Let tenants share cached state (prefix cache, store chunks): more reuse, but a tenant can
    # learn from timing or cached_tokens whether another sent a prompt.
    shared_cache: bool = False
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    # Completion length when a request names none. None = the rest of the context window, as
    # OpenAI and vLLM do; a smaller value keeps careless clients from holding a slot for long.
    default_max_tokens: int | None = None
    # Requests waiting beyond the running batch (--max-num-seqs); more get 429 with Retry-After
    # instead of queueing without bound. None: no limit.
    max_queued_requests: int | None = 256
    # Seconds between the one-line activity summaries logged as `kvtier.stats` (vLLM's every-10 s
    # line); 0 turns them off. Idle intervals log nothing.
    stats_interval_s: float = 10.0

    def __post_init__(self) -> None:
        if self.max_body_bytes < 1:
            raise ValueError(f"max_body_bytes must be >= 1, got {self.max_body_bytes}")
        if self.default_max_tokens is not None and self.default_max_tokens < 1:
            raise ValueError(f"default_max_tokens must be >= 1, got {self.default_max_tokens}")
        if self.max_queued_requests is not None and self.max_queued_requests < 0:
            raise ValueError(f"max_queued_requests must be >= 0, got {self.max_queued_requests}")
        if not self.stats_interval_s >= 0:  # (NaN too)
            raise ValueError(f"stats_interval_s must be >= 0 (0: off), got {self.stats_interval_s}")
        if self.api_key is not None and not self.api_key:
            raise ValueError("api_key must not be empty (leave it unset to disable authentication)")
        if self.api_key is not None and self.api_keys:
            # Refused rather than merged: a KVTIER_API_KEY left in the environment would otherwise
            # silently open a "default" tenant next to the file's.
            raise ValueError("give one API key (--api-key or KVTIER_API_KEY) or an --api-keys file, not both")
        seen: set[str] = set()
        for key, tenant in self.api_keys.items():
            if not isinstance(key, str) or not key:
                raise ValueError("api_keys: every key must be a non-empty string")
            check_tenant_name(tenant)
            if tenant in seen:
                raise ValueError(f"api_keys: tenant {tenant!r} has more than one key")
            seen.add(tenant)
        # Frozen all the way down: the caller's dict cannot change the keys after validation.
        object.__setattr__(self, "api_keys", MappingProxyType(dict(self.api_keys)))

    @property
    def tenant_keys(self) -> Mapping[str, str]:
        """{key: tenant} the server accepts; empty when it is open (every request is "default")."""
        if self.api_key is not None:
            return {self.api_key: DEFAULT_TENANT}
        return self.api_keys

    @property
    def open_paths(self) -> frozenset[str]:
        """Paths answered without a key when keys are required."""
        return frozenset({"/health", "/metrics"} if self.metrics_public else {"/health"})
