"""Where one returning context's time goes: py-spy attached to this process while N returning
4096-token contexts are restored through the public Engine API, then a per-thread summary by phase.

    pip install py-spy   # a profiler, not a kvtier dependency
    python scripts/profile_restore.py --dtype fp32 --tier memory --out out/profile_memory.txt
    python scripts/profile_restore.py --summarize out/profile_memory.txt   # re-print a summary

`--tier disk` restores after a restart (a new Engine over the same directory, its memory tier
empty, the page cache evicted), as `kvtier bench e2e`'s kvtier_disk_cold does.
"""

from __future__ import annotations

import argparse
import collections
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

# Phases, matched from the innermost frame outwards (the first rule that matches a frame wins).
RULES = [
    ("RoPE rotation", "rotate"), ("pool placement", "place_kv"), ("pool placement", "copy_in"),
    ("pool placement", "project_in"), ("chunk header parse", "parse_header"), ("chunk header parse", "_header_from_doc"),
    ("checksum", "check_segment"), ("checksum", "crc32"), ("decode read bytes", "decode"),
    ("disk read", "_FileReader"), ("attention", "causal_attention"), ("attention", "_history_then_own"),
    ("attention", "attend_decodes"), ("gather context", "run_layer"), ("mlp / o_proj", "finish (kvtier/models"),
    ("qkv projection", "qkv (kvtier/models"), ("logits", "logits (kvtier/models"), ("store lookup", "lookup (kvtier/store"),
    ("waiting", "wait ("), ("waiting", "get (queue"), ("waiting", "_wait_for_tstate_lock"), ("waiting", "sleep"),
    ("idle worker", "_worker (concurrent"), ("the profiling script itself", "<module>"),
]


def summarize(path: str) -> str:
    by: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for line in open(path):
        stack, _, n = line.rstrip().rpartition(" ")
        frames = stack.split(";")
        thread = frames[0].split(":")[-1].strip()
        label = next((name for f in reversed(frames) for name, pat in RULES if pat in f), "other")
        by[thread][label] += int(n)
    out = []
    for thread, c in sorted(by.items(), key=lambda kv: -sum(kv[1].values())):
        total = sum(c.values())
        out.append(f"thread {thread}: {total} samples")
        out += [f"  {n:6d} {n / total:6.1%}  {k}" for k, n in c.most_common(10)]
    return "\n".join(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="fp32", help="compute dtype (default: %(default)s)")
    ap.add_argument("--tier", default="memory", choices=["memory", "disk"], help="where the history comes from")
    ap.add_argument("--history", type=int, default=4096, help="history tokens (default: %(default)s)")
    ap.add_argument("--restores", type=int, default=5, help="profiled restores (default: %(default)s)")
    ap.add_argument("--out", default="out/profile_restore.txt", help="py-spy raw output (default: %(default)s)")
    ap.add_argument("--summarize", default=None, help="only print the summary of an existing raw file")
    args = ap.parse_args()
    if args.summarize:
        print(summarize(args.summarize))
        return 0
    import torch

    from kvtier.bench.common import drop_page_cache
    from kvtier.engine.config import EngineConfig, ReuseConfig
    from kvtier.engine.engine import Engine
    from kvtier.engine.request import SamplingParams
    from kvtier.models.loading import load_model

    spy_bin = shutil.which("py-spy") or os.path.join(os.path.dirname(sys.executable), "py-spy")
    model = load_model("smollm2-135m", dtype=args.dtype, tokenizer=False)
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    cfg = EngineConfig(kv_cache_bytes=2 << 30, enable_prefix_cache=False, max_model_len=args.history + 64)
    work = tempfile.mkdtemp()
    spec = "memory:8GB" if args.tier == "memory" else f"memory:8GB,disk:{work}:20GB"
    gen = torch.Generator().manual_seed(0)
    ctxs = torch.randint(100, model.config.vocab_size, (args.restores + 1, args.history + 64), generator=gen).tolist()
    engine = Engine(model, cfg, store=spec, reuse=ReuseConfig(method="kv"))
    for ids in ctxs:
        engine.generate([ids[: args.history]], params)
    engine.flush()
    engine.generate([ctxs[0]], params)  # warm-up
    if args.tier == "disk":
        engine.close()
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    spy = subprocess.Popen([spy_bin, "record", "--pid", str(os.getpid()), "-r", "250", "-f", "raw", "-o", args.out,
                            "--threads", "--idle", "--nonblocking"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(2)  # py-spy attaches
    times = []
    for ids in ctxs[1:]:
        if args.tier == "disk":
            engine = Engine(model, cfg, store=spec, reuse=ReuseConfig(method="kv"))
            drop_page_cache(work)
        t = time.perf_counter()
        out = engine.generate([ids], params)[0]
        times.append(time.perf_counter() - t)
        if args.tier == "disk":
            engine.close()
    spy.send_signal(signal.SIGINT)
    spy.wait(60)
    if args.tier == "memory":
        engine.close()
    shutil.rmtree(work, ignore_errors=True)
    print(f"{args.tier} {args.dtype} H={args.history}: TTFT " + " ".join(f"{t:.3f}" for t in times)
          + f" s, median {sorted(times)[len(times) // 2]:.3f} s, method {out.restore_method}")
    print(summarize(args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
