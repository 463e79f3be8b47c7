"""`kvtier store stats|verify|clear`, with the engine commands' `--store SPEC` option
(kvtier.cli.engine_args declares it; the home directory comes from kvtier.paths).
"""
from __future__ import annotations

import argparse
import json
import sys

from kvtier.cli.engine_args import TITLES, EngineOptions, default_store_spec, spec_type
from kvtier.cli.options import add_options

__all__ = ["add_store_argument", "default_store_spec", "register", "spec_type"]


def add_store_argument(parser: argparse.ArgumentParser) -> None:
    """Add `--store SPEC` (default: memory:2GB plus a 20GB disk tier under the kvtier home), the
    engine commands' option (kvtier.cli.engine_args.EngineOptions.store)."""
    add_options(parser, EngineOptions, only=("store",), titles=TITLES)


def register(subparsers) -> None:
    """Add the `store` command group (stats, verify, clear) to an argparse subparsers object."""
    p = subparsers.add_parser("store", help="inspect, check or empty the tiered state store",
                              description="Admin commands over every chunk of every model in a store.")
    sub = p.add_subparsers(dest="store_command", metavar="{stats,verify,clear}")
    sub.required = True
    s = sub.add_parser("stats", help="entries, bytes and counters per tier")
    add_store_argument(s)
    s.add_argument("--json", action="store_true", help="print JSON instead of a table")
    s.set_defaults(func=cmd_stats)
    v = sub.add_parser("verify", help="read every chunk; remove corrupt ones (exit 1 if any)")
    add_store_argument(v)
    v.set_defaults(func=cmd_verify)
    c = sub.add_parser("clear", help="remove every chunk from every tier of the store")
    add_store_argument(c)
    c.set_defaults(func=cmd_clear)


def _open(args):
    from kvtier.store.tiered import TieredStore
    return TieredStore.open(args.store, None)


def cmd_stats(args) -> int:
    with _open(args) as store:
        st = store.stats()
    if getattr(args, "json", False):
        print(json.dumps(st, indent=2, default=str))
        return 0
    from rich.console import Console
    from rich.table import Table

    # A fresh admin process has no traffic of its own: show what is stored, not hit counters.
    cols = ["entries", "bytes_used", "capacity"]
    t = Table(title=f"kvtier store  {st['spec']}")
    t.add_column("tier")
    for c in cols:
        t.add_column(c, justify="right")
    t.add_column("note")
    for name, d in st["tiers"].items():
        t.add_row(name, *[_fmt(d.get(c)) for c in cols], d.get("emulated") or "")
    Console().print(t)
    w = st["writer"]
    print(f"writer: queue_depth={w['queue_depth']} writing={w['writing']} dropped_saves={w['dropped_saves']} "
          "(counters are for this process; stats of a running engine come from the engine)")
    return 0


def _fmt(x) -> str:
    if x is None:
        return "-"
    if isinstance(x, int) and x >= 10_000:
        for unit, div in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
            if x >= div:
                return f"{x / div:.1f}{unit}"
    return str(x)


def cmd_verify(args) -> int:
    with _open(args) as store:
        rep = store.verify()
    for tier, key, why in rep.corrupt:
        print(f"removed corrupt chunk {key} from {tier}: {why}")
    per = ", ".join(f"{k}: {v['ok']} ok / {v['corrupt']} corrupt" for k, v in rep.per_tier.items())
    print(f"checked {rep.checked} chunks ({per})")
    return 0 if rep.clean else 1


def cmd_clear(args) -> int:
    with _open(args) as store:
        removed = store.clear()
        links = sum(t.counters.get("links", 0) for t in store.tiers)
    print("removed " + ", ".join(f"{n} chunks from {t}" for t, n in removed.items()))
    if links:  # the disk tier neither follows nor removes them: they are not its own files
        print(f"left {links} symbolic link(s) under the disk tier's directories untouched (never followed); "
              "the log names them: remove them by hand")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Standalone entry (`python -m kvtier.cli.store stats --store ...`) until kvtier.cli.main wires it."""
    parser = argparse.ArgumentParser(prog="kvtier")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["store", *(argv if argv is not None else sys.argv[1:])])
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
