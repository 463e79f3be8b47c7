"""`kvtier bench blend`: options of the blended-restore benchmark (non-prefix reuse on MuSiQue)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from kvtier.cli.bench.options import Target, add_bench_options, add_command, add_dtype_argument, float_list, int_list
from kvtier.cli.engine_args import non_negative_int
from kvtier.cli.options import option
from kvtier.device import add_device_argument
from kvtier.planning.blend import BlendOptions, BlendScore


@dataclass(frozen=True)
class BlendBenchOptions:
    """`kvtier bench blend`'s flags: one field each (kvtier.cli.bench.options.add_bench_options)."""

    model: str = option("smollm2-135m", "", "model preset, name or path (default: %(default)s)")
    data: str | None = option(None, "", "the MuSiQue JSON (default: $KVTIER_MUSIQUE, else "
                              "../shared/data/musique/musique_dev_100.json); absent: the run is skipped",
                              metavar="PATH")
    n: int = option(50, "", "questions (the first --n from --offset)")
    offset: int = option(0, "", "index of the first question")
    speed_n: int = option(5, "", "questions on which the prefix row and the cold-disk TTFT rows run")
    max_tokens: int = option(24, "", "greedy output tokens per row")
    link_tokens: list[int] = option(lambda: [2, 4, 8, 16, 32], "", "legolink rows: leading tokens of each passage "
                                    "recomputed (comma list; default: 2,4,8,16,32)", type=int_list)
    ratios: list[float] = option(lambda: [0.05, 0.15, 0.3], "", "cacheblend rows: shares of the loaded tokens "
                                 "recomputed (comma list; default: 0.05,0.15,0.3)", type=float_list)
    check_layer: int = option(BlendOptions().check_layer, "", "cacheblend rows: the layer whose keys' deviation picks "
                              "the tokens recomputed (default: %(default)s, the engine's)", type=non_negative_int)
    score: str = option(BlendScore.WEIGHTED.value, "", "cacheblend rows: how the check layer's deviations pick the "
                        "tokens: weighted (by the attention the prompt's last rows pay them) or deviation (alone); "
                        "default: %(default)s, the engine's", choices=[s.value for s in BlendScore])
    store: str = option("memory:4GB", "", "the store the memory TTFT rows restore from")
    chunk_tokens: int = option(256, "", "tokens per stored chunk")
    disk_size: str = option("16GB", "", "the cold-disk store's capacity")
    dir: str | None = option(None, "", "the cold-disk store's directory (default: a new temporary one)")
    synthetic: bool = option(False, "", "random ids laid out as the prompts are (ten passages of --passage-tokens), "
                             "for random-weight models (the default for a model without a tokenizer)")
    passage_tokens: int = option(48, "", "--synthetic: tokens per passage")
    seed: int = option(0, "", "seeds the passages' orders (and --synthetic's ids)")
    json: str | None = option(None, "", "rows, per-question values, settings, machine and data attribution as JSON, "
                              "rewritten after every question")
    resume: bool = option(False, "", "continue the run --json holds (one stopped part-way): its questions and "
                          "cold-disk rows are kept, the others run; its settings must match")
    plot: str | None = option(None, "", "PNG: fidelity against the share computed, and TTFT bars")
    replot: str | None = option(None, "", "only draw the figure of an earlier run's JSON", metavar="JSON")


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_bench_options(p, BlendBenchOptions)
    add_dtype_argument(p)
    add_device_argument(p)


run = Target("kvtier.bench.blend.run", "cmd")


def register(bench_subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    return add_command(bench_subparsers, "blend", add_arguments, run,
                       "blended restores (naive, legolink, cacheblend) against full prefill and exact prefix reuse on "
                       "MuSiQue: fidelity to full, answer F1, TTFT from memory and a cold disk")
