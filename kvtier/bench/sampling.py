"""`kvtier bench sampling`: decode tokens/s of the engine's batched sampler beside today's sampler.

"Today's sampler" is the per-row host sampler the engine had at commit 70df16f (kvtier/engine/
sampler.py there): the step's logits copied to the host once, then each row sampled on its own
(temperature, top-k, top-p, `torch.multinomial` from a host generator). Its code is kept below,
trimmed to what it did, as the baseline; `HostSampler` is the engine's `sample_rows` (the one
place a step's rows are sampled) calling it. It cannot apply penalties, logit_bias, min_p,
logprobs or grammars, so those rows have no baseline ("-").

Rows, at each batch size (that many prompts decoded together), temperature 1.0, top_p 0.9,
top_k 50, one seed per request: plain sampling (both samplers); every penalty on (repetition 1.1,
presence 0.5, frequency 0.5, min_p 0.05, a logit_bias on 10 tokens); logprobs 20; a JSON schema
(a nested object, an enum, an array, an integer, strings with maxLength, so the output ends: it
may end before --tokens). Rows 1-3 ignore EOS and decode --tokens tokens per request.

Decode tok/s = tokens generated after each request's first / the time from the step that gave
every request its first token to the last step (prefill excluded). Both engines share the loaded
weights; one warm-up run per row, then --repeats runs of every row interleaved (row by row, so a
slow moment of the machine hits every row alike) and the median run reported, with each row's
ratio to the baseline's plain row at the same batch size.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
import weakref
from collections.abc import Collection, Sequence
from pathlib import Path
from typing import Any

import torch

from kvtier.bench.common import machine_info, median, write_json_atomic
from kvtier.bench.report import markdown_rows, pyplot, rich_table, save_figure
from kvtier.dtypes import name_of
from kvtier.engine.config import EngineConfig
from kvtier.engine.engine import Engine
from kvtier.engine.request import GrammarSpec, SamplingParams
from kvtier.engine.runner.model_runner import ModelRunner
from kvtier.engine.sampler import Row, Sampled
from kvtier.models.loading import LoadedModel, load_model
from kvtier.text import stdlib_text

BASELINE_COMMIT = "70df16f"


# ----- the baseline: today's per-row host sampler (kvtier/engine/sampler.py at 70df16f) ----------
def host_make_generator(params: SamplingParams) -> torch.Generator | None:
    """A host generator: sampling runs on host logits, so a seed gives the same tokens on every device."""
    if params.greedy:
        return None
    g = torch.Generator()
    g.manual_seed(params.seed if params.seed is not None else torch.seed())
    return g


def host_sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """logits: [vocab] fp32 -> token id."""
    if params.greedy:
        return int(torch.argmax(logits))
    logits = logits / params.temperature
    if params.top_k > 0:
        kth = torch.topk(logits, min(params.top_k, logits.shape[-1])).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_p, order = torch.sort(probs, descending=True)
        # Keep the smallest set whose mass reaches top_p (the token crossing the line stays in).
        drop = torch.cumsum(sorted_p, 0) - sorted_p >= params.top_p
        drop[0] = False  # the most likely token always stays, however small top_p is
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_p)
    return int(torch.multinomial(probs, 1, generator=generator))


def host_sample_rows(logits: torch.Tensor, params: Sequence[SamplingParams],
                     generators: Sequence[torch.Generator | None]) -> list[int]:
    """logits: [n, vocab] fp32 on any device -> n token ids, with exactly one device-to-host
    transfer (the argmax ids when every row is greedy, else the logits once)."""
    if all(p.greedy for p in params):
        return logits.argmax(dim=-1).tolist()
    host = logits.cpu()
    return [host_sample(host[i], p, g) for i, (p, g) in enumerate(zip(params, generators))]


def host_sampler_can(params: SamplingParams) -> bool:
    """What the baseline sampler honours: temperature, top_k, top_p and the seed, nothing else."""
    return (not params.penalized and params.min_p == 0.0 and not params.logit_bias and params.logprobs is None
            and params.structured is None and params.min_tokens == 0 and not params.stop_token_ids)


class HostSampler:
    """Today's sampler as the engine's `sample_rows`: every row of a step sampled on the host, one
    by one, from a host generator per request (as at 70df16f). Refuses rows it cannot sample
    faithfully."""

    def __init__(self) -> None:
        # Keyed by the engine's own generator for the request: one host generator per request,
        # forgotten with it.
        self._host: weakref.WeakKeyDictionary[torch.Generator, torch.Generator | None] = weakref.WeakKeyDictionary()

    def __call__(self, logits: torch.Tensor, rows: Sequence[Row], stop_ids: Collection[int]) -> list[Sampled]:
        params, gens = [], []
        for row in rows:
            p = row.params
            if not host_sampler_can(p):
                raise ValueError(f"the {BASELINE_COMMIT} host sampler cannot sample {p}")
            gen = None
            if row.generator is not None:
                if row.generator not in self._host:
                    self._host[row.generator] = host_make_generator(p)
                gen = self._host[row.generator]
            params.append(p)
            gens.append(gen)
        return [Sampled(t, None) for t in host_sample_rows(logits, params, gens)]


# ----- rows -----------------------------------------------------------------------------------------
# A nested object with an enum, an array and an integer; every string has a maxLength, the array a
# maxItems and the integer bounds, so every output ends.
SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 24},
        "kind": {"enum": ["book", "film", "song", "game"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 10}, "maxItems": 3},
        "year": {"type": "integer", "minimum": 1900, "maximum": 2100},
        "author": {
            "type": "object",
            "properties": {"name": {"type": "string", "maxLength": 16},
                           "country": {"type": "string", "maxLength": 12}},
            "required": ["name", "country"],
            "additionalProperties": False,
        },
    },
    "required": ["title", "kind", "tags", "year", "author"],
    "additionalProperties": False,
}

BIASED_TOKENS = tuple(range(1000, 11000, 1000))  # 10 token ids, each logit_bias -5 (well inside any vocabulary)


@dataclasses.dataclass(frozen=True)
class RowSpec:
    key: str
    label: str
    params: dict[str, Any]  # beside the shared temperature / top_p / top_k / seed / max_tokens
    baseline: bool  # today's sampler runs it too


ROWS = (
    RowSpec("plain", "plain sampling", dict(ignore_eos=True), True),
    RowSpec("penalties", "penalties + min_p + logit_bias", dict(
        ignore_eos=True, repetition_penalty=1.1, presence_penalty=0.5, frequency_penalty=0.5, min_p=0.05,
        logit_bias=tuple((t, -5.0) for t in BIASED_TOKENS)), False),
    RowSpec("logprobs", "logprobs 20", dict(ignore_eos=True, logprobs=20), False),
    RowSpec("json", "JSON schema", dict(structured=GrammarSpec("json_schema", json.dumps(SCHEMA))), False),
)
SAMPLERS = ("batched", "host")  # the engine's sample_batch, today's per-row host sampler


def request_params(spec: RowSpec, tokens: int, seed: int) -> SamplingParams:
    return SamplingParams(max_tokens=tokens, temperature=1.0, top_p=0.9, top_k=50, seed=seed, **spec.params)


# ----- measuring ------------------------------------------------------------------------------------
def prompts_for(loaded: LoadedModel, n: int, length: int) -> list[list[int]]:
    """n prompts of `length` tokens: consecutive windows of real text (stdlib docstrings), or random
    ids for a model without a tokenizer."""
    tok = loaded.tokenizer
    if tok is None:
        g = torch.Generator().manual_seed(0)
        return [torch.randint(100, loaded.config.vocab_size, (length,), generator=g).tolist() for _ in range(n)]
    ids: list[int] = []
    chars = n * length * 6
    while len(ids) < n * length:
        ids = tok.encode(stdlib_text(chars), add_special_tokens=False)
        chars *= 2
    return [ids[i * length:(i + 1) * length] for i in range(n)]


@dataclasses.dataclass(frozen=True)
class Run:
    tokens: int  # generated after each request's first, summed over the batch
    seconds: float  # from the step that gave every request its first token to the last step

    @property
    def tok_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 and self.tokens > 0 else float("nan")


def decode_run(engine: Engine, prompts: Sequence[Sequence[int]], params: Sequence[SamplingParams]) -> Run:
    """Run the batch to completion; time its decode only (prefill excluded)."""
    rids = {engine.add_request(p, sp) for p, sp in zip(prompts, params)}
    started: set[str] = set()
    generated: dict[str, int] = {}
    while len(started) < len(rids):  # prefill (chunked by the token budget) until every request has a token
        for o in engine.step():
            started.add(o.request_id)
            generated[o.request_id] = len(o.output_ids)
    t = time.perf_counter()
    while engine.has_work():
        for o in engine.step():
            generated[o.request_id] = len(o.output_ids)
    seconds = time.perf_counter() - t
    return Run(sum(generated[r] - 1 for r in rids), seconds)


def _engine_config(loaded: LoadedModel, batch: int, max_len: int) -> EngineConfig:
    kv = ModelRunner.bytes_per_block(loaded.module, 16) * batch * (max_len // 16 + 2)
    # No prefix cache: every run prefills its prompts alike (repeats would otherwise hit it).
    return EngineConfig(kv_cache_bytes=max(kv, 64 << 20), max_model_len=max_len, enable_prefix_cache=False)


def measure(loaded: LoadedModel, batches: Sequence[int], tokens: int, prompt_len: int, repeats: int,
            seed: int = 0, log: Any = print) -> list[dict[str, Any]]:
    """One table row per (batch, row): the median run of each sampler that can run it."""
    prompts = prompts_for(loaded, max(batches), prompt_len)
    cfg = _engine_config(loaded, max(batches), prompt_len + tokens + 16)
    engines: dict[str, Engine] = {"batched": Engine(loaded, cfg), "host": Engine(loaded, cfg, sample_rows=HostSampler())}
    out = []
    try:
        for b in batches:
            cells = [(spec, s) for spec in ROWS for s in SAMPLERS if s == "batched" or spec.baseline]
            params = {spec.key: [request_params(spec, tokens, seed + i) for i in range(b)] for spec in ROWS}

            def once(spec: RowSpec, sampler: str) -> Run:
                return decode_run(engines[sampler], prompts[:b], params[spec.key])

            for spec, s in cells:
                once(spec, s)  # warm-up: first-call costs (kernels, the grammar's compile) stay out of the runs
            runs: dict[tuple[str, str], list[Run]] = {(spec.key, s): [] for spec, s in cells}
            for r in range(repeats):
                for spec, s in cells:
                    run = once(spec, s)
                    runs[spec.key, s].append(run)
                    log(f"  batch {b} {spec.key:9s} {s:7s} run {r + 1}/{repeats}: {run.tokens:4d} tokens in "
                        f"{run.seconds:6.2f} s = {run.tok_s:7.1f} tok/s")
            base = median([x.tok_s for x in runs["plain", "host"]])
            for spec in ROWS:
                row: dict[str, Any] = dict(batch=b, row=spec.key, label=spec.label)
                for s in SAMPLERS:
                    got = runs.get((spec.key, s))
                    row[s] = None if got is None else dict(
                        tok_s=median([x.tok_s for x in got]), runs_tok_s=[round(x.tok_s, 3) for x in got],
                        tokens=[x.tokens for x in got], seconds=[round(x.seconds, 4) for x in got])
                row["vs_host_plain"] = row["batched"]["tok_s"] / base
                out.append(row)
    finally:
        for e in engines.values():
            e.close()
    return out


# ----- output ---------------------------------------------------------------------------------------
HEAD = ("batch", "row", "batched sampler tok/s", f"host sampler ({BASELINE_COMMIT}) tok/s",
        "batched / host plain", "decode tokens per run")


def _cells(rows: Sequence[dict[str, Any]]) -> list[list[str]]:
    body = []
    for r in rows:
        host = r["host"]
        body.append([str(r["batch"]), r["label"], f"{r['batched']['tok_s']:.1f}",
                     "-" if host is None else f"{host['tok_s']:.1f}", f"{r['vs_host_plain']:.2f}x",
                     f"{median(r['batched']['tokens']):.0f}"])
    return body


def machine_line(meta: dict[str, Any]) -> str:
    bf16 = "native bf16" if meta.get("cpu_native_bf16") else "no native bf16"
    return (f"{meta.get('cpu_model', '?')}, {meta.get('cpu_count', '?')} cores ({bf16}), torch "
            f"{meta.get('torch', '?')}, {meta.get('torch_threads', '?')} threads, {meta.get('dtype', '?')} on "
            f"{meta.get('device', '?')}, load {meta.get('loadavg_start', '?')} -> {meta.get('loadavg_end', '?')}")


def markdown(doc: dict[str, Any]) -> str:
    """The table and the machine, as docs/benchmarks.md shows them."""
    meta = doc["meta"]
    return "\n".join([f"Machine: {machine_line(meta)}.", "",
                      *markdown_rows(HEAD, _cells(doc["rows"]))]) + "\n"


def plot(rows: Sequence[dict[str, Any]], path: str | Path, title: str) -> None:
    """One panel per batch size: a bar per row (the host sampler's plain row first, grey), each
    labelled with its ratio to it."""
    plt = pyplot()
    batches = list(dict.fromkeys(r["batch"] for r in rows))
    fig, axes = plt.subplots(1, len(batches), figsize=(5.5 * len(batches), 4.2), squeeze=False)
    for ax, b in zip(axes[0], batches):
        mine = [r for r in rows if r["batch"] == b]
        plain = next(r for r in mine if r["row"] == "plain")
        names = [f"plain\n(host, {BASELINE_COMMIT})"] + [r["label"].replace(" + ", "\n+ ") for r in mine]
        values = [plain["host"]["tok_s"]] + [r["batched"]["tok_s"] for r in mine]
        colors = ["0.6"] + ["C0"] * len(mine)
        bars = ax.bar(range(len(values)), values, color=colors)
        for bar, v in zip(bars, values):
            ax.annotate(f"{v / values[0]:.2f}x", (bar.get_x() + bar.get_width() / 2, v), ha="center", va="bottom",
                        fontsize=8)
        ax.set_xticks(range(len(values)), names, fontsize=7)
        ax.set_ylabel("decode tokens/s (median)")
        ax.set_title(f"batch {b}")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    save_figure(fig, path)


def cmd(args: argparse.Namespace) -> int:
    from rich.console import Console

    for name in ("tokens", "prompt_len", "repeats"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be at least 1")
    if any(b < 1 for b in args.batch) or not args.batch:
        raise ValueError("--batch: batch sizes of at least 1")
    console = Console(width=None if sys.stdout.isatty() else 200)
    loaded = load_model(args.model, dtype=args.dtype, device=args.device)
    dtype, device = name_of(loaded.dtype), str(loaded.module.lm_head.weight.device)
    meta: dict[str, Any] = dict(machine_info(), model=args.model, dtype=dtype, device=device,
                                tokens=args.tokens, prompt_len=args.prompt_len, repeats=args.repeats,
                                batches=list(args.batch), seed=args.seed, baseline_commit=BASELINE_COMMIT,
                                schema=SCHEMA, biased_tokens=list(BIASED_TOKENS))
    console.print(f"bench sampling: {args.model} ({dtype} on {device}), {args.tokens} tokens after "
                  f"{args.prompt_len}-token prompts, batches {list(args.batch)}, median of {args.repeats}")
    rows = measure(loaded, args.batch, args.tokens, args.prompt_len, args.repeats, args.seed,
                   log=lambda s: console.print(s, highlight=False))
    meta["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    doc = dict(meta=meta, rows=rows)
    out = Path(args.out)
    title = (f"kvtier bench sampling: {args.model} {dtype}, {args.tokens} tokens, temperature 1, top_p 0.9, "
             f"top_k 50 (median of {args.repeats})")
    console.print(rich_table(title, HEAD, _cells(rows), right=HEAD[2:]))
    console.print(f"machine: {machine_line(meta)}", highlight=False)
    write_json_atomic(out / "sampling.json", doc)
    (out / "sampling.md").write_text(markdown(doc))
    plot(rows, out / "sampling.png", title)
    console.print(f"wrote {out / 'sampling.json'}, {out / 'sampling.md'}, {out / 'sampling.png'}")
    return 0
