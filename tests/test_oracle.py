"""Our forward pass against HF transformers on the same weights (fp32, max abs diff <= 1e-4)."""

from __future__ import annotations

import pytest
import torch

from kvtier.engine.config import EngineConfig
from kvtier.engine.engine import Engine
from kvtier.engine.request import SamplingParams

from kvtier_testlib import ORACLE_CONFIGS, build_pair, loaded

GREEDY = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)


def hf_greedy(hf, ids: list[int], n: int) -> list[int]:
    """Plain argmax loop over HF's own KV cache (generate() would apply EOS/min-length processors)."""
    out: list[int] = []
    with torch.no_grad():
        res = hf(torch.tensor([ids]), use_cache=True)
        for _ in range(n):
            out.append(int(res.logits[0, -1].argmax()))
            res = hf(torch.tensor([[out[-1]]]), past_key_values=res.past_key_values, use_cache=True)
    return out


@pytest.mark.parametrize("name", list(ORACLE_CONFIGS))
def test_logits_match_transformers(name):
    cfg = ORACLE_CONFIGS[name]
    ours, hf = build_pair(cfg)
    # Long enough that llama3 scaling (original context 64) changes frequencies that matter.
    ids = torch.randint(3, cfg.vocab_size, (150,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
    diff = (ours(ids) - ref).abs().max().item()
    assert diff <= 1e-4, f"{name}: max abs logit diff {diff}"


@pytest.mark.parametrize("name", ["llama-gqa", "mistral", "qwen2-bias", "llama3-rope-scaling"])
def test_engine_greedy_matches_transformers(name):
    cfg = ORACLE_CONFIGS[name]
    ours, hf = build_pair(cfg)
    ids = torch.randint(3, cfg.vocab_size, (40,), generator=torch.Generator().manual_seed(2)).tolist()
    engine = Engine(loaded(cfg, ours), EngineConfig(kv_cache_bytes=8 << 20))
    assert engine.generate([ids], GREEDY)[0].output_ids == hf_greedy(hf, ids, 32)


@pytest.mark.slow
def test_smollm2_matches_transformers_on_real_prompt(smollm2_fp32):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(smollm2_fp32.source, dtype=torch.float32).eval()
    engine = Engine(smollm2_fp32, EngineConfig(kv_cache_bytes=256 << 20, max_model_len=2048))
    ids = engine.encode_chat([{"role": "user", "content": "Explain why the sky is blue in two sentences."}])
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    diff = (smollm2_fp32.module(torch.tensor(ids)) - ref).abs().max().item()
    # Our linears run on oneDNN's packed-weight kernel (row-invariant), HF's on MKL: fp32 sums in
    # another order, 30 layers deep, on logits of magnitude ~20.
    assert diff <= 2e-4, diff
    assert engine.generate([ids], GREEDY)[0].output_ids == hf_greedy(hf, ids, 32)
