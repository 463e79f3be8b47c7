"""Model configuration for the Llama family, independent of any file format."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

# HF `model_type` / `architectures` values whose forward pass is the one in llama.py.
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")


class UnsupportedModelError(ValueError):
    pass


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling; `kind` is "default", "linear" or "llama3"."""

    kind: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedModelError(
                f"model_type {self.model_type!r} is not supported; kvtier runs "
                f"{', '.join(SUPPORTED_MODEL_TYPES)} (Llama 2/3, Mistral, Qwen2, SmolLM)"
            )
        if self.num_heads % self.num_kv_heads:
            raise UnsupportedModelError(
                f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}"
            )

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def digest(self) -> str:
        return hashlib.sha256(json.dumps(self.to_dict(), sort_keys=True).encode()).hexdigest()

    @staticmethod
    def from_hf(cfg: Any) -> "ModelConfig":
        """Build from a transformers `PretrainedConfig` (or its dict)."""
        d: dict[str, Any] = cfg if isinstance(cfg, dict) else cfg.to_dict()
        model_type = d.get("model_type", "")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedModelError(
                f"model_type {model_type!r} (architectures {d.get('architectures')}) is not supported; "
                f"kvtier runs {', '.join(SUPPORTED_MODEL_TYPES)} (Llama 2/3, Mistral, Qwen2, SmolLM)"
            )
        if model_type == "mistral" and d.get("sliding_window"):
            # Sliding-window attention would silently change results past the window.
            if d["sliding_window"] < d.get("max_position_embeddings", 0):
                raise UnsupportedModelError(
                    "Mistral with sliding-window attention is not supported (full attention only); "
                    "set sliding_window to null in config.json to run it with full attention"
                )
        heads = d["num_attention_heads"]
        eos = d.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        # transformers >=5 moved rope settings into `rope_parameters`; older ones use rope_theta/rope_scaling.
        rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
        theta = rope.get("rope_theta", d.get("rope_theta", 10000.0))
        kind = rope.get("rope_type", rope.get("type", "default")) or "default"
        if kind not in ("default", "linear", "llama3"):
            raise UnsupportedModelError(f"rope type {kind!r} is not supported (default, linear, llama3)")
        scaling = RopeScaling(
            kind=kind,
            factor=float(rope.get("factor", 1.0)),
            low_freq_factor=float(rope.get("low_freq_factor", 1.0)),
            high_freq_factor=float(rope.get("high_freq_factor", 4.0)),
            original_max_position_embeddings=int(rope.get("original_max_position_embeddings", 8192)),
        )
        return ModelConfig(
            model_type=model_type,
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_layers=d["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=d.get("num_key_value_heads") or heads,
            head_dim=d.get("head_dim") or d["hidden_size"] // heads,
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=float(theta),
            rope_scaling=scaling,
            max_position_embeddings=int(d.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            # Qwen2 always has q/k/v bias; Llama exposes it as attention_bias.
            qkv_bias=model_type == "qwen2" or bool(d.get("attention_bias", False)),
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )

    def to_hf(self) -> Any:
        """The equivalent transformers config (used by oracle tests and baselines)."""
        import transformers

        rope: dict[str, Any] = {"rope_type": self.rope_scaling.kind, "rope_theta": self.rope_theta}
        if self.rope_scaling.kind != "default":
            rope.update(factor=self.rope_scaling.factor)
        if self.rope_scaling.kind == "llama3":
            rope.update(
                low_freq_factor=self.rope_scaling.low_freq_factor,
                high_freq_factor=self.rope_scaling.high_freq_factor,
                original_max_position_embeddings=self.rope_scaling.original_max_position_embeddings,
            )
        common: dict[str, Any] = dict(
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_layers,
            num_attention_heads=self.num_heads,
            num_key_value_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            rms_norm_eps=self.rms_norm_eps,
            max_position_embeddings=self.max_position_embeddings,
            tie_word_embeddings=self.tie_word_embeddings,
            bos_token_id=self.bos_token_id,
            eos_token_id=list(self.eos_token_ids) or None,
            rope_theta=self.rope_theta,
            rope_scaling=None if self.rope_scaling.kind == "default" else rope,
        )
        if self.model_type == "mistral":
            return transformers.MistralConfig(sliding_window=None, **common)
        if self.model_type == "qwen2":
            common.pop("head_dim")
            return transformers.Qwen2Config(use_sliding_window=False, **common)
        return transformers.LlamaConfig(attention_bias=self.qkv_bias, **common)
