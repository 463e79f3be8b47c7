"""The restore options every command that runs an engine takes (generate, chat, demo, serve)."""

from __future__ import annotations

import argparse
from typing import Any

from kvtier.restore.plan import METHOD_CHOICES


def _ratio(text: str) -> float:
    try:
        x = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1], got {text!r}") from None
    if not 0.0 < x <= 1.0:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1], got {text}")
    return x


def _non_negative(text: str) -> float:
    try:
        x = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text!r}") from None
    if x < 0:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text}")
    return x


def add_restore_arguments(p: argparse.ArgumentParser | Any) -> None:
    """--restore-method and the importance-only restore's options (p: a parser or argument group)."""
    p.add_argument("--restore-method", default="auto", choices=list(METHOD_CHOICES),
                   help="how stored state comes back: auto (the planner decides per request), kv, hidden, "
                        "bubblefree, cake, recompute, or impress (lossy, opt-in: only the stored prefix tokens "
                        "the new tokens attend to; its state is never saved) (default: auto)")
    p.add_argument("--allow-lossy", action="store_true",
                   help="with --restore-method auto: the planner may also choose impress where it predicts it at "
                        "least 15%% faster than every exact method (stores the importance layout; lossy, so off by "
                        "default)")
    p.add_argument("--importance-ratio", type=_ratio, default=0.25, metavar="R",
                   help="impress: share of a stored prefix each layer keeps (default: 0.25)")
    p.add_argument("--importance-unit", default="token", choices=["token", "granule"],
                   help="impress: keep single tokens (the paper), or whole stored granules of 16 tokens chosen by "
                        "their summed importance (reads follow the ratio) (default: token)")
    p.add_argument("--importance-selection", default="impress", choices=["impress", "h2o"],
                   help="impress: how tokens are chosen: probe heads first, every key only where they disagree "
                        "(impress, the paper), or every key and every head (h2o: more bytes, closer to full "
                        "accuracy on models with few KV heads) (default: impress)")
    p.add_argument("--eviction-policy", default="lru", choices=["lru", "lfu", "fifo", "score"],
                   help="what the memory and disk tiers give up first; score: accesses x the share of a chunk "
                        "importance restores needed, admitted to memory only above the lowest held (default: lru)")
    p.add_argument("--importance-reorder-s", type=_non_negative, default=600.0, metavar="S",
                   help="impress: every S seconds, when the writer is idle, store the chunks importance restores "
                        "have seen again with their tokens' K/V rows by importance, so the tokens a query keeps "
                        "share granules (single-token selection); 0: never (default: 600)")
    p.add_argument("--importance-alpha", type=_non_negative, default=0.6, metavar="A",
                   help="impress: probe heads agree when their Jaccard index is at least j**A, j that of "
                        "two random sets (default: 0.6)")


def reuse_options(args: argparse.Namespace) -> dict[str, Any]:
    """ReuseConfig keyword arguments from the options above."""
    return dict(method=args.restore_method, allow_lossy=args.allow_lossy, importance_ratio=args.importance_ratio,
                importance_alpha=args.importance_alpha, importance_unit=args.importance_unit,
                importance_selection=args.importance_selection,
                importance_reorder_s=args.importance_reorder_s, eviction_policy=args.eviction_policy)
