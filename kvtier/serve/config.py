"""Server settings: one validated dataclass, filled from the command line or by tests."""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_MAX_BODY_BYTES = 4 << 20  # far above any prompt that fits a context window, far below a memory problem


@dataclass(frozen=True)
class ServeConfig:
    served_model_name: str | None = None  # default: the engine's model name
    api_key: str | None = None  # when set, /v1/* needs `Authorization: Bearer <key>`
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    # Completion length when a request names none. None = the rest of the context window, as
    # OpenAI and vLLM do; a smaller value keeps careless clients from holding a slot for long.
    default_max_tokens: int | None = None
    # Requests waiting beyond the running batch (--max-num-seqs); more get 429 with Retry-After
    # instead of queueing without bound. None: no limit.
    max_queued_requests: int | None = 256

    def __post_init__(self) -> None:
        if self.max_body_bytes < 1:
            raise ValueError(f"max_body_bytes must be >= 1, got {self.max_body_bytes}")
        if self.default_max_tokens is not None and self.default_max_tokens < 1:
            raise ValueError(f"default_max_tokens must be >= 1, got {self.default_max_tokens}")
        if self.max_queued_requests is not None and self.max_queued_requests < 0:
            raise ValueError(f"max_queued_requests must be >= 0, got {self.max_queued_requests}")
        if self.api_key is not None and not self.api_key:
            raise ValueError("api_key must not be empty (leave it unset to disable authentication)")
