"""Dtype names in one place: canonical names, aliases, byte widths and the torch mapping.

Plain strings travel through configs, store namespaces and the planner (which never import
torch); `torch_dtype` maps them at the edge where tensors are made.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

COMPUTE_DTYPES = ("float32", "bfloat16", "float16")
STORAGE_DTYPES = COMPUTE_DTYPES + ("int8",)
WIDTH = {"float32": 4, "bfloat16": 2, "float16": 2, "int8": 1}  # bytes per stored value
_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16"}


def canonical(name: str) -> str:
    """'fp32' / 'float32' / 'torch.float32' -> 'float32'; raises ValueError naming the choices."""
    n = name.removeprefix("torch.")
    n = _ALIASES.get(n, n)
    if n not in STORAGE_DTYPES:
        raise ValueError(f"unknown dtype {name!r}; use one of fp32, bf16, fp16 (int8 for storage only)")
    return n


def name_of(dtype: "torch.dtype") -> str:
    """torch.float32 -> 'float32'."""
    return str(dtype).removeprefix("torch.")


@functools.lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    """This CPU's feature flags (/proc/cpuinfo; empty where it cannot be read)."""
    try:
        with open("/proc/cpuinfo") as f:
            info = f.read()
    except OSError:
        return frozenset()
    return frozenset(next((ln.split(":", 1)[1].split() for ln in info.splitlines() if ln.startswith("flags")), []))


def cpu_has_bf16() -> bool:
    """Whether this CPU computes bf16 natively (avx512_bf16 or AMX), not by emulation."""
    return bool({"avx512_bf16", "amx_bf16"} & cpu_flags())


def cpu_has_amx() -> bool:
    """Whether this CPU has AMX tiles for bf16 (Intel Sapphire Rapids and later)."""
    return "amx_bf16" in cpu_flags()


def torch_dtype(name: str) -> "torch.dtype":
    import torch

    return getattr(torch, canonical(name))
