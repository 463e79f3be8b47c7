"""The families beyond Llama (Qwen3's q/k norm, Phi-3's fused checkpoint) and every RoPE variant:
logits against HF transformers on random weights (fp32, 1e-4), every lossless restore method
bit-identical to a fresh prefill (HCache rebuilds K through the k-norm), and the refusals of what
kvtier does not compute (sliding-window layers, Gemma). docs/models.md names these tests."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
import transformers
from test_exact import LOSSLESS, engine, same

from kvtier.engine.engine import Engine, RequestOutput
from kvtier.engine.request import SamplingParams
from kvtier.models.config import ModelConfig, RopeScaling, UnsupportedModelError
from kvtier.models.loading import LoadedModel, _build, load_model
from kvtier.models.presets import random_state_dict
from kvtier.models.rope import Rope, rotate_into

from kvtier_testlib import _tiny, build_pair, loaded

FAMILIES = {
    # GQA, per-head q/k norm, head_dim (24) != hidden / heads (16).
    "qwen3": _tiny(model_type="qwen3", num_kv_heads=2, head_dim=24, num_layers=2),
    "qwen2-yarn": _tiny(model_type="qwen2", num_kv_heads=2, qkv_bias=True, num_layers=2, max_position_embeddings=256,
                        rope_scaling=RopeScaling(kind="yarn", factor=4.0, original_max_position_embeddings=64)),
    # Prompts stay within max_position_embeddings, where HF's dynamic NTK keeps the base (rope.py).
    "llama-dynamic": _tiny(num_kv_heads=2, num_layers=2, max_position_embeddings=256,
                           rope_scaling=RopeScaling(kind="dynamic", factor=2.0)),
}
PROMPT = 150  # past yarn's and longrope's original window (64)
# test_exact's comparison (first logits and the greedy continuation), on 8 tokens: CI time.
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, first_logits=True)


def _ids(vocab: int, n: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("name", list(FAMILIES))
def test_logits_match_transformers(name):
    cfg = FAMILIES[name]
    assert ModelConfig.from_hf(cfg.to_hf()) == cfg
    ours, hf = build_pair(cfg)
    ids = _ids(cfg.vocab_size, PROMPT)
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
    diff = (ours(ids) - ref).abs().max().item()
    assert diff <= 1e-4, f"{name}: max abs logit diff {diff}"


# ----- Phi-3: a checkpoint written by transformers, fused projections and LongRoPE ---------------
def _phi3_config() -> transformers.Phi3Config:
    half = 8  # head_dim 16 / 2
    return transformers.Phi3Config(
        vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, original_max_position_embeddings=64,
        rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                         "short_factor": [1.0 + 0.1 * i for i in range(half)],
                         "long_factor": [1.0 + 0.9 * i for i in range(half)]},
        sliding_window=None, bos_token_id=1, eos_token_id=2, pad_token_id=None,
    )


@pytest.fixture(scope="module")
def phi3(tmp_path_factory) -> tuple[LoadedModel, transformers.PreTrainedModel]:
    """The HF model (random weights, as random_state_dict draws them) and kvtier's load of its
    save_pretrained directory: the loader's own path, qkv_proj and gate_up_proj split on the way."""
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(_phi3_config(), dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.copy_(1.0 + 0.1 * torch.randn_like(p) if name.endswith("norm.weight") else
                    torch.randn_like(p) / (1.0 if "embed" in name else p.shape[-1] ** 0.5))
    path = tmp_path_factory.mktemp("phi3")
    hf.save_pretrained(path)
    assert list(Path(path).glob("*.safetensors"))
    return load_model(str(path), dtype="fp32", tokenizer=False), hf


def test_phi3_logits_match_transformers(phi3):
    m, hf = phi3
    cfg = m.config
    assert (cfg.model_type, cfg.rope_scaling.kind, cfg.rope_scaling.original_max_position_embeddings) == \
        ("phi3", "longrope", 64)
    assert ModelConfig.from_hf(cfg.to_hf()) == cfg
    # Past the original window HF picks the long factors, as kvtier does for this window (rope.py).
    ids = _ids(cfg.vocab_size, PROMPT)
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
    diff = (m.module(ids) - ref).abs().max().item()
    assert diff <= 1e-4, diff


# ----- every lossless restore is bit-identical to a fresh prefill --------------------------------
def run(e: Engine, ids: list[int]) -> RequestOutput:
    try:
        return e.generate([ids], GREEDY)[0]
    finally:
        e.close()


def _every_restore_is_exact(m: LoadedModel) -> None:
    """As test_exact's tiny-gqa check, shorter: a 160-token history saved, 40 new tokens."""
    ids = _ids(m.config.vocab_size, 200, seed=4).tolist()
    fresh = run(engine(m, prefix_cache=False), ids)
    for method in LOSSLESS:
        layout = ("hidden",) * m.config.num_layers if method in ("hidden", "bubblefree") else None
        saver = engine(m, chunk=64, prefix_cache=False, store="memory:1GB", method=method, layout=layout)
        try:
            saver.generate([ids[:160]], SamplingParams(max_tokens=1, temperature=0.0))
            assert saver.flush(30)
            out = run(saver, ids)
        finally:
            saver.close()
        if method != "recompute":
            assert out.prompt_tokens_reused >= 128 and out.restore_method == method, (method, out.restore_method)
        assert same(out, fresh), method


def _random(name: str) -> LoadedModel:
    cfg = FAMILIES[name]
    return loaded(cfg, _build(cfg, random_state_dict(cfg, 0), torch.float32, torch.device("cpu")))


@pytest.fixture(scope="module")
def qwen3() -> LoadedModel:
    return _random("qwen3")


def test_qwen3_every_restore_is_exact(qwen3):
    _every_restore_is_exact(qwen3)


def test_qwen2_yarn_every_restore_is_exact():
    """yarn scales cos/sin by its attention factor: a restored K is the K the forward pass made."""
    _every_restore_is_exact(_random("qwen2-yarn"))


def test_phi3_every_restore_is_exact(phi3):
    _every_restore_is_exact(phi3[0])


def test_qwen3_bf16_restore_is_exact():
    """q/k norm in bf16: a hidden-state restore (K rebuilt through the k-norm) and a KV restore
    give the fresh prefill's logits to the bit."""
    cfg = FAMILIES["qwen3"]
    m = loaded(cfg, _build(cfg, random_state_dict(cfg, 0, torch.bfloat16), torch.bfloat16, torch.device("cpu")))
    ids = _ids(cfg.vocab_size, 200, seed=5).tolist()
    fresh = run(engine(m, prefix_cache=False), ids)
    for method, layout in (("hidden", ("hidden",) * cfg.num_layers), ("kv", None)):
        e = engine(m, chunk=64, prefix_cache=False, store="memory:1GB", method=method, layout=layout)
        e.generate([ids[:160]], SamplingParams(max_tokens=1, temperature=0.0))
        assert e.flush(30)
        out = run(e, ids)
        assert out.restore_method == method and same(out, fresh), method


def test_qwen3_state_dict_uses_hf_names():
    names = set(random_state_dict(FAMILIES["qwen3"], 0))
    assert {"model.layers.0.self_attn.q_norm.weight", "model.layers.0.self_attn.k_norm.weight"} <= names


def test_scaled_rope_truncation_shift_does_not_scale_twice():
    """yarn multiplies cos/sin by its attention factor; re-rotating stored K by a position
    difference (truncation) must rotate only, so K at p shifted by d is K at p + d."""
    cfg = FAMILIES["qwen2-yarn"]
    rope = Rope(cfg, 128, torch.float32)
    k = torch.randn(10, cfg.num_kv_heads, cfg.head_dim)  # [tokens, kv_heads, hd]
    p, d = torch.arange(40, 50), torch.full((10,), -30)
    at_p = rotate_into(k, *rope.halves(p), torch.empty_like(k))
    moved = rotate_into(at_p, *rope.delta(d), torch.empty_like(k))
    assert torch.allclose(moved, rotate_into(k, *rope.halves(p + d), torch.empty_like(k)), atol=1e-5)


# ----- what kvtier refuses, with the reason and the fix ------------------------------------------
@pytest.mark.parametrize("hf_cfg, message", [
    (lambda: transformers.Gemma2Config(), "soft-caps"),
    (lambda: transformers.Gemma3TextConfig(), "sliding-window"),
    (lambda: transformers.MistralConfig(sliding_window=4096), "set sliding_window to null"),
    (lambda: transformers.Phi3Config(sliding_window=2047), "set sliding_window to null"),
    (lambda: transformers.Qwen2Config(num_hidden_layers=4, use_sliding_window=True, max_window_layers=2),
     "set use_sliding_window to false"),
    (lambda: transformers.Qwen3Config(num_hidden_layers=4, use_sliding_window=True, max_window_layers=2),
     "set use_sliding_window to false"),
    (lambda: transformers.Phi3Config(partial_rotary_factor=0.75), "partial_rotary_factor"),
])
def test_refused_with_the_reason(hf_cfg, message):
    with pytest.raises(UnsupportedModelError, match=message):
        ModelConfig.from_hf(hf_cfg())


def test_full_attention_configs_of_the_same_families_load():
    assert ModelConfig.from_hf(transformers.MistralConfig(sliding_window=None)).model_type == "mistral"
    assert ModelConfig.from_hf(transformers.Qwen2Config(use_sliding_window=False)).model_type == "qwen2"
    qwen3 = ModelConfig.from_hf(transformers.Qwen3Config())
    assert qwen3.qk_norm and not qwen3.qkv_bias and qwen3.head_dim == 128
    assert dataclasses.replace(qwen3, model_type="qwen2").digest() != qwen3.digest()
