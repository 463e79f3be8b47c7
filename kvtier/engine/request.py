"""Requests, their lifecycle and sampling parameters: plain values, no tensors."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Literal

from kvtier.planning.blend import BlendOptions


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # queued, nothing on the device
    RESTORING = "restoring"  # state is being brought back from the store
    PREFILL = "prefill"  # prompt (or its uncached rest) being computed, possibly in chunks
    DECODE = "decode"  # generating one token per step
    PREEMPTED = "preempted"  # blocks taken back; will be recomputed from its tokens
    FINISHED_STOPPED = "finished_stopped"  # EOS or a stop string
    FINISHED_LENGTH = "finished_length"  # max_tokens or the context window
    FINISHED_ABORTED = "finished_aborted"  # cancelled by the caller

    @property
    def finished(self) -> bool:
        return self.name.startswith("FINISHED")


class SamplingError(ValueError):
    pass


MAX_LOGPROBS = 20  # OpenAI's top_logprobs limit
MAX_N = 16
# vLLM's request priority (lower is served earlier), bounded to a 32-bit int: any ordering a client
# needs fits, and a bound keeps the value a plain machine integer wherever it is logged or stored.
MIN_PRIORITY, MAX_PRIORITY = -(2**31), 2**31 - 1


def check_priority(priority: object) -> int:
    """A request priority as the scheduler takes it (an int in [MIN_PRIORITY, MAX_PRIORITY])."""
    if isinstance(priority, bool) or not isinstance(priority, int) or not MIN_PRIORITY <= priority <= MAX_PRIORITY:
        raise SamplingError(f"priority must be an integer in [{MIN_PRIORITY}, {MAX_PRIORITY}], got {priority!r}")
    return priority


@dataclass(frozen=True)
class GrammarSpec:
    """A constraint on the output text, compiled by the grammar engine (engine/structured.py)."""

    kind: Literal["json_schema", "json_object", "regex", "lark", "gbnf"]
    text: str  # the JSON schema as JSON text, the regex, or the grammar ("" for json_object)


@dataclass(frozen=True)
class SamplingParams:
    """What to sample and when to stop, with vLLM's `SamplingParams` meanings (engine/sampler.py applies them).

    The defaults are vLLM's (temperature 1.0, top_p 1.0, top_k off, n 1, no logprobs) but one:
    max_tokens is 256 where vLLM's is 16 (and vLLM's max_tokens=None, up to the context window, is
    an error here).
    Where kvtier is stricter or named otherwise:
      - top_k: 0 disables it; vLLM also takes -1, which is an error here.
      - temperature must be in [0, 2] (OpenAI's range) and repetition_penalty in (0, 2]; vLLM
        bounds neither from above.
      - logprobs and prompt_logprobs at most 20 (MAX_LOGPROBS), n at most 16 (MAX_N).
      - structured (a GrammarSpec) takes the place of vLLM's guided decoding / structured outputs.
      - stop, stop_token_ids and logit_bias are kept as tuples (lists and a dict are converted).
      - first_logits is kvtier's own (oracle checks and benchmarks).
    Options vLLM has and kvtier lacks (best_of, include_stop_str_in_output, skip_special_tokens,
    bad_words, ...) are not accepted: an unknown keyword is a TypeError.
    """

    max_tokens: int = 256
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = disabled
    min_p: float = 0.0  # drop tokens less likely than min_p x the likeliest one (0 = off)
    # Penalties: repetition (transformers' / vLLM's: over prompt and output tokens, a positive logit
    # divided, a negative one multiplied), presence and frequency (OpenAI's: over output tokens).
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit)
    min_tokens: int = 0  # EOS, stop_token_ids and stop strings are held back until this many tokens exist
    stop_token_ids: tuple[int, ...] = ()  # tokens that end the output (as EOS does; not in the text)
    logprobs: int | None = None  # None: none; k >= 0: the sampled token's logprob and the k likeliest
    # None: none; k >= 0: every prompt token's logprob (after the first), rank and the k likeliest.
    # The whole prompt is then computed (a restored or device-cached token has no logits).
    prompt_logprobs: int | None = None
    n: int = 1  # samples of one prompt: one prefill, the prompt's blocks shared (engine.add_request)
    structured: GrammarSpec | None = None  # constrain the output to a JSON schema, regex or grammar
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    # Return the logits the first token was sampled from (RequestOutput.first_logits, on the host):
    # what benchmarks and oracle checks compare across restore methods.
    first_logits: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.stop, (list, str)):
            object.__setattr__(self, "stop", (self.stop,) if isinstance(self.stop, str) else tuple(self.stop))
        if isinstance(self.logit_bias, dict):
            object.__setattr__(self, "logit_bias", tuple(sorted((int(k), float(v)) for k, v in self.logit_bias.items())))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise SamplingError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if self.seed is not None and not -(2**63) <= self.seed < 2**64:
            raise SamplingError(f"seed must fit in 64 bits, got {self.seed}")
        if not 0.0 <= self.temperature <= 2.0:
            raise SamplingError(f"temperature must be in [0, 2], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise SamplingError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise SamplingError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise SamplingError(f"min_p must be in [0, 1], got {self.min_p}")
        if not 0.0 < self.repetition_penalty <= 2.0:
            raise SamplingError(f"repetition_penalty must be in (0, 2], got {self.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise SamplingError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if any(not -100.0 <= v <= 100.0 for _, v in self.logit_bias):
            raise SamplingError("logit_bias values must be in [-100, 100]")
        if self.min_tokens < 0 or self.min_tokens > self.max_tokens:
            raise SamplingError(f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= MAX_LOGPROBS:
                raise SamplingError(f"{name} must be in [0, {MAX_LOGPROBS}], got {value}")
        if not 1 <= self.n <= MAX_N:
            raise SamplingError(f"n must be in [1, {MAX_N}], got {self.n}")
        if any(not s for s in self.stop):
            raise SamplingError("stop strings must be non-empty")

    @property
    def greedy(self) -> bool:
        # Any temperature above 0 is sampled (the sampler is stable however small it is).
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def penalized(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    def check_vocab(self, vocab_size: int) -> None:
        """Token ids the parameters name must exist in the model's vocabulary."""
        bad = [t for t, _ in self.logit_bias if not 0 <= t < vocab_size] + \
              [t for t in self.stop_token_ids if not 0 <= t < vocab_size]
        if bad:
            raise SamplingError(f"token ids must be in [0, {vocab_size}), got {bad[:4]}")


@dataclass(frozen=True)
class RestoreReport:
    """What a request's restore from the store did, beside what its plan predicted."""

    method: str
    layout: str  # stored representation per layer, e.g. "kv=30" or "none=4, hidden=26"
    predicted_s: float  # the plan's restore + first step of the new tokens
    ideal_s: float  # the plan's bound: max(bytes / bandwidth, compute)
    seconds: float  # measured: the restore's start to the end of its first step
    bytes_read: int
    wait_s: float  # time the new tokens' layers waited for reads
    # On an asynchronous device (CUDA events): the copies' span on the copy stream, the new tokens'
    # compute span on the compute stream, and the share of the shorter one hidden under the other.
    copy_s: float | None = None
    compute_s: float | None = None
    overlap: float | None = None
    # Importance-only restores: of the restored prefix, the tokens each layer attended to (None: all).
    prefix_attended: int | None = None
    host_s: float | None = None  # host time in the restore's own code: prepare() and the placements
    # Blended restores: prompt tokens loaded from segments computed alone (approximate), and
    # tokens the restore recomputed (None: not blended).
    blended_tokens: int | None = None
    recomputed_tokens: int | None = None


@dataclass
class RequestMetrics:
    arrival: float = field(default_factory=time.perf_counter)
    first_scheduled: float | None = None
    first_token: float | None = None
    last_token: float | None = None
    prompt_tokens_reused: int = 0  # restored (device prefix cache or store) instead of computed
    prompt_tokens_computed: int = 0
    reused_by_tier: dict[str, int] = field(default_factory=dict)
    restore: RestoreReport | None = None  # how the store part was restored, if it was

    @property
    def restore_method(self) -> str | None:
        return self.restore.method if self.restore else None

    def note_reuse(self, tier: str, tokens: int) -> None:
        """Count `tokens` prompt tokens as reused from `tier` ("device": the device prefix cache)."""
        if tokens:
            self.reused_by_tier[tier] = self.reused_by_tier.get(tier, 0) + tokens
            self.prompt_tokens_reused += tokens

    def forget_reuse(self) -> None:
        self.reused_by_tier.clear()
        self.prompt_tokens_reused = 0

    @property
    def queue_time(self) -> float | None:
        return None if self.first_scheduled is None else self.first_scheduled - self.arrival

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.arrival

    def mean_tbt(self, num_output_tokens: int) -> float | None:
        if self.first_token is None or self.last_token is None or num_output_tokens < 2:
            return None
        return (self.last_token - self.first_token) / (num_output_tokens - 1)


@dataclass(eq=False)  # identity: the scheduler's `req in running` must not compare prompts field by field
class Request:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    output_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    num_computed: int = 0  # tokens whose KV is in the device pool
    block_ids: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)  # chained hashes of full blocks
    metrics: RequestMetrics = field(default_factory=RequestMetrics)
    session_id: str | None = None
    # Partitions reuse: the device prefix cache and the store key chains start from this salt, so
    # requests with different salts (tenants) never see, evict or time each other's state.
    cache_salt: str = ""
    # vLLM's priority: waiting requests are admitted by (priority, arrival), the lowest value first.
    priority: int = 0
    # llama-server's cache_prompt. False: the request neither reuses state (the device prefix cache,
    # the store) nor leaves its own for others (its blocks are not published, nothing is saved).
    # The answer is the same either way (a hit is bit-identical to recompute); only the cost and
    # what the caches hold afterwards differ.
    cache_prompt: bool = True
    restore_tried: bool = False  # the store was asked once for this (re)admission
    # Context truncation: the original prompt and the indices of it that were kept. Such state is
    # approximate (kept tokens once saw the dropped ones), so it is restored but never saved.
    source_ids: list[int] | None = None
    kept: list[int] | None = None
    # A lossy restore (importance-only, blended) brought its prefix back: its state is approximate,
    # but for its first `exact_upto` positions (a blend's exact prefix and the run continuing it),
    # whose whole blocks are published to the device prefix cache as an exact prefill's are.
    restored_lossy: bool = False
    exact_upto: int = 0
    # Marked documents: prompt spans [a, b) a blended restore may load from state computed alone,
    # and how (None: the request does not blend; planning/blend.py).
    segments: tuple[tuple[int, int], ...] = ()
    blend: BlendOptions | None = None
    # Positions [0, unslotted) have no pool slot: position p sits in slot p - unslotted (RoPE still
    # at p). An approximate restore leaves prefix tokens out for good; a feed policy releases a
    # decode's leading positions (whole blocks), whose K/V each step then brings back from outside
    # the pool: those are the first `fed` (fed <= unslotted; never both kinds at once).
    unslotted: int = 0
    fed: int = 0
    num_published: int = 0  # full blocks already registered in the device prefix cache
    attach_tokens: int = 0  # restore compute its next chunk carries (placement beside the new tokens)
    _all: list[int] = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        self._all = list(self.prompt_ids) + list(self.output_ids)

    @property
    def all_ids(self) -> list[int]:
        """Prompt then output tokens: the request's own list (read it, never modify it)."""
        return self._all

    def append_output(self, token: int) -> None:
        self.output_ids.append(token)
        self._all.append(token)

    @property
    def num_tokens(self) -> int:
        return len(self._all)

    @property
    def approximate(self) -> bool:
        """Its K/V are not those of its tokens computed in full (a truncated context, or a prefix
        restored by importance or blended): never saved, published or reused as exact state, but
        for its first `exact_upto` positions."""
        return self.kept is not None or self.restored_lossy

    def make_exact(self) -> None:
        """Its state is being recomputed from its tokens: nothing approximate remains."""
        self.restored_lossy, self.exact_upto, self.unslotted = False, 0, self.fed

    def feed_from(self, upto: int) -> None:
        """Positions [fed, upto) leave its slots too: from now on they are fed each step."""
        self.unslotted += upto - self.fed
        self.fed = upto
