"""`kvtier bench forward`: options of the prefill/decode throughput benchmark."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from kvtier.cli.bench.options import Target, add_bench_options, add_command, int_list, split_commas
from kvtier.cli.options import option
from kvtier.device import add_device_argument


@dataclass(frozen=True)
class ForwardOptions:
    """`kvtier bench forward`'s flags: one field each (kvtier.cli.bench.options.add_bench_options)."""

    model: str = option("smollm2-135m", "", "model preset, name or path (default: %(default)s)")
    dtype: list[str] = option(lambda: ["fp32", "bf16"], "", "comma list (fp32,bf16)", type=split_commas)
    prefill: list[int] = option(lambda: [512, 2048, 4096, 8192], "", "prompt lengths, prefilled in chunks of the "
                                "default token budget (comma list)", type=int_list)
    continuation: list[int] = option(lambda: [64, 512], "", "new-token chunks timed after a --history prefix held in "
                                     "the prefix cache (comma list)", type=int_list)
    history: int = option(2048, "", "history before each continuation chunk (default: 2048)")
    modes: list[str] = option(lambda: ["exact"], "", "exact (the default engine), inexact (--fast-inexact) and/or "
                              "eager (exact, decode steps without static buffers or CUDA graphs), comma list "
                              "(default: exact)", type=split_commas)
    batch: list[int] = option(lambda: [1, 8], "", "decode batch sizes (comma list)", type=int_list)
    new_tokens: int = option(32, "", "decode steps timed per run")
    prompt_len: int = option(128, "", "context of each decoding sequence (default: 128)")
    saving: bool = option(False, "", "also decode with every token saved to a memory tier")
    restoring: bool = option(False, "", "also time the decode batch's steps while two returning contexts restore from "
                             "a memory tier")
    hf_compiled: str = option("auto", "", "also time HF decode with a static cache under torch.compile (the gpt-fast "
                              "recipe); auto: on a GPU only (default: auto)", choices=("auto", "on", "off"))
    repeats: int = option(3, "", "timed runs; medians are reported (default: %(default)s)")
    threads: int = option(0, "", "torch threads (default: torch's default)")
    json: str | None = option(None, "", "write rows as JSON to this file, rewritten after every row (a run stopped "
                              "part-way keeps what it measured)")


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_bench_options(p, ForwardOptions)
    add_device_argument(p)


run = Target("kvtier.bench.forward", "cmd")


def register(bench_subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    return add_command(bench_subparsers, "forward", add_arguments, run,
                       "prefill/decode tokens/s of kvtier beside HF transformers")
