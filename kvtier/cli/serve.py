"""`kvtier serve`: run the OpenAI-compatible server (also `python -m kvtier.serve`)."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Any

from kvtier.cli.engine_args import (
    add_engine_arguments,
    build_engine_from_args,
    non_negative_int,
    positive_float,
    positive_int,
    reuse_from_args,
)
from kvtier.serve.config import DEFAULT_MAX_BODY_BYTES, ServeConfig
from kvtier.store.redact import redact

API_KEY_ENV = "KVTIER_API_KEY"
LOG_LEVELS = ("critical", "error", "warning", "info", "debug")

DESCRIPTION = f"""\
Serve a model over an OpenAI-compatible HTTP API: POST /v1/chat/completions, POST /v1/completions,
GET /v1/models, GET /health, GET /metrics (Prometheus); the schema is at GET /openapi.json.
Any OpenAI client works: base_url=http://HOST:PORT/v1. Prefix reuse across requests is automatic.
With --api-key (or ${API_KEY_ENV}) or --api-keys FILE, every path but /health needs
'Authorization: Bearer KEY' (/metrics too, unless --metrics-public); each key's tenant gets a
prompt cache of its own (unless --shared-cache).
"""


def _port(text: str) -> int:
    value = int(text)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"port must be in [0, 65535], got {text}")
    return value


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    add_engine_arguments(p)
    g = p.add_argument_group("sessions")
    g.add_argument("--session-ttl", type=positive_float, default=None, metavar="SECONDS",
                   help="delete what a session (the request's prompt_cache_key) saved once it has been idle this "
                        "long; chunks other live sessions share are kept (default: keep until evicted)")
    g.add_argument("--max-queued-requests", type=non_negative_int, default=256,
                   help="requests that may wait beyond the running batch; more get 429 with Retry-After "
                        "(default: %(default)s)")

    g = p.add_argument_group("HTTP")
    g.add_argument("--host", default="127.0.0.1",
                   help="address to bind; use 0.0.0.0 to accept remote clients (default: %(default)s)")
    g.add_argument("--port", type=_port, default=8000, help="port to bind (default: %(default)s)")
    g.add_argument("--api-key", default=os.environ.get(API_KEY_ENV) or None,
                   help="require 'Authorization: Bearer KEY' on every path but /health; the key's tenant is "
                        f"'default' (default: ${API_KEY_ENV}, else no key)")
    g.add_argument("--api-keys", default=None, metavar="FILE",
                   help="several keys: one 'TENANT KEY' pair per line ('#' comment lines and blank lines "
                        "ignored); each tenant's cached prompt state is its own (instead of --api-key)")
    g.add_argument("--metrics-public", action="store_true",
                   help="leave /metrics open without a key (for Prometheus scrapers)")
    g.add_argument("--shared-cache", action="store_true",
                   help="let tenants share cached prompt state: more reuse, but a tenant can tell from "
                        "timing or cached_tokens whether another tenant sent a prompt")
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

    from kvtier.serve.api_keys import load_api_keys
    from kvtier.serve.app import create_app

    level = args.serve_log_level
    logging.getLogger("kvtier").setLevel(level.upper())
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    config = ServeConfig(
        served_model_name=args.served_model_name, api_key=args.api_key,
        api_keys=load_api_keys(args.api_keys) if args.api_keys else {},
        metrics_public=args.metrics_public, shared_cache=args.shared_cache, max_body_bytes=args.max_body_bytes,
        default_max_tokens=args.default_max_tokens, max_queued_requests=args.max_queued_requests,
    )  # validated before the (slow) model load
    engine = build_engine_from_args(args, reuse=reuse_from_args(args, session_ttl_s=args.session_ttl))
    app = create_app(engine, config=config)
    name = config.served_model_name or engine.model.name
    store = "no store" if args.no_store or not args.store else f"store {redact(args.store)}"
    print(
        f"kvtier serving {name} ({engine.model.dtype} on {engine.device}, context {engine.max_model_len}, {store}) on "
        f"http://{args.host}:{args.port}/v1" + _auth_note(config),
        file=sys.stderr, flush=True,
    )
    uvicorn.run(app, host=args.host, port=args.port, log_level=level, timeout_graceful_shutdown=5)
    return 0


def _auth_note(config: ServeConfig) -> str:
    keys = config.tenant_keys
    if not keys:
        return ""
    tenants = "1 tenant" if len(keys) == 1 else f"{len(keys)} tenants"
    return f" (API key required; {tenants}{', shared cache' if config.shared_cache else ''})"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvtier serve", description=DESCRIPTION,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_serve_arguments(parser)
    args = parser.parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        return run(args)
    except (ValueError, FileNotFoundError, RuntimeError, ConnectionError) as e:  # model not found, Redis down, ...
        print(f"error: {redact(e)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
