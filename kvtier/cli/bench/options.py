"""Option pieces the bench commands share (the engine's own live in kvtier.cli.engine_args)."""

from __future__ import annotations

import argparse
import ast
import importlib
import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from kvtier.cli.engine_args import DTYPE_CHOICES, dtype_name


def add_dtype_argument(p: argparse._ActionsContainer, default: str = "auto") -> None:
    """--dtype, with the engine's choices (kvtier.cli.engine_args.DTYPE_CHOICES)."""
    p.add_argument("--dtype", default=default, type=dtype_name, choices=DTYPE_CHOICES,
                   help="compute dtype; auto = bf16 on a GPU or a CPU with native bf16, else fp32 "
                        "(default: %(default)s)")


def split_commas(text: str) -> list[str]:
    """'a,b' -> ['a', 'b'] (as given: no stripping)."""
    return text.split(",")


def int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def float_list(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x]


def described_by(module: str) -> dict:
    """add_parser keywords that show a benchmark module's docstring as the command's description,
    read from its source: importing the benchmark (torch, the engine) would slow every `kvtier` call."""
    spec = importlib.util.find_spec(module)
    doc = ast.get_docstring(ast.parse(Path(spec.origin).read_text())) if spec and spec.origin else None
    return dict(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)


@dataclass(frozen=True)
class Target:
    """A benchmark's entry point, imported only when its command runs (`kvtier --help` stays fast)."""

    module: str
    function: str

    def __call__(self, args: argparse.Namespace) -> int:
        return int(getattr(importlib.import_module(self.module), self.function)(args) or 0)


def add_command(bench_subparsers: argparse._SubParsersAction, name: str,
                add_arguments: Callable[[argparse.ArgumentParser], None], run: Callable[[argparse.Namespace], int],
                help: str, about: str | None = None) -> argparse.ArgumentParser:
    """`kvtier bench NAME`: its options, and as its description the docstring of the benchmark
    module `about` (default: the one `run` is a Target in)."""
    module = about or (run.module if isinstance(run, Target) else run.__module__)
    p = bench_subparsers.add_parser(name, help=help, **described_by(module))
    add_arguments(p)
    p.set_defaults(func=run)
    return p
