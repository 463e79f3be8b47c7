"""`kvtier bench impress --pool`: haystacks runs on other seeds summed item by item, per slice, with
the goals judged on the sums; runs that differ in more than the seed, or repeat a seed, refused."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvtier.bench.impress.goals import default_kind
from kvtier.bench.impress.pooled import PoolError, pool
from kvtier.bench.stats import wilson

KIND = default_kind()
ARGS = dict(model="smollm2-135m", dtype="bf16", n_haystacks=4, haystacks=None, forms="code,name",
            fact_counts="1,2", haystack_lengths="1024", ratios="0.25,0.5", windows="17", variants="")


def _row(variant: str, by_slice: dict[str, tuple[int, int]], kl: float, lost: int = 0) -> dict:
    n = sum(n for s, (n, _) in by_slice.items() if s.startswith("form="))
    correct = sum(k for s, (_, k) in by_slice.items() if s.startswith("form="))
    return dict(task="haystacks", variant=variant, n=n, correct=correct, accuracy=correct / n, lost=lost,
                by_slice={s: dict(n=sn, correct=k, accuracy=k / sn) for s, (sn, k) in by_slice.items()},
                kl_mean=kl, bytes_vs_full=1.0 if variant == "full" else 0.42, layers_passed=1.0, identify_share=0.1)


def _run(seed: int, full: dict, quarter: dict, half: dict, kl: float, **args) -> dict:
    rows = [_row("full", full, 0.0), _row(f"{KIND}@0.25", quarter, kl, lost=1), _row(f"{KIND}@0.5", half, kl / 4)]
    return dict(mode="accuracy", model="smollm2-135m", dtype="bf16", machine={"cpu_model": f"cpu{seed}"},
                args=ARGS | dict(seed=seed) | args, rows=rows)


A = _run(0, {"form=code": (2, 2), "form=name": (2, 1)}, {"form=code": (2, 1), "form=name": (2, 1)},
         {"form=code": (2, 2), "form=name": (2, 1)}, kl=0.02)
B = _run(2, {"form=code": (2, 1), "form=name": (2, 2)}, {"form=code": (2, 1), "form=name": (2, 2)},
         {"form=code": (2, 1), "form=name": (2, 2)}, kl=0.04)
C = _run(3, {"form=code": (4, 4), "form=name": (4, 0)}, {"form=code": (4, 4), "form=name": (4, 0)},
         {"form=code": (4, 4), "form=name": (4, 0)}, kl=0.01, n_haystacks=8)


def test_rows_sum_their_items_overall_and_per_slice():
    doc = pool([A, B], ["a.json", "b.json"])
    assert doc["seeds"] == [0, 2] and doc["runs"] == ["a.json", "b.json"]
    assert [m["cpu_model"] for m in doc["machines"]] == ["cpu0", "cpu2"]
    full, quarter = doc["rows"][0], doc["rows"][1]
    assert (full["variant"], full["n"], full["correct"]) == ("full", 8, 6)
    assert (quarter["n"], quarter["correct"], quarter["lost"]) == (8, 5, 2)
    assert quarter["by_slice"]["form=code"] == dict(n=4, correct=2, accuracy=0.5, ci95=list(wilson(2, 4)))
    assert quarter["by_slice"]["form=name"]["correct"] == 3 and full["by_slice"]["form=name"]["correct"] == 3
    assert quarter["ci95"] == list(wilson(5, 8))
    assert quarter["kl_mean"] == pytest.approx(0.03)  # each run's mean weighed by its items (4 and 4)


def test_the_goals_are_judged_on_the_pool():
    """Alone, run A's code slice is 50 points down at 0.25; pooled with B it is 25 points down."""
    goals = {g["goal"]: g for g in pool([A, B], ["a", "b"])["goals"]}
    quarter = next(g for name, g in goals.items() if "every slice" in name and "0.25" in name)
    half = next(g for name, g in goals.items() if "every slice" in name and "ratio 0.5" in name)
    assert (quarter["slice"], quarter["value"], quarter["met"]) == ("form=code", 25.0, False)
    assert (half["value"], half["met"]) == (0.0, True)


@pytest.mark.parametrize("runs, message", [
    ([A], "at least two runs"),
    ([A, A], "seed 0 is already in the pool"),
    ([A, C], "--n-haystacks 8 differs"),
    ([A, dict(B, mode="ttft")], "not a --mode accuracy run"),
    ([A, dict(B, rows=[r for r in B["rows"] if r["variant"] != "full"])], "rows"),
    ([A, dict(B, rows=[dict(r, task="retrieval") for r in B["rows"]])], "no haystacks rows"),
])
def test_runs_that_do_not_pool_are_refused_with_the_reason(runs, message):
    with pytest.raises(PoolError, match=message):
        pool(runs, [f"r{i}.json" for i in range(len(runs))])


def test_the_cli_pools_files_and_refuses_bad_ones(tmp_path):
    a, b, out = tmp_path / "a.json", tmp_path / "b.json", tmp_path / "pooled.json"
    a.write_text(json.dumps(A))
    b.write_text(json.dumps(B))
    cmd = [sys.executable, "-m", "kvtier", "bench", "impress", "--pool"]
    done = subprocess.run(cmd + [f"{a},{b}", "--json", str(out)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "pooled seeds [0, 2]" in done.stdout and "| form=code |" in done.stdout
    assert json.loads(out.read_text())["rows"][1]["correct"] == 5
    for bad, message in (([f"{a},{a}"], "already in the pool"), ([f"{a},{tmp_path / 'missing.json'}"], "missing.json"),
                         ([f"{a},{b}", "--replot", str(a)], "give one")):
        done = subprocess.run(cmd + bad, capture_output=True, text=True, timeout=120)
        assert done.returncode != 0 and message in done.stderr, done.stderr
