"""Engine configuration: validated dataclasses (the engine, and how it reuses state)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TypeVar

from kvtier.dtypes import canonical
from kvtier.planning.blend import BlendOptions
from kvtier.planning.optimizer import ProfileCostModel
from kvtier.planning.plan import AUTO, METHOD_CHOICES, Method
from kvtier.store.keys import DEFAULT_CHUNK_TOKENS
from kvtier.store.layout import Repr
from kvtier.store.seal import Seal


class PartialPolicy(str, enum.Enum):
    OPTIMIZER = "optimizer"  # the batch size and each front from the optimiser, under the TPOT SLO
    FIXED = "fixed"  # every front is a fixed share of its request's tokens


class ImportanceUnit(str, enum.Enum):
    TOKEN = "token"  # keep single tokens (the paper)
    GRANULE = "granule"  # keep whole stored granules (16 tokens) chosen by their summed importance


class ImportanceSelection(str, enum.Enum):
    IMPRESS = "impress"  # probe heads first, every key only where they disagree (the paper)
    PROBES = "probes"  # the probe heads choose in every layer (no threshold: fewer bytes)
    H2O = "h2o"  # every key read and every head scored (more bytes; keeps accuracy on few KV heads)


class EvictionPolicy(str, enum.Enum):
    LRU = "lru"
    LFU = "lfu"
    FIFO = "fifo"
    # IMPRESS §4.4.2: accesses x the share of a chunk importance-only restores needed; promotion
    # into memory admits a chunk only if it beats the lowest score held.
    SCORE = "score"


E = TypeVar("E", bound=enum.Enum)


def _member(cls: type[E], value: object, what: str) -> E:
    """A config string or member -> the member; a ValueError naming the choices otherwise."""
    try:
        return cls(value)
    except ValueError:
        raise ValueError(f"{what} {value!r}: use one of {', '.join(str(m.value) for m in cls)}") from None


@dataclass(frozen=True)
class PartialConfig:
    """How the engine caches part of a running request's tokens."""

    policy: PartialPolicy = PartialPolicy.OPTIMIZER
    ratio: float = 0.0  # the fixed policy's uncached share
    tpot_slo_s: float | None = None  # the optimizer keeps decode steps (model + observed residual) within this
    # Plan to this share of the SLO. The planned step is the mean one; a request whose lifetime
    # meets more prefill chunks than the mean sees slower steps, and the SLO is per request.
    slo_headroom: float = 0.9
    swap_bytes: int = 0  # host swap space for fronts (K rotated and V, every layer); 0: recompute only
    swap_bandwidth: float | None = None  # emulated bytes/s of reading fronts back (None: memory speed)
    cost: ProfileCostModel | None = None  # None: calibrated on this machine (cached per model)
    # Pin the front layers recomputed per step (the rest read from the swap space, which then must
    # hold every front): for tests and experiments. None: chosen per step from the cost model.
    recompute_layers: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "policy", _member(PartialPolicy, self.policy, "partial caching policy"))
        if not 0.0 <= self.ratio < 1.0:
            raise ValueError(f"uncached ratio must be in [0, 1), got {self.ratio}")
        if self.tpot_slo_s is not None and self.tpot_slo_s <= 0:
            raise ValueError(f"the TPOT SLO must be positive seconds, got {self.tpot_slo_s}")
        if not 0.0 < self.slo_headroom <= 1.0:
            raise ValueError(f"slo_headroom is the share of the SLO planned to, in (0, 1]; got {self.slo_headroom}")
        if self.swap_bytes < 0:
            raise ValueError("swap_bytes must be >= 0")
        if self.swap_bandwidth is not None and self.swap_bandwidth <= 0:
            raise ValueError("swap_bandwidth must be positive bytes/s")
        if self.recompute_layers is not None and (self.recompute_layers < 0 or not self.swap_bytes):
            raise ValueError("recompute_layers pins the layers recomputed (>= 0) and needs a swap space for the rest")


@dataclass(frozen=True)
class EngineConfig:
    block_size: int = 16  # tokens per device KV block
    # KV pool budget on the device. None: the device's default (engine/budget.py): 4 GiB on a CPU
    # (pages are only touched when used); on a GPU, memory_utilization of its memory less the
    # weights and a step's activations.
    kv_cache_bytes: int | None = None
    # Per-step token budget shared by decodes and prefill chunks. None: 2048 on a CPU, 16384 on a GPU.
    max_batched_tokens: int | None = None
    max_num_seqs: int = 64
    memory_utilization: float = 0.9  # the share of a GPU's memory the engine may use (vLLM's --gpu-memory-utilization)
    # Plain decode steps through static buffers, replayed as CUDA graphs on CUDA (eager elsewhere).
    # None: on for CUDA, off elsewhere; False is vLLM's --enforce-eager.
    static_decode: bool | None = None
    max_model_len: int | None = None  # default: the model's max_position_embeddings
    enable_prefix_cache: bool = True
    # Where the pool and every step's tensors live: the model's device when None; else it must be
    # the device the model was loaded on ("cpu", "cuda", "cuda:1"; `build_engine` loads it there).
    device: str | None = None
    # Partial token-wise caching (eLLM): decodes may keep KV for their newest tokens only. None: off.
    partial: PartialConfig | None = None
    # Exact (the default): a token's K/V and logits are the same bits whatever the prefill chunking,
    # the cache hit, the restore method or the batch (row-invariant linears and attention, see
    # models/invariant.py). False (`--fast-inexact`): the plain kernels, faster in places; its state
    # is stored in a namespace of its own. The engine sets its model's kernels (`CausalLM.set_kernels`).
    exact: bool = True
    # Exact bf16 attention's CPU kernel (`models/exact_matmul.py`): auto, gemm or flash (the model's
    # `Kernels.bf16_attention`, set with `exact`).
    bf16_attention: str = "auto"
    # What a first start lacks (the machine profile, the linears' larger row plans) is measured
    # while no request is in flight, where a BackgroundEngine runs the loop (`engine/idle.py`),
    # and adopted when complete; `kvtier serve` turns it on. False: the estimate and the quick
    # plans stay for this process.
    measure_when_idle: bool = False

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.max_batched_tokens is not None and self.max_batched_tokens < 1:
            raise ValueError("max_batched_tokens must be >= 1")
        if self.kv_cache_bytes is not None and self.kv_cache_bytes < 1:
            raise ValueError("kv_cache_bytes must be >= 1")
        if not 0.0 < self.memory_utilization <= 1.0:
            raise ValueError(f"memory_utilization (--gpu-memory-utilization) is a share of the device's memory in (0, 1], "
                             f"got {self.memory_utilization}")
        if self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be >= 1")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError("max_model_len must be >= 2")


@dataclass(frozen=True)
class ImpressConfig:
    """The importance-only restore (IMPRESS, lossy, opt-in): used when the restore method is impress,
    or auto with allow_lossy. Its engine stores chunks in the importance layout, a namespace of its
    own (state saved by other engines is not seen)."""

    ratio: float = 0.25  # the share of a stored prefix each layer keeps
    alpha: float = 0.6  # the similarity threshold's exponent (IMPRESS §4.3)
    # The defaults (whole granules, scores pooled over 17 tokens, the probes' importance summed)
    # lose least on free-form retrieval within the byte budget; the paper's single tokens lose
    # most of it (docs/impress.md, "What a user gives up").
    unit: ImportanceUnit = ImportanceUnit.GRANULE
    # Tokens each importance score is max-pooled over before choosing (odd; 1: none): what follows
    # and surrounds an important token is kept with it.
    window: int = 17
    # How the probe heads' sets become one: "sum" ranks by their summed importance; "majority"
    # puts tokens in at least two probes' top-k first (one retrieval head among three is outvoted).
    vote: str = "sum"
    # The probe heads choose in every layer: with a calibrated head per layer they keep full KV's
    # retrieval accuracy, and no layer falls back to reading every key (the paper's threshold),
    # which is what kept the byte budget out of reach (docs/impress.md).
    selection: ImportanceSelection = ImportanceSelection.PROBES
    # Seconds between reorder passes (IMPRESS §4.4.1, store/reorder.py): chunks importance restores
    # have seen are stored again with K/V rows by importance. 0: never.
    reorder_s: float = 600.0

    def __post_init__(self) -> None:
        if not 0.0 < self.ratio <= 1.0:
            raise ValueError(f"importance_ratio must be in (0, 1], got {self.ratio}")
        if self.alpha < 0:
            raise ValueError(f"importance_alpha must be >= 0, got {self.alpha}")
        if self.reorder_s < 0:
            raise ValueError(f"importance_reorder_s must be >= 0 seconds (0: never), got {self.reorder_s}")
        if self.window < 1 or self.window % 2 == 0:
            raise ValueError(f"importance_window must be an odd number of tokens >= 1, got {self.window}")
        if self.vote not in ("sum", "majority"):
            raise ValueError(f"importance_vote must be sum or majority, got {self.vote!r}")
        object.__setattr__(self, "unit", _member(ImportanceUnit, self.unit, "importance_unit"))
        object.__setattr__(self, "selection", _member(ImportanceSelection, self.selection, "importance_selection"))




@dataclass(frozen=True)
class ReuseConfig:
    """How the engine saves and restores state through the store."""

    method: Method | str = AUTO  # a restore Method, or auto: the planner's choice per request
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS
    save: bool = True
    lookahead: bool = True
    min_restore_tokens: int = 32  # restore only when the store adds at least this much over the device
    storage_dtype: str = ""  # "" = compute dtype (lossless)
    # What the store keeps per layer ("kv", "hidden", "none"); None = chosen from the method and the
    # hardware profile. Pinning it is for experiments and tests (e.g. a given bubble-free split).
    layout: tuple[str, ...] | None = None
    # Recompute device-cached tokens the store lacks so their state is saved and the stored chain
    # has no hole. Off by default: the store matches whole chunks only, so a short prompt that is a
    # prefix of a stored chunk would lose its device reuse (see docs/architecture.md).
    fill_holes: bool = False
    # Delete what a session saved once it has been idle this long (requests without a session id,
    # and chunks another live session shares, are unaffected). None = keep until evicted.
    session_ttl_s: float | None = None
    # With method auto: the planner may also choose the importance-only restore where it predicts
    # it faster than every exact method (and recompute). Lossy, so off unless asked for; the engine
    # then stores in the importance layout (exact methods read it as usual).
    allow_lossy: bool = False
    impress: ImpressConfig = field(default_factory=ImpressConfig)
    # Blended restores of marked documents (lossy, opt-in): the options requests blend with; None:
    # no request blends (planning/blend.py, docs/blend.md).
    blend: BlendOptions | None = None
    eviction_policy: EvictionPolicy = EvictionPolicy.LRU  # which chunks the memory and disk tiers give up first
    # The store secret shared by the servers of one store: chunks are sealed (HMAC) and only sealed
    # ones are read (store/seal.py). Unsealed: the store trusts whoever can write to it.
    seal: Seal = field(default_factory=Seal)

    def __post_init__(self) -> None:
        if self.method not in METHOD_CHOICES:
            raise ValueError(f"restore method {self.method!r}: use one of {', '.join(METHOD_CHOICES)}")
        if self.session_ttl_s is not None and self.session_ttl_s <= 0:
            raise ValueError(f"session_ttl_s must be positive seconds (or None to keep state), got {self.session_ttl_s}")
        object.__setattr__(self, "eviction_policy", _member(EvictionPolicy, self.eviction_policy, "eviction policy"))
        if self.allow_lossy and self.method != AUTO:
            raise ValueError(f"allow_lossy lets the planner choose an importance-only restore: it needs method auto, "
                             f"not {str(self.method)!r} (use method impress to always restore by importance)")
        if self.method != AUTO:
            object.__setattr__(self, "method", Method(self.method))
        if self.chunk_tokens < 1:
            raise ValueError(f"chunk_tokens must be >= 1, got {self.chunk_tokens}")
        if self.storage_dtype:
            object.__setattr__(self, "storage_dtype", canonical(self.storage_dtype))
        if self.layout is not None:
            try:
                object.__setattr__(self, "layout", tuple(Repr(r).value for r in self.layout))
            except ValueError:
                raise ValueError(f"layout {self.layout!r}: each layer is one of kv, hidden, none") from None

    @property
    def importance(self) -> bool:
        """Whether importance-only restores may run (fixed, or chosen by auto): the store then
        keeps the importance layout."""
        return self.method == Method.IMPRESS.value or self.allow_lossy

    @property
    def fixed_method(self) -> Method | None:
        """The method every restore uses, or None when the planner chooses (auto)."""
        return None if self.method == AUTO else Method(self.method)
