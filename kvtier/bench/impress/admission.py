"""`kvtier bench impress --mode admission`: the faster tier's hit ratio on important tokens under
score-based admission (IMPRESS §4.4.2) against LRU and LFU, in simulation.

A simulated trace, labelled as such: `--docs` stored documents of `--doc-chunks` chunks, asked about
with Zipf(`--zipf`) popularity; every request reads every chunk of its document (an importance
restore reads each chunk's probe keys, then the kept tokens of each), and each chunk has a fixed
share of important tokens, drawn once from Beta(0.5, 1.5) (mean 0.25, the ratio; most chunks hold
few important tokens, a few hold many), observed with noise on each read. The faster tier holds
`--capacity` of all chunks. The policies are the store's own classes, driven as the memory tier
drives them (insert on a miss unless admission says no, evict by the policy's order, touch on a
hit). Hit ratio on important tokens = important tokens read from the faster tier / all read.
"""
from __future__ import annotations

import argparse
from collections.abc import Sequence

import numpy as np

from kvtier.bench.goals import Goal, evaluate
from kvtier.store.policy import ScorePolicy, make_policy


def simulate(policy_name: str, shares: np.ndarray, trace: np.ndarray, capacity: int, seed: int) -> dict:
    """shares: [docs, chunks] important share per chunk; trace: [requests] document ids."""
    rng = np.random.default_rng(seed)
    policy = make_policy(policy_name)
    score = policy if isinstance(policy, ScorePolicy) else None
    held: set[str] = set()
    hit_imp = all_imp = 0.0
    hits = reads = 0
    for doc in trace:
        for c, share in enumerate(shares[doc]):
            key = f"{doc}/{c}"
            seen = float(np.clip(share + rng.normal(0, 0.05), 0, 1))  # one restore's kept share
            reads += 1
            all_imp += share
            if key in held:
                hits += 1
                hit_imp += share
                policy.touch(key)
            else:
                if score is not None:
                    score.access(key)
                if score is None or score.admit(key, len(held) < capacity):
                    if len(held) >= capacity:
                        victim = next(policy.victims(1, (key,)))
                        policy.remove(victim)
                        held.discard(victim)
                    policy.insert(key, 1)
                    held.add(key)
            if score is not None:
                score.observe(key, seen)
    return dict(policy=policy_name, hit_ratio=hits / reads, important_hit_ratio=hit_imp / all_imp)


def _score_gain(rows: Sequence[dict]) -> list[dict]:
    by = {r["policy"]: r["important_hit_ratio"] for r in rows}
    return [dict(value=(by["score"] - max(by["lru"], by["lfu"])) * 100, target=5.0)]


GOALS = (Goal("score admission: faster tier's hit ratio on important tokens >= 5 points above LRU and LFU "
              "(simulated trace)", _score_gain, lambda g: g["value"] >= g["target"], lambda gs: gs[0]),)


def run(args: argparse.Namespace) -> dict:
    rng = np.random.default_rng(args.seed)
    shares = rng.beta(0.5, 1.5, size=(args.docs, args.doc_chunks))
    popularity = 1.0 / np.arange(1, args.docs + 1) ** args.zipf
    trace = rng.choice(args.docs, size=args.requests, p=popularity / popularity.sum())
    capacity = max(1, int(args.capacity * args.docs * args.doc_chunks))
    rows = [simulate(p, shares, trace, capacity, args.seed) for p in ("lru", "lfu", "score")]
    for r in rows:
        print(f"{r['policy']:6s} hit ratio {r['hit_ratio']:.3f}  on important tokens {r['important_hit_ratio']:.3f}")
    return dict(rows=rows, goals=evaluate(GOALS, rows), simulated=True, docs=args.docs, doc_chunks=args.doc_chunks,
                requests=args.requests, zipf=args.zipf, capacity=args.capacity)


def table(doc: dict) -> str:
    lines = [f"Simulated trace: {doc['docs']} documents x {doc['doc_chunks']} chunks, {doc['requests']} requests, "
             f"Zipf {doc['zipf']}, faster tier = {doc['capacity']:.0%} of the chunks", "",
             "| policy | hit ratio (chunks) | hit ratio on important tokens |", "|---|---|---|"]
    for r in doc["rows"]:
        lines.append(f"| {r['policy']} | {r['hit_ratio']:.3f} | {r['important_hit_ratio']:.3f} |")
    return "\n".join(lines)
