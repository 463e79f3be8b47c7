"""HF transformers on the very weights of a kvtier model: the peers every benchmark compares with."""

from __future__ import annotations

import io
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvtier.bench.common import drop_page_cache


def build_hf(loaded):
    """An HF transformers model holding the very weights of `loaded`, in the same dtype, on the same device."""
    import torch
    import transformers

    dtype, device = loaded.dtype, loaded.module.lm_head.weight.device
    if loaded.source and Path(loaded.source).is_dir() and (Path(loaded.source) / "config.json").exists():
        hf = transformers.AutoModelForCausalLM.from_pretrained(loaded.source, dtype=dtype).to(device)
    else:
        cfg = loaded.config
        with torch.device(device):
            hf = transformers.AutoModelForCausalLM.from_config(cfg.to_hf(), dtype=dtype)
        state = {k: v for k, v in loaded.module.state_dict().items()}
        if cfg.tie_word_embeddings:
            state.pop("lm_head.weight", None)
        missing, unexpected = hf.load_state_dict(state, strict=False)
        bad = [k for k in missing if k != "lm_head.weight"]
        if bad or unexpected:
            raise RuntimeError(f"HF baseline weights do not match: missing {bad[:4]}, unexpected {unexpected[:4]}")
        if cfg.tie_word_embeddings:
            hf.tie_weights()
    return hf.eval()


class HFPeers:
    """The HF transformers peers on one context. The history's DynamicCache is prefilled once
    (untimed) and saved with torch.save (bytes, a file, a Redis value); each peer method is the
    timed part and returns the first new token.

    What is saved is the cache's tensors, [(keys, values) per layer], not the DynamicCache object:
    an object only loads with torch.load(weights_only=False), which runs whatever pickle the bytes
    hold, and a Redis value can be written by anyone who can reach the server. Tensors load with
    weights_only=True; the cache is then rebuilt around them without a copy (`_cache`), so the
    peers time the same work as loading the pickled object did."""

    def __init__(self, hf, ids: list[int], hist: int, peers: Sequence[str], path: Path, redis_client, key: str):
        import torch

        self.torch, self.hf, self.path, self.redis, self.key = torch, hf, path, redis_client, key
        self.device = dev = hf.lm_head.weight.device
        self.prompt = torch.tensor([ids], device=dev)  # [1, H + new]
        self.new, self.pos = self.prompt[:, hist:], torch.arange(hist, len(ids), device=dev)[None]  # new tokens, positions
        self.cache, self.blob = None, b""
        if set(peers) - {"hf_recompute"}:
            with torch.inference_mode():
                self.cache = hf(self.prompt[:, :hist], use_cache=True, logits_to_keep=1).past_key_values
            buf = io.BytesIO()
            torch.save([(layer.keys, layer.values) for layer in self.cache.layers], buf)
            self.blob = buf.getvalue()
        if "hf_offload" in peers:  # the history's K/V kept in (pinned) host memory, copied back per request
            assert self.cache is not None  # prefilled above
            pin = dev.type == "cuda"
            self.host_kv = [(layer.keys.cpu().pin_memory() if pin else layer.keys.cpu(),
                             layer.values.cpu().pin_memory() if pin else layer.values.cpu()) for layer in self.cache.layers]
        if "hf_load_cold_file" in peers:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(self.blob)
        if "hf_load_redis" in peers:
            redis_client.set(key, self.blob)

    def _new_tokens(self, cache) -> int:
        with self.torch.inference_mode():
            logits = self.hf(self.new, past_key_values=cache, use_cache=True, position_ids=self.pos,
                             cache_position=self.pos[0], logits_to_keep=1).logits
        return int(logits[0, -1].argmax())

    def hf_recompute(self) -> int:
        with self.torch.inference_mode():
            return int(self.hf(self.prompt, use_cache=False, logits_to_keep=1).logits[0, -1].argmax())

    def hf_floor(self) -> int:
        assert self.cache is not None  # prefilled for every peer but hf_recompute
        token = self._new_tokens(self.cache)
        self.cache.crop(-self.new.shape[1])  # back to the history only (a negative count in transformers 5)
        return token

    def hf_offload(self) -> int:
        """The cache offloaded to host memory and copied back to the device, then the new tokens."""
        assert self.cache is not None  # prefilled for every peer but hf_recompute
        for layer, (k, v) in zip(self.cache.layers, self.host_kv):
            layer.keys, layer.values = k.to(self.device, non_blocking=True), v.to(self.device, non_blocking=True)
        return self._new_tokens(self.cache)

    def _cache(self, source):
        """A DynamicCache over the tensors torch.save wrote to `source` (weights_only: tensors, nothing else)."""
        from transformers import DynamicCache

        kv = self.torch.load(source, weights_only=True, map_location=self.device)
        # Built from empty slices, then handed the loaded tensors: DynamicCache(ddp_cache_data=kv) would
        # concatenate, a second copy of the whole history that unpickling the cache object never made.
        cache = DynamicCache(ddp_cache_data=[(k[..., :0, :], v[..., :0, :]) for k, v in kv])
        layers: list[Any] = cache.layers  # DynamicLayer each (typed as the union of every layer kind)
        for layer, (k, v) in zip(layers, kv):
            layer.keys, layer.values = k, v
        return cache

    def hf_load_bytes(self) -> int:
        return self._new_tokens(self._cache(io.BytesIO(self.blob)))

    def hf_load_cold_file(self) -> int:
        return self._new_tokens(self._cache(self.path))

    def hf_load_redis(self) -> int:
        return self._new_tokens(self._cache(io.BytesIO(self.redis.get(self.key))))

    def before(self, peer: str) -> None:
        """Untimed: the file's pages leave the page cache before each cold load."""
        if peer == "hf_load_cold_file":
            drop_page_cache(self.path)

    def close(self) -> None:
        self.path.unlink(missing_ok=True)
        if self.redis is not None:
            self.redis.delete(self.key)
