"""`kvtier bench forward`: prefill and decode throughput of our engine beside HF transformers.

Both run the same weights, dtype and thread count in the same process; figures are medians of
`--repeats` runs. Our prefill runs through `Engine.generate` with the default per-step token budget
(so prompts over 2048 tokens are prefilled in chunks, as users run them); HF's is one forward with
`logits_to_keep=1`, so it is not charged for logits we skip too. `--device cuda` runs both on the
GPU (times include the device work: each timed region ends with a synchronize); `--saving` adds
decode rows with every token's state saved to a memory tier (HCache Fig. 14's setting), beside the
same decode without saving: `decode+save` once the prompts' own saves are written (what saving the
decoded tokens costs), `decode+save+backlog` while the writer still writes them (a burst of long
prompts just arrived). `continuation` rows time a chunk of new tokens after a history the
engine holds in its prefix cache (HF: the same chunk on a cache of that history). `--modes
exact,inexact` runs our rows twice, the exact default and `--fast-inexact`, so the cost of
exactness comes from the same run (each row's modes back to back, their order alternating from row
to row, so a machine's drift falls on both); mode `eager` is the exact engine with its decode steps
dynamic (no static buffers, no CUDA graphs: `--enforce-eager`).

Decode rows also time HF with a static cache under `torch.compile(mode="reduce-overhead")` (the
gpt-fast recipe: one CUDA graph per step) where `--hf-compiled` is on (by default on a GPU), and
every row is set beside its roofline (bench/roofline.py: this machine's copy bandwidth and matmul
rate, measured in the same run).
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from kvtier.bench import roofline
from kvtier.dtypes import name_of

# One warm-up call, then the median of `repeats` synchronized calls: the calibration's own timer.
from kvtier.engine.calibrate.hardware import _sync, load_or_measure
from kvtier.engine.calibrate.hardware import _time as median_time
from kvtier.engine.config import EngineConfig, ReuseConfig
from kvtier.engine.engine import Engine
from kvtier.engine.request import SamplingParams
from kvtier.engine.runner.model_runner import ModelRunner
from kvtier.models.loading import load_model
from kvtier.paths import home


@dataclass(frozen=True)
class Row:
    model: str
    dtype: str
    # "prefill", "continuation", "decode", "decode+save", "decode+save+backlog" (hf_tok_s: the same
    # decode without saving) or "decode+restore" (kvtier_tok_s: batch / median TBT while contexts
    # restore; hf_tok_s: the same decode alone, just before)
    phase: str
    tokens: int  # prompt length (prefill), new tokens (continuation) or batch size (decode)
    kvtier_tok_s: float
    hf_tok_s: float
    repeats: int
    mode: str = "exact"  # "exact" (the default), "inexact" (--fast-inexact) or "eager" (exact, dynamic decode)
    roofline_tok_s: float = float("nan")  # the fastest this row can run here (bench/roofline.py)
    hf_compiled_tok_s: float = float("nan")  # HF, static cache, torch.compile reduce-overhead (decode rows)

    @property
    def of_roofline(self) -> float:
        return self.kvtier_tok_s / self.roofline_tok_s

    @property
    def speedup(self) -> float:
        return self.kvtier_tok_s / self.hf_tok_s


def _prompt(n: int, vocab: int, seed: int) -> list[int]:
    return torch.randint(100, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


MODES = {"exact": {}, "inexact": {"exact": False}, "eager": {"static_decode": False}}
_MODE: dict = {}  # EngineConfig settings of the mode `run` is in


def _engine(loaded, max_len: int, seqs: int = 1, store: str | None = None, prefix_cache: bool = False) -> Engine:
    # The device's default per-step token budget, as users run it: a long prompt is prefilled in
    # chunks of it (2048 tokens on a CPU, 16384 on a GPU). With a store, the engine plans with this
    # machine's measured profile, as a server's does (built without one, it plans with a saved one
    # or a rough estimate: read buffers and the restore compute charged to step budgets a guess's).
    kv = ModelRunner.bytes_per_block(loaded.module, 16) * seqs * (max_len // 16 + 2)
    return Engine(loaded, EngineConfig(kv_cache_bytes=max(kv, 256 << 20), max_model_len=max_len, max_num_seqs=max(seqs, 8),
                                       enable_prefix_cache=prefix_cache, **_MODE),
                  store=store, reuse=ReuseConfig(method="kv", lookahead=False) if store else None,
                  profile=load_or_measure(loaded, home(), store) if store else None)


def bench_prefill(loaded, hf, length: int, repeats: int) -> tuple[float, float]:
    ids = _prompt(length, loaded.config.vocab_size, length)
    engine = _engine(loaded, max(length + 8, 1024))
    try:
        ours = median_time(lambda: engine.generate([ids], SamplingParams(max_tokens=1, temperature=0)), repeats)
    finally:
        engine.close()
    t = torch.tensor([ids], device=hf.lm_head.weight.device)
    with torch.inference_mode():
        theirs = median_time(lambda: hf(t, use_cache=True, logits_to_keep=1), repeats)
    return length / ours, length / theirs


def bench_continuation(loaded, hf, history: int, new: int, repeats: int) -> tuple[float, float]:
    """Tokens/s of a `new`-token chunk after a `history`-token prefix held in the device prefix
    cache (a fresh chunk each call); HF: the same chunk on a DynamicCache of the history, cut back
    to the history after each call."""
    vocab = loaded.config.vocab_size
    hist = _prompt(history, vocab, 7)
    engine = _engine(loaded, history + new + 16, prefix_cache=True)
    calls = iter(range(1 << 30))
    try:
        engine.generate([hist], SamplingParams(max_tokens=1, temperature=0))
        ours = median_time(lambda: engine.generate([hist + _prompt(new, vocab, 100 + next(calls))],
                                                   SamplingParams(max_tokens=1, temperature=0)), repeats)
    finally:
        engine.close()
    dev = hf.lm_head.weight.device
    with torch.inference_mode():
        past = hf(torch.tensor([hist], device=dev), use_cache=True, logits_to_keep=1).past_key_values
        chunk = torch.tensor([_prompt(new, vocab, 99)], device=dev)

        def hf_chunk() -> None:
            hf(chunk, past_key_values=past, use_cache=True, logits_to_keep=1)
            past.crop(-new)  # back to the history (this transformers takes the tokens to drop)

        theirs = median_time(hf_chunk, repeats)
    return new / ours, new / theirs


def bench_decode(loaded, hf, batch: int, prompt_len: int, new: int, repeats: int,
                 store: str | None = None, drain: bool = False) -> tuple[float, float]:
    """Decode tokens/s of `batch` sequences after `prompt_len`-token prompts: kvtier's engine (with
    `store`, saving every token's state; `drain`: the prompts' saves written before the timed
    decode) and HF transformers' (nan when hf is None)."""
    ours = batch * new / _engine_decode(loaded, batch, prompt_len, new, repeats, store, drain)
    if hf is None:
        return ours, float("nan")
    prompts = [_prompt(prompt_len, loaded.config.vocab_size, 1000 + i) for i in range(batch)]
    hf_decode_s(hf, prompts, new)
    return ours, batch * new / statistics.median(hf_decode_s(hf, prompts, new) for _ in range(repeats))


def hf_decode_s(hf, prompts: list[list[int]], new: int) -> float:
    """Seconds HF transformers takes to decode `new` greedy tokens for equal-length `prompts`,
    continuing the cache of their prefill (not timed)."""
    with torch.inference_mode():
        ids = torch.tensor(prompts, device=hf.lm_head.weight.device)
        out = hf(ids, use_cache=True, logits_to_keep=1)
        nxt = out.logits[:, -1].argmax(-1, keepdim=True)
        past = out.past_key_values
        _sync()
        t = time.perf_counter()
        for _ in range(new):
            out = hf(nxt, past_key_values=past, use_cache=True)
            past, nxt = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
        _sync()
        return time.perf_counter() - t


def _engine_decode(loaded, batch: int, prompt_len: int, new: int, repeats: int, store: str | None,
                   drain: bool) -> float:
    """Median seconds of kvtier decoding `new` tokens for `batch` sequences. Its own function, so
    the engine's pool is freed before HF allocates a cache as large (an 8B model at 32 x 8K: 32 GB)."""
    prompts = [_prompt(prompt_len, loaded.config.vocab_size, 1000 + i) for i in range(batch)]
    engine = _engine(loaded, prompt_len + new + 16, batch, store)
    params = SamplingParams(max_tokens=new + 1, temperature=0, ignore_eos=True)
    calls = [0]

    def ours_decode() -> float:
        started: set[str] = set()
        calls[0] += 1
        fresh = store is not None  # new prompts each time: none is restored from the last call's saves
        for i, p in enumerate(prompts):
            engine.add_request(_prompt(prompt_len, loaded.config.vocab_size, 7919 * calls[0] + i) if fresh else p, params)
        while len(started) < batch:  # prefill (chunked by the token budget) until every request has a token
            started |= {o.request_id for o in engine.step()}
        if drain:
            engine.flush()
        t = time.perf_counter()
        while engine.has_work():
            engine.step()
        return time.perf_counter() - t

    try:
        ours_decode()  # warm-up
        return statistics.median(ours_decode() for _ in range(repeats))
    finally:
        engine.close()


def bench_decode_restoring(loaded, batch: int, prompt_len: int, new: int, repeats: int,
                           returning: int = 2) -> tuple[float, float, float, float]:
    """Time between tokens of `batch` decoding sequences (`prompt_len` contexts) with nothing else
    to do, then while `returning` contexts of the same length restore from a memory tier (saved
    earlier, then dropped from the device) until each has its first token: -> (median TBT
    alone, median TBT while restoring, p90 of the latter, restores seen), over `repeats` rounds
    with fresh returning contexts."""
    vocab = loaded.config.vocab_size
    engine = _engine(loaded, prompt_len + 64 + new * (repeats + 2) * 4, batch + returning, "memory:16GB")
    alone: list[float] = []
    during: list[float] = []
    restored = 0
    try:
        decoding = SamplingParams(max_tokens=new * (repeats + 1) * 4, temperature=0, ignore_eos=True)
        for i in range(batch):
            engine.add_request(_prompt(prompt_len, vocab, 4000 + i), decoding)
        started: set[str] = set()
        while len(started) < batch:
            started |= {o.request_id for o in engine.step()}
        for rnd in range(repeats):
            saved = [_prompt(prompt_len, vocab, 5000 + 97 * rnd + i) for i in range(returning)]
            # Saved through the engine's own saver (the batch decoding beside them), then written.
            pending = {engine.add_request(p, SamplingParams(max_tokens=1, temperature=0)) for p in saved}
            while pending:
                pending -= {o.request_id for o in engine.step() if o.finished}
            engine.flush()
            for _ in range(new):  # decode alone
                t = time.perf_counter()
                engine.step()
                alone.append(time.perf_counter() - t)
            waiting = {engine.add_request(p + _prompt(64, vocab, 6000 + 97 * rnd + i),
                                          SamplingParams(max_tokens=2, temperature=0)) for i, p in enumerate(saved)}
            while waiting:  # until every returning context has its first token
                t = time.perf_counter()
                outs = engine.step()
                during.append(time.perf_counter() - t)
                for o in outs:
                    if o.request_id in waiting and o.output_ids:
                        waiting.discard(o.request_id)
                        restored += o.prompt_tokens_reused > 0
    finally:
        engine.close()
    during.sort()
    return (statistics.median(alone), statistics.median(during), during[int(0.9 * (len(during) - 1))], restored)


def hf_compiled_decode(hf, batch: int, prompt_len: int, new: int, repeats: int) -> float:
    """Decode tokens/s of HF with a static cache and its forward under torch.compile
    (reduce-overhead: a CUDA graph per step), the gpt-fast recipe; prefill is eager and untimed."""
    from transformers import StaticCache

    dev = hf.lm_head.weight.device
    vocab = hf.config.vocab_size
    ids = torch.tensor([_prompt(prompt_len, vocab, 1000 + i) for i in range(batch)], device=dev)
    try:  # transformers 5: sized on first use
        cache = StaticCache(config=hf.config, max_cache_len=prompt_len + new + 1)
    except TypeError:  # transformers 4
        cache = StaticCache(config=hf.config, max_batch_size=batch, max_cache_len=prompt_len + new + 1,
                            device=dev, dtype=hf.dtype)

    def forward(tok: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        return hf(tok, past_key_values=cache, cache_position=pos, use_cache=True).logits

    step = torch.compile(forward, mode="reduce-overhead", fullgraph=True)

    def timed() -> float:
        with torch.inference_mode():
            cache.reset()
            out = hf(ids, past_key_values=cache, cache_position=torch.arange(prompt_len, device=dev), use_cache=True,
                     logits_to_keep=1)
            nxt = out.logits[:, -1].argmax(-1, keepdim=True)
            positions = torch.arange(prompt_len, prompt_len + new, device=dev)
            _sync()
            t = time.perf_counter()
            for i in range(new):
                nxt = step(nxt, positions[i : i + 1])[:, -1].argmax(-1, keepdim=True)
            _sync()
            return time.perf_counter() - t

    timed()  # compiles and captures
    timed()
    return batch * new / statistics.median(timed() for _ in range(repeats))


def run(model: str, dtypes: list[str], lengths: list[int], batches: list[int], new_tokens: int, repeats: int,
        device: str = "auto", prompt_len: int = 128, saving: bool = False, modes: tuple[str, ...] = ("exact",),
        continuations: list[int] | None = None, history: int = 2048, hf_compiled: bool | None = None,
        restoring: bool = False, on_row: Callable[[list[Row]], None] | None = None) -> list[Row]:
    """Every row; `on_row` gets the rows so far as each is measured, so a run stopped part-way (a
    GPU lease's time limit) keeps what it measured."""
    from kvtier.bench.hf import build_hf

    global _MODE
    rows: list[Row] = []

    def add(row: Row) -> None:
        rows.append(row)
        if on_row is not None:
            on_row(rows)
    for dt in dtypes:
        loaded = load_model(model, dtype=dt, device=device, tokenizer=False)
        hf = build_hf(loaded)
        name = name_of(loaded.dtype)
        dev = loaded.module.lm_head.weight.device
        compiled = dev.type == "cuda" if hf_compiled is None else hf_compiled
        rates = roofline.measure(dev, loaded.dtype)
        shape = roofline.shape_of(loaded.module)
        print(f"  {name} on {dev}: copy {rates.bandwidth / 1e9:.1f} GB/s, matmul {rates.flops / 1e12:.2f} TFLOP/s",
              flush=True)
        # Each row's modes run back to back, their order alternating from row to row: a VM's speed
        # drifts over minutes, and modes run a whole table apart compared unlike machines.
        turns = itertools.count()

        def each_mode() -> Iterator[str]:
            global _MODE
            order = modes if next(turns) % 2 == 0 else modes[::-1]
            for mode in order:
                _MODE = MODES[mode]
                yield mode

        for n in lengths:
            for mode in each_mode():
                o, h = bench_prefill(loaded, hf, n, repeats)
                add(Row(model, name, "prefill", n, o, h, repeats, mode, roofline.prefill_tok_s(shape, rates, n)))
                print(f"  prefill {name} {mode} {n:5d} tokens: kvtier {o:8.1f} tok/s  transformers {h:8.1f} tok/s "
                      f"({rows[-1].of_roofline:.0%} of the roofline)", flush=True)
        for n in continuations or []:
            for mode in each_mode():
                o, h = bench_continuation(loaded, hf, history, n, repeats)
                add(Row(model, name, "continuation", n, o, h, repeats, mode,
                                roofline.prefill_tok_s(shape, rates, n, history)))
                print(f"  continuation {name} {mode} {n} after {history}: kvtier {o:8.1f} tok/s  "
                      f"transformers {h:8.1f} tok/s", flush=True)
        for b in batches:
            for mode in each_mode():
                o, h = bench_decode(loaded, hf, b, prompt_len, new_tokens, repeats)
                c = float("nan")
                if compiled and mode == modes[0]:
                    try:
                        c = hf_compiled_decode(hf, b, prompt_len, new_tokens, repeats)
                    except Exception as e:  # noqa: BLE001 - a transformers or torch that cannot compile it: say so
                        print(f"  HF compiled decode failed: {type(e).__name__}: {str(e)[:300]}", flush=True)
                roof = roofline.decode_tok_s(shape, rates, b, prompt_len + new_tokens // 2)
                add(Row(model, name, "decode", b, o, h, repeats, mode, roof, c))
                print(f"  decode  {name} {mode} batch {b} x {prompt_len}: kvtier {o:8.1f} tok/s  "
                      f"transformers {h:8.1f} tok/s  compiled {c:8.1f} tok/s ({o / roof:.0%} of the roofline)",
                      flush=True)
                if restoring and mode == modes[0]:  # TBT while returning contexts restore from memory
                    tbt, tbt_r, p90, seen = bench_decode_restoring(loaded, b, prompt_len, new_tokens, repeats)
                    add(Row(model, name, "decode+restore", b, b / tbt_r, b / tbt, repeats, mode, roof))
                    print(f"  decode+restore {name} batch {b}: TBT {tbt * 1e3:.1f} ms alone, {tbt_r * 1e3:.1f} ms "
                          f"(p90 {p90 * 1e3:.1f}) while restoring ({tbt_r / tbt:.2f}x; {seen} restores)", flush=True)
                # The same decode saving every token's state; compared with the row above.
                for phase, drain in (("decode+save", True), ("decode+save+backlog", False)) if saving else ():
                    s, _ = bench_decode(loaded, None, b, prompt_len, new_tokens, repeats, "memory:16GB", drain)
                    add(Row(model, name, phase, b, s, o, repeats, mode, roof))
                    print(f"  {phase} {name} batch {b}: {s:8.1f} tok/s ({s / o:.2f}x of without saving)", flush=True)
        del hf, loaded
    _MODE = {}
    return rows


def markdown(rows: list[Row]) -> str:
    lines = ["| dtype | mode | phase | tokens / batch | kvtier tok/s | transformers tok/s | kvtier / HF "
             "| HF compiled tok/s | roofline tok/s | kvtier / roofline |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        c = f"{r.hf_compiled_tok_s:.1f}" if r.hf_compiled_tok_s == r.hf_compiled_tok_s else "-"
        lines.append(f"| {r.dtype} | {r.mode} | {r.phase} | {r.tokens} | {r.kvtier_tok_s:.1f} | {r.hf_tok_s:.1f} "
                     f"| {r.speedup:.2f}x | {c} | {r.roofline_tok_s:.0f} | {r.of_roofline:.0%} |")
    for other in ("inexact", "eager"):
        by = {(r.dtype, r.phase, r.tokens): r.kvtier_tok_s for r in rows if r.mode == other}
        pairs = [(r, by[r.dtype, r.phase, r.tokens]) for r in rows
                 if r.mode == "exact" and (r.dtype, r.phase, r.tokens) in by]
        if pairs:
            lines += ["", f"| dtype | phase | tokens / batch | exact / {other} throughput |", "|---|---|---|---|"]
            lines += [f"| {r.dtype} | {r.phase} | {r.tokens} | {r.kvtier_tok_s / x:.2f}x |" for r, x in pairs]
    for dt in dict.fromkeys(r.dtype for r in rows):
        dec = {r.tokens: r.kvtier_tok_s for r in rows if r.dtype == dt and r.phase == "decode" and r.mode == "exact"}
        if 1 in dec and len(dec) > 1:
            b = max(dec)
            lines.append(f"\n{dt}: decode batch {b} / batch 1 throughput = {dec[b] / dec[1]:.2f}x")
    return "\n".join(lines)


def cmd(args: argparse.Namespace) -> int:
    torch.set_num_threads(args.threads or torch.get_num_threads())
    print(f"bench forward: {args.model}, threads={torch.get_num_threads()}, repeats={args.repeats}")
    bad = [m for m in args.modes if m not in MODES]
    if bad:
        raise SystemExit(f"--modes: unknown {', '.join(bad)} (use {', '.join(MODES)})")
    from kvtier.bench.common import machine_info

    machine = machine_info()

    def write(rows: list[Row]) -> None:  # after every row
        if args.json:
            Path(args.json).write_text(json.dumps({"threads": torch.get_num_threads(), "machine": machine,
                                                   "rows": [asdict(r) | {"speedup": r.speedup, "of_roofline": r.of_roofline}
                                                            for r in rows]}, indent=2))

    rows = run(args.model, args.dtype, args.prefill, args.batch, args.new_tokens, args.repeats, args.device,
               args.prompt_len, args.saving, tuple(args.modes), args.continuation, args.history,
               {"auto": None, "on": True, "off": False}[args.hf_compiled], args.restoring, write)
    print(markdown(rows))
    return 0
