"""The runner's attention backends, one chosen per runner (`choose`) by device, dtype and exact
mode: `cpu_exact`, `varlen` (CUDA where flash varlen attention is usable), `sdpa` (CUDA otherwise,
and the CPU's inexact mode). `static` (static buffers, CUDA graphs) is a whole-step decoder the
engine adds beside the backend for plain decode steps."""

from __future__ import annotations

from typing import Any

from kvtier.engine.runner.backends.base import AttentionBackend, PoolSpec
from kvtier.engine.runner.backends.cpu_exact import CpuExact
from kvtier.engine.runner.backends.sdpa import CudaSdpa, Sdpa
from kvtier.engine.runner.backends.varlen import Varlen
from kvtier.models import varlen as varlen_kernels  # not `varlen`: that name is this package's module
from kvtier.models.attention import exact_cpu


def choose(spec: PoolSpec) -> AttentionBackend[Any]:
    if exact_cpu(spec.device, spec.kernels):
        return CpuExact(spec)
    if varlen_kernels.usable(spec.device, spec.dtype, spec.heads, spec.kv_heads, spec.head_dim):
        return Varlen(spec)
    return CudaSdpa(spec) if spec.device.type == "cuda" else Sdpa(spec)
