"""`kvtier serve`: run the OpenAI-compatible server (also `python -m kvtier.serve`)."""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from typing import Any

from kvtier.cli.engine_args import (
    EngineOptions,
    add_engine_arguments,
    non_negative,
    non_negative_int,
    positive_float,
    positive_int,
)
from kvtier.cli.options import add_options, from_args, option
from kvtier.engine.grammar_limits import GrammarLimits
from kvtier.heap import freeze_startup_heap
from kvtier.serve.config import (
    DEFAULT_BODY_TIMEOUT_S,
    DEFAULT_HEADER_TIMEOUT_S,
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_MAX_OUTPUT_ENTRIES,
    UNKNOWN_FIELDS_MODES,
    ServeConfig,
)
from kvtier.serve.reasoning import PARSER_NAMES
from kvtier.store.redact import redact

API_KEY_ENV = "KVTIER_API_KEY"
LOG_LEVELS = ("critical", "error", "warning", "info", "debug")

DESCRIPTION = f"""\
Serve a model over an OpenAI-compatible HTTP API: POST /v1/chat/completions, POST /v1/completions,
GET /v1/models, GET /health, GET /metrics (Prometheus); the schema is at GET /openapi.json.
Any OpenAI client works: base_url=http://HOST:PORT/v1. Prefix reuse across requests is automatic.
With --api-key (or ${API_KEY_ENV}) or --api-keys FILE, every path but /health needs
'Authorization: Bearer KEY' (/metrics too, unless --metrics-public); each key's tenant gets a
prompt cache of its own (unless --shared-cache). /metrics takes the --metrics-key key when one is
set; with --api-keys and no --metrics-key, no tenant's key reads it.
"""


def _port(text: str) -> int:
    value = int(text)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"port must be in [0, 65535], got {text}")
    return value


SESSIONS, HTTP, GRAMMARS = "sessions", "HTTP", "structured output (grammars, regexes and JSON schemas requests send)"
REASONING, BLENDING = "reasoning models", "blending (--blend)"


@dataclass(frozen=True)
class ServeOptions:
    """The server's own options (the engine's are EngineOptions): flags, --config keys and
    KVTIER_<NAME> environment variables, as every option (kvtier/cli/options.py)."""

    session_ttl: float | None = option(None, SESSIONS, "delete what a session (the request's prompt_cache_key) saved "
                                       "once it has been idle this long; chunks other live sessions share are kept",
                                       type=positive_float, metavar="SECONDS", default_text="keep until evicted")
    max_queued_requests: int = option(256, SESSIONS, "requests that may wait beyond the running batch; more get 429 "
                                      "with Retry-After", type=non_negative_int)
    host: str = option("127.0.0.1", HTTP, "address to bind; use 0.0.0.0 to accept remote clients")
    port: int = option(8000, HTTP, "port to bind", type=_port)
    api_key: str | None = option(None, HTTP, "require 'Authorization: Bearer KEY' on every path but /health; the "
                                 f"key's tenant is 'default' (default: ${API_KEY_ENV}, else no key)", secret=True)
    api_keys: str | None = option(None, HTTP, "several keys: one 'TENANT KEY' pair per line ('#' comment lines and "
                                  "blank lines ignored); each tenant's cached prompt state is its own (instead of "
                                  "--api-key)", metavar="FILE", default_text="none")
    metrics_public: bool = option(False, HTTP, "leave /metrics open without a key (for Prometheus scrapers)")
    metrics_key: str | None = option(None, HTTP, "the key that reads /metrics (the scraper's), and nothing else; "
                                     "tenants' keys then get 403 there. Without it, with --api-keys no tenant's key "
                                     "reads /metrics (its counters add up every tenant's activity), while one "
                                     "--api-key still does (default: $KVTIER_METRICS_KEY, else none)",
                                     metavar="KEY", secret=True)
    unknown_fields: str = option("reject", HTTP, "a request field this server does not know: 'reject' answers 400 "
                                 "naming it (as OpenAI does), 'warn' logs it once and drops it (for clients that "
                                 "send extras)", choices=UNKNOWN_FIELDS_MODES)
    max_output_entries: int = option(DEFAULT_MAX_OUTPUT_ENTRIES, HTTP, "the most output entries one request may ask "
                                     "for: n x max_tokens x (1 + top logprobs), plus prompt_logprobs' entries; more "
                                     "is a 400; 0: no limit", type=non_negative_int, metavar="N")
    shared_cache: bool = option(False, HTTP, "let tenants share cached prompt state: more reuse, but a tenant can tell "
                                "from timing or cached_tokens whether another tenant sent a prompt")
    served_model_name: str | None = option(None, HTTP, "model id clients send and /v1/models lists",
                                           default_text="the --model value")
    max_body_bytes: int = option(DEFAULT_MAX_BODY_BYTES, HTTP, "larger request bodies get 413", type=positive_int)
    header_timeout: float = option(DEFAULT_HEADER_TIMEOUT_S, HTTP, "close a connection whose request headers are "
                                   "not complete this long after it opens, or after the request's first byte on a "
                                   "kept-alive one (408 if part of a request came)", type=positive_float,
                                   metavar="SECONDS")
    body_timeout: float = option(DEFAULT_BODY_TIMEOUT_S, HTTP, "answer 408 and close when a request body is not "
                                 "complete this long after its headers (the whole body, not each read)",
                                 type=positive_float, metavar="SECONDS")
    default_max_tokens: int | None = option(None, HTTP, "completion limit when a request sets none",
                                            type=positive_int, default_text="the rest of the context window")
    log_level: str = option("info", HTTP, "server and access log level", type=str.lower, choices=LOG_LEVELS,
                            aliases=("--uvicorn-log-level",))
    log_stats_interval: float = option(10.0, HTTP, "seconds between the one-line stats log (throughput, running and "
                                       "waiting requests, KV usage, reuse by tier), when there was activity; 0: off",
                                       type=non_negative, metavar="S")

    max_grammar_bytes: int = option(GrammarLimits.max_bytes, GRAMMARS, "a grammar, regex or JSON schema larger than "
                                    "this is a 400 naming its field", type=positive_int, metavar="BYTES")
    max_grammar_rules: int = option(GrammarLimits.max_rules, GRAMMARS, "the most rules (Lark, GBNF) or subschemas "
                                    "(JSON Schema) in one", type=positive_int, metavar="N")
    max_grammar_depth: int = option(GrammarLimits.max_depth, GRAMMARS, "the deepest nesting, and the longest chain of "
                                    "rule or $ref references, in one", type=positive_int, metavar="N")
    max_grammar_repeat: int = option(GrammarLimits.max_repeat, GRAMMARS, "the largest repetition count ({n,m}, ~ n), "
                                     "and product of nested ones, in one", type=positive_int, metavar="N")
    grammar_timeout: float = option(GrammarLimits.timeout_s, GRAMMARS, "a grammar not compiled, with its first token "
                                    "mask, within this many seconds is a 400", type=positive_float, metavar="SECONDS")

    reasoning_parser: str | None = option(None, REASONING, "return a reasoning model's thinking apart from its "
                                          "answer in chat completions: the text between <think> and </think> in "
                                          "the message's reasoning_content (streamed as reasoning_content deltas), "
                                          "the rest in content. qwen3: a block the output opens itself (with "
                                          "chat_template_kwargs enable_thinking false, all is content); "
                                          "deepseek_r1: the template opened the block, so the output up to "
                                          "</think> is thinking (DeepSeek-R1, QwQ)", choices=PARSER_NAMES,
                                          default_text="off: the thinking stays in content")

    blend_separator: str | None = option(None, BLENDING, "with --blend: "
                                         "in a completions text prompt, the parts between the first and the last "
                                         "part this string separates are documents (the string is taken out)",
                                         metavar="TEXT", default_text="none")

    def serve_config(self) -> ServeConfig:
        """The validated server settings (the --api-keys file is read here)."""
        from kvtier.serve.api_keys import load_api_keys

        return ServeConfig(
            served_model_name=self.served_model_name, api_key=self.api_key,
            api_keys=load_api_keys(self.api_keys) if self.api_keys else {}, metrics_public=self.metrics_public,
            metrics_key=self.metrics_key, max_output_entries=self.max_output_entries, unknown_fields=self.unknown_fields,
            shared_cache=self.shared_cache, max_body_bytes=self.max_body_bytes,
            default_max_tokens=self.default_max_tokens, max_queued_requests=self.max_queued_requests,
            stats_interval_s=self.log_stats_interval, reasoning_parser=self.reasoning_parser,
            blend_separator=self.blend_separator,
            grammar_limits=GrammarLimits(self.max_grammar_bytes, self.max_grammar_rules, self.max_grammar_depth,
                                         self.max_grammar_repeat, self.grammar_timeout),
        )


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    add_engine_arguments(p)
    add_options(p, ServeOptions)


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
    """Check everything a start needs, load the model, then serve until interrupted. Returns the
    process exit code. Fails fast: the options, the API keys, the port, the device, the store's
    tiers and the model's name are checked before any weight is read."""
    from kvtier.engine.transient import TransientWorker
    from kvtier.serve.app import create_app
    from kvtier.serve.server import ReadyServer, listen_socket, uvicorn_config

    options = from_args(ServeOptions, args)
    engine_options = EngineOptions.from_args(args)
    if options.blend_separator is not None and not engine_options.blend:
        raise ValueError("--blend-separator marks the documents to blend: add --blend")
    config = options.serve_config()
    sock = listen_socket(options.host, options.port)  # the port is ours (or one line, exit 2) before the load
    try:
        # Serve at once: a machine without a saved profile is planned for on an estimate, not
        # measured for minutes before the port answers (`kvtier profile` measures it).
        # Loaded on a thread that then exits: the OpenMP team torch gives the loading thread goes
        # with it, so the engine's loop thread runs the process's only team (two teams make each
        # of torch's small ops wait for its team to wake: kvtier/engine/transient.py).
        loading = TransientWorker("kvtier-load").submit(
            lambda: engine_options.build(reuse=engine_options.reuse(session_ttl_s=options.session_ttl),
                                         measure_profile=False))
        engine = loading.result()
        app = create_app(engine, config=config)
        freeze_startup_heap()
        host, port = sock.getsockname()[:2]
        name = config.served_model_name or engine.model.name
        store = "no store" if engine_options.no_store or not engine_options.store else \
            f"store {redact(engine_options.store)}"
        banner = (f"kvtier serving {name} ({engine.model.dtype} on {engine.device}, context {engine.max_model_len}, "
                  f"{store}) on http://{host}:{port}/v1" + _auth_note(config))
        http = uvicorn_config(app, header_timeout=options.header_timeout, body_timeout=options.body_timeout,
                              log_level=options.log_level)
        server = ReadyServer(http, on_ready=lambda: print(banner, file=sys.stderr, flush=True))
        server.run(sockets=[sock])
    finally:
        sock.close()
    return 0


def _auth_note(config: ServeConfig) -> str:
    keys = config.tenant_keys
    if not keys:
        return ""
    tenants = "1 tenant" if len(keys) == 1 else f"{len(keys)} tenants"
    return f" (API key required; {tenants}{', shared cache' if config.shared_cache else ''})"

