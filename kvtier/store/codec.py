"""Tensor <-> stored bytes in the storage dtype (float32/bfloat16/float16 losslessly cast, int8 with scales)."""
from __future__ import annotations

import torch

from kvtier.dtypes import STORAGE_DTYPES

_TORCH = {name: getattr(torch, name) for name in STORAGE_DTYPES}


def torch_dtype(name: str) -> torch.dtype:
    return _TORCH[name]


def encode(t: torch.Tensor, storage: str) -> list[tuple[str, torch.Tensor]]:
    """Encode one per-layer part into named uint8 buffers.

    Returns [("", data)] or, for int8, [("", data), (".scale", scales)]. Scales are float32, one per
    row of the last dimension (per token and head for K/V, per token for hidden), which keeps
    outlier channels in one head from flattening every other head.
    """
    t = t.detach().to("cpu")
    if storage != "int8":
        data = t.to(torch_dtype(storage)).contiguous()
        return [("", data.view(torch.uint8).reshape(-1))]
    x = t.to(torch.float32)
    scale = x.abs().amax(dim=-1, keepdim=True).clamp_min(1e-12) / 127.0  # [..., 1]
    q = torch.round(x / scale).clamp_(-127, 127).to(torch.int8).contiguous()
    return [
        ("", q.view(torch.uint8).reshape(-1)),
        (".scale", scale.contiguous().view(torch.uint8).reshape(-1)),
    ]


def decode(data: torch.Tensor, storage: str, shape: tuple[int, ...], compute: str,
           scale: torch.Tensor | None = None, copy: bool = True) -> torch.Tensor:
    """uint8 buffer (+ scales for int8) -> tensor of `shape` in the compute dtype.

    With copy=True the result never aliases `data`, so a caller may mutate what it gets without
    touching a cached copy (the memory tier); copy=False is for buffers the read owns.
    """
    out_dtype = torch_dtype(compute)
    if storage != "int8":
        t = data.view(torch_dtype(storage)).reshape(shape)
        if t.dtype != out_dtype:
            return t.to(out_dtype)
        if not copy:
            return t
        # empty+copy_ rather than clone(): clone of small tensors is far slower with intra-op
        # threads on a busy machine; copy_ takes the plain memcpy path.
        return torch.empty(shape, dtype=out_dtype).copy_(t)
    if scale is None:
        raise ValueError("int8 part without its scales")
    return to_compute(data.view(torch.int8).reshape(shape), scale.view(torch.float32).reshape(shape[:-1]), out_dtype)


def to_compute(stored: torch.Tensor, scale: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    """Stored values (any shape [..., d], in their storage dtype) in the compute dtype: a cast, or
    for int8 a dequantisation by the per-row `scale` ([...], float32). Runs on whatever device the
    tensors are on: the host decoding a read, or the GPU decoding what a restore copied over in the
    storage dtype. One expression for both, so the two give the same values."""
    if stored.dtype != torch.int8:
        return stored.to(out_dtype)
    if scale is None:
        raise ValueError("int8 part without its scales")
    return (stored.to(torch.float32) * scale[..., None]).to(out_dtype)
