"""`kvtier bench <cmd>`: every benchmark's options, one module per command.

The benchmarks themselves (kvtier/bench) hold no argparse: each module here declares a command's
options (engine options through kvtier.cli.engine_args) and imports its benchmark only when the
command runs, so `kvtier --help` stays fast.
"""

from __future__ import annotations

import argparse

from kvtier.cli.bench import blend, e2e, forward, impress, load, partial, restore, sampling, store, trace, truncation

COMMANDS = (forward, store, restore, trace, truncation, load, e2e, impress, partial, sampling, blend)


def register_all(bench_subparsers: argparse._SubParsersAction) -> None:
    for command in COMMANDS:
        command.register(bench_subparsers)
