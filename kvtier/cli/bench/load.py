"""`kvtier bench load`: options of the HTTP load benchmark (single questions or conversations)."""

from __future__ import annotations

import argparse
import os

from kvtier.cli.bench.options import Target, add_command, add_dtype_argument
from kvtier.cli.engine_args import positive_int
from kvtier.models import DEFAULT_MODEL
from kvtier.planning.plan import METHOD_CHOICES


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=DEFAULT_MODEL, help="model the server loads (default: %(default)s)")
    add_dtype_argument(p)
    p.add_argument("--store", default=None, help="store spec passed to the server (default: the server's)")
    p.add_argument("--no-store", action="store_true", help="run the server without the state store")
    p.add_argument("--kv-cache-gb", type=float, default=4.0, help="server KV pool budget in GiB (default: 4)")
    p.add_argument("--max-num-seqs", type=int, default=64, help="server batch limit (default: 64)")
    p.add_argument("--clients", type=int, default=32, help="concurrent streaming clients (default: 32)")
    p.add_argument("--duration", type=float, default=60.0, help="seconds to keep sending (default: 60)")
    p.add_argument("--max-tokens", type=int, default=64, help="max_tokens per request (default: 64)")
    p.add_argument("--url", default=None, help="target a running server instead of starting one")
    p.add_argument("--server-pid", type=int, default=None, help="with --url: server pid, to sample its RSS")
    p.add_argument("--served-model-name", default=None, help="model id to send (default: --model)")
    p.add_argument("--api-key", default=os.environ.get("KVTIER_API_KEY") or None,
                   help="bearer token sent to the server, and the key a started server requires (default: $KVTIER_API_KEY)")
    p.add_argument("--startup-timeout", type=float, default=600.0, help="seconds to wait for /health")
    p.add_argument("--json", default=None, metavar="FILE", help="write the report as JSON")
    p.add_argument("--mode", default="single", choices=["single", "conversation"],
                   help="single: one-question chats; conversation: each client holds multi-turn chats, every "
                        "turn resending the history (default: %(default)s)")
    p.add_argument("--turns", type=positive_int, default=4,
                   help="conversation mode: turns per conversation (default: 4)")
    p.add_argument("--history-tokens", type=positive_int, default=1536,
                   help="conversation mode: start a new conversation before the history outgrows this (default: 1536)")
    p.add_argument("--document-words", type=int, default=0,
                   help="conversation mode: give each conversation a document of its own of this many words in "
                        "its system prompt (the long-context case; default: 0, a short shared system prompt)")
    p.add_argument("--sample-every", type=float, default=5.0,
                   help="conversation mode: seconds between samples of /metrics and RSS (default: 5)")
    p.add_argument("--plot", default=None, metavar="PNG", help="conversation mode: RSS and tier bytes over time")
    p.add_argument("--restore-method", default=None, choices=list(METHOD_CHOICES),
                   help="passed to the server (default: the server's, auto)")
    p.add_argument("--no-prefix-cache", action="store_true",
                   help="start the server without its device prefix cache (reuse then comes from the store tiers)")


run = Target("kvtier.bench.load.run", "cmd_load")


def register(bench_subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    return add_command(bench_subparsers, "load", add_arguments, run,
                       "concurrent streaming clients against the HTTP server")
