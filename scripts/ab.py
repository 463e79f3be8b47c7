"""One command run in two git revisions, in alternating rounds: the A/B harness.

Each revision is checked out into a temporary worktree (`git worktree add --detach`; `.` is this
checkout as it stands, uncommitted edits included), and the command runs with its cwd and
PYTHONPATH set to that tree, so each side imports its own kvtier (with this venv's packages). Round
i runs A then B, round i+1 B then A, so that a machine's drift falls on both. What is compared is
the command's wall time, or with --metric REGEX the number its first group matches in the output
(the last match). Prints each side's median and quartiles, and the median of the per-round ratios
B/A with a distribution-free interval (order statistics of the paired ratios, about 95%).

    python scripts/ab.py BEFORE AFTER [--rounds 6] [--metric REGEX] [--json F.json] -- python -m kvtier bench ...

A leading `python` in the command is this interpreter. A round whose command fails stops the run.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def checkout(rev: str, parent: Path) -> Path:
    """A worktree of `rev` under `parent` (`.`: this checkout itself)."""
    if rev == ".":
        return ROOT
    path = parent / re.sub(r"[^A-Za-z0-9_.-]", "_", rev)
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "--quiet", str(path), rev], check=True)
    return path


def run_once(tree: Path, command: list[str], metric: re.Pattern | None) -> float:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(tree), os.environ.get("PYTHONPATH")])))
    argv = [sys.executable, *command[1:]] if command[0] in ("python", "python3") else command
    start = time.perf_counter()
    out = subprocess.run(argv, cwd=tree, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if out.returncode != 0:
        sys.exit(f"{' '.join(command)} failed in {tree} (exit {out.returncode}):\n{out.stderr[-2000:]}")
    if metric is None:
        return wall
    found = metric.findall(out.stdout + out.stderr)
    if not found:
        sys.exit(f"--metric {metric.pattern!r} matched nothing in the output of the run in {tree}")
    last = found[-1]
    return float(last[0] if isinstance(last, tuple) else last)


def median_interval(xs: list[float], level: float = 0.95) -> tuple[float, float]:
    """The order-statistic interval of the median: the widest ranks (k, n-1-k) whose binomial
    coverage is at least `level` (min and max where n is too small for it)."""
    xs, n = sorted(xs), len(xs)
    k = 0
    while k + 1 < n / 2:
        tail = sum(math.comb(n, i) for i in range(k + 2)) / 2**n  # P(Binomial(n, 1/2) <= k + 1)
        if 1 - 2 * tail < level:
            break
        k += 1
    return xs[k], xs[n - 1 - k]


def quartiles(xs: list[float]) -> str:
    if len(xs) < 2:
        return f"{xs[0]:.4g}"
    q1, q2, q3 = statistics.quantiles(xs, n=4)
    return f"{statistics.median(xs):.4g} (quartiles {q1:.4g}-{q3:.4g})"


def main() -> int:
    argv = sys.argv[1:]
    if "--" not in argv:
        sys.exit("usage: ab.py BEFORE AFTER [options] -- COMMAND ... (see the docstring)")
    cut = argv.index("--")
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("before", help="revision A (a commit, branch or tag; `.` = this checkout)")
    ap.add_argument("after", help="revision B")
    ap.add_argument("--rounds", type=int, default=6, help="rounds, each running both (default: %(default)s)")
    ap.add_argument("--metric", default=None, help="regex whose first group is the number compared (default: wall s)")
    ap.add_argument("--json", default=None, help="write every round's values and the summary here")
    args = ap.parse_args(argv[:cut])
    command = argv[cut + 1:]
    if not command or args.rounds < 1:
        ap.error("a command after -- and --rounds >= 1 are required")
    metric = re.compile(args.metric) if args.metric else None
    parent = Path(tempfile.mkdtemp(prefix="kvtier-ab-"))
    trees: list[Path] = []
    try:
        trees = [checkout(args.before, parent), checkout(args.after, parent)]
        values: list[list[float]] = [[], []]
        for r in range(args.rounds):
            for side in ((0, 1) if r % 2 == 0 else (1, 0)):
                values[side].append(run_once(trees[side], command, metric))
            print(f"round {r + 1}: A {values[0][-1]:.4g}  B {values[1][-1]:.4g}", flush=True)
    finally:
        for tree in trees:
            if tree != ROOT:
                subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)], check=False)
        shutil.rmtree(parent, ignore_errors=True)
    ratios = [b / a for a, b in zip(*values) if a]
    lo, hi = median_interval(ratios)
    print(f"A {args.before}: {quartiles(values[0])}")
    print(f"B {args.after}: {quartiles(values[1])}")
    print(f"B/A per round: median {statistics.median(ratios):.3f}, interval {lo:.3f}-{hi:.3f} ({len(ratios)} pairs)")
    if args.json:
        Path(args.json).write_text(json.dumps(dict(before=args.before, after=args.after, command=command,
                                                   a=values[0], b=values[1], ratios=ratios, interval=[lo, hi]),
                                              indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
