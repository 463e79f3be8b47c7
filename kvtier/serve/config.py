"""Server settings: one validated dataclass, filled from the command line or by tests."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from kvtier.engine.grammar_limits import GrammarLimits
from kvtier.serve.reasoning import PARSER_NAMES
from kvtier.serve.tenants import DEFAULT_TENANT, check_tenant_name

DEFAULT_MAX_BODY_BYTES = 4 << 20  # far above any prompt that fits a context window, far below a memory problem
DEFAULT_MAX_OUTPUT_ENTRIES = 1 << 20  # why this much: kvtier/serve/budget.py
# Read deadlines (seconds), applied by the HTTP protocol (kvtier/serve/server.py), not the app: a
# client sends its headers in one packet, so 10 s is generous (CIS's nginx benchmark and HAProxy's
# docs suggest 10 s); 30 s for a whole body is ~1.1 Mbit/s at the 4 MiB body limit.
DEFAULT_HEADER_TIMEOUT_S = 10.0
DEFAULT_BODY_TIMEOUT_S = 30.0
UNKNOWN_FIELDS_MODES = ("reject", "warn")


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
    # The one key that reads /metrics (a scraper's), and nothing else: it is no tenant's. Set, it
    # replaces tenants' keys there; without it a keys file's tenants do not read /metrics at all,
    # since its counters add up every tenant's traffic and reuse.
    metrics_key: str | None = field(default=None, repr=False)
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
    # The most output entries (sampled tokens and the logprobs sent with them) one request may ask
    # for: n x max_tokens x (1 + top logprobs), plus its prompt logprobs; more is a 400. 0: no limit.
    max_output_entries: int = DEFAULT_MAX_OUTPUT_ENTRIES
    # What a request's grammar, regex or JSON schema may be (sizes, depths, repetitions, compile time).
    grammar_limits: GrammarLimits = field(default_factory=GrammarLimits)
    # A chat or completion request with a field no schema knows: "reject" answers 400 naming it (as
    # OpenAI does: a misspelt option must not pass silently); "warn" logs each unknown name once
    # and ignores it, for clients that send extras of another server's API.
    unknown_fields: str = "reject"
    # A reasoning model's parser (kvtier/serve/reasoning.py): chat answers return its thinking as
    # reasoning_content, apart from content. None: the thinking stays in content.
    reasoning_parser: str | None = None
    # With the engine's blending on: in a plain (completions) text prompt, the parts between the
    # first and the last part this string separates are documents; it is taken out of the prompt.
    # None: plain prompts mark no document.
    blend_separator: str | None = None

    def __post_init__(self) -> None:
        if self.max_body_bytes < 1:
            raise ValueError(f"max_body_bytes must be >= 1, got {self.max_body_bytes}")
        if self.default_max_tokens is not None and self.default_max_tokens < 1:
            raise ValueError(f"default_max_tokens must be >= 1, got {self.default_max_tokens}")
        if self.max_queued_requests is not None and self.max_queued_requests < 0:
            raise ValueError(f"max_queued_requests must be >= 0, got {self.max_queued_requests}")
        if self.max_output_entries < 0:
            raise ValueError(f"max_output_entries must be >= 0 (0: no limit), got {self.max_output_entries}")
        if not self.stats_interval_s >= 0:  # (NaN too)
            raise ValueError(f"stats_interval_s must be >= 0 (0: off), got {self.stats_interval_s}")
        if self.unknown_fields not in UNKNOWN_FIELDS_MODES:
            raise ValueError(f"unknown_fields must be one of {', '.join(UNKNOWN_FIELDS_MODES)}, got {self.unknown_fields!r}")
        if self.blend_separator is not None and not self.blend_separator:
            raise ValueError("blend_separator must not be empty (leave it unset for no separator)")
        if self.reasoning_parser is not None and self.reasoning_parser not in PARSER_NAMES:
            raise ValueError(f"reasoning_parser must be one of {', '.join(PARSER_NAMES)}, got {self.reasoning_parser!r}")
        if self.api_key is not None and not self.api_key:
            raise ValueError("api_key must not be empty (leave it unset to disable authentication)")
        if self.api_key is not None and self.api_keys:
            # Refused rather than merged: a KVTIER_API_KEY left in the environment would otherwise
            # silently open a "default" tenant next to the file's.
            raise ValueError("give one API key (--api-key or KVTIER_API_KEY) or an --api-keys file, not both")
        self._check_metrics_key()
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

    def _check_metrics_key(self) -> None:
        if self.metrics_key is None:
            return
        if not self.metrics_key:
            raise ValueError("metrics_key must not be empty (leave it unset to read /metrics with a tenant's key)")
        # A tenant's key that is also the metrics key would make that tenant the scraper.
        if self.metrics_key == self.api_key or self.metrics_key in self.api_keys:
            raise ValueError("the metrics key (--metrics-key) must differ from every tenant's API key")

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

    @property
    def metrics_refusal(self) -> str | None:
        """Why a tenant's key does not read /metrics (the 403's message), or None when it does."""
        if self.metrics_public:
            return None
        if self.metrics_key is not None:
            return "/metrics takes the metrics key (--metrics-key), not a tenant's API key"
        if self.api_keys:
            return ("/metrics counts every tenant's requests, so no tenant's API key reads it; give the scraper a "
                    "key of its own with --metrics-key, or open /metrics with --metrics-public")
        return None  # one key (or none): one tenant, whose own activity is all the counters show

    def key_required(self, path: str) -> bool:
        """Whether `path` answers only with a key (its OpenAPI operation declares the bearer scheme)."""
        if path in self.open_paths:
            return False
        return bool(self.tenant_keys) or (path == "/metrics" and self.metrics_key is not None)
