"""Engine behaviour: batching, chunked prefill, prefix cache and preemption never change tokens."""

from __future__ import annotations

import pytest
import torch

from kvtier.engine.config import EngineConfig
from kvtier.engine.engine import Engine, PromptError
from kvtier.engine.request import SamplingError, SamplingParams

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


def prompts(n: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (int(l),), generator=g).tolist() for l in torch.randint(5, 120, (n,), generator=g)]


def alone(model, ids, **cfg) -> list[int]:
    return Engine(model, EngineConfig(kv_cache_bytes=16 << 20, **cfg)).generate([ids], GREEDY)[0].output_ids


def test_concurrent_requests_match_running_alone(tiny_gqa):
    ps = prompts(8, tiny_gqa.config.vocab_size)
    engine = Engine(tiny_gqa, EngineConfig(kv_cache_bytes=16 << 20, max_batched_tokens=96))
    together = engine.generate(ps, GREEDY)
    assert [o.output_ids for o in together] == [alone(tiny_gqa, p) for p in ps]
    assert engine.pool.num_free == engine.pool.num_blocks  # every block returned


@pytest.mark.parametrize("chunk", [1, 7, 16, 33])
def test_chunked_prefill_equals_one_shot(tiny_mha, chunk):
    ids = prompts(1, tiny_mha.config.vocab_size, seed=3)[0] + list(range(10, 60))
    assert alone(tiny_mha, ids, max_batched_tokens=chunk) == alone(tiny_mha, ids, max_batched_tokens=4096)


def test_chunked_prefill_logits_equal_one_shot(tiny_gqa):
    ids = prompts(1, tiny_gqa.config.vocab_size, seed=4)[0] + list(range(100, 140))
    ref = tiny_gqa.module(torch.tensor(ids))[-1]
    for chunk in (5, 32):
        engine = Engine(tiny_gqa, EngineConfig(kv_cache_bytes=16 << 20, max_batched_tokens=chunk))
        engine.add_request(ids, SamplingParams(max_tokens=1, temperature=0))
        rows = []
        orig = engine.runner.execute
        engine.runner.execute = lambda items, capture=None, **kw: rows.append(orig(items, capture, **kw)) or rows[-1]
        while engine.has_work():
            engine.step()
        assert (rows[-1][0] - ref).abs().max().item() <= 1e-4


def test_prefix_cache_hit_gives_same_tokens_as_miss(tiny_gqa):
    shared = list(range(3, 3 + 70))  # 4 full blocks of 16 + 6
    a, b = shared + [500, 501, 502], shared + [900, 901]
    engine = Engine(tiny_gqa, EngineConfig(kv_cache_bytes=16 << 20))
    first = engine.generate([a], GREEDY)[0]
    second = engine.generate([b], GREEDY)[0]
    assert first.prompt_tokens_reused == 0
    assert second.prompt_tokens_reused == 64 and second.reused_by_tier == {"device": 64}
    assert second.prompt_tokens_computed == len(b) - 64
    assert second.output_ids == alone(tiny_gqa, b, enable_prefix_cache=False)
    # The same prompt again reuses all full blocks but still computes its last token.
    again = engine.generate([a], GREEDY)[0]
    assert again.output_ids == first.output_ids and again.prompt_tokens_reused == 64


def test_preemption_and_resume_give_same_tokens(tiny_gqa):
    ps = prompts(6, tiny_gqa.config.vocab_size, seed=5)
    params = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
    block_bytes = 2 * 4 * 16 * 2 * 16 * 4  # layers * block * kv_dim * fp32, K and V
    # 20 blocks (320 tokens) for 6 requests of up to ~180 tokens each forces preemption.
    engine = Engine(tiny_gqa, EngineConfig(kv_cache_bytes=20 * block_bytes, max_model_len=320))
    outs = engine.generate(ps, params)
    assert engine.scheduler.num_preemptions > 0
    for p, o in zip(ps, outs):
        ref = Engine(tiny_gqa, EngineConfig(kv_cache_bytes=16 << 20)).generate([p], params)[0]
        assert o.output_ids == ref.output_ids
    assert engine.pool.num_free == engine.pool.num_blocks


def test_seeded_sampling_is_reproducible_and_top_k_1_is_greedy(tiny_gqa):
    ids = prompts(1, tiny_gqa.config.vocab_size, seed=6)[0]
    engine = Engine(tiny_gqa, EngineConfig(kv_cache_bytes=16 << 20))
    p = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, top_k=50, seed=7, ignore_eos=True)
    a, b = engine.generate([ids, ids], p)
    assert a.output_ids == b.output_ids
    k1 = engine.generate([ids], SamplingParams(max_tokens=16, top_k=1, seed=1, ignore_eos=True))[0]
    assert k1.output_ids == engine.generate([ids], SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))[0].output_ids


def test_max_tokens_and_context_window_finish_with_length(tiny_gqa):
    engine = Engine(tiny_gqa, EngineConfig(kv_cache_bytes=16 << 20, max_model_len=64))
    out = engine.generate([list(range(3, 53))], SamplingParams(max_tokens=100, temperature=0, ignore_eos=True))[0]
    assert out.finish_reason == "length" and len(out.output_ids) == 64 - 50


def test_eos_stops(tiny_gqa):
    engine = Engine(tiny_gqa, EngineConfig(kv_cache_bytes=16 << 20))
    ids = prompts(1, tiny_gqa.config.vocab_size, seed=8)[0]
    free = engine.generate([ids], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))[0].output_ids
    engine.eos_ids = {free[3]}
    out = engine.generate([ids], SamplingParams(max_tokens=8, temperature=0))[0]
    assert out.output_ids == free[: free.index(free[3]) + 1] and out.finish_reason == "stop"


def test_abort_frees_blocks(tiny_gqa):
    engine = Engine(tiny_gqa, EngineConfig(kv_cache_bytes=16 << 20))
    rid = engine.add_request(list(range(3, 40)), SamplingParams(max_tokens=100, temperature=0, ignore_eos=True))
    engine.step()
    engine.step()
    engine.abort(rid)
    outs = engine.step()
    assert outs[0].finish_reason == "abort" and engine.pool.num_free == engine.pool.num_blocks


@pytest.mark.parametrize(
    "kwargs, msg",
    [
        (dict(temperature=-1), "temperature"),
        (dict(temperature=3), "temperature"),
        (dict(top_p=0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(top_k=-2), "top_k"),
    ],
)
def test_bad_sampling_values_are_rejected(kwargs, msg):
    with pytest.raises(SamplingError, match=msg):
        SamplingParams(**kwargs)


def test_bad_prompts_are_rejected(tiny_gqa):
    engine = Engine(tiny_gqa, EngineConfig(kv_cache_bytes=16 << 20, max_model_len=64))
    with pytest.raises(PromptError, match="empty"):
        engine.add_request([])
    with pytest.raises(PromptError, match="context window is 64"):
        engine.add_request(list(range(3, 80)))
    with pytest.raises(PromptError, match="token ids"):
        engine.add_request([10**9])


@pytest.mark.slow
def test_stop_strings_and_streaming(smollm2_fp32):
    engine = Engine(smollm2_fp32, EngineConfig(kv_cache_bytes=256 << 20, max_model_len=2048))
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    full = engine.chat(msgs, SamplingParams(max_tokens=30, temperature=0))
    assert "Paris" in full.text
    stopped = engine.generate([engine.encode_chat(msgs)], SamplingParams(max_tokens=30, temperature=0, stop=("Paris",)))[0]
    assert stopped.finish_reason == "stop" and "Paris" not in stopped.text
    assert full.text.startswith(stopped.text)
    pieces = [o.delta_text for o in engine.stream(engine.encode_chat(msgs), SamplingParams(max_tokens=30, temperature=0))]
    assert "".join(pieces) == full.text and len(pieces) > 3
