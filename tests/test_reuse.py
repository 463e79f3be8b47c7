"""Multi-turn reuse inside the engine: every turn is saved, later turns restore it from the store,
and greedy outputs equal a no-reuse engine's."""

from __future__ import annotations

import time

import pytest
import torch

from kvtier.engine.config import EngineConfig, ReuseConfig
from kvtier.engine.engine import Engine
from kvtier.engine.request import SamplingParams

from kvtier_testlib import fake_profile

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def user_turn(i: int, vocab: int) -> list[int]:
    return torch.randint(3, vocab, (40 + 9 * i,), generator=torch.Generator().manual_seed(100 + i)).tolist()


def conversation(engine_for_turn, vocab: int, turns: int = 4):
    """Run `turns` turns; each prompt is the whole conversation so far plus a new user message."""
    history: list[int] = []
    outs = []
    for i in range(turns):
        prompt = history + user_turn(i, vocab)
        engine = engine_for_turn(i)
        out = engine.generate([prompt], GREEDY)[0]
        engine.close() if hasattr(engine, "_owned") else None
        outs.append(out)
        history = prompt + out.output_ids
    return outs


@pytest.mark.parametrize("method", ["kv", "hidden", "cake", "auto"])
def test_four_turn_conversation_reuses_stored_state(tiny_gqa, tier_spec, method):
    vocab = tiny_gqa.config.vocab_size
    plain = Engine(tiny_gqa, EngineConfig(kv_cache_bytes=32 << 20, enable_prefix_cache=False))
    expected = conversation(lambda i: plain, vocab)
    spec = tier_spec
    tier = spec.split(":")[0].split("+")[0]  # memory, disk or redis (a cluster too)
    # No device prefix cache: whatever is reused must come back from the store tier under test.
    engine = Engine(tiny_gqa, EngineConfig(kv_cache_bytes=32 << 20, enable_prefix_cache=False), store=spec,
                    reuse=ReuseConfig(method=method, chunk_tokens=24),
                    profile=fake_profile(tiny_gqa.fingerprint, compute_scale=50.0))  # loading pays off

    def flushed(i):
        engine.flush(30)  # the previous turn's saves are on the tier before this turn
        return engine

    got = conversation(flushed, vocab)
    engine.close()
    assert [o.output_ids for o in got] == [o.output_ids for o in expected]
    assert got[0].prompt_tokens_reused == 0
    for prev, out in zip(got, got[1:]):
        # Everything before the previous turn's last generated token was computed and saved.
        saved = prev.prompt_tokens + len(prev.output_ids) - 1
        assert out.prompt_tokens_reused >= saved - saved % 24, (out.prompt_tokens_reused, saved)
        assert out.reused_by_tier.get(tier, 0) == out.prompt_tokens_reused
        assert out.prompt_tokens_computed == out.prompt_tokens - out.prompt_tokens_reused
        assert out.restore_method in ("kv", "hidden", "bubblefree", "cake")
    assert engine.stats().counters["restores"] == 3


def test_session_ids_feed_per_session_stats(tiny_gqa):
    """Per-session totals from the outputs (the server's metrics keep them; the engine does not)."""
    engine = Engine(tiny_gqa, EngineConfig(kv_cache_bytes=32 << 20))
    prompt = user_turn(0, tiny_gqa.config.vocab_size) * 2
    stats: dict[str, dict[str, int]] = {}
    for sid in ("a", "a", "b"):
        engine.add_request(prompt, GREEDY, session_id=sid)
        while engine.has_work():
            for out in engine.step():
                if out.finished:
                    st = stats.setdefault(sid, dict(requests=0, prompt_tokens=0, prompt_tokens_reused=0,
                                                    output_tokens=0))
                    st["requests"] += 1
                    st["prompt_tokens"] += out.prompt_tokens
                    st["prompt_tokens_reused"] += out.prompt_tokens_reused
                    st["output_tokens"] += len(out.output_ids)
    a, b = stats["a"], stats["b"]
    assert a["requests"] == 2 and b["requests"] == 1
    assert a["prompt_tokens"] == 2 * len(prompt) and a["output_tokens"] == 2 * GREEDY.max_tokens
    # Content-addressed reuse crosses sessions: b reuses what a computed.
    assert b["prompt_tokens_reused"] == (len(prompt) - 1) // 16 * 16


def test_restart_restores_from_disk(tiny_gqa, tmp_path):
    """A new engine process (here: a new Engine) finds the conversation on disk."""
    vocab = tiny_gqa.config.vocab_size
    spec = f"disk:{tmp_path}/store:1GB"
    prof = fake_profile(tiny_gqa.fingerprint)
    first = Engine(tiny_gqa, EngineConfig(kv_cache_bytes=32 << 20), store=spec, profile=prof,
                   reuse=ReuseConfig(method="kv"))
    prompt = user_turn(0, vocab) * 3
    out = first.generate([prompt], GREEDY)[0]
    first.close()
    second = Engine(tiny_gqa, EngineConfig(kv_cache_bytes=32 << 20), store=spec, profile=prof,
                    reuse=ReuseConfig(method="kv"))
    again = second.generate([prompt + out.output_ids + [7, 8, 9]], GREEDY)[0]
    second.close()
    plain = Engine(tiny_gqa, EngineConfig(kv_cache_bytes=32 << 20)).generate([prompt + out.output_ids + [7, 8, 9]], GREEDY)[0]
    assert again.output_ids == plain.output_ids
    assert again.reused_by_tier.get("disk", 0) >= 64


def test_step_loop_keeps_decoding_while_a_request_restores_from_a_slow_tier(tiny_gqa, tmp_path):
    vocab = tiny_gqa.config.vocab_size
    prof = fake_profile(tiny_gqa.fingerprint)
    slow = f"disk:{tmp_path}/slow:1GB:bw=1MB/s"
    long_ctx = torch.randint(3, vocab, (600,), generator=torch.Generator().manual_seed(5)).tolist()
    engine = Engine(tiny_gqa, EngineConfig(kv_cache_bytes=32 << 20, enable_prefix_cache=False), store=slow,
                    profile=prof, reuse=ReuseConfig(method="kv", lookahead=False))
    engine.generate([long_ctx], SamplingParams(max_tokens=1, temperature=0))
    engine.flush(60)
    # A decodes; B's 600-token prefix (about 600 KB of fp32 KV) trickles in at 1 MB/s.
    a = engine.add_request(list(range(10, 30)), SamplingParams(max_tokens=400, temperature=0, ignore_eos=True))
    engine.step()
    b = engine.add_request(long_ctx + [5, 6], GREEDY)
    a_tokens_while_b_restoring = 0
    saw_restoring = False
    done_b = None
    t0 = time.perf_counter()
    while done_b is None and time.perf_counter() - t0 < 60:
        for out in engine.step():
            breq_restoring = any(r.request_id == b for r in engine.scheduler.restoring)
            saw_restoring |= breq_restoring
            if out.request_id == a and breq_restoring:
                a_tokens_while_b_restoring += 1
            if out.request_id == b and out.finished:
                done_b = out
    engine.abort(a)
    engine.step()
    engine.close()
    assert saw_restoring and a_tokens_while_b_restoring >= 5
    assert done_b is not None and done_b.prompt_tokens_reused >= 576 and done_b.restore_method == "kv"
    plain = Engine(tiny_gqa, EngineConfig(kv_cache_bytes=32 << 20)).generate([long_ctx + [5, 6]], GREEDY)[0]
    assert done_b.output_ids == plain.output_ids


def test_device_cache_hits_leave_no_hole_in_the_store(tiny_gqa, tmp_path):
    """Two conversations share a 40-token system prompt. The second one's first blocks come from
    the device prefix cache, but its first store chunk differs from the first conversation's: the
    engine recomputes those tokens once so the store holds its whole chain."""
    vocab = tiny_gqa.config.vocab_size
    engine = Engine(tiny_gqa, EngineConfig(kv_cache_bytes=32 << 20), store=f"disk:{tmp_path}/s:1GB",
                    profile=fake_profile(tiny_gqa.fingerprint, compute_scale=50.0),
                    reuse=ReuseConfig(method="kv", fill_holes=True))
    system = list(range(3, 43))
    a, b = system + user_turn(1, vocab), system + user_turn(2, vocab)
    engine.generate([a], GREEDY)
    out_b = engine.generate([b], GREEDY)[0]
    engine.flush(30)
    computed = b + out_b.output_ids[:-1]
    assert engine.link.store.lookup(computed).num_tokens == len(computed)
    assert out_b.output_ids == Engine(tiny_gqa, EngineConfig(kv_cache_bytes=32 << 20)).generate([b], GREEDY)[0].output_ids
    # And the device cache is still used when the store already has the prefix.
    again = engine.generate([computed + [9, 9, 9]], GREEDY)[0]
    assert again.prompt_tokens_reused >= len(computed) // 16 * 16
    engine.close()


def test_session_ttl_deletes_what_an_idle_session_saved_but_keeps_shared_chunks(tiny_gqa):
    vocab = tiny_gqa.config.vocab_size
    engine = Engine(tiny_gqa, EngineConfig(kv_cache_bytes=32 << 20, enable_prefix_cache=False), store="memory:64MB",
                    profile=fake_profile(tiny_gqa.fingerprint),
                    reuse=ReuseConfig(method="kv", chunk_tokens=24, session_ttl_s=60.0))
    shared = (user_turn(0, vocab) + user_turn(3, vocab))[:48]  # two whole chunks both sessions start with
    a_prompt, b_prompt = shared + user_turn(1, vocab), shared + user_turn(2, vocab)
    for sid, prompt in (("a", a_prompt), ("b", b_prompt)):
        engine.add_request(prompt, GREEDY, session_id=sid)
        while engine.has_work():
            engine.step()
    state = engine.link.scheduler_side
    engine.flush(30)
    assert state.store.lookup(a_prompt).num_tokens == len(a_prompt) // 24 * 24
    t_a = state.sessions.sessions["a"].last_seen
    state.sessions.sessions["b"].last_seen = t_a + 50  # b was active later than a
    assert state.expire_sessions(now=t_a + 30) == 0  # nobody idle past the TTL yet
    state._next_expiry = 0.0
    removed = state.expire_sessions(now=t_a + 61)  # a idle 61 s > 60: gone; b idle 11 s: kept
    assert removed > 0 and set(state.sessions.sessions) == {"b"}
    assert state.store.lookup(a_prompt).num_tokens == 48  # only the chunks b shares remain
    assert state.store.lookup(b_prompt).num_tokens == len(b_prompt) // 24 * 24
    state._next_expiry = 0.0
    state.expire_sessions(now=t_a + 50 + 61)  # then b expires too: nothing of either is left
    assert state.store.lookup(b_prompt).num_tokens == 0 and engine.stats().counters["sessions_expired"] == 2
    engine.close()


def test_session_ttl_must_be_positive():
    with pytest.raises(ValueError, match="session_ttl_s"):
        ReuseConfig(session_ttl_s=0)
