"""Helpers shared by the store tests (a plain module: tests/ is not a package)."""
from __future__ import annotations

import os

import torch

from kvtier.store import StoreNamespace

LAYERS, KV_HEADS, HEAD_DIM, HIDDEN = 4, 2, 8, 32


def make_ns(storage: str = "", reprs=(), model: str = "model-a", compute: str = "float32") -> StoreNamespace:
    return StoreNamespace(model, LAYERS, KV_HEADS, HEAD_DIM, HIDDEN, compute_dtype=compute,
                          storage_dtype=storage, layer_reprs=tuple(reprs))


def make_state(n_tokens: int, seed: int = 0, dtype=torch.float32):
    """k, v: [layers, tokens, kv_heads, head_dim]; h: [layers, tokens, hidden]."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(LAYERS, n_tokens, KV_HEADS, HEAD_DIM, generator=g).to(dtype)
    v = torch.randn(LAYERS, n_tokens, KV_HEADS, HEAD_DIM, generator=g).to(dtype)
    h = torch.randn(LAYERS, n_tokens, HIDDEN, generator=g).to(dtype)
    return k, v, h


def tokens(n: int, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(1000 + seed)
    return torch.randint(0, 50000, (n,), generator=g).tolist()


def open_fds() -> set[tuple[str, str]]:
    """This process's open descriptors and what each points at, sockets and pipes left out (other
    tests' servers and clients open and close theirs at any time, some only when the garbage
    collector runs): a store's files, directories, eventfds and rings are all here."""
    out = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # closed meanwhile (the listing's own descriptor among them)
            continue
        if not target.startswith(("socket:", "pipe:")):
            out.add((fd, target))
    return out
