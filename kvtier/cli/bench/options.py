"""Option pieces the bench commands share (the engine's own live in kvtier.cli.engine_args)."""

from __future__ import annotations

import argparse
import ast
import dataclasses
import importlib
import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from kvtier.cli.engine_args import DTYPE_CHOICES, dtype_name
from kvtier.cli.options import fields_of


def add_dtype_argument(p: argparse._ActionsContainer, default: str = "auto") -> None:
    """--dtype, with the engine's choices (kvtier.cli.engine_args.DTYPE_CHOICES)."""
    p.add_argument("--dtype", default=default, type=dtype_name, choices=DTYPE_CHOICES,
                   help="compute dtype; auto = bf16 on a GPU or a CPU with native bf16, else fp32 "
                        "(default: %(default)s)")


_PLAIN: dict[str, Callable[[str], object]] = {"int": int, "float": float}


def add_bench_options(p: argparse.ArgumentParser, cls: type) -> dict[str, argparse._ActionsContainer]:
    """A flag per field of a benchmark's options dataclass (fields made with kvtier.cli.options.option;
    an on/off field is a store_true flag; an int or float field
    without a `type` parses as its annotation says), in argument groups by the fields' `group` ("" = none).
    Unlike the engine's options, a benchmark's take no $KVTIER_* variable and no --config file: a
    bench run is what its command line says. Returns the groups by name, for flags added by hand."""
    groups: dict[str, argparse._ActionsContainer] = {"": p}
    for name, (f, opt) in fields_of(cls).items():
        g = groups.get(opt.group) or groups.setdefault(opt.group, p.add_argument_group(opt.group))
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        flag = "--" + name.replace("_", "-")
        if f.type in (bool, "bool"):
            g.add_argument(flag, *opt.aliases, action="store_true", help=opt.help)
            continue
        shown = "" if "default" in opt.help else f" (default: {opt.default_text or '%(default)s'})"
        kind = opt.type or _PLAIN.get(str(f.type).removesuffix(" | None"), str)  # int and float from the annotation
        g.add_argument(flag, *opt.aliases, default=default, type=kind, choices=opt.choices, metavar=opt.metavar,
                       help=opt.help + shown)
    return groups


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
        return int(getattr(bench_module(self.module), self.function)(args) or 0)


def bench_module(name: str):
    """Import a benchmark module; a library of the `kvtier[bench]` extra it lacks is one line and exit 1."""
    from kvtier.bench import missing_extra

    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as e:
        if (exit_ := missing_extra(e, f"`kvtier bench {name.split('.')[2]}`")) is not None:
            raise exit_ from None
        raise


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
