"""`kvtier bench blend`: blended restores (non-prefix reuse of documents' state computed alone:
naive, EPIC/LegoLink, CacheBlend) against a full prefill and exact prefix reuse, on MuSiQue
questions with ten retrieved passages each, in a shuffled order.

Every row runs on the same token ids per question: `full` (nothing reused, the reference),
`prefix` (exact prefix reuse after a request with the passages in another order), `naive`,
`legolink-K` and `cacheblend-R`. Columns: the share of the prompt computed, first-token agreement
with full (Wilson 95%), mean KL(full || row) of the first token's distribution (bootstrap 95%),
leading output tokens equal to full's, answer token F1 against full's answer and the gold ones,
TTFT from a memory store and, for full and the default legolink and cacheblend rows, from a cold
disk, each beside its roofline (bench/roofline's rates measured in the same run; the disk's read
bandwidth measured cold on the store's own files).

Data: MuSiQue (Trivedi et al., TACL 2022, CC BY 4.0), the first 100 of the CacheBlend paper's 150
questions, read from --data (never copied into the repository). --synthetic (or a model without a
tokenizer) runs random ids laid out the same way, for random-weight models.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from kvtier.bench.blend import data as blend_data
from kvtier.bench.blend.ideal import FlopModel, ideal, row_flops
from kvtier.bench.blend.metrics import Sample, best_f1, kl_first, leading_equal, summarize, token_f1
from kvtier.bench.blend.report import plot, table
from kvtier.bench.common import drop_page_cache, machine_info, pinned_copy_rate, read_bandwidth, write_json_atomic
from kvtier.bench.roofline import Rates, measure
from kvtier.device import describe
from kvtier.engine import prompts as prompts_
from kvtier.engine.config import ReuseConfig
from kvtier.engine.engine import Engine, RequestOutput
from kvtier.engine.request import SamplingParams
from kvtier.models.loading import LoadedModel, load_model
from kvtier.planning.blend import BlendMode, BlendOptions, BlendScore

PREFIX_SALT = "bench-prefix"  # the prefix row's own chains: the blended rows never see them


@dataclass(frozen=True)
class RowSpec:
    name: str
    blend: BlendOptions | None  # None: an exact row (full, prefix)


def row_specs(link_tokens: Sequence[int], ratios: Sequence[float], check_layer: int, score: str) -> list[RowSpec]:
    return ([RowSpec("naive", BlendOptions(mode="naive"))]
            + [RowSpec(f"legolink-{k}", BlendOptions(link_tokens=k)) for k in link_tokens]
            + [RowSpec(f"cacheblend-{r:g}", BlendOptions(mode="cacheblend", ratio=r, check_layer=check_layer, score=score))
               for r in ratios])


def disk_specs(check_layer: int, score: str) -> list[RowSpec]:
    """The rows timed from a cold disk: full and the engine's default legolink and cacheblend."""
    d = BlendOptions()
    return [RowSpec("full", None), RowSpec(f"legolink-{d.link_tokens}", d),
            RowSpec(f"cacheblend-{d.ratio:g}", BlendOptions(mode="cacheblend", ratio=d.ratio, check_layer=check_layer,
                                                            score=score))]


def _serve(engine: Engine, ids: Sequence[int], spans: Sequence[tuple[int, int]], params: SamplingParams,
           blend: BlendOptions | bool, cache_prompt: bool = True, salt: str | None = None) -> RequestOutput:
    """One request alone in the engine, run to its end."""
    rid = engine.add_request(list(ids), params, cache_salt=salt, cache_prompt=cache_prompt, segments=spans,
                             blend=blend)
    while True:
        for out in engine.step():
            if out.finished and out.request_id == rid:
                return out


def _blended(engine: Engine, ids: Sequence[int], params: SamplingParams, spans: Sequence[tuple[int, int]],
             blend: BlendOptions) -> RequestOutput:
    """A blended row, then the exact state it kept (the chunks it saved before its first loaded
    row, its blocks in the device prefix cache) forgotten: each row starts from the same store
    and device, whatever row ran before it."""
    out = _serve(engine, ids, spans, params, blend=blend)
    engine.flush(600)
    engine.store.discard(engine.store.keys_for(ids))
    engine.reset_prefix_cache()
    return out


def _computed(out: RequestOutput) -> int:
    """Prompt tokens the row computed: a blend's recomputed ones and the last, else those not reused."""
    r = out.restore
    if r is not None and r.method == "blend" and r.recomputed_tokens is not None:
        return r.recomputed_tokens + 1
    return out.prompt_tokens - out.prompt_tokens_reused


def _answer(out: RequestOutput, synthetic: bool) -> str:
    """The answer as text; random ids' answers as their ids (F1 then counts shared ids)."""
    return " ".join(map(str, out.output_ids)) if synthetic else out.text


def _sample(p: blend_data.Prompt, out: RequestOutput, full: RequestOutput, synthetic: bool) -> Sample:
    assert out.first_logits is not None and full.first_logits is not None  # SamplingParams(first_logits=True)
    answer = _answer(out, synthetic)
    computed = _computed(out)
    return Sample(question=p.index, recomputed_share=computed / out.prompt_tokens,
                  first_token_equal=out.output_ids[:1] == full.output_ids[:1],
                  kl=kl_first(full.first_logits, out.first_logits),
                  leading_equal=leading_equal(out.output_ids, full.output_ids),
                  f1_full=token_f1(answer, _answer(full, synthetic)), f1_gold=best_f1(answer, p.answers),
                  ttft_s=out.ttft or float("nan"), bytes_read=out.restore.bytes_read if out.restore else 0,
                  recomputed_tokens=computed, text=answer)


@dataclass
class Context:
    """What every pass needs: the model, its FLOP model, the settings."""

    loaded: LoadedModel
    args: argparse.Namespace
    synthetic: bool
    fm: FlopModel
    params: SamplingParams


def _engine(ctx: Context, store: str) -> Engine:
    return Engine(ctx.loaded, store=store, reuse=ReuseConfig(chunk_tokens=ctx.args.chunk_tokens, blend=BlendOptions()))


def _raw(s: Sample, ctx: Context, p: blend_data.Prompt, blend: BlendOptions | None) -> dict:
    """A sample as the JSON keeps it, with the FLOPs its first token took (its ideal comes later)."""
    return asdict(s) | dict(flops=row_flops(ctx.fm, p.ids, p.spans, blend, s.recomputed_tokens))


def fill_ideals(raws: Sequence[dict], bandwidth: float, rates: Rates) -> None:
    """Each sample's roofline, its reads at `bandwidth` (the memory copy's or the disk's)."""
    for r in raws:
        i = ideal(r["bytes_read"], r["flops"], bandwidth, rates)
        r.update(ideal_read_s=i.read_s, ideal_compute_s=i.compute_s, ideal_s=i.seconds)


def _prefix_row(engine: Engine, p: blend_data.Prompt, params: SamplingParams) -> RequestOutput:
    """Exact prefix reuse as a server gets it: a request with the passages in another order
    served and saved first, then this prompt (its own salt: the blended rows never reuse it)."""
    _serve(engine, p.warm_ids, (), SamplingParams(max_tokens=1, temperature=0.0), blend=False, salt=PREFIX_SALT)
    engine.flush(600)
    return _serve(engine, p.ids, p.spans, params, blend=False, salt=PREFIX_SALT)


def _warm_up(engine: Engine, p: blend_data.Prompt) -> None:
    """A short untimed request first: a fresh engine's first step pays one-time costs no row should."""
    _serve(engine, p.ids[:64], (), SamplingParams(max_tokens=2, temperature=0.0), blend=False, cache_prompt=False)


def _question(ctx: Context, engine: Engine, p: blend_data.Prompt, specs: Sequence[RowSpec], timed: bool) -> dict:
    """Every row on one question from the memory store -> its raw record."""
    engine.precompile(list(p.documents))  # untimed: the documents' state computed alone, stored
    engine.flush(600)
    full = _serve(engine, p.ids, p.spans, ctx.params, blend=False, cache_prompt=False)
    rows = {"full": _raw(_sample(p, full, full, ctx.synthetic), ctx, p, None)}
    for spec in specs:
        assert spec.blend is not None
        out = _blended(engine, p.ids, ctx.params, p.spans, spec.blend)
        rows[spec.name] = _raw(_sample(p, out, full, ctx.synthetic), ctx, p, spec.blend)
        rows[spec.name]["method"] = out.restore.method if out.restore else None
    if timed:
        rows["prefix"] = _raw(_sample(p, _prefix_row(engine, p, ctx.params), full, ctx.synthetic), ctx, p, None)
    return dict(index=p.index, question=p.question, answers=list(p.answers), prompt_tokens=len(p.ids), rows=rows)


def _progress(i: int, n: int, rec: dict, seconds: float) -> None:
    rows = rec["rows"]
    said = "  ".join(f"{k} {v['kl']:.3g}" for k, v in rows.items() if k != "full")
    print(f"[{i + 1}/{n}] q{rec['index']} {rec['prompt_tokens']} tokens, full TTFT {rows['full']['ttft_s']:.1f} s, "
          f"{seconds:.0f} s in all; KL: {said}", flush=True)


def memory_pass(ctx: Context, prompts: Sequence[blend_data.Prompt], specs: Sequence[RowSpec]) -> Iterator[dict]:
    """Each question's raw record, as it is done (a long run's JSON is written after each)."""
    with _engine(ctx, ctx.args.store) as engine:
        if prompts:
            _warm_up(engine, prompts[0])
        for i, p in enumerate(prompts):
            t0 = time.perf_counter()
            record = _question(ctx, engine, p, specs, p.index - ctx.args.offset < ctx.args.speed_n)
            _progress(i, len(prompts), record, time.perf_counter() - t0)
            yield record


def disk_pass(ctx: Context, prompts: Sequence[blend_data.Prompt]) -> tuple[list[dict], float | None]:
    """The disk rows on the first --speed-n questions, the page cache evicted before each request
    -> (raw records, the disk's cold read bandwidth over the store's files)."""
    prompts = prompts[: ctx.args.speed_n]
    if not prompts:
        return [], None
    root = Path(ctx.args.dir or tempfile.mkdtemp(prefix="kvtier-blend-"))
    out: list[tuple[blend_data.Prompt, RowSpec, Sample]] = []
    with _engine(ctx, f"disk:{root}/store:{ctx.args.disk_size}") as engine:
        _warm_up(engine, prompts[0])
        for p in prompts:
            engine.precompile(list(p.documents))
            engine.flush(600)
            full = None
            for spec in disk_specs(ctx.args.check_layer, ctx.args.score):
                drop_page_cache(root)
                o = _blended(engine, p.ids, ctx.params, p.spans, spec.blend) if spec.blend else \
                    _serve(engine, p.ids, p.spans, ctx.params, blend=False, cache_prompt=False)
                full = full or o
                out.append((p, spec, _sample(p, o, full, ctx.synthetic)))
                print(f"  cold disk q{p.index} {spec.name}: TTFT {o.ttft or 0:.2f} s, read "
                      f"{out[-1][2].bytes_read / 1e6:.0f} MB", flush=True)
    bandwidth = read_bandwidth(f for f in root.rglob("*") if f.is_file())
    return [dict(row=spec.name, **_raw(s, ctx, p, spec.blend)) for p, spec, s in out], bandwidth


def _median(xs: Sequence[float]) -> float | None:
    return statistics.median(xs) if xs else None


def summary_rows(records: Sequence[dict], disk: Sequence[dict], specs: Sequence[RowSpec]) -> list[dict]:
    """One row per method: its fidelity and memory TTFT over the questions, its cold-disk TTFT."""
    names = ["full", "prefix", *(s.name for s in specs)]
    blends = {s.name: s.blend for s in specs}
    rows = []
    for name in names:
        raw = [r["rows"][name] for r in records if name in r["rows"]]
        if not raw:
            continue
        fields = set(Sample.__dataclass_fields__)
        row = dict(row=name, **summarize([Sample(**{k: v for k, v in x.items() if k in fields}) for x in raw]))
        b = blends.get(name)
        row.update(mode=BlendMode(b.mode).value if b else name, link_tokens=b.link_tokens if b else None,
                   ratio=b.ratio if b else None, check_layer=b.check_layer if b and b.mode is BlendMode.CACHEBLEND else None,
                   score=BlendScore(b.score).value if b and b.mode is BlendMode.CACHEBLEND else None,
                   ideal_s=_median([x["ideal_s"] for x in raw]),
                   ideal_read_s=_median([x["ideal_read_s"] for x in raw]),
                   ideal_compute_s=_median([x["ideal_compute_s"] for x in raw]))
        cold = [d for d in disk if d["row"] == name]
        row["disk"] = dict(n=len(cold), ttft_s=_median([d["ttft_s"] for d in cold]),
                           ideal_s=_median([d["ideal_s"] for d in cold]),
                           bytes_read=_median([d["bytes_read"] for d in cold])) if cold else None
        rows.append(row)
    return rows


def _prompts(loaded: LoadedModel, args: argparse.Namespace, synthetic: bool) -> list[blend_data.Prompt]:
    if synthetic:
        return [blend_data.synthetic_prompt(loaded.config.vocab_size, args.offset + i, args.seed, args.passage_tokens)
                for i in range(args.n)]
    questions = blend_data.load_questions(blend_data.data_path(args.data), args.offset, args.n)

    def encode(prompt: str | Sequence[int]) -> list[int]:  # the engine's own (Engine.encode)
        return prompts_.encode(loaded, prompt)

    return [blend_data.text_prompt(encode, loaded.tokenizer, q, args.offset + i, args.seed)
            for i, q in enumerate(questions)]


# What a resumed run must share with the run it continues, for their questions to be one sample.
RESUME_KEYS = ("model", "dtype", "device", "data", "offset", "max_tokens", "link_tokens", "ratios", "check_layer", "score", "store",
               "chunk_tokens", "passage_tokens", "seed", "synthetic")


def resumed(args: argparse.Namespace, synthetic: bool) -> tuple[list[dict], list[dict], float | None]:
    """What the run in --json already measured -> (its question records, cold-disk records, disk
    bandwidth); nothing where the file does not exist yet. Exits naming the settings that differ."""
    if not args.json:
        raise SystemExit("--resume continues the run in --json FILE: give --json")
    path = Path(args.json)
    if not path.is_file():
        return [], [], None
    try:
        doc = json.loads(path.read_text())
        if not isinstance(doc, dict) or not isinstance(doc.get("questions", []), list):
            raise ValueError("not a bench blend JSON")
    except (ValueError, UnicodeDecodeError) as e:
        raise SystemExit(f"--resume: {args.json} is not a bench blend run's JSON ({e})") from None
    now = vars(args) | dict(synthetic=synthetic)
    old = doc.get("settings", {})
    if differ := [k for k in RESUME_KEYS if old.get(k) != now.get(k)]:
        said = ", ".join(f"--{k.replace('_', '-')} {old.get(k)!r} there, {now.get(k)!r} now" for k in differ)
        raise SystemExit(f"--resume: {args.json} was run with other settings ({said})")
    return list(doc.get("questions", [])), list(doc.get("disk", [])), doc.get("rates", {}).get("disk_bandwidth")


def _rates(device: torch.device, dtype: torch.dtype, repeats: int) -> Rates:
    """The matmul rate, and the bandwidth the memory tier's reads reach: a copy in host memory on
    the CPU; on a GPU the tier lives in pinned host memory, so a pinned host-to-device copy."""
    rates = measure(device, dtype, repeats)
    if device.type == "cuda":
        rates = replace(rates, bandwidth=pinned_copy_rate(device, reps=repeats))
    return rates


def _best(a: Rates, b: Rates) -> Rates:
    """The faster of two measurements of each rate: the one other work on the machine disturbed least."""
    return Rates(max(a.bandwidth, b.bandwidth), max(a.flops, b.flops))


def _document(ctx: Context, path: Path, records: list[dict], disk: list[dict], disk_bw: float | None,
              rates: Sequence[Rates], specs: Sequence[RowSpec], kept: int = 0, disk_kept: bool = False) -> dict:
    """The JSON document: settings, machine, rates, rows, every question's raw values. The first
    `kept` records (and the disk rows where `disk_kept`) come from a resumed run: their ideals stay
    those of the rates measured when they ran."""
    best = _best(*rates)
    fill_ideals([r for rec in records[kept:] for r in rec["rows"].values()], best.bandwidth, best)
    if not disk_kept:
        fill_ideals(disk, disk_bw or float("nan"), best)
    settings = {k: v for k, v in vars(ctx.args).items() if k not in ("func", "replot")} | dict(synthetic=ctx.synthetic)
    machine = machine_info() | dict(loadavg_end=[round(x, 2) for x in os.getloadavg()],
                                    device=describe(next(ctx.loaded.module.parameters()).device))
    return dict(bench="blend", model=ctx.args.model, dtype=ctx.args.dtype, settings=settings,
                data=None if ctx.synthetic else dict(path=str(path), attribution=blend_data.ATTRIBUTION),
                machine=machine, date=time.strftime("%Y-%m-%d"),
                rates=dict(flops=best.flops, memory_bandwidth=best.bandwidth, disk_bandwidth=disk_bw,
                           measured=[asdict(r) for r in rates],
                           source="bench/roofline.measure (a matmul in the compute dtype, a copy in host memory, on a GPU a "
                                  "pinned host-to-device copy: the memory tier's reads; the faster "
                                  "of a measurement before and one after the rows); the disk's cold read of the "
                                  "store's files (bench/common.read_bandwidth); ideal = max(bytes read / bandwidth, "
                                  "FLOPs / matmul rate)"),
                rows=summary_rows(records, disk, specs), questions=records, disk=disk)


def run(args: argparse.Namespace) -> dict | None:
    """The whole benchmark -> its JSON document; None where the data is absent (skipped)."""
    synthetic = args.synthetic
    path = blend_data.data_path(args.data)
    if not synthetic and not path.is_file():
        print(f"skipped: no MuSiQue data at {path} (give --data PATH or set ${blend_data.DATA_ENV}; "
              "--synthetic runs random ids)")
        return None
    loaded = load_model(args.model, dtype=args.dtype, device=args.device, tokenizer=not synthetic)
    if loaded.tokenizer is None and not synthetic:
        print(f"{args.model} has no tokenizer: running random ids (--synthetic)")
        synthetic = True
    torch.manual_seed(0)
    prompts = _prompts(loaded, args, synthetic)
    device = next(loaded.module.parameters()).device
    repeats = 1 if synthetic else 5  # random ids are for tests: a second or two, not five runs per rate
    before = _rates(device, loaded.dtype, repeats)
    ctx = Context(loaded, args, synthetic, FlopModel.of(loaded.module),
                  SamplingParams(max_tokens=args.max_tokens, temperature=0.0, first_logits=True))
    specs = row_specs(args.link_tokens, args.ratios, args.check_layer, args.score)
    records, disk, disk_bw = resumed(args, synthetic) if args.resume else ([], [], None)
    if records or disk:
        print(f"resuming {args.json}: {len(records)} questions and {len(disk)} cold-disk rows kept", flush=True)
    kept, disk_kept = len(records), bool(disk)
    if not disk:
        disk, disk_bw = disk_pass(ctx, prompts)
    done = {r["index"] for r in records}
    for record in memory_pass(ctx, [p for p in prompts if p.index not in done], specs):
        records.append(record)
        if args.json:  # what is done so far, should the run be stopped early
            write_json_atomic(args.json, _document(ctx, path, records, disk, disk_bw, (before, before), specs,
                                                   kept, disk_kept))
    after = _rates(device, loaded.dtype, repeats)
    return _document(ctx, path, records, disk, disk_bw, (before, after), specs, kept, disk_kept)


def cmd(args: argparse.Namespace) -> int:
    if args.replot:  # a figure from an earlier run's JSON
        doc = json.loads(Path(args.replot).read_text())
        plot(doc, args.plot or str(Path(args.replot).with_suffix(".png")))
        return 0
    doc = run(args)
    if doc is None:
        return 0
    print(table(doc))
    if args.json:
        write_json_atomic(args.json, doc)
    if args.plot:
        plot(doc, args.plot)
    return 0
