"""What a chunk holds: the per-layer representation and the namespace every key is scoped to.

A namespace is everything that makes stored state meaningful: the model (fingerprint of config and
weights), its shapes, the compute dtype, the storage dtype, which representation each layer uses
and how the exact kernels round (`NUMERICS_VERSION`). Its digest goes into every chunk key, so any change to it is simply a different set of keys:
a miss, never wrong data.
"""
from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field
from enum import Enum

from kvtier.dtypes import COMPUTE_DTYPES, STORAGE_DTYPES, WIDTH

# 2: K is stored rotated at its canonical position (the chunk key fixes every token's position),
#    so a restore copies it into the pool as is; segments carry CRC-32C checksums and start on
#    512-byte boundaries (a disk read may land straight in the KV pool).
# 3: the preamble carries a flags word and an HMAC tag (sealed chunks, seal.py); the header names
#    its segments' digest algorithm.
FORMAT_VERSION = 3
# How the exact CPU kernels round, where it changed what a stored state holds (its bits, not its
# format): state computed before a change is another engine's state, so its keys differ (a miss).
# 2: exact attention splits a query's keys at its 512-key block and 64-key piece (exact_attention.py).
# (Which of the two exact bf16 attention kernels ran depends on the CPU, so it is not here: state of
# the GEMM kernel carries a tag in its model fingerprint, `exact_attention.numerics_tag`.)
NUMERICS_VERSION = 2


class Repr(str, Enum):
    KV = "kv"  # K (RoPE applied at the token's position in its context) and V of the layer
    HIDDEN = "hidden"  # the layer input (residual stream before the input norm)
    NONE = "none"  # nothing stored: the layer is recomputed

    def parts(self) -> tuple[str, ...]:
        """Tensor parts a layer in this representation stores."""
        return {Repr.KV: ("k", "v"), Repr.HIDDEN: ("h",), Repr.NONE: ()}[self]


@dataclass(frozen=True)
class StoreNamespace:
    model_fingerprint: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    compute_dtype: str = "float32"
    storage_dtype: str = ""  # empty = same as compute_dtype (lossless)
    layer_reprs: tuple[Repr, ...] = field(default=())  # empty = all KV
    # The importance-only restore's layout (IMPRESS): the keys of `probe_kv_heads` KV heads of
    # every layer stored again, all layers together at the start of a chunk ("kp": one read gives
    # a chunk's probe keys), and a CRC per `granule_tokens` rows of every K/V segment so a read of
    # a few tokens is verified without reading the rest. 0: the plain layout.
    probe_kv_heads: int = 0
    granule_tokens: int = 0
    # Each layer's probes are KV heads [probe_first[l], probe_first[l] + probe_kv_heads): which
    # head chooses best differs by layer (engine/calibrate/probes.py). Empty: 0 in every layer.
    probe_first: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.compute_dtype not in COMPUTE_DTYPES:
            raise ValueError(f"compute_dtype {self.compute_dtype!r}: use one of {COMPUTE_DTYPES}")
        if not self.storage_dtype:
            object.__setattr__(self, "storage_dtype", self.compute_dtype)
        if self.storage_dtype not in STORAGE_DTYPES:
            raise ValueError(f"storage_dtype {self.storage_dtype!r}: use one of {STORAGE_DTYPES}")
        reprs = tuple(Repr(r) for r in self.layer_reprs) or (Repr.KV,) * self.num_layers
        if len(reprs) != self.num_layers:
            raise ValueError(
                f"layer_reprs has {len(reprs)} entries but the model has {self.num_layers} layers"
            )
        object.__setattr__(self, "layer_reprs", reprs)
        for name in ("num_layers", "num_kv_heads", "head_dim", "hidden_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if not 0 <= self.probe_kv_heads <= self.num_kv_heads:
            raise ValueError(f"probe_kv_heads must be in [0, {self.num_kv_heads}], got {self.probe_kv_heads}")
        firsts = tuple(int(f) for f in self.probe_first) or (0,) * self.num_layers
        if len(firsts) != self.num_layers:
            raise ValueError(f"probe_first has {len(firsts)} entries but the model has {self.num_layers} layers")
        if bad := [f for f in firsts if not 0 <= f <= self.num_kv_heads - self.probe_kv_heads]:
            raise ValueError(f"probe_first {bad[0]} with {self.probe_kv_heads} probe heads is outside "
                             f"the model's {self.num_kv_heads} KV heads")
        object.__setattr__(self, "probe_first", firsts)
        if self.granule_tokens < 0:
            raise ValueError(f"granule_tokens must be >= 0, got {self.granule_tokens}")
        if self.granule_tokens and self.storage_dtype == "int8":
            raise ValueError("granule reads need a storage dtype without row scales: use bfloat16, float16 "
                             "or float32 storage with the importance layout")

    def digest(self) -> str:
        """Stable hex digest of everything that makes stored state reusable."""
        doc = {
            "format": FORMAT_VERSION,
            "numerics": NUMERICS_VERSION,
            "model": self.model_fingerprint,
            "layers": self.num_layers,
            "kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden": self.hidden_size,
            "compute": self.compute_dtype,
            "storage": self.storage_dtype,
            "reprs": [r.value for r in self.layer_reprs],
        }
        if self.probe_kv_heads or self.granule_tokens:  # only when set: plain keys stay what they were
            doc["importance_layout"] = [self.probe_kv_heads, self.granule_tokens] + \
                (list(self.probe_first) if any(self.probe_first) else [])
        raw = json.dumps(doc, sort_keys=True).encode()
        return hashlib.blake2b(raw, digest_size=16).hexdigest()

    def probes(self, layer: int) -> slice:
        """Layer `layer`'s probe KV heads."""
        first = self.probe_first[layer]
        return slice(first, first + self.probe_kv_heads)

    def part_shape(self, part: str, tokens: int) -> tuple[int, ...]:
        """Per-layer tensor shape of one part for `tokens` tokens."""
        if part in ("k", "v"):
            return (tokens, self.num_kv_heads, self.head_dim)  # [tokens, kv_heads, head_dim]
        if part == "kp":
            return (tokens, self.probe_kv_heads, self.head_dim)  # [tokens, probe kv heads, head_dim]
        if part == "h":
            return (tokens, self.hidden_size)  # [tokens, hidden]
        raise ValueError(f"unknown part {part!r}")

    def bytes_per_token(self) -> int:
        """Stored payload bytes per token over all layers (int8 scales included)."""
        probes = sum(1 for r in self.layer_reprs if r is Repr.KV) * self.probe_kv_heads * self.head_dim
        return sum(self.layer_bytes_per_token(r) for r in self.layer_reprs) + probes * WIDTH[self.storage_dtype]

    def layer_bytes_per_token(self, rep: Repr) -> int:
        """Stored bytes of one token in one layer stored as `rep`; int8 adds an fp32 scale per row."""
        total = 0
        for p in rep.parts():
            shape = self.part_shape(p, 1)  # [1, kv_heads, hd] or [1, hidden]
            values = math.prod(shape)
            total += values * WIDTH[self.storage_dtype]
            if self.storage_dtype == "int8":
                total += 4 * (values // shape[-1])  # one fp32 scale per row of the last dimension
        return total
