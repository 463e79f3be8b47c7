"""`kvtier bench load`: options of the HTTP load benchmark (single questions or conversations)."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

from kvtier.cli.bench.options import Target, add_bench_options, add_command, add_dtype_argument
from kvtier.cli.engine_args import positive_int
from kvtier.cli.options import option
from kvtier.models import DEFAULT_MODEL
from kvtier.planning.plan import METHOD_CHOICES


@dataclass(frozen=True)
class LoadOptions:
    """`kvtier bench load`'s flags: one field each (kvtier.cli.bench.options.add_bench_options)."""

    model: str = option(DEFAULT_MODEL, "", "model the server loads (default: %(default)s)")
    store: str | None = option(None, "", "store spec passed to the server (default: the server's)")
    no_store: bool = option(False, "", "run the server without the state store")
    kv_cache_gb: float = option(4.0, "", "server KV pool budget in GiB (default: 4)")
    max_num_seqs: int = option(64, "", "server batch limit (default: 64)")
    clients: int = option(32, "", "concurrent streaming clients (default: 32)")
    duration: float = option(60.0, "", "seconds to keep sending (default: 60)")
    max_tokens: int = option(64, "", "max_tokens per request (default: 64)")
    url: str | None = option(None, "", "target a running server instead of starting one")
    server_pid: int | None = option(None, "", "with --url: server pid, to sample its RSS")
    served_model_name: str | None = option(None, "", "model id to send (default: --model)")
    api_key: str | None = option(lambda: os.environ.get("KVTIER_API_KEY") or None, "", "bearer token sent to the "
                                 "server, and the key a started server requires (default: $KVTIER_API_KEY)")
    startup_timeout: float = option(600.0, "", "seconds to wait for /health")
    json: str | None = option(None, "", "write the report as JSON", metavar="FILE")
    mode: str = option("single", "", "single: one-question chats; conversation: each client holds multi-turn chats, "
                       "every turn resending the history (default: %(default)s)", choices=("single", "conversation"))
    turns: int = option(4, "", "conversation mode: turns per conversation (default: 4)", type=positive_int)
    history_tokens: int = option(1536, "", "conversation mode: start a new conversation before the history outgrows "
                                 "this (default: 1536)", type=positive_int)
    document_words: int = option(0, "", "conversation mode: give each conversation a document of its own of this many "
                                 "words in its system prompt (the long-context case; default: 0, a short shared "
                                 "system prompt)")
    sample_every: float = option(5.0, "", "conversation mode: seconds between samples of /metrics and RSS (default: 5)")
    plot: str | None = option(None, "", "conversation mode: RSS and tier bytes over time", metavar="PNG")
    restore_method: str | None = option(None, "", "passed to the server (default: the server's, auto)",
                                        choices=tuple(METHOD_CHOICES))
    no_prefix_cache: bool = option(False, "", "start the server without its device prefix cache (reuse then comes "
                                   "from the store tiers)")


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_bench_options(p, LoadOptions)
    add_dtype_argument(p)


run = Target("kvtier.bench.load.run", "cmd_load")


def register(bench_subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    return add_command(bench_subparsers, "load", add_arguments, run,
                       "concurrent streaming clients against the HTTP server")
