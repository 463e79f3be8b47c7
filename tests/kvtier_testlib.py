"""Helpers shared by the top-level tests (a module name of its own: `conftest` is ambiguous
when pytest collects several test directories)."""

from __future__ import annotations

import torch

from kvtier.models.config import ModelConfig, RopeScaling
from kvtier.models.loading import LoadedModel, _build
from kvtier.models.presets import random_state_dict
from kvtier.planning.costs import HardwareProfile, TierRates


def _tiny(**kw) -> ModelConfig:
    base = dict(
        model_type="llama", vocab_size=512, hidden_size=64, intermediate_size=160, num_layers=3,
        num_heads=4, num_kv_heads=4, head_dim=16, max_position_embeddings=1024, eos_token_ids=(2,),
    )
    base.update(kw)
    return ModelConfig(**base)


ORACLE_CONFIGS = {
    "llama-mha": _tiny(),
    "llama-gqa": _tiny(num_kv_heads=2, tie_word_embeddings=True),
    "llama3-rope-scaling": _tiny(
        num_kv_heads=1, rope_theta=500000.0,
        rope_scaling=RopeScaling(kind="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                 original_max_position_embeddings=64),
    ),
    "llama-linear-rope": _tiny(rope_scaling=RopeScaling(kind="linear", factor=2.0)),
    "mistral": _tiny(model_type="mistral", num_kv_heads=2),
    "qwen2-bias": _tiny(model_type="qwen2", num_kv_heads=2, qkv_bias=True, head_dim=16),
}


def build_pair(cfg: ModelConfig, seed: int = 0):
    """Our module and an HF transformers model holding the same fp32 weights."""
    import transformers

    state = random_state_dict(cfg, seed)
    if cfg.tie_word_embeddings:  # one shared matrix: the embedding
        state.pop("lm_head.weight")
    ours = _build(cfg, dict(state), torch.float32, "cpu")
    hf = transformers.AutoModelForCausalLM.from_config(cfg.to_hf(), dtype=torch.float32)
    missing, unexpected = hf.load_state_dict(state, strict=False)
    assert not [k for k in missing if k != "lm_head.weight"] and not unexpected, (missing, unexpected)
    if cfg.tie_word_embeddings:
        hf.tie_weights()
    return ours, hf.eval()


def loaded(cfg: ModelConfig, module, name: str = "test") -> LoadedModel:
    return LoadedModel(name, cfg, module, None, f"test-{cfg.digest()[:8]}", "test")


def fake_profile(fp: str, compute_scale: float = 1.0, io_bps: float = 1e9) -> HardwareProfile:
    rates = TierRates(io_bps, io_bps, 1e-5)
    return HardwareProfile(fp, "float32", 2, 2e-5 * compute_scale, 1e-9 * compute_scale, 5e-7 * compute_scale,
                           1e-7 * compute_scale, {"memory": rates, "disk": rates, "redis": rates})


def spy_logits(engine) -> list[torch.Tensor]:
    """Record the logits every step of `engine` returns (the runner's own output)."""
    seen: list[torch.Tensor] = []
    execute = engine.runner.execute

    def spy(*a, **kw):
        out = execute(*a, **kw)
        if out.numel():
            seen.append(out.clone())
        return out

    engine.runner.execute = spy  # type: ignore[method-assign]
    return seen


def first_logits(engine, ids: list[int], params) -> tuple:
    """(output, the logits of the request's first step) of one run of `ids`; the engine is closed."""
    seen = spy_logits(engine)
    try:
        return engine.generate([ids], params)[0], seen[0][-1]
    finally:
        engine.close()
