"""Every option of a command that runs an engine, declared once: generate, chat, demo, serve and
the benchmarks add these groups and build their engine with `build_engine_from_args`.

Each option maps to one field of EngineConfig, ReuseConfig, ImpressConfig or PartialConfig; the
configs validate values, argparse only parses them.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any

from kvtier.device import add_device_argument
from kvtier.models.loading import DEFAULT_MODEL
from kvtier.planning.plan import METHOD_CHOICES

if TYPE_CHECKING:
    from kvtier.engine.config import ImpressConfig, PartialConfig, ReuseConfig
    from kvtier.engine.engine import Engine

DTYPE_CHOICES = ("auto", "fp32", "bf16", "fp16")


# ----- value types (argparse turns their errors into a usage line and exit 2) -----------------------
def _number(text: str, kind: type, ok: Any, what: str) -> Any:
    try:
        x = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
    if not ok(x):
        raise argparse.ArgumentTypeError(f"expected {what}, got {text}")
    return x


def positive_int(text: str) -> int:
    return _number(text, int, lambda x: x >= 1, "a positive integer")


def non_negative_int(text: str) -> int:
    return _number(text, int, lambda x: x >= 0, "an integer >= 0")


def positive_float(text: str) -> float:
    return _number(text, float, lambda x: x > 0, "a positive number")


def non_negative(text: str) -> float:
    return _number(text, float, lambda x: x >= 0, "a number >= 0")


def ratio(text: str) -> float:
    return _number(text, float, lambda x: 0.0 < x <= 1.0, "a number in (0, 1]")


# ----- option groups ---------------------------------------------------------------------------------
def add_model_arguments(p: argparse._ActionsContainer, model_default: str = DEFAULT_MODEL) -> None:
    """--model, --dtype and --device: what to load and where (every command that loads a model)."""
    p.add_argument("--model", default=model_default,
                   help=f"preset (tiny-mha, tiny-gqa, mha-1b), {DEFAULT_MODEL}, HF model dir or .gguf file "
                        "(default: %(default)s)")
    p.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES,
                   help="compute dtype; auto = bf16 on a GPU or a CPU with native bf16, else fp32 (default: auto)")
    add_device_argument(p)


def add_engine_arguments(p: argparse.ArgumentParser, model_default: str = DEFAULT_MODEL) -> None:
    """The model, the engine's budgets, the store, restores and partial caching."""
    g = p.add_argument_group("model and engine")
    add_model_arguments(g, model_default)
    g.add_argument("--max-model-len", type=positive_int, default=None,
                   help="context window in tokens (default: the model's)")
    g.add_argument("--kv-cache-gb", type=float, default=4.0,
                   help="KV pool budget on the device in GiB; on a CPU, pages are used only as blocks fill (default: 4)")
    g.add_argument("--max-batched-tokens", type=positive_int, default=2048,
                   help="per-step token budget shared by decodes and prefill chunks (default: 2048)")
    g.add_argument("--max-num-seqs", type=positive_int, default=64,
                   help="most requests in the running batch; the rest queue (default: 64)")
    g.add_argument("--no-prefix-cache", action="store_true",
                   help="disable the device prefix cache (reuse then comes only from the store)")
    g.add_argument("--fast-inexact", action="store_true",
                   help="plain kernels instead of the row-invariant ones: a little faster in places, but a cache hit, "
                        "a restore, another prefill chunking or batch may then change a token's logits (bf16, fp16; "
                        "its state is stored apart from exact state) (default: exact)")

    g = p.add_argument_group("state store (reuse across requests)")
    from kvtier.cli.store import add_store_argument

    add_store_argument(g)
    g.add_argument("--no-store", action="store_true", help="run without the state store (no saving, no restore)")
    g.add_argument("--chunk-tokens", type=positive_int, default=64, help="tokens per stored chunk (default: 64)")
    g.add_argument("--store-secret-file", metavar="PATH", default=None,
                   help="a secret shared by every server of this store (at least 16 bytes, first line of the "
                        "file): chunks are sealed with an HMAC and only sealed ones are used, so whoever can "
                        "write to the store's Redis or directories cannot plant state. Also read from "
                        "$KVTIER_STORE_SECRET (see docs/serve.md, Security)")
    g.add_argument("--store-secret", metavar="SECRET", default=None,
                   help="the store secret as a value (visible to other users in `ps`: prefer the file or the "
                        "environment variable)")
    add_restore_arguments(g)
    add_partial_arguments(p)


def add_restore_arguments(p: argparse._ActionsContainer) -> None:
    """--restore-method and the importance-only restore's options."""
    p.add_argument("--restore-method", default="auto", choices=list(METHOD_CHOICES),
                   help="how stored state comes back: auto (the planner decides per request), kv, hidden, "
                        "bubblefree, cake, recompute, or impress (lossy, opt-in: only the stored prefix tokens "
                        "the new tokens attend to; its state is never saved) (default: auto)")
    p.add_argument("--allow-lossy", action="store_true",
                   help="with --restore-method auto: the planner may also choose impress where it predicts it at "
                        "least 15%% faster than every exact method (stores the importance layout; lossy, so off by "
                        "default)")
    p.add_argument("--importance-ratio", type=ratio, default=0.25, metavar="R",
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
    p.add_argument("--importance-reorder-s", type=non_negative, default=600.0, metavar="S",
                   help="impress: every S seconds, when the writer is idle, store the chunks importance restores "
                        "have seen again with their tokens' K/V rows by importance, so the tokens a query keeps "
                        "share granules (single-token selection); 0: never (default: 600)")
    p.add_argument("--importance-alpha", type=non_negative, default=0.6, metavar="A",
                   help="impress: probe heads agree when their Jaccard index is at least j**A, j that of "
                        "two random sets (default: 0.6)")


def add_partial_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("partial token-wise caching (eLLM): more sequences in the same KV memory")
    g.add_argument("--partial-caching", choices=["off", "optimizer", "fixed"], default=None,
                   help="let decoding requests keep KV for their newest tokens only and get the oldest back every "
                        "step (recomputed, or from --front-swap-gb): optimizer chooses the batch size and each "
                        "request's uncached front under --tpot-slo-ms; fixed uses --uncached-ratio "
                        "(default: optimizer when --tpot-slo-ms is given, else off)")
    g.add_argument("--tpot-slo-ms", type=float, default=None,
                   help="time-per-output-token SLO in ms: the optimizer admits requests and sizes fronts so that "
                        "decode steps, as the engine observes them, stay within 90%% of it")
    g.add_argument("--uncached-ratio", type=float, default=0.25,
                   help="share of each decoding request's tokens left uncached with --partial-caching fixed")
    g.add_argument("--front-swap-gb", type=float, default=0.0,
                   help="host memory for uncached fronts, read back instead of recomputed where faster (GiB; 0: off)")


# ----- options -> configs ----------------------------------------------------------------------------
def impress_from_args(args: argparse.Namespace) -> ImpressConfig:
    from kvtier.engine.config import ImportanceSelection, ImportanceUnit, ImpressConfig

    return ImpressConfig(ratio=args.importance_ratio, alpha=args.importance_alpha,
                         unit=ImportanceUnit(args.importance_unit),
                         selection=ImportanceSelection(args.importance_selection), reorder_s=args.importance_reorder_s)


def reuse_from_args(args: argparse.Namespace, **extra: Any) -> ReuseConfig:
    from kvtier.engine.config import ReuseConfig
    from kvtier.store.seal import load_secret

    return ReuseConfig(method=args.restore_method, allow_lossy=args.allow_lossy, chunk_tokens=args.chunk_tokens,
                       eviction_policy=args.eviction_policy, impress=impress_from_args(args),
                       seal=load_secret(getattr(args, "store_secret", None), getattr(args, "store_secret_file", None)),
                       **extra)


def partial_from_args(args: argparse.Namespace) -> PartialConfig | None:
    from kvtier.engine.config import PartialConfig, PartialPolicy

    policy = args.partial_caching or ("optimizer" if args.tpot_slo_ms is not None else "off")
    if policy == "off":
        if args.tpot_slo_ms is not None:
            raise ValueError("--tpot-slo-ms sets the partial-caching optimizer's SLO: drop --partial-caching off")
        return None
    return PartialConfig(policy=PartialPolicy(policy), ratio=args.uncached_ratio if policy == "fixed" else 0.0,
                         tpot_slo_s=args.tpot_slo_ms / 1e3 if args.tpot_slo_ms is not None else None,
                         swap_bytes=int(args.front_swap_gb * (1 << 30)))


def build_engine_from_args(args: argparse.Namespace, reuse: ReuseConfig | None = None, **config: Any) -> Engine:
    """Load the model and build its engine from the options above (`config`: EngineConfig overrides)."""
    from kvtier.engine.factory import build_engine

    kw: dict[str, Any] = dict(max_model_len=args.max_model_len, kv_cache_bytes=int(args.kv_cache_gb * (1 << 30)),
                              max_batched_tokens=args.max_batched_tokens, max_num_seqs=args.max_num_seqs,
                              enable_prefix_cache=not args.no_prefix_cache, partial=partial_from_args(args),
                              exact=not args.fast_inexact)
    kw.update(config)
    return build_engine(args.model, dtype=args.dtype, device=args.device, store=None if args.no_store else args.store,
                        reuse=reuse or reuse_from_args(args), **kw)
