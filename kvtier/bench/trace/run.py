"""`kvtier bench trace`: replay a multi-turn chat trace (and a long-document Q&A trace) through the
engine with and without state reuse, on several storage stacks.

Each configuration gets a fresh engine and a fresh store and replays the same seeded trace on the
wall clock: sessions arrive as a Poisson process; a session's next turn is sent a think time after
its previous turn finished (closed loop, as a user would). TTFT is measured from the moment a turn
is due (its scheduled arrival) to its first token, so time a request spends waiting for the step
loop counts. Configurations:

  main      recompute (no store, no device prefix cache: the no-reuse baseline), then kv and auto
            restore over a memory store and over memory+disk, and kv with the device prefix cache
            on over a memory store (kv/device+memory).
  pressure  kv over memory+disk with a memory tier far smaller than the working set and a small
            max_num_seqs (so requests queue): LRU eviction only vs look-ahead prefetch + eviction
            (CachedAttention §3.3). Identical otherwise.
  tbt       the store with saving on vs off, restore method `recompute`, so both runs do the same
            compute and differ only by the saving path (capture, snapshot, background writer).
  full      kv over device prefix cache (small pool) + memory + disk + redis, all under pressure,
            so every tier serves some hits (needs redis-server, started privately on a free port;
            use --fill-holes, or the device cache leaves holes in the stored chain).

Outside those two, the device prefix cache is off in every store configuration (as in HCache's
evaluation), so reuse measures the store tiers; `--device-cache` turns it on everywhere.
`--check-sessions N` adds a sequential replay (batch 1, identical prompts for the recompute and the
reuse engine) that checks greedy outputs are identical without any timing noise.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import heapq
import json
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from kvtier.bench.common import write_json_atomic
from kvtier.bench.report import goal_rows, markdown_rows, pyplot, save_figure
from kvtier.bench.stats import quantile_linear
from kvtier.bench.trace.goals import evaluate_goals
from kvtier.dtypes import name_of
from kvtier.testing.services import RedisServer

TIERS = ("device", "memory", "disk", "redis")
GROUPS = ("first", "later")


# ----- configurations ---------------------------------------------------------------------------
@dataclass(frozen=True)
class RunConfig:
    name: str
    method: str  # recompute | kv | auto (the engine's restore method; recompute without a store = no reuse)
    storage: str  # none | memory | memory+disk | device+memory+disk+redis
    policy: str = "lookahead"  # lookahead | lru ("-" without a store)
    save: bool = True
    pressure: bool = False  # memory tier far below the working set, requests queue
    device_cache: bool = False
    group: str = "main"


def all_configs(redis: bool) -> list[RunConfig]:
    out = [
        RunConfig("recompute", "recompute", "none", policy="-", save=False),
        RunConfig("kv/memory", "kv", "memory"),
        RunConfig("auto/memory", "auto", "memory"),
        RunConfig("kv/memory+disk", "kv", "memory+disk"),
        RunConfig("auto/memory+disk", "auto", "memory+disk"),
        RunConfig("kv/device+memory", "kv", "device+memory", device_cache=True),
        RunConfig("kv/memory+disk/pressure-lru", "kv", "memory+disk", policy="lru", pressure=True, group="pressure"),
        RunConfig("kv/memory+disk/pressure-lookahead", "kv", "memory+disk", policy="lookahead", pressure=True,
                  group="pressure"),
        RunConfig("store-recompute/memory+disk/save-off", "recompute", "memory+disk", save=False, group="tbt"),
        RunConfig("store-recompute/memory+disk/save-on", "recompute", "memory+disk", save=True, group="tbt"),
    ]
    if redis:
        out.append(RunConfig("kv/device+memory+disk+redis/pressure", "kv", "device+memory+disk+redis",
                             pressure=True, device_cache=True, group="full"))
    return out


def select_configs(spec: str, workload: str, redis: bool, baseline: bool = True) -> list[RunConfig]:
    """`spec`: comma list of config names or groups (main, pressure, tbt, full, all).
    The default ("auto") runs everything on multiturn and the main group on longdoc."""
    configs = all_configs(redis)
    if spec == "auto":
        spec = "all" if workload == "multiturn" else "main"
    want = {s.strip() for s in spec.split(",") if s.strip()}
    chosen = [c for c in configs if "all" in want or c.name in want or c.group in want]
    unknown = want - {c.name for c in configs} - {c.group for c in configs} - {"all"}
    if unknown:
        raise ValueError(f"unknown configurations {sorted(unknown)}: use names {[c.name for c in configs]} "
                         f"or groups main, pressure, tbt, full, all")
    if baseline and any(c.method != "recompute" or c.storage != "none" for c in chosen) and not any(
            c.storage == "none" for c in chosen):
        chosen.insert(0, configs[0])  # the recompute baseline is what everything is compared with
    return chosen


# ----- one run ----------------------------------------------------------------------------------
@dataclass
class TurnRecord:
    session: str
    turn: int
    group: str
    scheduled_s: float  # when the turn was due, from the start of the run
    ttft_s: float  # due -> first token
    engine_ttft_s: float  # add_request -> first token (the engine's own number)
    mean_tbt_s: float | None
    prompt_tokens: int
    reused: int
    computed: int
    by_tier: dict[str, int]
    restore_method: str | None
    output_tokens: int
    finish_reason: str | None
    output_digest: str
    output_ids: list[int] = dataclasses.field(default_factory=list, repr=False)


def _digest(ids: Sequence[int]) -> str:
    return hashlib.sha1(",".join(map(str, ids)).encode()).hexdigest()[:12]


def replay(engine, workload, max_model_len: int, log=print) -> tuple[list[TurnRecord], dict]:
    """Drive `engine` through `workload` on the wall clock; returns per-turn records and run totals."""
    from kvtier.engine.request import SamplingParams

    t0 = time.perf_counter()
    due: list[tuple[float, int, str, int]] = []  # (time due, tiebreak, session, turn)
    sessions = {s.session_id: s for s in workload.sessions}
    answers: dict[str, list[str]] = {sid: [] for sid in sessions}
    seq = 0
    for s in workload.sessions:
        heapq.heappush(due, (t0 + s.arrival_s, seq, s.session_id, 0))
        seq += 1
    inflight: dict[str, tuple[str, int, float, float]] = {}  # rid -> (session, turn, due, submitted)
    records: list[TurnRecord] = []
    truncated = 0
    steps = 0
    while due or inflight:
        now = time.perf_counter()
        while due and due[0][0] <= now:
            at, _, sid, turn = heapq.heappop(due)
            s = sessions[sid]
            ids = engine.encode_chat(s.messages(turn, answers[sid]))
            t = s.turns[turn]
            if len(ids) + t.max_tokens >= max_model_len:
                truncated += len(s.turns) - turn  # the conversation outgrew the context: it ends here
                continue
            params = SamplingParams(max_tokens=t.max_tokens, temperature=0.0)
            rid = engine.add_request(ids, params, session_id=sid)
            inflight[rid] = (sid, turn, at, time.perf_counter())
        if not inflight:
            if due:
                time.sleep(max(0.0, min(due[0][0] - time.perf_counter(), 0.05)))
            continue
        for out in engine.step():
            if not out.finished or out.request_id not in inflight:
                continue
            sid, turn, at, submitted = inflight.pop(out.request_id)
            end = time.perf_counter()
            ttft = (submitted - at) + (out.ttft if out.ttft is not None else end - submitted)
            records.append(TurnRecord(
                session=sid, turn=turn, group="first" if turn == 0 else "later", scheduled_s=at - t0,
                ttft_s=ttft, engine_ttft_s=out.ttft or 0.0, mean_tbt_s=out.mean_tbt,
                prompt_tokens=out.prompt_tokens, reused=out.prompt_tokens_reused,
                computed=out.prompt_tokens_computed, by_tier=dict(out.reused_by_tier),
                restore_method=out.restore_method, output_tokens=len(out.output_ids),
                finish_reason=out.finish_reason, output_digest=_digest(out.output_ids),
                output_ids=list(out.output_ids)))
            answers[sid].append(out.text)
            s = sessions[sid]
            if turn + 1 < len(s.turns):
                heapq.heappush(due, (end + s.turns[turn + 1].think_s, seq, sid, turn + 1))
                seq += 1
        steps += 1
    wall = time.perf_counter() - t0
    gen = sum(r.output_tokens for r in records)
    totals = dict(wall_s=wall, steps=steps, turns=len(records), truncated_turns=truncated,
                  generated_tokens=gen, throughput_tok_s=gen / wall if wall > 0 else 0.0,
                  preemptions=engine.stats(with_store=False).preemptions)
    return records, totals


def store_spec(cfg: RunConfig, args: argparse.Namespace, workdir: Path, redis: RedisServer | None) -> str | None:
    if cfg.storage == "none":
        return None
    mem = args.pressure_memory if cfg.pressure else args.memory
    parts = [f"memory:{mem}"]
    if "disk" in cfg.storage:
        d = Path(tempfile.mkdtemp(prefix="disk-", dir=workdir))
        parts.append(f"disk:{d}:{args.pressure_disk if cfg.storage.endswith('redis') else args.disk}")
    if "redis" in cfg.storage:
        assert redis is not None
        parts.append(f"{redis.url}?prefix=trace-{os.getpid()}-{int(time.time() * 1000)}")
    return ",".join(parts)


def run_config(model, profile, workload, cfg: RunConfig, args: argparse.Namespace, workdir: Path,
               redis: RedisServer | None, log=print) -> tuple[list[TurnRecord], dict]:
    from kvtier.engine.config import EngineConfig, ReuseConfig
    from kvtier.engine.engine import Engine

    spec = store_spec(cfg, args, workdir, redis)
    device_cache = cfg.device_cache or (args.device_cache and spec is not None)
    kv_bytes = int((args.pressure_kv_cache_gb if cfg.device_cache and cfg.pressure else args.kv_cache_gb) * (1 << 30))
    econf = EngineConfig(kv_cache_bytes=kv_bytes, max_batched_tokens=args.max_batched_tokens,
                         max_num_seqs=args.pressure_max_num_seqs if cfg.pressure else args.max_num_seqs,
                         max_model_len=args.max_model_len, enable_prefix_cache=device_cache)
    reuse = ReuseConfig(method=cfg.method, chunk_tokens=args.chunk_tokens, save=cfg.save,
                        lookahead=cfg.policy == "lookahead", fill_holes=args.fill_holes and device_cache)
    engine = Engine(model, econf, store=spec, reuse=reuse, profile=profile if spec else None)
    load0 = os.getloadavg()[0]
    try:
        records, totals = replay(engine, workload, engine.max_model_len, log)
        if spec is not None:
            engine.flush()
            es = engine.stats()
            st = es.store or {}
            totals["store"] = dict(spec=spec, counters=es.counters, tier_tokens=es.reused_by_tier,
                                   layout=sorted(set(es.layout)),
                                   writer=st.get("writer"), store=st.get("store"),
                                   tiers={k: {f: v.get(f) for f in ("hits", "misses", "evictions", "puts", "bytes_used",
                                                                     "capacity", "entries") if f in v}
                                          for k, v in st.get("tiers", {}).items()})
    finally:
        engine.close()
    totals.update(dtype=name_of(model.dtype), loadavg_start=load0, loadavg_end=os.getloadavg()[0],
                  max_num_seqs=econf.max_num_seqs, device_cache=device_cache, spec=spec)
    return records, totals


def sequential_check(model, profile, wl, args, log=print) -> list[dict]:
    """Lossless check without timing noise: the sessions' turns one at a time (batch 1), each prompt
    run by a recompute engine and by a reuse engine (kv over memory), both on the identical prompt
    (the conversation is carried on with the reuse engine's answers). Returns per-turn records
    (both engines) with output digests; TTFT here has no queueing at all."""
    from kvtier.engine.config import EngineConfig, ReuseConfig
    from kvtier.engine.engine import Engine
    from kvtier.engine.request import SamplingParams

    econf = EngineConfig(kv_cache_bytes=int(args.kv_cache_gb * (1 << 30)), max_batched_tokens=args.max_batched_tokens,
                         max_num_seqs=1, max_model_len=args.max_model_len, enable_prefix_cache=False)
    base = Engine(model, econf)
    reuse = Engine(model, econf, store=f"memory:{args.memory}",
                   reuse=ReuseConfig(method=args.check_method, chunk_tokens=args.chunk_tokens), profile=profile)
    dtype = name_of(model.dtype)
    names = {id(base): f"recompute [{dtype}, sequential]", id(reuse): f"{args.check_method}/memory [{dtype}, sequential]"}
    recs: list[dict] = []
    try:
        for s in wl.sessions[: args.check_sessions]:
            answers: list[str] = []
            for turn, t in enumerate(s.turns):
                ids = reuse.encode_chat(s.messages(turn, answers))
                n = min(t.max_tokens, args.check_tokens)
                if len(ids) + n >= reuse.max_model_len:
                    break
                params = SamplingParams(max_tokens=n, temperature=0.0)
                outs = {}
                for eng in (reuse, base):
                    o = eng.generate([ids], params)[0]
                    outs[id(eng)] = o
                    recs.append(dict(workload=f"{wl.name}-sequential", config=names[id(eng)], session=s.session_id,
                                     turn=turn, group="first" if turn == 0 else "later", scheduled_s=0.0,
                                     ttft_s=o.ttft, engine_ttft_s=o.ttft, mean_tbt_s=o.mean_tbt,
                                     prompt_tokens=o.prompt_tokens, reused=o.prompt_tokens_reused,
                                     computed=o.prompt_tokens_computed, by_tier=dict(o.reused_by_tier),
                                     restore_method=o.restore_method, output_tokens=len(o.output_ids),
                                     finish_reason=o.finish_reason, output_digest=_digest(o.output_ids)))
                reuse.flush()  # a think time lets the writer finish; here we wait for it
                a, b = outs[id(base)], outs[id(reuse)]
                assert a.ttft is not None and b.ttft is not None  # both produced a token
                answers.append(b.text)
                log(f"    {s.session_id} turn {turn}: prompt {len(ids)}, reused {b.prompt_tokens_reused}, TTFT "
                    f"{b.ttft * 1000:.0f} vs {a.ttft * 1000:.0f} ms, {'same' if a.output_ids == b.output_ids else 'DIFFERENT'}",
                    flush=True)
    finally:
        reuse.close()
        base.close()
    return recs


def sequential_rows(recs: list[dict]) -> list[dict]:
    rows = []
    for cfg in dict.fromkeys(r["config"] for r in recs):
        mine = [r for r in recs if r["config"] == cfg]
        is_base = cfg.startswith("recompute")
        ref = {(r["session"], r["turn"]): r["output_digest"] for r in recs
               if r["config"].startswith("recompute") and r["workload"] == mine[0]["workload"]}
        rc = RunConfig(cfg, "recompute" if is_base else cfg.split("/")[0], "none" if is_base else "memory", policy="-")
        wall = sum(r["ttft_s"] + (r["mean_tbt_s"] or 0) * max(r["output_tokens"] - 1, 0) for r in mine)
        totals = dict(wall_s=wall, throughput_tok_s=sum(r["output_tokens"] for r in mine) / wall if wall else 0.0,
                      dtype=cfg.split("[")[1].split(",")[0], max_num_seqs=1)
        for row in make_rows(mine[0]["workload"], rc, mine, totals, None if is_base else ref, same_prompts=True):
            row["sequential"] = True
            rows.append(row)
    return rows


# ----- aggregation ------------------------------------------------------------------------------
def hit_rates(recs: list[dict]) -> dict[str, float]:
    """Per tier: the share of reused prompt tokens that tier served. `overall`: reused / prompt tokens.
    `store_memory`: memory's share of the tokens the store (not the device cache) served."""
    reused = sum(r["reused"] for r in recs)
    prompt = sum(r["prompt_tokens"] for r in recs)
    by = {t: sum(r["by_tier"].get(t, 0) for r in recs) for t in TIERS}
    out = {t: (by[t] / reused if reused else 0.0) for t in TIERS}
    out["overall"] = reused / prompt if prompt else 0.0
    store = by["memory"] + by["disk"] + by["redis"]
    out["store_memory"] = by["memory"] / store if store else 0.0
    return out


def make_rows(workload: str, cfg: RunConfig, recs: list[dict], totals: dict, baseline: dict | None,
              same_prompts: bool = False) -> list[dict]:
    rows = []
    for g in GROUPS:
        rs = [r for r in recs if r["group"] == g]
        if not rs:
            continue
        tbts = [r["mean_tbt_s"] for r in rs if r["mean_tbt_s"] is not None]
        ttfts = [r["ttft_s"] for r in rs]
        methods: dict[str, int] = {}
        for r in rs:
            if r["restore_method"]:
                methods[r["restore_method"]] = methods.get(r["restore_method"], 0) + 1
        compared = mismatched = diverged = 0
        if baseline is not None:
            own = {(r["session"], r["turn"]): r["output_digest"] for r in recs}
            for r in rs:
                ref = baseline.get((r["session"], r["turn"]))
                if ref is None:
                    continue
                # Same prompt only if every earlier answer of the session matched: compare those turns.
                if not same_prompts and any(own.get((r["session"], t)) != baseline.get((r["session"], t))
                                            for t in range(r["turn"])):
                    diverged += 1
                    continue
                compared += 1
                mismatched += ref != r["output_digest"]
        rows.append(dict(
            workload=workload, dtype=totals.get("dtype", "?"), config=cfg.name, method=cfg.method, storage=cfg.storage, policy=cfg.policy,
            save=cfg.save, pressure=cfg.pressure, device_cache=totals.get("device_cache", False), turns=g,
            requests=len(rs), ttft_p50_s=quantile_linear(ttfts, 0.5), ttft_p99_s=quantile_linear(ttfts, 0.99),
            ttft_mean_s=statistics.fmean(ttfts), tbt_mean_s=statistics.fmean(tbts) if tbts else None,
            throughput_tok_s=totals["throughput_tok_s"], hit_rate=hit_rates(rs),
            tokens_reused=sum(r["reused"] for r in rs), tokens_computed=sum(r["computed"] for r in rs),
            prompt_tokens=sum(r["prompt_tokens"] for r in rs), output_tokens=sum(r["output_tokens"] for r in rs),
            restore_methods=methods, compared_turns=compared, mismatched_turns=mismatched, diverged_turns=diverged,
            run_wall_s=totals["wall_s"], max_num_seqs=totals.get("max_num_seqs"),
            loadavg=[totals.get("loadavg_start"), totals.get("loadavg_end")]))
    return rows


# ----- reports ----------------------------------------------------------------------------------
def _ms(x) -> str:
    return "-" if x is None else f"{x * 1000:.0f}"


def _pc(x) -> str:
    return f"{x * 100:.0f}%"


COLUMNS = ("workload", "config", "turns", "n", "TTFT p50 ms", "TTFT p99 ms", "TBT ms", "tok/s", "reuse",
           "device", "memory", "disk", "redis", "reused", "computed", "mismatch")


def table_cells(r: dict) -> list[str]:
    h = r["hit_rate"]
    return [r["workload"], r["config"], r["turns"], str(r["requests"]), _ms(r["ttft_p50_s"]), _ms(r["ttft_p99_s"]),
            "-" if r["tbt_mean_s"] is None else f"{r['tbt_mean_s'] * 1000:.1f}", f"{r['throughput_tok_s']:.1f}",
            _pc(h["overall"]), _pc(h["device"]), _pc(h["memory"]), _pc(h["disk"]), _pc(h["redis"]),
            str(r["tokens_reused"]), str(r["tokens_computed"]),
            f"{r['mismatched_turns']}/{r['compared_turns']}" if r["compared_turns"] else "-"]


def markdown(rows: list[dict], goals: list[dict]) -> str:
    return "\n".join(markdown_rows(COLUMNS, [table_cells(r) for r in rows]) + goal_rows(goals)) + "\n"


def print_table(rows: list[dict], goals: list[dict]) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title="kvtier trace benchmark (TTFT from the turn's due time; hit shares of reused tokens)")
    for c in COLUMNS:
        t.add_column(c, justify="left" if c in ("workload", "config", "turns") else "right")
    for r in rows:
        t.add_row(*table_cells(r))
    con = Console(width=220)
    con.print(t)
    for g in goals:
        con.print(f"[{'green' if g['met'] else 'red'}]{'met' if g['met'] else 'NOT met'}[/]: {g['goal']}: {g['summary']}")


def plot(requests: list[dict], path: str) -> None:
    plt = pyplot()
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    workloads = [w for w in dict.fromkeys(r["workload"] for r in requests) if not w.endswith("sequential")]
    fig, axes = plt.subplots(len(workloads), 2, figsize=(13, 4.6 * len(workloads)), squeeze=False)
    for i, wl in enumerate(workloads):
        configs = list(dict.fromkeys(r["config"] for r in requests if r["workload"] == wl))
        for j, g in enumerate(GROUPS):
            ax = axes[i][j]
            for k, c in enumerate(configs):
                xs = sorted(r["ttft_s"] for r in requests if r["workload"] == wl and r["config"] == c and r["group"] == g)
                if not xs:
                    continue
                ys = [(n + 1) / len(xs) for n in range(len(xs))]
                style = "-" if k % 2 else "--"
                ax.step(xs, ys, where="post", linestyle="-" if c == "recompute" else style,
                        linewidth=2.4 if c == "recompute" else 1.4,
                        color="black" if c == "recompute" else plt.cm.tab10(k % 10), label=f"{c} (n={len(xs)})")
            ax.set_xscale("log")
            ax.xaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
            ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: f"{x:g}"))
            ax.xaxis.set_minor_formatter(NullFormatter())
            ax.set_xlabel("TTFT (s, log scale; from the turn's due time)")
            ax.set_ylabel("fraction of turns")
            ax.set_title(f"{wl}: {g} turns")
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=7, loc="lower right")
    fig.suptitle("TTFT distributions (CDF) per configuration")
    fig.tight_layout(rect=(0, 0, 1, 0.98))
    save_figure(fig, path)


def write_json(path: str, rows: list[dict], goals: list[dict], meta: dict, requests: list[dict]) -> None:
    write_json_atomic(path, dict(rows=rows, goals=goals, meta=meta, requests=requests))


def render(rows, goals, requests, args) -> None:
    if args.markdown:
        Path(args.markdown).write_text(markdown(rows, goals))
    if args.plot and requests:
        plot(requests, args.plot)
    print_table(rows, goals)


# ----- the command ------------------------------------------------------------------------------


def rebuild_rows(reqs: list[dict], runs: dict, dtype: str) -> list[dict]:
    """Rows from per-turn records (and each run's totals): re-rendering never trusts stale aggregates."""
    cfgs = {c.name: c for c in all_configs(True)}
    rows: list[dict] = []
    baselines: dict[str, dict] = {}
    trace = [r for r in reqs if not r["workload"].endswith("sequential")]
    for wl, name in dict.fromkeys((r["workload"], r["config"]) for r in trace):
        recs = [r for r in trace if r["workload"] == wl and r["config"] == name]
        totals = dict(runs.get(f"{wl}/{name}") or {})
        totals.setdefault("dtype", dtype)
        if "wall_s" not in totals:
            continue
        if name == "recompute":
            baselines[wl] = {(r["session"], r["turn"]): r["output_digest"] for r in recs}
        rows += make_rows(wl, cfgs[name], recs, totals, None if name == "recompute" else baselines.get(wl),
                          same_prompts=wl == "longdoc")
    rows += sequential_rows([r for r in reqs if r["workload"].endswith("sequential")])
    return rows


def _load(paths: list[str]) -> tuple[list[dict], list[dict], dict]:
    rows: list[dict] = []
    reqs: list[dict] = []
    meta: dict = {}
    for p in paths:
        doc = json.loads(Path(p).read_text())
        m = doc.get("meta", {})
        rq = doc.get("requests", [])
        rows += rebuild_rows(rq, m.get("runs", {}), m.get("dtype", "?")) if rq else doc["rows"]
        reqs += rq
        if not meta:
            meta = m
        else:
            meta.setdefault("runs", {}).update(m.get("runs", {}))
            meta.setdefault("workloads", {}).update(m.get("workloads", {}))
    return rows, reqs, meta


def _print_rows(new: list[dict], totals: dict) -> None:
    for r in new:
        print(f"    {r['turns']:>5}: n={r['requests']} TTFT p50 {_ms(r['ttft_p50_s'])} ms p99 "
              f"{_ms(r['ttft_p99_s'])} ms, TBT {_ms(r['tbt_mean_s'])} ms, reuse {_pc(r['hit_rate']['overall'])}"
              f" (mem {_pc(r['hit_rate']['memory'])}, disk {_pc(r['hit_rate']['disk'])}), "
              f"mismatch {r['mismatched_turns']}/{r['compared_turns']}", flush=True)
    print(f"    wall {totals['wall_s']:.1f} s, {totals['throughput_tok_s']:.1f} tok/s, "
          f"load {totals['loadavg_start']:.1f}->{totals['loadavg_end']:.1f}", flush=True)


def run_plan(model, profile, plan, args: argparse.Namespace, workdir: Path, redis: RedisServer | None,
             meta: dict) -> tuple[list[dict], list[dict]]:
    """Every (workload, configuration) of the plan in turn: rows and per-turn records (JSON after each)."""
    rows: list[dict] = []
    reqs: list[dict] = []
    baselines: dict[str, dict] = {}
    for wl, cfg in plan:
        print(f"[{time.strftime('%H:%M:%S')}] {wl.name} / {cfg.name} ...", flush=True)
        records, totals = run_config(model, profile, wl, cfg, args, workdir, redis)
        recs = [dict(dataclasses.asdict(r), workload=wl.name, config=cfg.name) for r in records]
        for r in recs:
            r.pop("output_ids")
        if cfg.name == "recompute":
            baselines[wl.name] = {(r["session"], r["turn"]): r["output_digest"] for r in recs}
        new = make_rows(wl.name, cfg, recs, totals, None if cfg.name == "recompute" else baselines.get(wl.name),
                        same_prompts=wl.name == "longdoc")  # longdoc prompts never carry earlier answers
        rows += new
        reqs += recs
        meta["runs"][f"{wl.name}/{cfg.name}"] = totals
        _print_rows(new, totals)
        if args.json:
            write_json(args.json, rows, evaluate_goals(rows), meta, reqs)
    return rows, reqs


def _workloads(args: argparse.Namespace, tok) -> list:
    from kvtier.bench import workloads

    wls = []
    if args.workload in ("multiturn", "all"):
        wls.append(workloads.multiturn(tok, args.sessions, args.rate, args.think, args.output_scale, args.seed,
                                       args.max_turns))
    if args.workload in ("longdoc", "all"):
        wls.append(workloads.longdoc(tok, args.documents, args.questions, args.doc_rate, args.doc_think,
                                     args.doc_tokens, args.doc_output_tokens, args.seed))
    return wls


def _rerender(args: argparse.Namespace) -> int:
    """--from-json: rows rebuilt from saved per-turn records, goals re-judged, reports re-rendered."""
    rows, reqs, meta = _load([args.from_json, *args.merge])
    goals = evaluate_goals(rows)
    if args.json:
        write_json(args.json, rows, goals, meta, reqs)
    render(rows, goals, reqs, args)
    return 0


def cmd_trace(args: argparse.Namespace) -> int:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if args.from_json:
        return _rerender(args)

    import torch

    from kvtier.engine.calibrate.hardware import load_or_measure
    from kvtier.models.loading import load_model
    from kvtier.paths import home

    if args.threads:
        torch.set_num_threads(args.threads)
    model = load_model(args.model, dtype=args.dtype)
    wls = _workloads(args, model.tokenizer)
    own_workdir = args.workdir is None
    workdir = Path(tempfile.mkdtemp(prefix="kvtier-trace-") if own_workdir else args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    redis = None
    binary = shutil.which("redis-server") if args.redis == "auto" else (None if args.redis == "none" else args.redis)
    try:
        if binary:
            redis = RedisServer(binary).start()
        plan = [] if args.check_only else [(wl, c) for wl in wls
                                          for c in select_configs(args.configs, wl.name, redis is not None,
                                                                  not args.no_baseline)]
        needs_store = any(c.storage != "none" for _, c in plan) or args.check_sessions > 0
        profile = None
        if needs_store:
            pdir = Path(tempfile.mkdtemp(prefix="profile-", dir=workdir))
            pspec = f"memory:1GB,disk:{pdir}:4GB" + (f",{redis.url}?prefix=trace-profile" if redis else "")
            t = time.perf_counter()
            profile = load_or_measure(model, Path(args.home) if args.home else home(), pspec)
            print(f"hardware profile ready in {time.perf_counter() - t:.1f} s (tiers: {sorted(profile.tiers)})",
                  flush=True)
        meta = dict(model=model.name, dtype=name_of(model.dtype), threads=torch.get_num_threads(),
                    cpu_count=os.cpu_count(), args={k: v for k, v in vars(args).items() if k != "func"},
                    workloads={wl.name: dict(wl.params, sessions_n=len(wl.sessions), turns_n=wl.num_turns)
                               for wl in wls},
                    profile=dataclasses.asdict(profile) if profile else None, runs={})
        rows, reqs = run_plan(model, profile, plan, args, workdir, redis, meta)
        if args.check_sessions:
            multi = next((w for w in wls if w.name == "multiturn"), None)
            if multi is not None:
                print(f"[{time.strftime('%H:%M:%S')}] sequential lossless check ({args.check_sessions} sessions)", flush=True)
                recs = sequential_check(model, profile, multi, args)
                rows += sequential_rows(recs)
                reqs += recs
        goals = evaluate_goals(rows)
        if args.json:
            write_json(args.json, rows, goals, meta, reqs)
        render(rows, goals, [r for r in reqs if not r["workload"].endswith("sequential")], args)
    finally:
        if redis is not None:
            redis.close()
        if own_workdir:
            shutil.rmtree(workdir, ignore_errors=True)
    return 0
