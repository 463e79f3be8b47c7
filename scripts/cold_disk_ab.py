"""A cold disk restore after a restart, today's code against the previous read grouping and header
matching, interleaved per context so the VM's drift (the same command varies 10-30% between runs
here) hits both alike.

For each of N+1 random contexts (the first a warm-up): engine A saves H tokens and closes; then, in
alternating order, one fresh engine per variant drops the chunk files' page cache and restores them
for H + 64 tokens (max_tokens=1). Prints the median TTFT and the median time spent opening the
chunks (`PlannedReads.open`), with quartiles; `--json` writes the samples.

    before  the read buffer of CachedAttention's formula as is; a device's reads in groups of
            READ_GROUP_LAYERS from the first layer on (the new tokens wait for the whole group that
            holds the buffer's last layer); a learned segment table matched by copying every entry
    after   the shallowest buffer from which the planner's pipeline predicts no stall (reads that
            take the compute's cores slow it, so more of them hide); layer 0 read alone and a
            group ending where the buffer does; the digests taken out of the parsed entries and
            the rest compared in one go

    python scripts/cold_disk_ab.py [--history 4096] [--dtype bf16] [--contexts 12] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile

import torch
from profile_disk_restore import (  # scripts/ is on the path of a script run from it
    cold_restore,
    save_context,
    time_opening,
)

from kvtier.engine.config import EngineConfig
from kvtier.engine.request import SamplingParams
from kvtier.engine.restore import layerwise
from kvtier.models.loading import load_model
from kvtier.planning.planner import Planner
from kvtier.store import format as fmt

GROUPS_NOW, MATCH_NOW, DEPTH_NOW = layerwise.layer_groups, fmt.SegmentTable.match, Planner._start_depth


def _formula_depth(cls, io, comp, lead, steal, buffer):  # the previous read buffer, for the baseline
    return max(buffer, 1), cls._run(io, comp, lead, max(buffer, 1), steal)[0]


def _groups_uncut(layout, first, size, cuts=()):  # the previous grouping, for the baseline
    return GROUPS_NOW(layout, first, size)


def _match_by_copy(self: fmt.SegmentTable, entries):  # the previous matching, for the baseline
    if type(entries) is not list or len(entries) != len(self._rows):
        return None
    try:
        if [e[:4] + e[5:] for e in entries] != self._rows:
            return None
    except TypeError:
        return None
    digests = [e[4] for e in entries]
    if not all(type(d) is int for d in digests):
        return None
    return tuple(fmt.Segment(s.layer, s.part, s.offset, s.nbytes, d, s.dtype, s.shape, s.granules)
                 for s, d in zip(self.segments, digests))


VARIANTS = {"before": (_groups_uncut, _match_by_copy, classmethod(_formula_depth)),
            "after": (GROUPS_NOW, MATCH_NOW, classmethod(DEPTH_NOW.__func__))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--history", type=int, default=4096)
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--contexts", type=int, default=12)
    ap.add_argument("--json")
    args = ap.parse_args()
    opened = time_opening()
    model = load_model("smollm2-135m", dtype=args.dtype)
    once = SamplingParams(max_tokens=1, temperature=0.0)
    config = EngineConfig(kv_cache_bytes=1 << 30, max_model_len=max(8192, args.history + 64), enable_prefix_cache=False)
    ttft: dict[str, list[float]] = {v: [] for v in VARIANTS}
    opening: dict[str, list[float]] = {v: [] for v in VARIANTS}
    with tempfile.TemporaryDirectory() as d:
        spec = f"disk:{d}:20GB"
        for i in range(args.contexts + 1):
            ids = torch.randint(100, 40000, (args.history + 64,), generator=torch.Generator().manual_seed(i)).tolist()
            save_context(model, config, spec, ids, args.history, once)
            for name in list(VARIANTS)[:: 1 if i % 2 else -1]:
                groups, match, depth = VARIANTS[name]
                layerwise.layer_groups, fmt.SegmentTable.match = groups, match  # type: ignore[method-assign]
                Planner._start_depth = depth  # type: ignore[method-assign,assignment]
                wall = cold_restore(model, config, spec, d, ids, args.history, once, name)
                if i:  # context 0 is the warm-up
                    ttft[name].append(wall)
                    opening[name].append(opened[-1])
    for name in VARIANTS:
        q = statistics.quantiles(ttft[name], n=4)
        print(f"H={args.history} {args.dtype} {name:6s}: TTFT median {statistics.median(ttft[name]):.3f} s "
              f"(q25 {q[0]:.3f}, q75 {q[2]:.3f}), opening median {1e3 * statistics.median(opening[name]):.1f} ms, "
              f"n={len(ttft[name])}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(args=vars(args), ttft_s=ttft, opening_s=opening), f, indent=1)


if __name__ == "__main__":
    main()
