"""`kvtier bench forward`: options of the prefill/decode throughput benchmark."""

from __future__ import annotations

import argparse

from kvtier.cli.bench.options import Target, add_command, int_list, split_commas
from kvtier.device import add_device_argument


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2-135m", help="model preset, name or path (default: %(default)s)")
    p.add_argument("--dtype", type=split_commas, default=["fp32", "bf16"], help="comma list (fp32,bf16)")
    p.add_argument("--prefill", type=int_list, default=[512, 2048, 4096, 8192],
                   help="prompt lengths, prefilled in chunks of the default token budget (comma list)")
    p.add_argument("--continuation", type=int_list, default=[64, 512],
                   help="new-token chunks timed after a --history prefix held in the prefix cache (comma list)")
    p.add_argument("--history", type=int, default=2048, help="history before each continuation chunk (default: 2048)")
    p.add_argument("--modes", type=split_commas, default=["exact"],
                   help="exact (the default engine), inexact (--fast-inexact) and/or eager (exact, decode steps "
                   "without static buffers or CUDA graphs), comma list (default: exact)")
    p.add_argument("--batch", type=int_list, default=[1, 8], help="decode batch sizes (comma list)")
    p.add_argument("--new-tokens", type=int, default=32, help="decode steps timed per run")
    p.add_argument("--prompt-len", type=int, default=128, help="context of each decoding sequence (default: 128)")
    p.add_argument("--saving", action="store_true", help="also decode with every token saved to a memory tier")
    p.add_argument("--restoring", action="store_true",
                   help="also time the decode batch's steps while two returning contexts restore from a memory tier")
    p.add_argument("--hf-compiled", choices=["auto", "on", "off"], default="auto",
                   help="also time HF decode with a static cache under torch.compile (the gpt-fast recipe); "
                   "auto: on a GPU only (default: auto)")
    add_device_argument(p)
    p.add_argument("--repeats", type=int, default=3, help="timed runs; medians are reported (default: %(default)s)")
    p.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's default)")
    p.add_argument("--json", default=None, help="write rows as JSON to this file, rewritten after every row (a run stopped part-way keeps what it measured)")


run = Target("kvtier.bench.forward", "cmd")


def register(bench_subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    return add_command(bench_subparsers, "forward", add_arguments, run,
                       "prefill/decode tokens/s of kvtier beside HF transformers")
