"""Context overflow without recompute: kept tokens reuse stored pre-RoPE KV at new positions."""

from __future__ import annotations

import pytest
import torch

from kvtier.engine.config import EngineConfig, ReuseConfig
from kvtier.engine.engine import Engine
from kvtier.engine.request import SamplingParams
from kvtier.planning.truncation import TruncationConfig, kept_positions
from kvtier.testing.reference import context_state, continuation_logits, truncation_fidelity

from kvtier_testlib import fake_profile


def test_kept_positions_exact():
    cfg = TruncationConfig(keep_prefix=2, drop_ratio=0.5)
    assert kept_positions(8, 10, cfg) == list(range(8))
    # 10 tokens, limit 8: droppable = 8, drop ceil(8 * 0.5) = 4 oldest after the prefix.
    assert kept_positions(10, 8, cfg) == [0, 1, 6, 7, 8, 9]
    # Half is not enough for a limit of 4: drop 6.
    assert kept_positions(10, 4, cfg) == [0, 1, 8, 9]
    with pytest.raises(ValueError):
        TruncationConfig(drop_ratio=1.0)


def test_engine_truncates_and_reuses_kv_at_new_positions(tiny_gqa, tmp_path):
    vocab = tiny_gqa.config.vocab_size
    prof = fake_profile(tiny_gqa.fingerprint, compute_scale=50.0)
    engine = Engine(tiny_gqa, EngineConfig(kv_cache_bytes=32 << 20, max_model_len=256, enable_prefix_cache=False),
                    store=f"disk:{tmp_path}/s:1GB", profile=prof, reuse=ReuseConfig(method="kv"),
                    truncation=TruncationConfig(keep_prefix=8))
    g = torch.Generator().manual_seed(11)
    first = torch.randint(3, vocab, (230,), generator=g).tolist()
    out1 = engine.generate([first], SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))[0]
    engine.flush(30)
    turn2 = first + out1.output_ids + torch.randint(3, vocab, (40,), generator=g).tolist()  # 280 > 256
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    out2 = engine.generate([turn2], params)[0]
    saved_before = engine.stats().counters["saves"]
    engine.close()
    keep = kept_positions(len(turn2), 256 - 8, TruncationConfig(keep_prefix=8))
    assert out2.prompt_tokens == len(keep) and out2.prompt_tokens_reused > 0
    assert out2.reused_by_tier.get("disk", 0) == out2.prompt_tokens_reused
    # Oracle: the stored KV of the original context, kept tokens' K moved to compact positions.
    r = out2.prompt_tokens_reused
    stored = context_state(tiny_gqa.module, turn2[: len(first) + len(out1.output_ids) - 1])
    idx = torch.tensor(keep[:r])
    rest, got = [turn2[i] for i in keep[r:]], []
    for _ in range(8):
        logits = continuation_logits(tiny_gqa.module, stored.k[:, idx], stored.v[:, idx], torch.arange(r) - idx, rest + got)
        got.append(int(logits[-1].argmax()))
    assert out2.output_ids == got
    assert saved_before == engine.stats().counters["saves"]  # nothing saved after the truncated turn


@pytest.mark.slow
def test_truncation_perplexity_rerope_vs_token_truncation_vs_naive(smollm2_fp32):
    from kvtier.text import stdlib_text

    ids = smollm2_fp32.tokenizer.encode(stdlib_text(6000), add_special_tokens=False)
    f = truncation_fidelity(smollm2_fp32.module, ids[:512], ids[512:640], 384, TruncationConfig(keep_prefix=16))
    # The benchmark (kvtier bench truncation) averages several windows against the 2% goal.
    assert abs(f.rerope_vs_tokens) < 0.05, f
    assert f.ppl_kv_naive > 2 * f.ppl_kv_rerope, f


def test_truncated_state_never_enters_the_device_prefix_cache(tiny_gqa, tmp_path):
    """A truncated context's K/V are approximations (kept tokens once saw the dropped ones). A later
    request made of exactly the kept token ids must not reuse them as if they were exact: no device
    prefix-cache hit, and its output equals a fresh engine's."""
    vocab = tiny_gqa.config.vocab_size
    engine = Engine(tiny_gqa, EngineConfig(kv_cache_bytes=32 << 20, max_model_len=256), store=f"disk:{tmp_path}/s:1GB",
                    profile=fake_profile(tiny_gqa.fingerprint, compute_scale=50.0), reuse=ReuseConfig(method="kv"),
                    truncation=TruncationConfig(keep_prefix=8))
    g = torch.Generator().manual_seed(12)
    first = torch.randint(3, vocab, (230,), generator=g).tolist()
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    out1 = engine.generate([first], params)[0]
    engine.flush(30)
    turn2 = first + out1.output_ids + torch.randint(3, vocab, (40,), generator=g).tolist()
    out2 = engine.generate([turn2], params)[0]
    assert out2.prompt_tokens_reused > 0 and "device" not in out2.reused_by_tier  # restored, approximately
    kept = [turn2[i] for i in kept_positions(len(turn2), 256 - 8, TruncationConfig(keep_prefix=8))]
    again = engine.generate([kept], params)[0]
    engine.close()
    assert again.reused_by_tier.get("device", 0) == 0 and engine.pool.hits == 0
    fresh = Engine(tiny_gqa, EngineConfig(kv_cache_bytes=32 << 20, max_model_len=256)).generate([kept], params)[0]
    assert again.output_ids == fresh.output_ids
