"""Model configuration for the Llama family, independent of any file format."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

# HF `model_type` values whose forward pass is the one in llama.py (docs/models.md lists them).
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "phi3")
_FAMILIES = "Llama 2/3, Mistral, Qwen2/2.5, Qwen3 dense, Phi-3, SmolLM"
# RoPE variants: "default" is computed here, the others by transformers' own functions (rope.py).
ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "longrope", "llama3")
# Families that look close but compute something else: why each is refused.
_REFUSED = {
    "gemma": "Gemma's (1) embeddings are scaled by sqrt(hidden), its norms add 1 to the weight and its MLP is GELU",
    "gemma2": "Gemma 2 alternates sliding-window and global attention layers and soft-caps attention and final logits",
    "gemma3": "Gemma 3 alternates sliding-window and global attention layers (with two RoPE bases) and "
              "normalises q/k with Gemma's norm",
    "gemma3_text": "Gemma 3 alternates sliding-window and global attention layers (with two RoPE bases) and "
                   "normalises q/k with Gemma's norm",
}


class UnsupportedModelError(ValueError):
    pass


def _unsupported_type(model_type: str, architectures: Any = None) -> UnsupportedModelError:
    why = _REFUSED.get(model_type)
    arch = f" (architectures {architectures})" if architectures else ""
    reason = f": {why}, which kvtier does not implement" if why else ""
    return UnsupportedModelError(
        f"model_type {model_type!r}{arch} is not supported{reason}; kvtier runs "
        f"{', '.join(SUPPORTED_MODEL_TYPES)} ({_FAMILIES}) with full attention"
    )


# The RoPE keys with a field of their own, per kind; every other key of a config's rope dict is
# kept verbatim in `RopeScaling.extra` (yarn's beta_fast, longrope's short/long factors, ...).
_NAMED_KEYS = {
    "linear": ("factor",),
    "dynamic": ("factor",),
    "yarn": ("factor", "original_max_position_embeddings"),
    "longrope": ("original_max_position_embeddings",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
}
# Not RoPE parameters of the variant itself (checked or read elsewhere).
_NOT_PARAMS = ("rope_type", "type", "rope_theta", "partial_rotary_factor")


def _frozen(v: Any) -> Any:
    """A JSON value as a hashable one (lists -> tuples), so the config stays frozen and hashable."""
    return tuple(_frozen(x) for x in v) if isinstance(v, list | tuple) else v


def _thawed(v: Any) -> Any:
    return [_thawed(x) for x in v] if isinstance(v, tuple) else v


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling: `kind` is one of ROPE_TYPES. The fields are the parameters of
    _NAMED_KEYS; `extra` holds the rest of the config's rope dict as sorted (key, value) items
    (lists as tuples), so `to_hf` gives transformers back exactly what it read."""

    kind: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    extra: tuple[tuple[str, Any], ...] = ()

    def __post_init__(self) -> None:
        if self.kind not in ROPE_TYPES:
            raise UnsupportedModelError(f"rope type {self.kind!r} is not supported ({', '.join(ROPE_TYPES)})")

    @staticmethod
    def from_hf(rope: dict[str, Any], d: dict[str, Any]) -> "RopeScaling":
        """From a config's rope dict (`rope_parameters` or `rope_scaling`) and the config dict `d`."""
        kind = rope.get("rope_type", rope.get("type", "default")) or "default"
        kind = {"su": "longrope"}.get(kind, kind)  # Phi-3's early name, as transformers maps it
        if kind not in ROPE_TYPES:
            raise UnsupportedModelError(f"rope type {kind!r} is not supported ({', '.join(ROPE_TYPES)})")
        named = _NAMED_KEYS.get(kind, ())
        # Phi-3 keeps original_max_position_embeddings beside the rope dict, not in it.
        orig = rope.get("original_max_position_embeddings", d.get("original_max_position_embeddings", 8192))
        extra = {k: _frozen(v) for k, v in rope.items() if k not in named and k not in _NOT_PARAMS}
        return RopeScaling(
            kind=kind,
            factor=float(rope.get("factor", 1.0)) if "factor" in named else 1.0,
            low_freq_factor=float(rope.get("low_freq_factor", 1.0)),
            high_freq_factor=float(rope.get("high_freq_factor", 4.0)),
            original_max_position_embeddings=int(orig),
            extra=tuple(sorted(extra.items())) if kind != "default" else (),
        )

    def hf_parameters(self, theta: float) -> dict[str, Any]:
        """transformers' `rope_parameters` dict for this scaling."""
        out: dict[str, Any] = {"rope_type": self.kind, "rope_theta": theta}
        out.update({k: getattr(self, k) for k in _NAMED_KEYS.get(self.kind, ())})
        out.update({k: _thawed(v) for k, v in self.extra})
        return out


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
            raise _unsupported_type(self.model_type)
        if self.num_heads % self.num_kv_heads:
            raise UnsupportedModelError(
                f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}"
            )

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def qk_norm(self) -> bool:
        """Qwen3: an RMSNorm over each head of q and of k (weights of size head_dim) before RoPE."""
        return self.model_type == "qwen3"

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        # A field added after the first stored state is left out at its default: the digest of
        # every config that existed before it (and so its stored state) stays what it was.
        if not self.rope_scaling.extra:
            d["rope_scaling"].pop("extra")
        return d

    def digest(self) -> str:
        return hashlib.sha256(json.dumps(self.to_dict(), sort_keys=True).encode()).hexdigest()

    @staticmethod
    def from_hf(cfg: Any) -> "ModelConfig":
        """Build from a transformers `PretrainedConfig` (or its dict); raises UnsupportedModelError,
        naming the reason and the fix where there is one, for what llama.py does not compute."""
        d: dict[str, Any] = cfg if isinstance(cfg, dict) else cfg.to_dict()
        model_type = d.get("model_type", "")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise _unsupported_type(model_type, d.get("architectures"))
        _check_computable(model_type, d)
        heads = d["num_attention_heads"]
        eos = d.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        # transformers >=5 moved rope settings into `rope_parameters`; older ones use rope_theta/rope_scaling.
        rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
        theta = rope.get("rope_theta", d.get("rope_theta", 10000.0))
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
            rope_scaling=RopeScaling.from_hf(rope, d),
            max_position_embeddings=int(d.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            # Qwen2 always has q/k/v bias; Llama and Qwen3 expose it as attention_bias; Phi-3 has none.
            qkv_bias=model_type == "qwen2" or (model_type != "phi3" and bool(d.get("attention_bias", False))),
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )

    def to_hf(self) -> Any:
        """The equivalent transformers config (used by oracle tests and baselines)."""
        import transformers

        rope = self.rope_scaling.hf_parameters(self.rope_theta)
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
        if self.model_type == "qwen3":
            return transformers.Qwen3Config(use_sliding_window=False, attention_bias=self.qkv_bias, **common)
        if self.model_type == "phi3":
            if self.head_dim * self.num_heads != self.hidden_size:
                raise UnsupportedModelError("Phi-3's head_dim is hidden_size / num_attention_heads")
            common.pop("head_dim")
            orig = self.rope_scaling.original_max_position_embeddings
            return transformers.Phi3Config(sliding_window=None, pad_token_id=None, **common,
                                           original_max_position_embeddings=orig)
        return transformers.LlamaConfig(attention_bias=self.qkv_bias, **common)


def _check_computable(model_type: str, d: dict[str, Any]) -> None:
    """Refuse what a supported family's config can ask for that llama.py does not compute."""
    layer_types = d.get("layer_types") or []
    if model_type in ("qwen2", "qwen3"):
        # Qwen keeps a sliding_window value even when use_sliding_window is off; the layers from
        # max_window_layers on slide when it is on.
        sliding = "sliding_attention" in layer_types or (
            not layer_types and bool(d.get("use_sliding_window")) and d.get("sliding_window") is not None
            and d.get("max_window_layers", 0) < d.get("num_hidden_layers", 0))
        fix = "set use_sliding_window to false"
    else:
        window = d.get("sliding_window")
        sliding = "sliding_attention" in layer_types or (
            window is not None and window < d.get("max_position_embeddings", 0))
        fix = "set sliding_window to null"
    if layer_types:  # transformers uses a config's own layer_types as they are
        fix += " and every layer_types entry to full_attention"
    if sliding:
        # Sliding-window attention would silently change results past the window.
        raise UnsupportedModelError(
            f"{model_type} with sliding-window attention is not supported (kvtier runs full attention only); "
            f"{fix} in config.json to run it with full attention"
        )
    rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
    partial = rope.get("partial_rotary_factor", d.get("partial_rotary_factor")) or 1.0
    if float(partial) != 1.0:
        raise UnsupportedModelError(
            f"partial_rotary_factor={partial} (RoPE on part of each head, as in Phi-4-mini) is not supported; "
            "kvtier rotates whole heads"
        )
    if d.get("hidden_act", "silu") != "silu":
        raise UnsupportedModelError(f"hidden_act {d['hidden_act']!r} is not supported (SiLU-gated MLPs only)")
    if d.get("mlp_bias"):
        raise UnsupportedModelError("mlp_bias is not supported (MLPs without bias only)")
