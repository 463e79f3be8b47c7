"""Whether the disk tier may use io_uring is tried in a child process first (kvtier/store/tiers/uring.py):
the binding's wheel carries AVX-512 instructions, and on a CPU without them making a ring killed the
whole process with SIGILL (found on an AMD EPYC, Zen 3). A child that dies or fails means threads,
never a ring in this process."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvtier.store.policy import make_policy
from kvtier.store.tiers import disk, uring


def test_a_child_killed_by_an_instruction_it_lacks_means_no_ring():
    why = uring.probe([sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGILL)"])
    assert why is not None and "SIGILL" in why and "instructions this CPU lacks" in why
    why = uring.probe([sys.executable, "-c", "raise SystemExit('no io_uring in this kernel')"])
    assert why is not None and "no io_uring in this kernel" in why
    assert uring.probe([sys.executable, "-c", "pass"]) is None


def test_a_failed_probe_keeps_the_disk_tier_on_threads_without_making_a_ring(monkeypatch, tmp_path):
    monkeypatch.delenv("KVTIER_IO_URING", raising=False)
    monkeypatch.setattr(uring, "probe", lambda: "the self-test was killed by SIGILL")

    made: list[int] = []  # recorded, not raised: available() turns a failing ring into a fallback

    def no_ring(*a, **k):
        made.append(1)
        raise AssertionError("a ring was made in this process after the child failed")

    monkeypatch.setattr(uring.Ring, "__init__", no_ring)
    uring.available.cache_clear()
    try:
        assert uring.available() is False
        tier = disk.DiskTier([str(tmp_path)], [1 << 20], None, lambda: make_policy("lru"))
        try:
            assert tier.usage()["io_uring"] is False
        finally:
            tier.close()
        assert not made
    finally:
        uring.available.cache_clear()


def test_the_probe_passes_where_a_ring_works():
    """Where the binding can make a ring at all (a CPU it was built for, a kernel with io_uring), the
    full self-test passes too, so the disk tier keeps its rings there."""
    plain = subprocess.run([sys.executable, "-c", "from kvtier.store.tiers.uring import Ring; Ring(2).close()"],
                           capture_output=True, timeout=60)
    if plain.returncode != 0:
        pytest.skip(f"the liburing binding cannot make a ring here (exit {plain.returncode})")
    assert uring.probe() is None
