"""`kvtier serve`: run the OpenAI-compatible server (also `python -m kvtier.serve`)."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Any

from kvtier.device import add_device_argument
from kvtier.engine.partial_args import add_partial_arguments, partial_from_args
from kvtier.models.loading import DEFAULT_MODEL
from kvtier.restore.args import add_restore_arguments, reuse_options
from kvtier.serve.config import DEFAULT_MAX_BODY_BYTES

API_KEY_ENV = "KVTIER_API_KEY"
LOG_LEVELS = ("critical", "error", "warning", "info", "debug")

DESCRIPTION = f"""\
Serve a model over an OpenAI-compatible HTTP API: POST /v1/chat/completions, POST /v1/completions,
GET /v1/models, GET /health, GET /metrics (Prometheus); the schema is at GET /openapi.json.
Any OpenAI client works: base_url=http://HOST:PORT/v1. Prefix reuse across requests is automatic.
With --api-key (or ${API_KEY_ENV}) set, /v1/* needs 'Authorization: Bearer KEY'.
"""


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {text}")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return value


def _port(text: str) -> int:
    value = int(text)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"port must be in [0, 65535], got {text}")
    return value


def _add_store_argument(p: argparse._ActionsContainer) -> None:
    try:
        from kvtier.store.cli import add_store_argument
    except ImportError:  # the store's CLI layer is optional for serving
        p.add_argument("--store", metavar="SPEC", default=None, help="tiered state store spec")
        return
    add_store_argument(p)


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model and engine")
    g.add_argument("--model", default=DEFAULT_MODEL,
                   help=f"preset (tiny-mha, tiny-gqa, mha-1b), {DEFAULT_MODEL}, HF model dir or .gguf file "
                        "(default: %(default)s)")
    g.add_argument("--dtype", default="auto", choices=["auto", "fp32", "bf16", "fp16"],
                   help="compute dtype; auto = bf16 on a GPU or a CPU with native bf16, else fp32 (default: auto)")
    add_device_argument(g)
    g.add_argument("--max-model-len", type=positive_int, default=None,
                   help="context window in tokens (default: the model's)")
    g.add_argument("--kv-cache-gb", type=float, default=4.0,
                   help="KV pool budget on the device in GiB; on a CPU, pages are used only as blocks fill (default: 4)")
    g.add_argument("--max-batched-tokens", type=positive_int, default=2048,
                   help="per-step token budget shared by decodes and prefill chunks (default: 2048)")
    g.add_argument("--max-num-seqs", type=positive_int, default=64,
                   help="most requests in the running batch; the rest queue (default: 64)")
    g.add_argument("--max-queued-requests", type=_non_negative_int, default=256,
                   help="requests that may wait beyond the running batch; more get 429 with Retry-After "
                        "(default: %(default)s)")
    g.add_argument("--no-prefix-cache", action="store_true",
                   help="disable the device prefix cache (reuse then comes only from the store)")

    g = p.add_argument_group("state store (reuse across requests)")
    _add_store_argument(g)
    g.add_argument("--no-store", action="store_true", help="run without the state store (no saving, no restore)")
    add_restore_arguments(g)
    add_partial_arguments(p)
    g.add_argument("--chunk-tokens", type=positive_int, default=64, help="tokens per stored chunk (default: 64)")
    g.add_argument("--session-ttl", type=_positive_float, default=None, metavar="SECONDS",
                   help="delete what a session (the request's prompt_cache_key) saved once it has been idle this "
                        "long; chunks other live sessions share are kept (default: keep until evicted)")

    g = p.add_argument_group("HTTP")
    g.add_argument("--host", default="127.0.0.1",
                   help="address to bind; use 0.0.0.0 to accept remote clients (default: %(default)s)")
    g.add_argument("--port", type=_port, default=8000, help="port to bind (default: %(default)s)")
    g.add_argument("--api-key", default=os.environ.get(API_KEY_ENV) or None,
                   help=f"require 'Authorization: Bearer KEY' on /v1/* (default: ${API_KEY_ENV}, else no key)")
    g.add_argument("--served-model-name", default=None,
                   help="model id clients send and /v1/models lists (default: the --model value)")
    g.add_argument("--max-body-bytes", type=positive_int, default=DEFAULT_MAX_BODY_BYTES,
                   help="larger request bodies get 413 (default: %(default)s)")
    g.add_argument("--default-max-tokens", type=positive_int, default=None,
                   help="completion limit when a request sets none (default: the rest of the context window)")
    g.add_argument("--log-level", dest="serve_log_level", default="info", choices=LOG_LEVELS,
                   help="server and access log level (default: %(default)s)")


def register(subparsers: Any) -> argparse.ArgumentParser:
    """Add the `serve` subcommand to an argparse subparsers object."""
    p = subparsers.add_parser(
        "serve", help="run the OpenAI-compatible HTTP server", description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_serve_arguments(p)
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    """Load the model, then serve until interrupted. Returns the process exit code."""
    import uvicorn

    from kvtier.engine.config import ReuseConfig
    from kvtier.engine.factory import build_engine
    from kvtier.serve.app import create_app
    from kvtier.serve.config import ServeConfig

    level = args.serve_log_level
    logging.getLogger("kvtier").setLevel(level.upper())
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    config = ServeConfig(
        served_model_name=args.served_model_name, api_key=args.api_key, max_body_bytes=args.max_body_bytes,
        default_max_tokens=args.default_max_tokens, max_queued_requests=args.max_queued_requests,
    )  # validated before the (slow) model load
    engine = build_engine(
        args.model, dtype=args.dtype, device=args.device, store=None if args.no_store else args.store,
        reuse=ReuseConfig(chunk_tokens=args.chunk_tokens, session_ttl_s=args.session_ttl, **reuse_options(args)),
        max_model_len=args.max_model_len,
        kv_cache_bytes=int(args.kv_cache_gb * (1 << 30)), max_batched_tokens=args.max_batched_tokens,
        max_num_seqs=args.max_num_seqs, enable_prefix_cache=not args.no_prefix_cache,
        partial=partial_from_args(args),
    )
    app = create_app(engine, config=config)
    name = config.served_model_name or engine.model.name
    store = "no store" if args.no_store or not args.store else f"store {args.store}"
    print(
        f"kvtier serving {name} ({engine.model.dtype} on {engine.device}, context {engine.max_model_len}, {store}) on "
        f"http://{args.host}:{args.port}/v1" + (" (API key required)" if config.api_key else ""),
        file=sys.stderr, flush=True,
    )
    uvicorn.run(app, host=args.host, port=args.port, log_level=level, timeout_graceful_shutdown=5)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvtier serve", description=DESCRIPTION,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_serve_arguments(parser)
    args = parser.parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        return run(args)
    except (ValueError, FileNotFoundError, RuntimeError) as e:  # model not found, bad budget, ...
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
