"""The planner's importance-only restore: its cost model, what it learns, and `auto` choosing it only
where the caller allows lossy restores and it predicts faster; exact when it does not."""
from __future__ import annotations

import dataclasses

import pytest

from kvtier.engine.config import ImpressConfig, ReuseConfig
from kvtier.engine.engine import Engine
from kvtier.engine.request import SamplingParams
from kvtier.planning.costs import HardwareProfile, ModelShape, TierLink, TierRates
from kvtier.planning.plan import Method, PlannedChunk
from kvtier.planning.planner import ImportanceReads, Planner
from kvtier.store.layout import Repr

from kvtier_testlib import fake_profile

LAYERS, KV_HEADS, HEAD_DIM = 30, 3, 64  # SmolLM2-shaped, bf16
SHAPE = ModelShape(LAYERS, 2 * KV_HEADS * HEAD_DIM * 2, 9 * HEAD_DIM * 2)


def _chunks(hist: int) -> list[PlannedChunk]:
    return [PlannedChunk(f"k{a}", a, a + 64, "disk", 0) for a in range(0, hist, 64)]


def _planner(bps: float | None, unit: int = 16) -> Planner:
    prof = fake_profile("fp", compute_scale=1.0, io_bps=2e9)
    reads = ImportanceReads.initial(0.25, 1, KV_HEADS, 16, unit)
    return Planner(prof, SHAPE, {"disk": TierLink(prof.tiers["disk"], bps)}, importance=reads)


def test_initial_read_shares():
    tokens = ImportanceReads.initial(0.25, 1, 3, 16, 1)
    assert tokens.probe_share == pytest.approx(1 / 6)
    assert tokens.granule_share == pytest.approx(1 - 0.75 ** 16)  # scattered tokens touch nearly every granule
    assert ImportanceReads.initial(0.25, 3, 16, 16, 16).granule_share == 0.25  # whole granules: the ratio
    assert ImportanceReads.initial(0.25, 3, 16, 16, 16).probe_share == pytest.approx(3 / 32)


def test_the_predicted_bytes_follow_the_probe_granule_and_pass_shares():
    chunks = _chunks(8192)
    full = 8192 * LAYERS * SHAPE.kv_bytes_per_token_layer
    for passed in (1.0, 0.0):
        planner = _planner(20e6)  # slow enough that the bytes bound it
        assert planner.importance is not None
        planner.importance.pass_rate = passed
        _, ideal, _, _, _ = planner.predict(Method.IMPRESS, chunks, 64, ())
        # Every layer's probe keys (1/6 of K/V); then K and V of every head for the kept quarter where
        # the probes agree, else all of K and the kept quarter of V.
        share = 1 / 6 + (0.25 if passed else 0.5 + 0.5 * 0.25)
        assert ideal == pytest.approx(full * share / planner._bandwidth(chunks), rel=1e-9)


def test_learning_from_restores_moves_the_prediction():
    planner, chunks = _planner(100e6, unit=1), _chunks(8192)
    assert planner.importance is not None
    start = 1 - 0.75 ** 16
    assert (planner.importance.granule_share, planner.importance.pass_rate) == (pytest.approx(start), 0.8)
    before = planner.predict(Method.IMPRESS, chunks, 64, ())[0]
    planner.observe_importance(0.5, 1.0)  # reordered chunks, every layer agreed
    assert planner.importance.granule_share == pytest.approx(start + 0.3 * (0.5 - start))
    assert planner.importance.pass_rate == pytest.approx(0.8 + 0.3 * 0.2)
    assert planner.predict(Method.IMPRESS, chunks, 64, ())[0] < before  # less to read
    planner.observe_importance(1.5, 0.5)  # not a share: ignored
    assert planner.importance.granule_share < 1


# `kvtier profile` of SmolLM2-135M bf16 on the 2-core machine docs/benchmarks.md's importance
# tables were measured on (2026-11-24).
SMOLLM2 = HardwareProfile(
    "smollm2", "bfloat16", 2, prefill_a=4.386e-4, prefill_b=2.101e-7, project_s=8.808e-7, place_s=7.729e-8,
    tiers={"disk": TierRates(8.524e8, 1.706e9, 7.814e-5, overlap=0.382)}, prefill_g=1.295e-5, prefill_c=7.766e-4)

# The fastest method each cell measured (8128-token history + 64 new, medians of 3; docs/benchmarks.md).
MEASURED_FASTEST = {(None, 1): Method.KV, (500e6, 1): Method.KV, (100e6, 1): Method.KV, (20e6, 1): Method.CAKE,
                    (None, 16): Method.KV, (500e6, 16): Method.KV, (100e6, 16): Method.IMPRESS, (20e6, 16): Method.IMPRESS}


@pytest.mark.parametrize("bps, unit", list(MEASURED_FASTEST))
def test_auto_with_lossy_allowed_chooses_what_measured_fastest(bps, unit):
    # 97% of layers passed the threshold in the needle runs (docs/benchmarks.md).
    reads = ImportanceReads.initial(0.25, 1, KV_HEADS, 16, unit, pass_rate=0.97)
    planner = Planner(SMOLLM2, SHAPE, {"disk": TierLink(SMOLLM2.tiers["disk"], bps)}, importance=reads)
    kv = (Repr.KV,) * LAYERS
    chunks = [PlannedChunk(f"k{a}", a, a + 64, "disk", 0) for a in range(0, 8128, 64)]
    assert planner.choose(chunks, 64, {Method.KV: kv, Method.CAKE: kv, Method.IMPRESS: kv}).method \
        is MEASURED_FASTEST[(bps, unit)]
    assert planner.choose(chunks, 64, {Method.KV: kv, Method.CAKE: kv}).method is not Method.IMPRESS  # unless allowed


def test_allow_lossy_needs_auto():
    with pytest.raises(ValueError, match="auto"):
        ReuseConfig(method="kv", allow_lossy=True)


@pytest.fixture(scope="module")
def model():
    from kvtier.models.loading import load_model

    return load_model("tiny-gqa", dtype="fp32", tokenizer=False)


def test_auto_with_lossy_allowed_restores_exactly_where_exact_is_faster(model, tmp_path, monkeypatch):
    import torch

    from kvtier.engine.calibrate.probes import ProbeCalibration
    from kvtier.engine.link import store_link as statelink

    # Random weights: probe heads rarely agree, so importance restores would read most keys and auto
    # would (rightly) not choose them; here the probes are taken to always agree.
    monkeypatch.setattr(statelink, "cached_calibration", lambda model, probes: ProbeCalibration((), 1.0))

    ids = torch.randint(3, model.config.vocab_size, (268,), generator=torch.Generator().manual_seed(5)).tolist()
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    with Engine(model) as plain:
        want = plain.generate([ids], greedy)[0].output_ids
    prof = fake_profile(model.fingerprint, compute_scale=500.0)  # recompute far off
    # A read call costs 5 ms: importance restores make one per chunk and layer, so unthrottled kv
    # wins; at 0.2 MB/s the bytes decide and whole granules read 0.375x of them.
    prof.tiers["disk"] = dataclasses.replace(prof.tiers["disk"], read_latency_s=5e-3)
    reuse = ReuseConfig(allow_lossy=True, impress=ImpressConfig(ratio=0.25, unit="granule"))
    spec = f"disk:{tmp_path}/d:256MB"
    with Engine(model, store=spec, reuse=reuse, profile=prof) as first:
        first.generate([ids[:256]], SamplingParams(max_tokens=1, temperature=0.0))
        assert first.flush(30)
    with Engine(model, store=spec, reuse=reuse, profile=prof) as engine:
        out = engine.generate([ids], greedy)[0]
    assert out.restore is not None and out.restore.method in ("kv", "cake")
    assert out.output_ids == want  # exact methods read the importance layout exactly
    slow = f"disk:{tmp_path}/d:256MB:bw=0.2MB/s"
    with Engine(model, store=slow, reuse=reuse, profile=prof) as engine:
        out = engine.generate([ids], greedy)[0]
    assert out.restore is not None and out.restore.method == "impress"
    assert out.restore.prefix_attended == 64 and out.restore.predicted_s > 0


@pytest.mark.parametrize("selection, passes", [("impress", 0.25), ("probes", 1.0), ("h2o", 0.0)])
def test_the_planner_expects_every_key_read_where_the_selection_reads_it(model, tmp_path, monkeypatch, selection,
                                                                          passes):
    """The share of layers planned to read only the probe keys and the kept tokens: the calibrated
    pass rate under the paper's threshold, every layer without it, none with H2O."""
    from kvtier.engine.calibrate.probes import ProbeCalibration
    from kvtier.engine.link import store_link as statelink

    monkeypatch.setattr(statelink, "cached_calibration", lambda model, probes: ProbeCalibration((), 0.25))
    reuse = ReuseConfig(method="impress", impress=ImpressConfig(selection=selection))
    with Engine(model, store=f"disk:{tmp_path}/d:64MB", reuse=reuse) as engine:
        assert engine.link.scheduler_side.planner.importance.pass_rate == passes


@pytest.mark.parametrize("lossy_s, chosen", [(0.84, Method.IMPRESS), (0.86, Method.KV)])
def test_a_lossy_plan_must_be_predicted_15_percent_faster(monkeypatch, lossy_s, chosen):
    planner, chunks = _planner(None), _chunks(1024)
    times = {Method.RECOMPUTE: 9.0, Method.KV: 1.0, Method.CAKE: 2.0, Method.IMPRESS: lossy_s}
    real = planner.plan
    monkeypatch.setattr(planner, "plan", lambda m, *a, **k: dataclasses.replace(real(m, *a, **k), predicted_s=times[m]))
    allowed = {Method.KV: (), Method.CAKE: (), Method.IMPRESS: ()}
    assert planner.choose(chunks, 64, allowed).method is chosen
