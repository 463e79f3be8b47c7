"""Decode after a shared prefix (a document asked about again), with a CPU pool that keeps a run's
blocks consecutive (`BlockPool.keep_runs`, shipped) against one that hands out its stack's order
(before), paired in one process, with HF transformers decoding the same prompt beside them.

One SmolLM2 model; two engines with the device prefix cache on, differing only in `keep_runs`. Per
history H, the document's first question is answered once by each engine (its continuation then
holds, cached, the blocks right after the document's). Each round asks a new question: each engine
times a 1-token and a 33-token generate of the document plus a fresh question (the document a
prefix hit, the question prefilled), so decode = 32 tokens / the difference; HF times 32 decode
steps continuing its own cache of the same prompt. Prints medians, the median of the per-round
ratios, and how each engine read its contexts (in place, or gathered on every layer).

    cd scripts && python shared_prefix_decode_ab.py [--history 1024,4096,8000] [--rounds 6] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from kvtier.bench.forward import hf_decode_s
from kvtier.bench.hf import build_hf
from kvtier.engine.config import EngineConfig
from kvtier.engine.engine import Engine
from kvtier.engine.request import SamplingParams
from kvtier.heap import freeze_startup_heap
from kvtier.models.loading import load_model

NEW = 32
ONE = SamplingParams(max_tokens=1, temperature=0.0)
MANY = SamplingParams(max_tokens=NEW + 1, temperature=0.0, ignore_eos=True)


def count_reads(engine: Engine, reads: dict[str, int]) -> None:
    """Count, per step, whether the first run's context was read in place or gathered."""
    prepare = engine.runner.prepare

    def spy(items):  # type: ignore[no-untyped-def]
        batch = prepare(items)
        ctx = batch.ctx[0]
        reads["gathered" if isinstance(ctx, torch.Tensor) else "in place" if ctx is not None else "fresh"] += 1
        return batch

    engine.runner.prepare = spy  # type: ignore[method-assign]


def kvtier_decode_s(engine: Engine, prompt_one: list[int], prompt_many: list[int]) -> float:
    t = time.perf_counter()
    engine.generate([prompt_one], ONE)
    one = time.perf_counter() - t
    t = time.perf_counter()
    engine.generate([prompt_many], MANY)
    return time.perf_counter() - t - one


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--history", default="1024,4096,8000")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--json")
    args = ap.parse_args()
    histories = [int(h) for h in args.history.split(",")]
    model = load_model("smollm2-135m", dtype="fp32")
    hf = build_hf(model)
    config = EngineConfig(kv_cache_bytes=1 << 30, max_model_len=max(histories) + 128)
    engines = {"runs": Engine(model, config), "scattered": Engine(model, config)}
    engines["scattered"].pool.keep_runs = False
    freeze_startup_heap()
    reads = {name: {"in place": 0, "gathered": 0, "fresh": 0} for name in engines}
    for name, e in engines.items():
        count_reads(e, reads[name])
    rates: dict[str, dict[int, list[float]]] = {k: {h: [] for h in histories} for k in (*engines, "hf")}
    vocab = model.config.vocab_size
    for h in histories:
        g = torch.Generator().manual_seed(h)
        doc = torch.randint(100, vocab, (h,), generator=g).tolist()
        question = lambda: torch.randint(100, vocab, (24,), generator=g).tolist()  # noqa: E731
        first = doc + question()
        for e in engines.values():
            e.generate([first], MANY)  # the first question's answer caches the blocks after the document
        hf_decode_s(hf, [first], NEW)  # warm-up
        for r in range(args.rounds):
            p1, p2 = doc + question(), doc + question()
            order = list(engines) if r % 2 else list(engines)[::-1]
            for name in order:
                rates[name][h].append(NEW / kvtier_decode_s(engines[name], p1, p2))
            rates["hf"][h].append(NEW / hf_decode_s(hf, [p2], NEW))
    for e in engines.values():
        e.close()
    print(f"decode of 1 sequence after a shared document, fp32, {NEW} tokens, {args.rounds} paired rounds (tok/s)")
    print("| H | consecutive (shipped) | scattered (before) | paired ratio | HF | shipped / HF |")
    print("|---|---|---|---|---|---|")
    for h in histories:
        a, b, c = rates["runs"][h], rates["scattered"][h], rates["hf"][h]
        print(f"| {h} | {statistics.median(a):.1f} | {statistics.median(b):.1f} | "
              f"{statistics.median([x / y for x, y in zip(a, b)]):.2f} | {statistics.median(c):.1f} | "
              f"{statistics.median([x / y for x, y in zip(a, c)]):.2f} |")
    print("contexts read per step:", reads)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(args=vars(args), tok_s=rates, reads=reads), f, indent=1)


if __name__ == "__main__":
    main()
