"""What a first start lacks is measured while the engine has nothing to serve (`engine/idle.py`):
the machine profile replaces the estimate once complete and is saved for the next start, a request
arriving meanwhile is served (between slices) with the answer it would get otherwise, the tiers
are timed on scratch directories beside the store's own, and a close cuts the measurement short
and removes them."""

from __future__ import annotations

import threading
import time

import pytest

from kvtier.engine.background import BackgroundEngine
from kvtier.engine.calibrate import hardware
from kvtier.engine.config import EngineConfig
from kvtier.engine.engine import Engine, RequestOutput
from kvtier.engine.request import SamplingParams
from kvtier.models import invariant


@pytest.fixture(autouse=True)
def few_points(monkeypatch):
    """Short prefill steps to time: what is tested is how the measurement runs, not its fit. The
    linears' pending row plans are the process's (`invariant`): those of the larger models earlier
    tests in this worker loaded would be checked first, minutes of idle slices before the profile."""
    monkeypatch.setattr(hardware, "COMPUTE_POINTS", ((0, 64), (0, 256), (256, 320), (64, 128)))
    monkeypatch.setattr(invariant, "_pending", {})


def _engine(model, tmp_path, measure: bool) -> Engine:
    return Engine(model, EngineConfig(max_model_len=512, kv_cache_bytes=1 << 24, measure_when_idle=measure),
                  store=f"memory:16MB,disk:{tmp_path / 'store'}:64MB")


def _wait(cond, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline
        time.sleep(0.01)


def _ask(bg: BackgroundEngine, prompt: list[int]) -> RequestOutput:
    done = threading.Event()
    out: list[RequestOutput] = []

    def seen(o: RequestOutput) -> None:
        if o.finished:
            out.append(o)
            done.set()

    bg.submit(prompt, SamplingParams(max_tokens=6, temperature=0.0), seen)
    assert done.wait(120)
    return out[0]


def test_the_profile_is_measured_while_idle_adopted_and_saved(tiny_gqa, tmp_path, monkeypatch):
    monkeypatch.setenv("KVTIER_HOME", str(tmp_path))
    prompt = list(range(5, 60))
    with _engine(tiny_gqa, tmp_path / "plain", measure=False) as plain:
        expected = plain.generate([prompt], SamplingParams(max_tokens=6, temperature=0.0))[0].output_ids
    engine = _engine(tiny_gqa, tmp_path, measure=True)
    assert engine.profile_source == "estimate"
    estimate = engine.link.planner.profile
    bg = BackgroundEngine(engine, idle_after_s=0.0)
    try:
        _wait(lambda: engine.idle.running is not None)
        assert _ask(bg, prompt).output_ids == expected  # served between slices, the same tokens
        _wait(lambda: engine.profile_source == "measured")
        assert engine.idle.running is None
        measured = engine.link.planner.profile
        assert measured is not estimate and measured.points  # timed steps, not the estimate
        assert hardware.load_profile(tiny_gqa, tmp_path) == measured  # the next start takes it
        assert all(link.rates == measured.rates(name) for name, link in engine.link.planner.links.items())
        # The scratch tiers sat beside the store's directory and are gone; the store's own holds its state only.
        assert not list(tmp_path.glob(".kvtier-profile-*"))
        assert _ask(bg, prompt).output_ids == expected
    finally:
        bg.close()
        engine.close()


def test_a_close_cuts_the_measurement_short_and_removes_its_scratch(tiny_gqa, tmp_path, monkeypatch):
    monkeypatch.setenv("KVTIER_HOME", str(tmp_path))
    reached = threading.Event()

    def endless_tiers(*a, **k):
        reached.set()
        while True:  # a slice at a time until the engine closes it
            time.sleep(0.01)
            yield

    monkeypatch.setattr(hardware, "tier_slices", endless_tiers)
    engine = _engine(tiny_gqa, tmp_path, measure=True)
    bg = BackgroundEngine(engine, idle_after_s=0.0)
    try:
        assert reached.wait(120)  # the compute is measured; the scratch tiers exist now
        assert list(tmp_path.glob(".kvtier-profile-*"))
    finally:
        bg.close()
        engine.close()
    assert not list(tmp_path.glob(".kvtier-profile-*"))
    assert engine.profile_source == "estimate" and hardware.load_profile(tiny_gqa, tmp_path) is None


@pytest.mark.parametrize("measure", [False, True])
def test_nothing_is_measured_unless_turned_on_or_where_a_profile_is_saved(tiny_gqa, tmp_path, monkeypatch, measure):
    monkeypatch.setenv("KVTIER_HOME", str(tmp_path))
    if measure:  # a saved profile: nothing to measure
        hardware.save_profile(hardware.estimate(tiny_gqa), hardware.profile_path(tmp_path, tiny_gqa))
    engine = _engine(tiny_gqa, tmp_path, measure=measure)
    try:
        assert engine.idle_slice() is False
        assert engine.profile_source == ("saved" if measure else "estimate")
    finally:
        engine.close()


def test_measuring_waits_for_a_quiet_moment(tiny_gqa, tmp_path, monkeypatch):
    """Requests keep the engine from measuring; it starts only `idle_after_s` after the last one."""
    monkeypatch.setenv("KVTIER_HOME", str(tmp_path))
    engine = _engine(tiny_gqa, tmp_path, measure=True)
    bg = BackgroundEngine(engine, idle_after_s=1.0)
    try:
        for _ in range(3):
            _ask(bg, list(range(5, 40)))
            assert engine.idle.running is None and engine.profile_source == "estimate"
        done_at = time.monotonic()
        _wait(lambda: engine.idle.running is not None)
        # (the engine's idle clock starts before the last step ends: a bound below idle_after_s)
        assert time.monotonic() - done_at >= 0.5
    finally:
        bg.close()
        engine.close()
