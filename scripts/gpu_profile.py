"""Where a GPU restore's and a saving decode's time goes: host Python and device kernels.

    python scripts/gpu_profile.py OUT_DIR [restore|restoring|saving ...]     (default: all)

restore: llama3-8b-shaped bf16 (random weights), an 8K history + 64 new tokens restored with method
  kv from a memory tier (pinned). Three timed restores, then one under cProfile (the step thread's
  Python) and one under torch.profiler (host ops and device kernels, as a table and a trace).
restoring: smollm2-shape bf16, RBATCH (default 1) sequences of 8K decoding while two returning 8K
  contexts (saved to a memory tier, then dropped from the device) restore with method kv: each
  step's time alone and until the returning contexts have a token, their restore reports, then the
  returning steps under cProfile and torch.profiler (`kvtier bench forward --restoring`'s TBT row).
saving: smollm2-shape bf16, 32 sequences of 8K decoding 32 tokens, with and without every token's
  state saved to a memory tier (the prompts' saves drained first): the time of every decode step,
  then the saving run again under cProfile and torch.profiler. Where `py-spy` is on PATH it also
  samples every thread that holds the GIL (the writer thread competes with the step thread for it).

Everything is printed and written under OUT_DIR (text tables, JSON, gzipped chrome traces).
"""

from __future__ import annotations

import cProfile
import gzip
import json
import os
import pstats
import shutil
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

import torch

from kvtier.engine.calibrate.hardware import load_or_measure
from kvtier.engine.config import EngineConfig, ReuseConfig
from kvtier.engine.engine import Engine, RequestOutput
from kvtier.engine.request import SamplingParams
from kvtier.engine.runner.model_runner import ModelRunner
from kvtier.models.loading import load_model
from kvtier.paths import home
from kvtier.planning.costs import HardwareProfile


def _ids(n: int, vocab: int, seed: int) -> list[int]:
    return torch.randint(100, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@contextmanager
def pyspy(path: Path):
    """Sample this process's GIL-holding threads with py-spy while the block runs (if installed)."""
    exe = shutil.which("py-spy")
    proc = None
    if exe:
        proc = subprocess.Popen([exe, "record", "--pid", str(os.getpid()), "--gil", "--threads", "--rate", "500",
                                 "--format", "raw", "--output", str(path), "--nonblocking"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        time.sleep(1.0)  # attach
    try:
        yield
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGINT)
            try:
                _, err = proc.communicate(timeout=30)
                if proc.returncode:
                    print(f"  py-spy exited {proc.returncode}: {err.decode()[-400:]}", flush=True)
            except subprocess.TimeoutExpired:
                proc.kill()


# A CPU smoke test of this script: DEVICE=cpu RESTORE_MODEL=tiny-gqa SAVING_MODEL=tiny-gqa CTX=256 BATCH=2
DEVICE = os.environ.get("DEVICE", "cuda")


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def profiled(out: Path, name: str, fn: Callable[[], object], before: Callable[[], object] = lambda: None) -> None:
    """fn once under cProfile, once under py-spy and once under torch.profiler (each after
    `before`, untraced); tables into out/."""
    before()
    sync()
    prof = cProfile.Profile()
    prof.enable()
    fn()
    sync()
    prof.disable()
    with open(out / f"{name}_cprofile.txt", "w") as f:
        st = pstats.Stats(prof, stream=f)
        st.sort_stats("tottime").print_stats(45)
        st.sort_stats("cumulative").print_stats(60)
    before()
    with pyspy(out / f"{name}_pyspy.txt"):
        fn()
        sync()
    from torch.profiler import ProfilerActivity, profile

    before()
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if DEVICE == "cuda" else [])
    with profile(activities=acts) as p:
        fn()
        sync()
    ka = p.key_averages()
    with open(out / f"{name}_torch.txt", "w") as f:
        f.write(ka.table(sort_by="self_cpu_time_total", row_limit=30))
        f.write("\n")
        f.write(ka.table(sort_by="self_device_time_total", row_limit=30))
    trace = out / f"{name}_trace.json"
    p.export_chrome_trace(str(trace))
    with open(trace, "rb") as src, gzip.open(str(trace) + ".gz", "wb") as dst:
        shutil.copyfileobj(src, dst)
    trace.unlink()
    print(f"  {name}: profiles written", flush=True)


def _profile(loaded, spec: str) -> HardwareProfile:
    """This machine's profile, measured once (as `kvtier bench restore` and a server plan with).
    An Engine built without one plans with a saved profile or, with none saved yet, a rough
    estimate, under which profiled kv restores (run first, nothing saved) measured about twice the
    bench's time."""
    return load_or_measure(loaded, home(), spec)


def restore(out: Path, new: int = 64) -> dict:
    """kv restores of one history from each tier in RESTORE_TIERS (memory: pinned; disk: cold)."""
    from kvtier.bench.common import drop_page_cache

    ctx = int(os.environ.get("CTX", 8192))
    loaded = load_model(os.environ.get("RESTORE_MODEL", "llama3-8b"), dtype="bf16", device=DEVICE, tokenizer=False)
    max_len = ctx + new + 8
    kv = ModelRunner.bytes_per_block(loaded.module, 16) * (max_len // 16 + 2)
    ids = _ids(ctx + new, loaded.config.vocab_size, 1)
    one = SamplingParams(max_tokens=1, temperature=0.0)
    result: dict = {}
    for tier in os.environ.get("RESTORE_TIERS", "memory,disk").split(","):
        disk = Path("/tmp/kvtier-profile-disk")
        spec = "memory:32GB" if tier == "memory" else f"disk:{disk}:60GB"
        engine = Engine(loaded, EngineConfig(kv_cache_bytes=kv, max_model_len=max_len, enable_prefix_cache=False),
                        store=spec, reuse=ReuseConfig(method="kv", lookahead=False), profile=_profile(loaded, spec))
        try:
            engine.generate([ids[:ctx]], one)
            engine.flush()

            def run() -> RequestOutput:
                if tier == "disk":
                    drop_page_cache(disk)
                out_ = engine.generate([ids], one)[0]
                sync()
                engine.flush()
                return out_

            rows = []
            for _ in range(4):
                o = run()
                r = o.restore
                assert r is not None, "the history was not restored"
                rows.append(dict(ttft_s=o.ttft, host_s=r.host_s, copy_s=r.copy_s, seconds=r.seconds,
                                 bytes=r.bytes_read))
            result[tier] = dict(runs=rows[1:], ttft_s=statistics.median(float(r["ttft_s"] or 0) for r in rows[1:]),
                                host_s=statistics.median(r["host_s"] or 0 for r in rows[1:]))
            print(f"  restore kv {ctx} from {tier}: {json.dumps(result[tier])}", flush=True)
            profiled(out, f"restore_{tier}", run)
        finally:
            engine.close()
            shutil.rmtree(disk, ignore_errors=True)
    del loaded
    if DEVICE == "cuda":
        torch.cuda.empty_cache()
    return result


def restoring(out: Path, new: int = 64, returning: int = 2) -> dict:
    """The decode steps of RBATCH sequences while `returning` contexts restore from memory."""
    batch, prompt_len = int(os.environ.get("RBATCH", 1)), int(os.environ.get("CTX", 8192))
    loaded = load_model(os.environ.get("SAVING_MODEL", "smollm2-shape"), dtype="bf16", device=DEVICE, tokenizer=False)
    vocab = loaded.config.vocab_size
    max_len = prompt_len + 256
    seqs = batch + returning
    kv = ModelRunner.bytes_per_block(loaded.module, 16) * seqs * (max_len // 16 + 2)
    engine = Engine(loaded, EngineConfig(kv_cache_bytes=kv, max_model_len=max_len, max_num_seqs=max(seqs, 8),
                                         enable_prefix_cache=False),
                    store="memory:16GB", reuse=ReuseConfig(method="kv", lookahead=False),
                    profile=_profile(loaded, "memory:16GB"))
    rounds: list[dict] = []
    saved: list[list[int]] = []

    def before() -> None:  # fresh contexts saved through the engine and written, then steps alone
        saved[:] = [_ids(prompt_len, vocab, 5000 + 97 * len(rounds) + i) for i in range(returning)]
        pending = {engine.add_request(p, SamplingParams(max_tokens=1, temperature=0)) for p in saved}
        while pending:
            pending -= {o.request_id for o in engine.step() if o.finished}
        engine.flush()
        alone = []
        for _ in range(4):
            t = time.perf_counter()
            engine.step()
            alone.append(time.perf_counter() - t)
        rounds.append(dict(alone_ms=[round(x * 1e3, 2) for x in alone]))

    def back() -> None:  # the returning contexts, stepped until each has its first token
        waiting = {engine.add_request(p + _ids(new, vocab, 6000 + i), SamplingParams(max_tokens=2, temperature=0))
                   for i, p in enumerate(saved)}
        steps, reports = [], []
        while waiting:
            t = time.perf_counter()
            outs = engine.step()
            steps.append(time.perf_counter() - t)
            for o in outs:
                if o.request_id in waiting and o.output_ids:
                    waiting.discard(o.request_id)
                    r = o.restore
                    reports.append(None if r is None else dict(
                        method=r.method, seconds=r.seconds, host_s=r.host_s, wait_s=r.wait_s, copy_s=r.copy_s,
                        compute_s=r.compute_s, bytes=r.bytes_read, ttft_s=o.ttft))
        rounds[-1].update(during_ms=[round(x * 1e3, 2) for x in steps], restores=reports)

    try:
        decoding = SamplingParams(max_tokens=max_len - prompt_len - 8, temperature=0, ignore_eos=True)
        for i in range(batch):
            engine.add_request(_ids(prompt_len, vocab, 4000 + i), decoding)
        started: set[str] = set()
        while len(started) < batch:
            started |= {o.request_id for o in engine.step()}
        for _ in range(4):
            before()
            back()
            print(f"  restoring round {len(rounds)}: {json.dumps(rounds[-1])}", flush=True)
        profiled(out, "restoring", back, before)
    finally:
        engine.close()
    return dict(rounds=rounds)


def saving(out: Path, new: int = 32) -> dict:
    batch, prompt_len = int(os.environ.get("BATCH", 32)), int(os.environ.get("CTX", 8192))
    loaded = load_model(os.environ.get("SAVING_MODEL", "smollm2-shape"), dtype="bf16", device=DEVICE, tokenizer=False)
    vocab = loaded.config.vocab_size
    result: dict = {}
    for store in (None, "memory:16GB"):
        max_len = prompt_len + new + 16
        kv = ModelRunner.bytes_per_block(loaded.module, 16) * batch * (max_len // 16 + 2)
        engine = Engine(loaded, EngineConfig(kv_cache_bytes=kv, max_model_len=max_len, max_num_seqs=batch,
                                             enable_prefix_cache=False),
                        store=store, reuse=ReuseConfig(method="kv", lookahead=False) if store else None,
                        profile=_profile(loaded, store) if store else None)
        params = SamplingParams(max_tokens=new + 1, temperature=0, ignore_eos=True)
        calls = [0]

        def prefill() -> None:  # fresh prompts (nothing restored), their saves written
            calls[0] += 1
            started: set[str] = set()
            for i in range(batch):
                engine.add_request(_ids(prompt_len, vocab, 7919 * calls[0] + i), params)
            while len(started) < batch:
                started |= {o.request_id for o in engine.step()}
            engine.flush()
            sync()

        def decode(steps: list[float] | None = None) -> float:
            t0 = time.perf_counter()
            while engine.has_work():
                t = time.perf_counter()
                engine.step()
                if steps is not None:
                    steps.append(time.perf_counter() - t)
            sync()
            return time.perf_counter() - t0

        name = "save" if store else "plain"
        try:
            prefill()
            decode()
            totals, steps = [], []
            for _ in range(3):
                s: list[float] = []
                prefill()
                totals.append(decode(s))
                steps.append(s)
            med = statistics.median(totals)
            result[name] = dict(tok_s=batch * new / med, totals=totals,
                                step_ms=[[round(x * 1e3, 2) for x in s] for s in steps])
            print(f"  decode {name} batch {batch} x {prompt_len}: {batch * new / med:.1f} tok/s; steps (ms) "
                  f"{result[name]['step_ms'][-1]}", flush=True)
            if store:
                profiled(out, "saving", decode, prefill)
        finally:
            engine.close()
    return result


def main() -> int:
    out = Path(sys.argv[1] if len(sys.argv) > 1 else "out/gpu")
    out.mkdir(parents=True, exist_ok=True)
    which = sys.argv[2:] or ["restore", "restoring", "saving"]
    results = {}
    for w in which:
        t = time.perf_counter()
        results[w] = {"restore": restore, "restoring": restoring, "saving": saving}[w](out)
        print(f"{w}: {time.perf_counter() - t:.0f} s", flush=True)
    (out / "profile.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
