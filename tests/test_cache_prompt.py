"""llama-server's cache_prompt: false neither reuses state (the device prefix cache, the store) nor
leaves any (no published blocks, no saves); the answer is the same either way."""

from __future__ import annotations

import pytest
import torch

from kvtier.engine.config import EngineConfig, ReuseConfig
from kvtier.engine.engine import Engine
from kvtier.engine.request import SamplingParams

from kvtier_testlib import fake_profile

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


@pytest.mark.parametrize("where", ["device", "store"])
def test_cache_prompt_false_neither_reuses_nor_leaves_state(tiny_gqa, where):
    """"device": the prefix cache on beside a memory store; "store": the prefix cache off, so what
    is reused comes back from the store's memory tier."""
    prompt = torch.randint(3, tiny_gqa.config.vocab_size, (70,), generator=torch.Generator().manual_seed(7)).tolist()
    engine = Engine(tiny_gqa, EngineConfig(kv_cache_bytes=16 << 20, enable_prefix_cache=where == "device"),
                    store="memory:64MB", reuse=ReuseConfig(method="kv", chunk_tokens=16),
                    profile=fake_profile(tiny_gqa.fingerprint, compute_scale=50.0))  # loading pays off

    def run(**kw):
        out = engine.generate([prompt], GREEDY, **kw)[0]
        assert engine.flush(30)  # its saves (if any) are on the tier before the next one looks
        return out

    def saves() -> int:
        return engine.stats().counters["saves"]

    private = run(cache_prompt=False)
    assert private.prompt_tokens_reused == 0 and private.prompt_tokens_computed == len(prompt)
    # It left nothing: no save, no stored chunk, no block in the prefix cache.
    assert saves() == 0 and engine.link.store.lookup(prompt).num_tokens == 0 and not engine.pool.cached
    first = run()  # so the default finds nothing either, and leaves its state
    assert first.prompt_tokens_reused == 0 and saves() > 0
    done = saves()
    again = run(cache_prompt=False)  # the state is there now, and is not taken
    assert again.prompt_tokens_reused == 0 and again.reused_by_tier == {} and saves() == done
    hit = run()
    assert hit.prompt_tokens_reused > 0 and saves() > done
    assert ("device" in hit.reused_by_tier) if where == "device" else (set(hit.reused_by_tier) == {"memory"})
    assert private.output_ids == first.output_ids == again.output_ids == hit.output_ids
    engine.close()


def test_cache_prompt_false_samples_share_their_own_prefill_only(tiny_gqa):
    """n > 1: the samples still fork from the request's one prefill (that is not reuse of cached
    state), and a later request finds none of their blocks."""
    prompt = list(range(3, 3 + 40))
    engine = Engine(tiny_gqa, EngineConfig(kv_cache_bytes=16 << 20))
    params = SamplingParams(n=3, max_tokens=4, temperature=1.0, seed=5)
    outs = engine.generate([prompt], params, cache_prompt=False)
    assert [o.prompt_tokens_reused for o in outs] == [0, len(prompt), len(prompt)]  # forked from sample 0
    assert not engine.pool.cached and engine.pool.num_free == engine.pool.num_blocks
    plain = Engine(tiny_gqa, EngineConfig(kv_cache_bytes=16 << 20)).generate([prompt], params)
    assert [o.output_ids for o in outs] == [o.output_ids for o in plain]
    assert engine.generate([prompt], GREEDY)[0].prompt_tokens_reused == 0
