"""Which kernels a model's forward runs: state of each model (`CausalLM.kernels`), never of the
process, so two models in one process (an exact server's and a benchmark's plain one) each keep
their own numerics."""

from __future__ import annotations

from dataclasses import dataclass

BF16_ATTENTION = ("auto", "gemm", "flash")


@dataclass(frozen=True)
class Kernels:
    """`exact`: row-invariant linears and attention on the CPU (models/invariant.py,
    exact_attention.py), so a token's bits never depend on chunking, cache hits or batch; False
    (`--fast-inexact`): the plain kernels. `bf16_attention`: exact bf16 attention's CPU kernel
    (models/exact_matmul.py): auto, gemm (oneDNN's GEMMs, where checked row-invariant) or flash."""

    exact: bool = True
    bf16_attention: str = "auto"

    def __post_init__(self) -> None:
        if self.bf16_attention not in BF16_ATTENTION:
            raise ValueError(f"unknown bf16 attention kernel {self.bf16_attention!r}; "
                             f"use one of {', '.join(BF16_ATTENTION)}")
