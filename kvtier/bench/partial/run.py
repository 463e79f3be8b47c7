"""`kvtier bench partial`: serving under a small KV budget with partial token-wise caching (eLLM).

A memory-bound workload (long prompts, ShareGPT-like output lengths, Poisson arrivals) is replayed
in real time against one engine per policy, all in the same run and process:

  full         ample KV memory (the reference for "no worse when memory is ample")
  recompute    the budget; a sequence that does not fit is preempted and recomputed later
  swap         the budget plus a memory tier: a preempted sequence's state is restored from it
  fixed-r      every decoding request keeps KV for its newest (1 - r) tokens, the rest recomputed
  optimizer    b and fronts from the optimiser under the TPOT SLO, fronts recomputed
  optimizer+swap  the same with fronts read back from host memory (unthrottled, or at --swap-mbps)

The budget is `--budget-share` of the workload's peak KV demand (the peak the `full` run held);
the SLO is `--slo-x` times the unloaded decode step (one request alone). A request meets the SLO
when its mean time per output token does. Writes {rows, goals, meta, series} JSON and a plot.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from kvtier.bench.common import machine_info
from kvtier.bench.partial.goals import evaluate_goals
from kvtier.bench.report import goal_rows, markdown_rows, pyplot, save_figure
from kvtier.bench.stats import quantile_round
from kvtier.engine.calibrate.fronts import cost_model, held_out_error
from kvtier.engine.config import EngineConfig, PartialConfig, PartialPolicy, ReuseConfig
from kvtier.engine.engine import Engine
from kvtier.engine.partial import PartialCaching
from kvtier.engine.request import SamplingParams
from kvtier.engine.runner.model_runner import ModelRunner
from kvtier.models.loading import load_model

BS = 16


@dataclass(frozen=True)
class Arrival:
    at: float  # seconds after the start
    prompt: tuple[int, ...]
    max_tokens: int


def workload(n: int, rate: float, prompt_range: tuple[int, int], mean_output: float, vocab: int,
             seed: int) -> list[Arrival]:
    """Poisson arrivals; prompt lengths uniform in the range; output lengths log-normal around
    `mean_output` with ShareGPT's spread (sigma 0.8), clipped to [8, 4 x mean]. Token ids are
    seeded random: with EOS ignored, throughput does not depend on content."""
    g = torch.Generator().manual_seed(seed)
    rng = __import__("random").Random(seed)
    out, t = [], 0.0
    sigma = 0.8
    for _ in range(n):
        t += rng.expovariate(rate)
        plen = rng.randint(*prompt_range)
        m = int(min(max(rng.lognormvariate(math.log(mean_output) - sigma * sigma / 2, sigma), 8), 4 * mean_output))
        out.append(Arrival(t, tuple(torch.randint(10, vocab, (plen,), generator=g).tolist()), m))
    return out


def replay(engine: Engine, arrivals: list[Arrival], slo_s: float | None, max_seconds: float) -> dict[str, Any]:
    """Drive the engine in real time for at most `max_seconds` after the first arrival (then the
    requests still running are aborted): per-request TTFT and TPOT (requests with two or more
    tokens, finished or not), output tokens/s over the run, per-step concurrency."""
    t0 = time.perf_counter()
    pending = list(arrivals)
    last: dict[str, Any] = {}  # request -> its latest output
    series: list[tuple[float, int, int]] = []  # (time, running, pool blocks in use)
    peak_blocks = tokens = 0
    added: list[str] = []
    end = arrivals[0].at + max_seconds
    while (pending or engine.has_work()) and time.perf_counter() - t0 < end:
        now = time.perf_counter() - t0
        while pending and pending[0].at <= now:
            a = pending.pop(0)
            added.append(engine.add_request(list(a.prompt), SamplingParams(max_tokens=a.max_tokens, temperature=0,
                                                                            ignore_eos=True)))
        if not engine.has_work():
            time.sleep(max(0.0, min(pending[0].at - now, 0.05)) if pending else 0.0)
            continue
        for o in engine.step():
            last[o.request_id] = o
            tokens += len(o.delta_ids)
        now_st = engine.stats(with_store=False)
        used = now_st.kv_blocks_total - now_st.kv_blocks_free
        peak_blocks = max(peak_blocks, used)
        series.append((time.perf_counter() - t0, now_st.running, used))
    span = time.perf_counter() - t0 - arrivals[0].at
    cut = engine.has_work() or bool(pending)
    for rid in added:
        if rid not in last or not last[rid].finished:
            engine.abort(rid)
    while engine.has_work():
        engine.step()
    tpots = [o.mean_tbt for o in last.values() if o.mean_tbt is not None]
    ttfts = [o.ttft for o in last.values() if o.ttft is not None]
    st = engine.stats(with_store=False)
    running = [r for _, r, _ in series]
    out = dict(requests=sum(o.finished for o in last.values()), started=len(last), cut=cut, output_tokens=tokens,
               seconds=span, tok_s=tokens / span,
               tpot_p50=quantile_round(tpots, 0.5), tpot_p99=quantile_round(tpots, 0.99), ttft_p50=quantile_round(ttfts, 0.5),
               ttft_p99=quantile_round(ttfts, 0.99), slo_attainment=None if slo_s is None else
               sum(t <= slo_s for t in tpots) / max(1, len(tpots)),
               # output tokens/s of the requests that finished within the SLO (DistServe's goodput)
               goodput_tok_s=None if slo_s is None else sum(
                   len(o.output_ids) for o in last.values()
                   if o.finished and o.mean_tbt is not None and o.mean_tbt <= slo_s) / span,
               concurrency_mean=statistics.fmean(running) if running else 0.0, concurrency_max=max(running, default=0),
               peak_blocks=peak_blocks, preemptions=st.preemptions, steps=st.steps,
               restored_tokens=st.counters.get("restored_tokens", 0))
    if engine.config.partial is not None:
        assert isinstance(engine.partial, PartialCaching)
        out["partial"] = engine.partial.summary()
        hist = engine.partial.stats.history
        out["mean_ratio"] = statistics.fmean(h[2] for h in hist) if hist else 0.0
    return dict(summary=out, series=series)


@dataclass(frozen=True)
class Policy:
    name: str
    partial: PartialConfig | None = None
    store: str | None = None
    ample: bool = False


def policies(slo_s: float, cost, swap_mbps: float | None, ratios: list[float]) -> list[Policy]:
    opt = PartialConfig(policy=PartialPolicy.OPTIMIZER, tpot_slo_s=slo_s, cost=cost)
    # Ample memory: the optimiser without the SLO (the machinery alone: no front is needed, so it
    # must cost nothing) and with it (the SLO then caps b below what memory allows).
    out = [Policy("full", ample=True), Policy("full+optimizer-noslo", replace(opt, tpot_slo_s=None), ample=True),
           Policy("full+optimizer", opt, ample=True), Policy("recompute"), Policy("swap", store="memory:8GB")]
    out += [Policy(f"fixed-r{r:g}", PartialConfig(policy=PartialPolicy.FIXED, ratio=r, cost=cost)) for r in ratios]
    out += [Policy("optimizer", opt), Policy("optimizer+swap", replace(opt, swap_bytes=8 << 30))]
    if swap_mbps:
        out.append(Policy(f"optimizer+swap@{swap_mbps:g}MB/s",
                          replace(opt, swap_bytes=8 << 30, swap_bandwidth=swap_mbps * 1e6)))
    return out


def run_policy(lm, pol: Policy, arrivals: list[Arrival], blocks: int, max_len: int, slo_s: float,
               max_batched_tokens: int, max_seconds: float) -> dict[str, Any]:
    per_block = ModelRunner.bytes_per_block(lm.module, BS)
    cfg = EngineConfig(kv_cache_bytes=per_block * blocks, max_model_len=max_len, partial=pol.partial,
                       max_batched_tokens=max_batched_tokens, enable_prefix_cache=False)
    reuse = ReuseConfig(method="kv", lookahead=False) if pol.store else None
    with Engine(lm, cfg, store=pol.store, reuse=reuse) as eng:
        res = replay(eng, arrivals, slo_s, max_seconds)
    return res


def unloaded_step(lm, prompt_len: int, max_len: int) -> float:
    """Mean time per output token of one request alone (the unloaded decode step)."""
    cfg = EngineConfig(kv_cache_bytes=ModelRunner.bytes_per_block(lm.module, BS) * (max_len // BS + 4),
                       max_model_len=max_len, enable_prefix_cache=False)
    ids = torch.randint(10, lm.config.vocab_size, (prompt_len,), generator=torch.Generator().manual_seed(7)).tolist()
    with Engine(lm, cfg) as eng:
        eng.generate([ids], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))  # warm-up
        tbts = [eng.generate([ids], SamplingParams(max_tokens=33, temperature=0, ignore_eos=True))[0].mean_tbt
                for _ in range(3)]
    return statistics.median(t for t in tbts if t is not None)


COLUMNS = ("model", "rate", "policy", "tok_s", "goodput_tok_s", "tpot_p50", "tpot_p99", "slo_attainment", "ttft_p50",
           "ttft_p99",
           "concurrency_mean", "concurrency_max", "preemptions", "mean_ratio")


def _cell(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.3f}" if abs(v) < 10 else f"{v:.1f}"
    return str(v)


def markdown(rows: list[dict], goals: list[dict]) -> str:
    body = [[_cell(r.get(c)) for c in COLUMNS] for r in rows]
    return "\n".join(markdown_rows(COLUMNS, body) + goal_rows(goals, "value"))


def plot(series: dict[str, list], rows: list[dict], path: str) -> None:
    plt = pyplot()

    fig, (a1, a2, a3) = plt.subplots(1, 3, figsize=(18, 4.5))
    for key, s in series.items():
        if s:
            a1.plot([p[0] for p in s], [p[1] for p in s], label=key, lw=0.9)
    a1.set_xlabel("seconds")
    a1.set_ylabel("running sequences")
    a1.set_title("concurrency over time")
    a1.legend(fontsize=6)
    labels = [f"{r['model']} {r['rate']:g}/s {r['policy']}" for r in rows]
    y = range(len(rows))
    a2.barh(y, [r["tok_s"] for r in rows], color="tab:blue")
    a2.set_yticks(y, labels, fontsize=6)
    a2.set_xlabel("output tokens/s")
    a2.invert_yaxis()
    ms = [1e3 * (r["tpot_p50"] or 0) for r in rows], [1e3 * (r["tpot_p99"] or 0) for r in rows]
    a3.barh(y, ms[1], color="tab:orange", label="TPOT p99")
    a3.barh(y, ms[0], color="tab:blue", label="TPOT p50")
    a3.scatter([1e3 * r["slo_s"] for r in rows], y, marker="|", s=200, color="black", label="SLO", zorder=3)
    a3.set_yticks(y, [""] * len(rows))
    a3.set_xscale("log")
    a3.set_xlabel("ms per output token (log)")
    a3.invert_yaxis()
    a3.legend(fontsize=7)
    fig.tight_layout()
    save_figure(fig, path, dpi=120)


def cmd(args: argparse.Namespace) -> int:
    torch.set_num_threads(args.threads or torch.get_num_threads())
    meta: dict[str, Any] = dict(machine=machine_info(), args=vars(args))
    rows: list[dict] = []
    series: dict[str, list] = {}
    mape = None
    for model in args.models:
        lm = load_model(model, dtype=args.dtype, tokenizer=False)
        print(f"bench partial: {model} ({lm.dtype}), threads={torch.get_num_threads()}", flush=True)
        cost = cost_model(lm, refresh=args.recalibrate)
        err, held = held_out_error(lm, cost)
        mape = err if mape is None else max(mape, err)
        meta[f"{model}:cost_model"] = vars(cost) | dict(held_out_mape=err, held_out=[vars(s) for s in held])
        print(f"  cost model {cost}; held-out MAPE {err:.1%}", flush=True)
        max_len = args.prompt_max + 4 * args.mean_output + BS
        step = unloaded_step(lm, (args.prompt_min + args.prompt_max) // 2, max_len)
        slo = args.slo_x * step
        meta[f"{model}:unloaded_step_s"] = step
        print(f"  unloaded step {step * 1e3:.1f} ms -> TPOT SLO {slo * 1e3:.1f} ms", flush=True)
        for rate in args.rates:
            arrivals = workload(args.requests, rate, (args.prompt_min, args.prompt_max), args.mean_output,
                                lm.config.vocab_size, args.seed)
            ample = args.requests * (max_len // BS + 1)
            budget = None
            for pol in policies(slo, cost, args.swap_mbps, args.ratios):
                if args.policies and pol.name not in args.policies and not pol.ample:
                    continue
                if budget is None and not pol.ample:
                    raise SystemExit("the budget comes from the `full` run: keep it first")
                blocks = ample if pol.ample else max(budget or 0, max_len // BS + 1)
                res = run_policy(lm, pol, arrivals, blocks, max_len, slo, args.max_batched_tokens, args.duration)
                s = res["summary"]
                if pol.name == "full":
                    budget = math.ceil(args.budget_share * s["peak_blocks"])
                    meta[f"{model}@{rate}:peak_blocks"] = s["peak_blocks"]
                    meta[f"{model}@{rate}:budget_blocks"] = budget
                row = dict(model=model, rate=rate, policy=pol.name, blocks=blocks, slo_s=slo, slo_x=args.slo_x) | s
                rows.append(row)
                series[f"{model} {rate:g}/s {pol.name}"] = res["series"]
                print("  " + " ".join(f"{c}={_cell(row.get(c))}" for c in COLUMNS), flush=True)
                goals = evaluate_goals(rows, mape)
                if args.json:
                    Path(args.json).write_text(json.dumps(dict(rows=rows, goals=goals, meta=meta, series=series),
                                                          indent=1, default=str))
    goals = evaluate_goals(rows, mape)
    print(markdown(rows, goals))
    if args.plot:
        plot(series, rows, args.plot)
    return 0
