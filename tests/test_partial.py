"""Partial token-wise caching (eLLM) is exact: a decode whose first tokens are not in the pool
(recomputed in the step, or read back from the swap space from any layer on) gives the logits and
greedy tokens of full caching; front rows never enter the pool."""

from __future__ import annotations

import pytest
import torch

from kvtier.engine.config import EngineConfig, PartialConfig
from kvtier.engine.engine import Engine
from kvtier.engine.request import Request, SamplingParams
from kvtier.engine.runner.model_runner import ContextFeed, ModelRunner, RunItem
from kvtier.planning.optimizer import ProfileCostModel

BS = 16
# A cost model under which reading fronts back always wins (boundary 0) unless pinned.
COST = ProfileCostModel(c0=1e-3, c1=1e-4, g=1e-6, a=1e-4, q=0.0, w=1e-6)


def _prompts(vocab: int, lengths: list[int], seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(10, vocab, (n,), generator=g).tolist() for n in lengths]


@pytest.mark.parametrize("model_name", ["tiny_mha", "tiny_gqa", "smollm2_fp32"])
def test_runner_front_logits_match_full_caching(model_name, request):
    """One decode step of three sequences, one of them fully cached, the others with fronts of
    1 and 5 blocks: recomputed (boundary L), read back from layer 0, and mixed (boundary L/2).
    The released front slots hold NaN: a read of them would poison the logits."""
    lm = request.getfixturevalue(model_name)
    layers = lm.config.num_layers
    lengths = [40, 57, 100]
    per = 8
    runner = ModelRunner(lm.module, 3 * per, BS, 256)
    seqs = _prompts(lm.config.vocab_size, [n + 1 for n in lengths])
    blocks = [list(range(i * per, (i + 1) * per)) for i in range(3)]
    for ids, bl, n in zip(seqs, blocks, lengths):
        runner.execute([RunItem(ids[:n], 0, bl, want_logits=False)])
    full = runner.execute([RunItem([ids[n]], n, bl, want_logits=True) for ids, bl, n in zip(seqs, blocks, lengths)])
    fronts = [0, 16, 80]
    kept_k, kept_v = runner.k_cache.clone(), runner.v_cache.clone()
    front_slots = torch.cat([runner.slots(bl, 0, u) for bl, u in zip(blocks, fronts) if u])
    for boundary in (layers, 0, layers // 2):
        runner.k_cache.copy_(kept_k)
        runner.v_cache.copy_(kept_v)
        # the fronts' true K/V, as the swap space would hold them, then NaN where they were
        feed_k, feed_v = kept_k[:, front_slots].clone(), kept_v[:, front_slots].clone()
        runner.k_cache[:, front_slots] = float("nan")
        runner.v_cache[:, front_slots] = float("nan")
        dec = [RunItem([ids[n]], n, bl[u // BS:], want_logits=True, unslotted=u, context_feed=u)
               for ids, bl, n, u in zip(seqs, blocks, lengths, fronts)]
        runs = [RunItem(ids[:u], 0, (), want_logits=False, feeds=i)
                for i, (ids, u) in enumerate(zip(seqs, fronts)) if u] if boundary else []
        feed = ContextFeed(boundary, lambda li: (feed_k[li], feed_v[li])) if boundary < layers else None
        got = runner.execute(dec + runs, feed=feed)
        assert torch.isfinite(got).all()
        assert (got - full).abs().max().item() <= 1e-4, boundary
        # front rows were not written: their slots still hold NaN in every layer
        assert torch.isnan(runner.k_cache[:, front_slots]).all() and torch.isnan(runner.v_cache[:, front_slots]).all()


def test_front_runs_must_come_last(tiny_gqa):
    runner = ModelRunner(tiny_gqa.module, 4, BS, 64)
    with pytest.raises(ValueError, match="feeding runs"):
        runner.prepare([RunItem([1] * 16, 0, (), want_logits=False, feeds=1),
                        RunItem([5], 20, [0, 1], True, unslotted=16, context_feed=16)])


def _generate(lm, prompts, partial: PartialConfig | None, max_tokens: int = 32):
    cfg = EngineConfig(kv_cache_bytes=ModelRunner.bytes_per_block(lm.module, BS) * 64, max_model_len=256,
                       partial=partial)
    with Engine(lm, cfg) as eng:
        outs = eng.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
        return [o.output_ids for o in outs], eng


# Every ratio on the tiny models; the real model (seconds a case) at the two extremes.
@pytest.mark.parametrize(("model_name", "ratio"), [
    (m, r) for m in ("tiny_mha", "tiny_gqa", "smollm2_fp32") for r in (0.1, 0.5, 0.9)
    if not (m == "smollm2_fp32" and r == 0.5)
])
def test_engine_partial_caching_generates_the_same_tokens(model_name, ratio, request):
    """fp32, 32 greedy tokens of three prompts (8 on the real model, whose every step recomputes
    the fronts of 30 layers: CI's time): fronts of `ratio` of each request's length (growing as it
    decodes), recomputed every step, equal full caching's tokens."""
    lm = request.getfixturevalue(model_name)
    prompts = _prompts(lm.config.vocab_size, [170, 33, 220], seed=1)
    n = 8 if model_name == "smollm2_fp32" else 32
    want, _ = _generate(lm, prompts, None, n)
    got, eng = _generate(lm, prompts, PartialConfig(policy="fixed", ratio=ratio, cost=COST), n)
    assert got == want
    st = eng.partial.stats
    assert st.front_steps > 0 and st.recomputed_tokens > 0 and st.swapped_tokens == 0


@pytest.mark.parametrize("layers", [0, 1, None])
def test_engine_fronts_read_back_from_swap_space(tiny_gqa, layers):
    """Fronts swapped out to host memory as they grow, read back from layer `layers` on (None:
    chosen by the cost model, which prefers reading here): the same tokens as full caching."""
    prompts = _prompts(tiny_gqa.config.vocab_size, [70, 33, 120], seed=2)
    want, _ = _generate(tiny_gqa, prompts, None)
    cfg = PartialConfig(policy="fixed", ratio=0.5, cost=COST, swap_bytes=64 << 20, recompute_layers=layers)
    got, eng = _generate(tiny_gqa, prompts, cfg)
    assert got == want
    st = eng.partial.stats
    assert st.swapped_tokens > 0
    assert (st.recomputed_tokens > 0) == (layers == 1)
    assert eng.partial.swap is not None and eng.partial.swap.used == 0  # every request finished: swap space empty


def test_pool_holds_only_the_cached_tail(tiny_gqa):
    """Blocks held = ceil((s - u) / 16): a request's front blocks go back to the pool."""
    prompts = _prompts(tiny_gqa.config.vocab_size, [100], seed=3)
    cfg = EngineConfig(kv_cache_bytes=ModelRunner.bytes_per_block(tiny_gqa.module, BS) * 64, max_model_len=256,
                       partial=PartialConfig(policy="fixed", ratio=0.5, cost=COST), enable_prefix_cache=False)
    with Engine(tiny_gqa, cfg) as eng:
        eng.add_request(prompts[0], SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))
        seen = []
        while eng.has_work():
            eng.step()
            for req in eng.scheduler.running:
                if req.fed:
                    seen.append((req.fed, len(req.block_ids), req.num_computed))
                    assert len(req.block_ids) == -(-(req.num_computed - req.fed) // BS)
                    assert eng.pool.num_free == eng.pool.num_blocks - len(req.block_ids)
        assert seen and max(f for f, _, _ in seen) >= 48


def test_cli_options_build_the_config():
    import argparse

    from kvtier.cli.engine_args import EngineOptions, add_engine_arguments

    p = argparse.ArgumentParser()
    add_engine_arguments(p)

    def partial_from_args(args):
        return EngineOptions.from_args(args).partial()

    assert partial_from_args(p.parse_args([])) is None
    cfg = partial_from_args(p.parse_args(["--tpot-slo-ms", "60", "--front-swap-gb", "0.5"]))
    assert cfg == PartialConfig(policy="optimizer", tpot_slo_s=0.06, swap_bytes=1 << 29)
    cfg = partial_from_args(p.parse_args(["--partial-caching", "fixed", "--uncached-ratio", "0.4"]))
    assert cfg is not None and (cfg.policy, cfg.ratio, cfg.tpot_slo_s) == ("fixed", 0.4, None)
    with pytest.raises(ValueError, match="drop --partial-caching off"):
        partial_from_args(p.parse_args(["--partial-caching", "off", "--tpot-slo-ms", "60"]))
    with pytest.raises(ValueError, match="uncached ratio"):
        partial_from_args(p.parse_args(["--partial-caching", "fixed", "--uncached-ratio", "1.5"]))
    with pytest.raises(ValueError, match="slo_headroom"):
        PartialConfig(tpot_slo_s=0.05, slo_headroom=0.0)


def test_optimizer_with_a_calibrated_cost_model_is_exact(tiny_gqa, tmp_path, monkeypatch):
    """No cost model given: the factory measures this machine once (cached under KVTIER_HOME) and the
    optimiser, under a budget too small for all three requests in full, still generates full
    caching's tokens."""
    from kvtier.engine.calibrate import fronts as partial_profile

    monkeypatch.setenv("KVTIER_HOME", str(tmp_path))
    monkeypatch.setattr(partial_profile, "GRID", ((1, 128, 0, "recompute"), (4, 128, 0, "recompute"),
                                                  (4, 128, 64, "recompute"), (1, 256, 128, "recompute"),
                                                  (4, 256, 128, "swap")))
    prompts = _prompts(tiny_gqa.config.vocab_size, [170, 150, 220], seed=5)
    want, _ = _generate(tiny_gqa, prompts, None)
    cfg = EngineConfig(kv_cache_bytes=ModelRunner.bytes_per_block(tiny_gqa.module, BS) * 24, max_model_len=256,
                       partial=PartialConfig(policy="optimizer"))
    from kvtier.engine.factory import make_engine

    with make_engine(tiny_gqa, cfg) as eng:  # the factory measures; Engine(...) itself never does
        got = [o.output_ids for o in eng.generate(prompts, SamplingParams(max_tokens=32, temperature=0,
                                                                           ignore_eos=True))]
        summary = eng.stats().partial
    assert got == want
    assert list((tmp_path / "partial").glob("*.json"))
    assert summary is not None and summary["solves"] > 0 and summary["front_steps"] > 0


def test_the_optimiser_prices_fronts_by_where_they_come_from(tiny_gqa):
    """Without a swap space a front can only be recomputed (no read price); an emulated slow swap
    space adds bytes / bandwidth per front token to the read price."""
    from kvtier.engine.partial import PartialCaching

    runner = ModelRunner(tiny_gqa.module, 8, BS, 128)
    assert PartialCaching(PartialConfig(cost=COST), runner, COST).cost.w is None
    assert PartialCaching(PartialConfig(cost=COST, swap_bytes=1 << 20), runner, COST).cost.w == COST.w
    slow = PartialCaching(PartialConfig(cost=COST, swap_bytes=1 << 20, swap_bandwidth=1e8), runner, COST)
    per_token = 2 * tiny_gqa.config.num_layers * tiny_gqa.config.num_kv_heads * tiny_gqa.config.head_dim * 4
    assert slow.cost.w == pytest.approx(COST.w + per_token / 1e8)


def test_the_optimiser_plans_against_the_steps_it_observes(tiny_gqa):
    """The SLO is on the time per output token the requests see: the whole engine step. A step
    slower than the model moves the planning model's per-step term by a moving average of the
    excess; steps without a decode leave it alone. When no b meets the SLO any more, nobody new
    is admitted and the running decodes go on."""
    from kvtier.engine.partial import RESIDUAL_WEIGHT, PartialCaching

    runner = ModelRunner(tiny_gqa.module, 8, BS, 128)
    params = SamplingParams(max_tokens=8)

    def req(rid: str, n: int) -> Request:
        return Request(rid, list(range(n)), params, num_computed=n - 1)

    decoding = [req("a", 40), req("b", 60)]
    waiting = [req(f"w{i}", 50) for i in range(4)]
    items = [RunItem([r.prompt_ids[-1]], r.num_tokens - 1, (), want_logits=True) for r in decoding]
    # SLO 1.5 ms: the model (1 ms + 0.1 ms per sequence + 1 us per context token) meets it with 3;
    # planned to 90% of it (the default headroom), with 2
    assert PartialCaching(PartialConfig(tpot_slo_s=1.5e-3, cost=COST), runner, COST).plan(
        decoding, waiting, capacity_blocks=64).cap == 2
    pc = PartialCaching(PartialConfig(tpot_slo_s=1.5e-3, slo_headroom=1.0, cost=COST), runner, COST)
    assert pc.plan(decoding, waiting, capacity_blocks=64).cap == 3

    predicted = COST.base_s([40, 60])
    pc.step_fronts(items, decoding)
    pc.observe(predicted + 0.2)
    assert pc.stats.step_residual_s == pytest.approx(RESIDUAL_WEIGHT * 0.2)
    assert pc.planning_cost().c0 == pytest.approx(COST.c0 + RESIDUAL_WEIGHT * 0.2)
    pc.observe(5.0)  # no step prepared: nothing to account
    prefill = [RunItem(list(range(50)), 0, (), want_logits=True)]
    pc.step_fronts(prefill, waiting[:1])
    pc.observe(5.0)  # a prefill-only step is not a decode step
    assert pc.stats.step_residual_s == pytest.approx(RESIDUAL_WEIGHT * 0.2)
    assert pc.stats.steps == 1 and pc.stats.slo_misses == 1

    plan = pc.plan(decoding, waiting, capacity_blocks=64)  # 10 ms over: no b meets 1.5 ms
    assert plan.cap == 2 and plan.fed == {"a": 0, "b": 0}
    assert pc.plan([], waiting, capacity_blocks=64).cap == 1
    # An SLO only the first running decode meets: the second is kept, not preempted.
    tight = PartialCaching(PartialConfig(tpot_slo_s=1.15e-3, slo_headroom=1.0, cost=COST), runner, COST)
    assert tight.plan(decoding, waiting, capacity_blocks=64).cap == 2
    # Memory still preempts: two sequences of 40 and 60 tokens need more than 3 blocks with fronts.
    assert tight.plan(decoding, waiting, capacity_blocks=3).cap == 1

    for _ in range(200):  # faster than the model: the residual turns negative, c0 never below 0
        pc.step_fronts(items, decoding)
        pc.observe(0.0)
    assert pc.stats.step_residual_s == pytest.approx(-predicted, rel=1e-3)
    assert pc.planning_cost().c0 == 0.0
